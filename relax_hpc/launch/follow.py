"""`submit --wait`: follow a Slurm job to its end, through every requeue, and say how it ended.

The job is followed with squeue alone (a cluster may run without accounting, where sacct answers
nothing): a job that Slurm requeues stays in the queue, pending, under the same id, so the run
has ended once the job has left the queue or sits there in a final state (a failed squeue is
asked again: a controller too busy to answer fails as well). How it ended is read
from RUN_DIR, which every start of the run writes (the last trained step, the checkpoint, the
launcher's end event and the no-progress guard's reason), and Slurm's word on the job: sacct
where accounting runs, else the controller's record of ended jobs (`squeue --states=all`,
`scontrol show job`), which it keeps for MinJobAge after the end.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import completed_steps, guard_reason, step_records
from relax_hpc.paths import RunPaths

# States of a job that will still run (or is running): keep waiting.
ACTIVE = {
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
    "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
}  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    code: int  # what submit --wait exits with: 0 completed, 1 otherwise
    message: str


def queue_state(job_id: str) -> str | None:
    """The job's state as squeue shows it, or None once it has left the queue."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        return "UNKNOWN"  # a slow controller: ask again later
    states = out.stdout.split()
    if out.returncode == 0:
        return states[0] if states else None
    # squeue fails both for a job the controller has forgotten (MinJobAge after its end) and for a
    # controller too busy to answer ("Socket timed out"): only the first means the job has ended.
    return None if "Invalid job id" in out.stderr else "UNKNOWN"


def _run(argv: list[str]) -> str | None:
    """A Slurm client's answer, or None where it fails (no accounting, no such job, no tool)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def sacct_state(job_id: str) -> str | None:
    """Slurm accounting's state of the job, where accounting runs (None otherwise)."""
    out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    return out.strip().splitlines()[-1].strip() if out else None


def controller_state(job_id: str) -> str | None:
    """The controller's own record of the job, which it keeps for a while after the end
    (MinJobAge): what a cluster without accounting knows. squeue --states=all, else scontrol."""
    out = _run(["squeue", "--states=all", "-h", "-j", job_id, "-o", "%T"])
    if out:
        return out.split()[0]
    out = _run(["scontrol", "show", "job", job_id])
    found = re.search(r"JobState=(\S+)", out or "")
    return found.group(1) if found else None


def slurm_state(job_id: str) -> str | None:
    """What Slurm knows of the job's state: accounting where it runs, else the controller."""
    return sacct_state(job_id) or controller_state(job_id)


# Slurm's final states in an operator's words.
ENDED = {"CANCELLED": "cancelled", "TIMEOUT": "timed out", "FAILED": "failed", "NODE_FAIL": "ended by a node failure",
         "OUT_OF_MEMORY": "out of memory", "PREEMPTED": "preempted", "BOOT_FAIL": "failed to boot",
         "DEADLINE": "past its deadline", "COMPLETED": "ended"}  # fmt: skip


def run_facts(paths: RunPaths) -> str:
    """How far the run got, from RUN_DIR: the last trained step, the checkpoint and the launcher's
    last word (its exit, or the no-progress guard's reason)."""
    starts = [r for r in read_jsonl(paths.events_metrics) if r.get("event") == "start"]
    steps = step_records(paths)
    if not starts and not steps:
        return "the run never started"
    said = (
        f"the run trained to step {steps[-1]['step']}, checkpoint at step {completed_steps(paths)}"
        if steps
        else f"the run started {len(starts)} time(s) and trained no step"
    )
    ends = [r for r in read_jsonl(paths.events_metrics) if r.get("event") == "end"]
    if ends and (not starts or ends[-1]["time"] > starts[-1]["time"]):
        how = {75: "stopped with a checkpoint", 1: "failed"}.get(int(ends[-1].get("exit", 1)), "ended")
        said += f"; the launcher {how} (exit {ends[-1].get('exit')})"
    elif starts:
        said += "; the launcher was ended without a word (killed)"
    reason = guard_reason(paths)
    return said + (f"; {reason}" if reason else "")


def outcome(paths: RunPaths, job_id: str) -> Outcome:
    """How the run ended: from RUN_DIR, and Slurm's word on the job."""
    ends = [r for r in read_jsonl(paths.train_metrics) if r.get("event") == "end"]
    if ends and ends[-1].get("completed"):
        return Outcome(0, f"job {job_id} completed: step {ends[-1].get('step')}")
    launcher = [r for r in read_jsonl(paths.events_metrics) if r.get("event") == "end"]
    if paths.eval_results.is_file() and launcher and launcher[-1].get("exit") == 0:  # an eval job
        return Outcome(0, f"job {job_id} completed: every model x dataset scored ({paths.eval_table})")
    state = slurm_state(job_id)
    how = f" ({ENDED.get(state.split()[0], state)}: Slurm says {state})" if state else ""
    return Outcome(1, f"job {job_id} did not complete{how}: {run_facts(paths)}")


def follow(
    job_id: str,
    paths: RunPaths,
    poll_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
    unanswered_polls: int = 120,
) -> Outcome:
    """Wait until the job has left the queue (or sits in a final state), then its outcome. A
    controller that fails to answer `unanswered_polls` times in a row (10 minutes) ends the wait
    with what RUN_DIR says."""
    failures = 0
    while (state := queue_state(job_id)) is not None and state.split()[0] in ACTIVE | {"UNKNOWN"}:
        failures = failures + 1 if state == "UNKNOWN" else 0
        if failures >= unanswered_polls:
            break
        sleep(poll_s)
    return outcome(paths, job_id)
