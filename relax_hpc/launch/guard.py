"""The no-progress guard: no Slurm allocation is spent on a run that cannot take a step in it.

At submit, a time limit must fit a start-up, one step, one checkpoint and the pre-timeout lead
(with Slurm's minute of slack): the run's own times where RUN_DIR has history, estimates
otherwise. Inside the job, a run that went `launch.slurm.max_idle_allocations` allocations in a
row without a new checkpointed step is not requeued again; a preempted allocation (the launcher's
`preempted` event) does not count, one that ended by its time limit or failed does. Both read
RUN_DIR only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.schema import JobConfig
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import completed_steps, step_records
from relax_hpc.paths import RunPaths

# What the tiny default takes on a CPU; a larger model's first allocation measures its own.
ESTIMATE_START_S, ESTIMATE_STEP_S, ESTIMATE_CHECKPOINT_S = 20.0, 5.0, 5.0
SIGNAL_SLACK_S = 60  # Slurm checks time limits about every 30 s: the notice may come a minute early


@dataclass(frozen=True)
class Timings:
    start_s: float  # launcher start to the first trained step
    step_s: float
    checkpoint_s: float
    measured: bool  # from this run's records (else the estimates above)


def starts(paths: RunPaths) -> list[dict[str, Any]]:
    """The launcher's start records (one per start of the roles, several per allocation after a
    restart), in order."""
    return [e for e in read_jsonl(paths.events_metrics) if e.get("event") == "start"]


def timings(paths: RunPaths) -> Timings:
    """The run's median start-up and step and its slowest checkpoint, where it has trained (each
    start-up from a launcher start to the first step it trained)."""
    steps = step_records(paths)
    launches = [s["time"] for s in starts(paths)]
    start_s = [
        first["time"] - t
        for t, nxt in zip(launches, [*launches[1:], float("inf")], strict=False)  # one more bound than starts
        if (first := next((r for r in steps if t < r["time"] < nxt), None)) is not None
    ]
    timed = [r for r in steps if "time_step" in r]
    if not start_s or not timed:
        return Timings(ESTIMATE_START_S, ESTIMATE_STEP_S, ESTIMATE_CHECKPOINT_S, measured=False)
    checkpoints = [r["time_checkpoint"] for r in timed if r.get("time_checkpoint")]
    return Timings(
        statistics.median(start_s),
        statistics.median(r["time_step"] for r in timed),
        max(checkpoints, default=ESTIMATE_CHECKPOINT_S),
        measured=True,
    )


def time_limit_problem(cfg: JobConfig, paths: RunPaths) -> str | None:
    """Why launch.slurm.time_min cannot fit a start-up, a step, a checkpoint and the lead (None: it
    can)."""
    sl = cfg.launch.slurm
    t = timings(paths)
    need = t.start_s + t.step_s + t.checkpoint_s + sl.signal_lead_s + SIGNAL_SLACK_S
    if need <= sl.time_min * 60:
        return None
    source = "measured in this run's RUN_DIR" if t.measured else "estimated: RUN_DIR has no steps yet"
    return (
        f"launch.slurm.time_min={sl.time_min} ({sl.time_min * 60} s) cannot fit one step of progress: start-up "
        f"{t.start_s:.0f} s + a step {t.step_s:.0f} s + a checkpoint {t.checkpoint_s:.0f} s ({source}) + "
        f"launch.slurm.signal_lead_s={sl.signal_lead_s} s + {SIGNAL_SLACK_S} s (Slurm may signal a minute early) "
        f"= {need:.0f} s; every allocation would requeue without a step. Raise time_min to at least "
        f"{-(-int(need) // 60)} or lower signal_lead_s"
    )


def idle_allocations(paths: RunPaths, job_id: str | None) -> int:
    """How many allocations of this job in a row, up to the current one, ended without a new
    checkpointed step: each allocation's first start, against the next one's (the current one
    against the checkpoint now). A preempted allocation is passed over: Slurm took it away."""
    firsts: dict[int, int] = {}
    preempted: set[int] = set()
    for e in read_jsonl(paths.events_metrics):
        if e.get("slurm_job_id") != job_id:
            continue
        if e.get("event") == "start":
            firsts.setdefault(int(e.get("slurm_restart_count", 0)), int(e["step"]))
        elif e.get("event") == "preempted":
            preempted.add(int(e["slurm_restart_count"]))
    counts = sorted(firsts)
    steps = [firsts[k] for k in counts] + [completed_steps(paths)]
    idle = 0
    for count, before, after in reversed(list(zip(counts, steps[:-1], steps[1:], strict=True))):
        if after > before:
            break
        idle += count not in preempted
    return idle


def stop_requeueing(cfg: JobConfig, paths: RunPaths, job_id: str | None) -> str | None:
    """Why this job must not requeue itself again (None: it may)."""
    limit = cfg.launch.slurm.max_idle_allocations
    idle = idle_allocations(paths, job_id)
    if not limit or idle < limit:
        return None
    return (
        f"not requeued: {idle} allocation(s) in a row ended without a new step (launch.slurm.max_idle_allocations="
        f"{limit}); the run stays at step {completed_steps(paths)}. Give each allocation more time "
        "(launch.slurm.time_min) or a shorter start-up, then submit again to resume"
    )
