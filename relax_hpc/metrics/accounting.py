"""GPU- and CPU-hours per role, and samples per GPU-hour (or per CPU-hour without GPUs).

Two sources, the better one first:

- Slurm accounting (`sacct`), where the run's jobs have records: each role is a job step named
  `<launch.slurm.job_name>:<role>`, charged its elapsed time x the CPUs and GPUs of its AllocTRES;
  an elastic engine job (RUN_DIR/scale/ops) is charged as a whole. The job rows themselves give
  the allocation's total, which is what the cluster bills: roles that share a node overlap
  (`srun --overlap`), and Slurm charges each such step the GPUs its node holds, so the roles'
  hours may add up to more than the allocation's.
- The run's own events, otherwise (the local executor, or no accounting on the cluster): the
  launcher's `usage` event at the end of each start of the run says how long each role's
  processes ran, what they were given (CPU threads, GPUs) and, for the processes of its own
  machine, the CPU time they used (user + system, from the kernel's counters: launch.cputime),
  with the launcher's own. A role's GPU-hours are the time it held its GPUs, whatever it did on
  them; its CPU-hours its CPU time where measured, else (job steps on other nodes without
  accounting) its elapsed time x the CPUs it was given. The summary says which.

`sacct` is asked only by `status` and at the end of a run, never on a step's path; once every job
of the run has ended, its answer is kept in RUN_DIR/metrics/accounting.json (a live job's
figures change, and are asked again).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths, write_atomic

SACCT_FIELDS = ("JobID", "JobName", "ElapsedRaw", "AllocTRES", "State")
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING")


def role_kind(name: str) -> str:
    """`engine-3` -> `engine`: a role's kind, which the hours are added up by."""
    return re.sub(r"-\d+$", "", name)


def tres(text: str) -> tuple[float, float]:
    """(CPUs, GPUs) of an AllocTRES such as `cpu=4,gres/gpu=2,mem=0,node=1`."""
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    gpus = sum(float(v) for k, v in fields.items() if k == "gres/gpu" or k.startswith("gres/gpu:"))
    return float(fields.get("cpu", 0)), gpus


def _add(usage: dict[str, list[float]], kind: str, cpu_s: float, gpu_s: float) -> None:
    usage[kind][0] += cpu_s / 3600
    usage[kind][1] += gpu_s / 3600


