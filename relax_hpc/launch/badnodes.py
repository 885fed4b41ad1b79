"""Bad nodes: a node on which roles failed for the node's own reasons `launch.slurm.bad_node_failures`
times is left out.

The record is RUN_DIR/metrics/events.jsonl: every `role_exit` carries `node_fault` where the failure
belongs to a node, by the words of its log's last lines: Slurm's NODE_FAIL (`srun: error: Node
failure on NODE`), an unreachable slurmd (a step's launch that timed out on NODE), or a device
error of CUDA or the driver (an uncorrectable ECC error, a GPU lost). A NODE_FAIL usually ends the
whole job (the launcher with it) and requeues it: so at each start the launcher also records a
`node_failed` event for each node of the job's previous allocation that Slurm now holds as not
responding (`failed_nodes`). Nothing else is a node's: a
fenced exit (76: a newer start of the run), a cancellation or preemption (the launcher was asked to
stop), a hang, a crash or an out-of-memory is the run's. A device error names the node only for a
role of one node: which node of a multi-node trainer failed is not known, and leaving all of them
out would punish the healthy ones. A node that reaches the count gets a `bad_node` event; `python -m
relax_hpc.status RUN_DIR --clear-bad-nodes` writes `bad_nodes_cleared`, and counting starts again
after it.

Slurm takes an exclude list (ExcNodeList) only while a job is pending, so the launcher sets it
once its job is requeued (after the pre-timeout notice, or whenever the launcher ends with its job
pending again) and elastic engine jobs are submitted with it (`--exclude`). A list that would
leave the job's partition fewer nodes than the job needs is cut short, the most-failed nodes
first: a job whose every candidate node is excluded would pend forever, so the last usable nodes
stay in and the launcher says so instead (a `bad_node_kept` event).
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_hpc.fence import EXIT_FENCED
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.paths import RunPaths

# srun's own words when the node failed under a running step, or its slurmd did not answer a launch.
NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
UNREACHABLE = re.compile(
    r"srun: error: Task launch for \S+ failed on node (\S+): (Socket timed out on send/recv operation|"
    r"Communication connection failure|Connection refused|Zero Bytes were transmitted or received)"
)
# CUDA's and the driver's words for a device that failed, not the code on it (an illegal address,
# a device-side assert, out of memory and a kernel's launch failure are the program's).
DEVICE_ERRORS = (
    "uncorrectable ECC error",
    "uncorrectable NVLink error",
    "GPU has fallen off the bus",
    "GPU is lost",
    "CUDA-capable device(s) is/are busy or unavailable",
    "system not yet initialized",
    "CUDA driver initialization failed",
)


def node_fault(exit_code: int | None, log_tail: str, nodes: list[str]) -> dict[str, str] | None:
    """The node a role's failure belongs to, and why ({"node", "cause"}), from the last lines of
    its log (None: the failure is the run's, or not known to be a node's)."""
    if not exit_code or exit_code == EXIT_FENCED:
        return None
    for line in reversed(log_tail.splitlines()):
        if (m := NODE_FAILURE.search(line)) and m[1] in nodes:
            return {"node": m[1], "cause": "NODE_FAIL"}
        if (m := UNREACHABLE.search(line)) and m[1] in nodes:
            return {"node": m[1], "cause": f"slurmd unreachable: {m[2]}"}
        if len(nodes) == 1 and any(words in line for words in DEVICE_ERRORS):
            return {"node": nodes[0], "cause": f"device error: {line.strip()[-200:]}"}
    return None


def failures(events: list[dict[str, Any]]) -> Counter[str]:
    """Failures by a node's own fault (a role's `node_fault`, a `node_failed` allocation), per node,
    since the list was last cleared."""
    count: Counter[str] = Counter()
    for event in events:
        if event.get("event") == "bad_nodes_cleared":
            count.clear()
        elif event.get("event") == "role_exit" and event.get("node_fault"):
            count[event["node_fault"]["node"]] += 1
        elif event.get("event") == "node_failed":
            count[event["node"]] += 1
    return count


def not_responding(nodes: list[str]) -> dict[str, str]:
    """Those of `nodes` whose slurmd Slurm found not responding (a NODE_FAIL's nodes, DOWN after
    SlurmdTimeout), with the state it shows."""
    if not nodes:
        return {}
    out = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%T|%E"], capture_output=True,
                         text=True, check=False, timeout=60)  # fmt: skip
    rows = (line.split("|", 2) for line in out.stdout.splitlines() if line.count("|") == 2)
    return {node: state for node, state, reason in rows if state.endswith("*") or reason == "Not responding"}


def failed_nodes(events: list[dict[str, Any]], job_id: str, restart_count: int, nodes: list[str]) -> list[dict]:
    """At an allocation's start: the `node_failed` events for the nodes of the job's previous
    allocation (its last `allocation` event) that Slurm now holds as not responding, then this
    allocation's own `allocation` event, to log in that order."""
    before = [e for e in events if e.get("event") == "allocation" and e.get("slurm_job_id") == job_id
              and e.get("slurm_restart_count", 0) < restart_count]  # fmt: skip
    gone = not_responding(sorted(set(before[-1]["nodes"]) - set(nodes))) if before else {}
    failed = [{"event": "node_failed", "node": node, "cause": f"NODE_FAIL (Slurm: {state})", "slurm_job_id": job_id}
              for node, state in gone.items()]  # fmt: skip
    return [*failed, {"event": "allocation", "slurm_job_id": job_id, "slurm_restart_count": restart_count,
                      "nodes": nodes}]  # fmt: skip


