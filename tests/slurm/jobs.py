"""Submitting the tiny run to the test cluster and watching it, as a user would from a login node."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"
# One trainer node (2 ranks) + one rollout node (2 engines), small steps.
TINY_SLURM = (
    "launch.executor=slurm",
    "launch.slurm.trainer.nodes=1",
    "launch.slurm.rollout.nodes=1",
    "launch.slurm.cpus_per_node=2",
    "launch.slurm.time_min=10",
    "rollout.prompts_per_step=8",
    "rollout.eval_every=0",
)


def submit(
    run_dir: Path, *args: str, timeout_s: float = 600, config: Path = CONFIG, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(config), f"run.dir={run_dir}", *TINY_SLURM, *args]
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)


def job_id(run_dir: Path) -> str:
    return (run_dir / "slurm" / "job_id").read_text().strip()


def slurm(*argv: str, **kwargs) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60, **kwargs).stdout


def sacct(job: str, fields: str = "JobID,JobName,State,Partition,NodeList") -> list[dict[str, str]]:
    names = fields.split(",")
    lines = slurm("sacct", "-n", "-P", "-D", "-j", job, "-o", fields).splitlines()
    return [dict(zip(names, line.split("|"), strict=True)) for line in lines if line]


def job_state(job: str) -> str:
    """The job's current state (squeue while it lives, then sacct)."""
    state = slurm("squeue", "-h", "-j", job, "-o", "%T").strip()
    if state:
        return state
    rows = [r for r in sacct(job, "JobID,State") if r["JobID"] == job]
    return rows[-1]["State"] if rows else "UNKNOWN"


FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def finished(job: str) -> bool:
    """The job has ended for good (sacct writes `CANCELLED by UID`)."""
    return job_state(job).split()[0] in FINAL_STATES


def wait_until(predicate, timeout_s: float, what: str, every: float = 0.25, explain=None):
    """`explain` (a run_story): what the failure message shows, for a CI run whose RUN_DIR is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}" + (f"\n{explain()}" if explain else ""))


def run_story(run_dir: Path, lines: int = 25) -> str:
    """The launcher's events, the last lines of its Slurm output and of each role's latest log."""
    events = run_dir / "metrics" / "events.jsonl"
    starts = sorted((p for p in (run_dir / "logs").glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    logs = [*sorted((run_dir / "slurm").glob("*.out")), *(sorted(starts[-1].glob("*.log")) if starts else [])]
    tail = lambda log: "\n".join(log.read_text(errors="replace").splitlines()[-lines:])  # noqa: E731
    parts = [
        events.read_text() if events.exists() else "",
        *(f"--- {log.relative_to(run_dir)}\n{tail(log)}" for log in logs),
    ]
    return "\n".join(parts)


def train_events(run_dir: Path, event: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if r.get("event") == event]


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if "loss" in r]
    return steps[-1] if steps else 0


def job_log(run_dir: Path, job: str) -> str:
    logs = sorted((run_dir / "slurm").glob(f"{job}_*log.out"))
    return "\n".join(p.read_text(errors="replace") for p in logs)


def describe(run_dir: Path, job: str) -> str:
    """What to look at when an assertion fails."""
    parts = [f"job {job}: {sacct(job)}", job_log(run_dir, job)[-3000:]]
    parts += [
        f"{log}:\n" + log.read_text(errors="replace")[-2000:]
        for log in sorted((run_dir / "logs").glob("*/trainer.log"))[-1:]
    ]
    return "\n".join(parts)


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def no_accounting(tmp_path) -> dict[str, str]:
    """The environment of a client on a cluster without accounting: its sacct fails as Slurm's
    does there; squeue and scontrol answer from the controller as ever."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "sacct"
    fake.write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def status(run_dir, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "relax_hpc.status", str(run_dir)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True, env=env)  # fmt: skip
    return out.stdout
