"""Preemption to training resumed, on a real Slurm cluster: each part of the cycle timed.

    python tools/bench/preemption.py [--cycles 3]      # uses $SLURM_CONF, or starts tools/slurm/cluster.sh

The tiny run (launch.executor=slurm, 1 trainer node + 1 rollout node) gets the pre-timeout notice
(`scancel --batch --signal=USR2`, the signal Slurm sends `signal_lead_s` before the time limit or at
a preemption) a few steps after each start. Per cycle:

    checkpoint_s   notice -> trainer's stop record (the checkpoint is written before it)
    requeue_s      notice -> submitit's `scontrol requeue` done (every role stopped)
    restart_s      requeue -> the batch shell runs again (Slurm's part)
    resume_s       batch start -> trainer resumed from the checkpoint (processes, model, checkpoint load)
    first_step_s   resumed -> first training step finished (weights pushed to the engines, a batch generated)
    total_s        notice -> first step after the restart

Baseline in the same run: a trivial batch job that requeues itself on the same signal, which
measures Slurm's own notice -> requeue -> running cycle on this cluster. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from relax_hpc.paths import RunPaths  # noqa: E402  # importable once REPO is on sys.path (above)
from tests.slurm.jobs import job_id, slurm, submit, train_events, wait_until  # noqa: E402  # importable once REPO is on sys.path (above)

STAMP = re.compile(r"submitit \w+ \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\) - (.*)")


def submitit_events(log: Path) -> list[tuple[float, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m:
            out.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), m[2]))
    return out


def steps_after(run_dir: Path, t: float) -> list[dict]:
    return [r for r in _records(run_dir) if "loss" in r and r["time"] > t]


def _records(run_dir: Path) -> list[dict]:
    from relax_hpc.metrics.jsonl import read_jsonl

    return read_jsonl(RunPaths(run_dir).train_metrics)


def relax_cycles(work: Path, cycles: int) -> list[dict]:
    run_dir = work / "run"
    out = submit(run_dir, "trainer.total_steps=1000", "rollout.max_staleness=0", "ckpt.every_steps=1000")
    if out.returncode != 0:
        raise SystemExit(out.stdout + out.stderr)
    job = job_id(run_dir)
    log = run_dir / "slurm" / f"{job}_0_log.out"
    results = []
    try:
        for cycle in range(cycles):
            started = wait_until(lambda cycle=cycle: train_events(run_dir, "start")[cycle:], 300, "the trainer's start")
            since = started[-1]["time"]
            wait_until(lambda since=since: len(steps_after(run_dir, since)) >= 3, 300, "3 steps")
            notice = time.time()
            slurm("scancel", "--batch", "--signal=USR2", job)
            wait_until(lambda cycle=cycle: len(train_events(run_dir, "start")) > cycle + 1, 300, "the resumed start")
            wait_until(lambda: steps_after(run_dir, train_events(run_dir, "start")[-1]["time"]), 300, "a step")
            stop = next(e for e in train_events(run_dir, "end") if e["time"] > notice)
            events = [(t, m) for t, m in submitit_events(log) if t > notice]
            requeued = next(t for t, m in events if m.startswith("Requeued job"))
            restarted = next(t for t, m in events if m.startswith("Starting with") and t > requeued)
            resumed = train_events(run_dir, "start")[-1]["time"]
            first = steps_after(run_dir, resumed)[0]["time"]
            results.append(
                {
                    "checkpoint_s": stop["time"] - notice,
                    "requeue_s": requeued - notice,
                    "restart_s": restarted - requeued,
                    "resume_s": resumed - restarted,
                    "first_step_s": first - resumed,
                    "total_s": first - notice,
                    "checkpoint_step": stop["step"],
                }
            )
    finally:
        subprocess.run(["scancel", job], check=False)
    return results


BASELINE = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
echo "start $(date +%s.%N) $SLURM_RESTART_COUNT"
trap 'scontrol requeue $SLURM_JOB_ID; exit 0' USR2
sleep 300 & wait
"""


def baseline_cycles(work: Path, cycles: int) -> list[float]:
    """Slurm alone: notice -> requeue -> the batch shell running again, for a job that does nothing."""
    script, log = work / "baseline.sbatch", work / "baseline.out"
    script.write_text(BASELINE)
    job = slurm("sbatch", "--parsable", "-N2", f"--output={log}", str(script)).strip()
    times = []
    try:
        for cycle in range(cycles):
            wait_until(
                lambda cycle=cycle: log.exists() and log.read_text().count("start") > cycle, 120, "baseline start"
            )
            time.sleep(1)
            notice = time.time()
            slurm("scancel", "--batch", "--signal=USR2", job)
            wait_until(lambda cycle=cycle: log.read_text().count("start") > cycle + 1, 120, "baseline restart")
            times.append(float(log.read_text().splitlines()[-1].split()[1]) - notice)
    finally:
        subprocess.run(["scancel", job], check=False)
    return times


@contextmanager
def slurm_cluster(work: Path) -> Iterator[None]:
    """The cluster $SLURM_CONF names, or the test cluster (tools/slurm/cluster.sh) started in
    `work` for the duration."""
    if "SLURM_CONF" in os.environ:
        yield
        return
    cluster = work / "cluster"
    started = subprocess.run(["bash", str(REPO / "tools/slurm/cluster.sh"), "start", str(cluster)],
                             capture_output=True, text=True, check=True)  # fmt: skip
    os.environ["SLURM_CONF"] = started.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield
    finally:
        subprocess.run(["bash", str(REPO / "tools/slurm/cluster.sh"), "stop", str(cluster)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    with slurm_cluster(work):
        baseline = baseline_cycles(work, args.cycles)
        cycles = relax_cycles(work, args.cycles)
    keys = [k for k in cycles[0] if k.endswith("_s")]
    median = {k: round(statistics.median(c[k] for c in cycles), 2) for k in keys}
    print(
        json.dumps(
            {
                "cycles": [{k: round(v, 2) for k, v in c.items()} for c in cycles],
                "median": median,
                "baseline_slurm_requeue_s": round(statistics.median(baseline), 2),
                "total_over_baseline": round(median["total_s"] / statistics.median(baseline), 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
