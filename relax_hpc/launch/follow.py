"""`submit --wait`: follow a Slurm job to its end, through every requeue, and say how it ended.

The job is followed with squeue alone (a cluster may run without accounting, where sacct answers
nothing): a job that Slurm requeues stays in the queue, pending, under the same id, so the run
has ended once the job has left the queue or sits there in a final state. How it ended is read
from RUN_DIR, which every start of the run writes: the trainer's end record (completed or not)
and the launcher's end event (its exit status). sacct, where it answers, only adds Slurm's own
word on a job that ended without a word of its own (cancelled while pending, node failure).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from relax_hpc.metrics.jsonl import read_jsonl
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
    return states[0] if out.returncode == 0 and states else None


def sacct_state(job_id: str) -> str | None:
    """Slurm accounting's final state of the job, where accounting runs (None otherwise)."""
    try:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True, text=True, timeout=20,
            check=False,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return None
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return lines[-1].strip() if out.returncode == 0 and lines else None


def outcome(paths: RunPaths, job_id: str) -> Outcome:
    """How the run ended, from RUN_DIR (and sacct where it answers)."""
    ends = [r for r in read_jsonl(paths.train_metrics) if r.get("event") == "end"]
    if ends and ends[-1].get("completed"):
        return Outcome(0, f"job {job_id} completed: step {ends[-1].get('step')}")
    launches = [r for r in read_jsonl(paths.events_metrics) if r.get("event") == "end"]
    if launches:
        last = launches[-1]
        how = {75: "stopped with a checkpoint (not requeued)", 1: "failed"}.get(int(last.get("exit", 1)), "ended")
        said = f"the run {how} at step {last.get('step')} (exit {last.get('exit')})"
    else:
        said = "the run never started"
    slurm = sacct_state(job_id)
    return Outcome(1, f"job {job_id} did not complete: {said}" + (f"; Slurm says {slurm}" if slurm else ""))


def follow(job_id: str, paths: RunPaths, poll_s: float = 5.0, sleep: Callable[[float], None] = time.sleep) -> Outcome:
    """Wait until the job has left the queue (or sits in a final state), then its outcome."""
    while (state := queue_state(job_id)) is not None and state.split()[0] in ACTIVE | {"UNKNOWN"}:
        sleep(poll_s)
    return outcome(paths, job_id)