def from_sacct_rows(rows: list[dict[str, str]], elastic_jobs: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hours per role kind, the allocations' total) from sacct rows (SACCT_FIELDS): a step named
    `<prefix>:<role>` is that role's; an elastic job's own row is the `elastic` role's."""
    roles: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        seconds = float(row["ElapsedRaw"] or 0)
        cpus, gpus = tres(row["AllocTRES"])
        if "." not in row["JobID"]:  # an allocation (a heterogeneous job: one row per component)
            _add(total, "job", seconds * cpus, seconds * gpus)
            if row["JobID"].split("+")[0] in elastic_jobs:
                _add(roles, "elastic", seconds * cpus, seconds * gpus)
        elif ":" in row["JobName"]:
            _add(roles, role_kind(row["JobName"].split(":", 1)[1]), seconds * cpus, seconds * gpus)
    return _hours(roles), _hours(total).get("job", {"cpu_h": 0.0, "gpu_h": 0.0})


def from_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Hours per role kind from the launcher's `usage` events (two per start of the run: until
    its roles' stop, then the stop's own), which add up. CPU:
    the CPU time its processes used (`cpu_s`, launch.cputime), where the launcher could measure it,
    and the launcher's own (with the fork server's); else (job steps on other nodes) the seconds x
    the CPUs it was given. GPU: the seconds it held its GPUs x their number."""
    roles: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in (e for e in events if e.get("event") == "usage"):
        for name, used in event["roles"].items():
            _add(roles, role_kind(name), used.get("cpu_s", used["s"] * used["cpus"]), used["s"] * used["gpus"])
        if "launcher_cpu_s" in event:
            _add(roles, "launcher", event["launcher_cpu_s"], 0.0)
    return _hours(roles)


def cpu_measured(events: list[dict[str, Any]]) -> bool:
    """Whether the events' CPU-hours are CPU time used, every role's measured (else some are
    seconds x CPUs given)."""
    usage = [used for e in events if e.get("event") == "usage" for used in e["roles"].values()]
    return bool(usage) and all("cpu_s" in used for used in usage)


def _hours(usage: dict[str, list[float]]) -> dict[str, Any]:
    return {kind: {"cpu_h": cpu, "gpu_h": gpu} for kind, (cpu, gpu) in sorted(usage.items())}


def run_jobs(paths: RunPaths) -> tuple[list[str], set[str]]:
    """(every Slurm job of the run: its main job, its elastic engine jobs; the elastic ones)."""
    # .get: an eval job's start records no job id (it runs in submit's process or its batch shell).
    starts = [e for e in read_jsonl(paths.events_metrics) if e.get("event") == "start"]
    jobs: set[str] = {str(e["slurm_job_id"]) for e in starts if e.get("slurm_job_id") is not None}
    if paths.slurm_job_id.is_file():
        jobs.add(paths.slurm_job_id.read_text().strip())
    elastic = set()
    for op in (paths.scale / "ops").glob("*.json") if (paths.scale / "ops").is_dir() else []:
        job = json.loads(op.read_text()).get("job_id")
        if job:
            elastic.add(str(job))
    return sorted(jobs | elastic), elastic


def sacct_rows(jobs: list[str]) -> list[dict[str, str]] | None:
    """Every record of these jobs (-D: each requeued allocation too); None where sacct is missing
    or has no records of them (no accounting storage)."""
    try:
        out = subprocess.run(
            ["sacct", "-n", "-P", "-D", "-j", ",".join(jobs), "-o", ",".join(SACCT_FIELDS)],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.split("|") for line in out.stdout.splitlines() if line.strip()]
    rows = [dict(zip(SACCT_FIELDS, parts, strict=True)) for parts in lines if len(parts) == len(SACCT_FIELDS)]
    return rows if out.returncode == 0 and rows else None


def _cache(paths: RunPaths) -> Path:
    return paths.root / "metrics" / "accounting.json"


def unaccounted(events: list[dict[str, Any]], live: bool) -> list[str]:
    """The starts whose launcher wrote no `usage` event: killed with its allocation (scancel's
    SIGKILL after KillWait, a node's loss) before it could, so their hours are in no record;
    `live`: the last start still runs (its usage comes at its end)."""
    missing: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for event in events:
        if event.get("event") == "start":
            missing += [current] if current else []
            current = event
        elif event.get("event") == "usage":
            current = None
    missing += [current] if current and not live else []
    return [
        f"job {e['slurm_job_id']} (restart {e.get('slurm_restart_count', 0)})" if e.get("slurm_job_id")
        else time.strftime("the start at %Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
        for e in missing
    ]  # fmt: skip


def accounting(paths: RunPaths, slurm: bool = True, live: bool = False) -> dict[str, Any]:
    """The run's hours per role kind, their source, and samples per GPU- or CPU-hour; with
    `slurm` False, from the events alone (no sacct: what the metric sinks report). From the
    events, the starts they cannot account are listed (`unaccounted`; `live`: the run's last
    start still runs)."""
    jobs, elastic = run_jobs(paths) if slurm else ([], set())
    facts: dict[str, Any] | None = None
    if jobs and _cache(paths).is_file():
        cached = json.loads(_cache(paths).read_text())
        facts = cached if cached.get("jobs") == jobs else None
    if facts is None and jobs:
        rows = sacct_rows(jobs)
        if rows is not None:
            roles, total = from_sacct_rows(rows, elastic)
            facts = {"source": "sacct", "jobs": jobs, "roles": roles, "total": total}
            if not any(r["State"].split()[0] in ACTIVE_STATES for r in rows):  # final: never asked again
                with contextlib.suppress(OSError):  # a RUN_DIR this user may only read
                    write_atomic(_cache(paths), json.dumps(facts).encode())
    if facts is None:
        events = read_jsonl(paths.events_metrics)
        roles = from_events(events)
        total = {unit: sum(r[unit] for r in roles.values()) for unit in ("cpu_h", "gpu_h")}
        facts = {"source": "events", "jobs": jobs, "roles": roles, "total": total, "cpu_used": cpu_measured(events),
                 "unaccounted": unaccounted(events, live)}  # fmt: skip
    samples = sum(r.get("samples", 0) for r in read_jsonl(paths.train_metrics) if "loss" in r)  # trained steps
    samples += sum(r.get("samples", 0) for r in read_jsonl(paths.eval_results))  # an eval job's scored ones
    return {**facts, **per_hour(samples, facts["total"])}


def per_hour(samples: int, total: dict[str, float]) -> dict[str, Any]:
    """Samples trained (an eval job: scored) per GPU-hour of the whole run (per CPU-hour where it
    had no GPUs)."""
    unit = "gpu_h" if total["gpu_h"] > 0 else "cpu_h"
    rate = samples / total[unit] if total[unit] > 0 else 0.0
    return {"samples": samples, f"samples_per_{unit}": rate}


def render(facts: dict[str, Any]) -> list[str]:
    """A line per role kind, then the total and the rate."""
    lines = [
        f"usage:       {kind} {r['gpu_h']:.3f} GPU-h, {r['cpu_h']:.3f} CPU-h" for kind, r in facts["roles"].items()
    ]
    total = facts["total"]
    unit = "GPU" if "samples_per_gpu_h" in facts else "CPU"
    cpu = "user + system time of every process" if facts.get("cpu_used") else "elapsed time x the CPUs given"
    lines.append(f"usage:       CPU-h: {cpu}; GPU-h: elapsed time x the GPUs held")
    lines.append(
        f"usage:       total {total['gpu_h']:.3f} GPU-h, {total['cpu_h']:.3f} CPU-h ({facts['source']}); "
        f"{facts['samples']} samples, {facts[f'samples_per_{unit.lower()}_h']:.0f} per {unit}-hour"
    )
    if facts.get("unaccounted"):
        lines.append(
            f"usage:       not counted above: {', '.join(facts['unaccounted'])}, whose launcher was killed before "
            "its usage record (no Slurm accounting to ask)"
        )
    return lines