def bad_nodes(events: list[dict[str, Any]], threshold: int) -> list[str]:
    """The nodes failed on at least `threshold` times (0: none ever), most failures first."""
    if threshold <= 0:
        return []
    return [node for node, n in failures(events).most_common() if n >= threshold]


def newly_bad(events: list[dict[str, Any]], nodes: list[str], threshold: int) -> list[str]:
    """Those of `nodes` whose count is exactly `threshold` now (the failure just logged made them bad)."""
    count = failures(events)
    return [node for node in nodes if threshold > 0 and count[node] == threshold]


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields of the job ({} where Slurm knows none)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=False, timeout=60
    )
    first = out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return dict(field.split("=", 1) for field in first.split() if "=" in field)


def partition_nodes(partition: str | None) -> list[str]:
    """The nodes of a partition (None: of the cluster)."""
    where = ["-p", partition] if partition else []
    out = subprocess.run(
        ["sinfo", "-h", "-N", *where, "-o", "%N"], capture_output=True, text=True, check=False, timeout=60
    )
    return sorted(set(out.stdout.split()))


def usable_exclusion(bad: list[str], available: list[str], needed: int) -> tuple[list[str], list[str]]:
    """(the bad nodes to exclude, those kept so that `needed` of `available` nodes stay usable)."""
    room = max(0, len(set(available)) - needed)
    candidates = [node for node in bad if node in available]  # others could not be given to it anyway
    return candidates[:room], candidates[room:]


@dataclass(frozen=True)
class Exclusion:
    """What a job's next requeue leaves out, worked out while the job still runs: once it is
    requeued, Slurm ends the launcher within moments, which then has time for one call only."""

    job_id: str
    excluded: list[str]
    kept: list[str]  # bad, but the partition would be left without enough nodes
    needed: int
    partition: str


def plan_exclusion(paths: RunPaths, job_id: str, threshold: int) -> Exclusion | None:
    """The exclusion for job `job_id`'s next start (None: no bad node, or Slurm knows no such job)."""
    bad = bad_nodes(read_jsonl(paths.events_metrics), threshold)
    job = job_fields(job_id) if bad else {}
    if "Partition" not in job:
        return None
    needed = int(job.get("NumNodes", "1").split("-")[0])  # a pending job's is MIN-MAX
    excluded, kept = usable_exclusion(bad, partition_nodes(job["Partition"]), needed)
    return Exclusion(job_id, excluded, kept, needed, job["Partition"])


def apply_exclusion(plan: Exclusion, events: JsonlWriter, say: Callable[[str], None]) -> None:
    """Set the planned exclude list if the job is pending (requeued), and say so. Slurm ends a
    requeued job's launcher within moments of the requeue, so the event and the line come first,
    and a `nodes_not_excluded` event follows when Slurm refuses (the job is not pending). A
    requeued job shows COMPLETING until its batch shell has exited, though Slurm counts it
    pending already: the update itself is the test."""
    if not plan.excluded:
        if plan.kept and job_fields(plan.job_id).get("JobState") in ("PENDING", "COMPLETING"):
            events.log({"event": "bad_node_kept", "job": plan.job_id, "nodes": plan.kept})
            say(_kept_line(plan))
        return
    events.log({"event": "nodes_excluded", "job": plan.job_id, "nodes": plan.excluded})
    say(f"bad node(s) {','.join(plan.excluded)} excluded from job {plan.job_id}'s next start")
    if plan.kept:
        events.log({"event": "bad_node_kept", "job": plan.job_id, "nodes": plan.kept})
        say(_kept_line(plan))
    refused = _set_exclusion(plan.job_id, plan.excluded)
    if refused:
        events.log({"event": "nodes_not_excluded", "job": plan.job_id, "why": refused})
        say(f"job {plan.job_id}: nothing excluded ({refused})")


def _kept_line(plan: Exclusion) -> str:
    return (
        f"bad node(s) {','.join(plan.kept)} NOT excluded: job {plan.job_id} needs {plan.needed} of the "
        f"{plan.partition} partition's nodes"
    )


def exclude_if_requeued(paths: RunPaths, job_id: str, threshold: int, events: JsonlWriter) -> list[str]:
    """Plan and apply at once, for a job already pending: the lines said."""
    lines: list[str] = []
    plan = plan_exclusion(paths, job_id, threshold)
    if plan:
        apply_exclusion(plan, events, lines.append)
    return lines


def scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    """`scontrol ARGS` deaf to SIGTERM: a requeue SIGTERMs every process of the job, and these
    calls come right after one (the launcher itself treats SIGTERM as a stop request)."""
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, check=False, timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),
    )  # fmt: skip


# What scontrol says when the controller did not answer (a busy one): worth asking again.
UNANSWERED = ("Socket timed out", "Unable to contact slurm controller", "Zero Bytes were transmitted")


def _set_exclusion(job_id: str, nodes: list[str], attempts: int = 3) -> str | None:
    """Set a pending job's ExcNodeList; Slurm's answer where it refuses (a job not pending)."""
    for _ in range(attempts):
        out = scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}")
        if out.returncode == 0:
            return None
        if not any(words in out.stderr for words in UNANSWERED):
            break
    return out.stderr.strip() or f"scontrol exit {out.returncode}"


def current_job(paths: RunPaths) -> str | None:
    """The run's Slurm job: what `submit` wrote, else the job of the launcher's last start (sbatch)."""
    if paths.slurm_job_id.is_file():
        return paths.slurm_job_id.read_text().strip()
    starts = [e for e in read_jsonl(paths.events_metrics) if e.get("event") == "start" and e.get("slurm_job_id")]
    return starts[-1]["slurm_job_id"] if starts else None


def clear(paths: RunPaths) -> str:
    """Forget every failure so far; a pending job of the run gets its exclude list emptied."""
    job_id = current_job(paths)
    JsonlWriter(paths.events_metrics).log({"event": "bad_nodes_cleared"})
    if job_id and job_fields(job_id).get("JobState") == "PENDING":
        _set_exclusion(job_id, [])
        return f"bad nodes cleared; pending job {job_id} may start on any node again"
    return "bad nodes cleared"
