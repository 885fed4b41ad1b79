"""Elastic rollout and engine health on a real Slurm cluster, each part timed, in one run.

    python tools/bench/elastic.py [--window 20]      # uses $SLURM_CONF, or starts tools/slurm/cluster.sh

The tiny run (launch.executor=slurm, 1 trainer node + 1 rollout node with 2 engines) trains; then:

    samples/s with 2 engines       over `window` steps
    scale out 2 engines            `python -m relax_hpc.scale RUN_DIR out --engines 2`, timed from the
                                   command to: its job running, both engines registered, both holding
                                   the trainer's weights (state active), the driver's first batch
                                   that used 4 engines
    samples/s with 4 engines       over `window` steps after that
    a hung engine                  SIGSTOP to engine-0: time to the health manager's finding (hung:
                                   launch.health.engine_timeout_s=20 here, 60 by default), and to its
                                   replacement registered and holding the current weights

Every "node" of the test cluster shares this machine's cores, so more engines add no compute
here: the samples/s figures show what scale-out costs and that it does not disturb training, not
what it gains on a real cluster. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from preemption import REPO, slurm_cluster  # puts the repository on sys.path too

from relax_hpc.metrics.jsonl import read_jsonl  # importable once preemption has set sys.path
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import read_records
from tests.slurm.jobs import job_id, job_state, submit, wait_until

ENGINE_TIMEOUT_S = 20


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(RunPaths(run_dir).train_metrics) if "loss" in r]


def samples_per_s(run_dir: Path, window: int) -> float:
    """Trained samples per second over the next `window` steps from now."""
    first = len(steps(run_dir))
    wait_until(lambda: len(steps(run_dir)) >= first + window + 1, 600, f"{window} steps")
    rows = steps(run_dir)[first : first + window + 1]
    return sum(r["samples"] for r in rows[1:]) / (rows[-1]["time"] - rows[0]["time"])


def scale(run_dir: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args], cwd=REPO,
                         capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    return out.stdout


def op_state(run_dir: Path, op_id: str) -> str:
    return {r["id"]: r["state"] for r in json.loads(scale(run_dir, "list", "--json"))}[op_id]


def scale_out(run_dir: Path) -> dict[str, float]:
    asked = time.time()
    said = scale(run_dir, "out", "--engines", "2", "--id", "el")
    job = said.split("job ")[1].split(";")[0]
    wait_until(lambda: job_state(job) == "RUNNING", 300, "the elastic job to run")
    running = time.time()
    ids = {"el-0", "el-1"}
    wait_until(lambda: ids <= {r.engine_id for r in read_records(run_dir / "registry" / "engines")}, 300, "registered")
    registered = time.time()
    wait_until(lambda: op_state(run_dir, "el") == "active", 300, "the current weights")
    active = time.time()
    used = wait_until(
        lambda: [r for r in read_jsonl(RunPaths(run_dir).rollout_metrics) if r.get("engines") == 4], 300, "4 engines"
    )
    return {
        "submitted_to_running_s": running - asked,
        "running_to_registered_s": registered - running,
        "registered_to_weights_s": active - registered,
        "weights_to_first_batch_s": used[0]["time"] - active,
        "total_s": used[0]["time"] - asked,
    }


def hung_engine(run_dir: Path) -> dict[str, float]:
    engines = run_dir / "registry" / "engines"
    victim = next(r for r in read_records(engines) if r.engine_id == "engine-0")
    events = RunPaths(run_dir).events_metrics
    stopped = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    finding = wait_until(
        lambda: [e for e in read_jsonl(events) if e.get("event") == "role_hung" and e.get("role") == "engine-0"],
        300,
        "the hung engine to be found",
    )
    version = lambda: max(int(r["version"]) for r in steps(run_dir))  # noqa: E731
    wait_until(
        lambda: any(
            r.engine_id == "engine-0" and r.instance != victim.instance and int(r.weight_version) >= version() - 1
            for r in read_records(engines)
        ),
        300,
        "its replacement to hold the current weights",
    )
    replaced = time.time()
    return {"stopped_to_found_s": finding[0]["time"] - stopped, "stopped_to_replaced_s": replaced - stopped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    run_dir = work / "run"
    with slurm_cluster(work):
        out = submit(run_dir, "trainer.total_steps=100000", "ckpt.every_steps=1000", "launch.slurm.time_min=30",
                     f"launch.health.engine_timeout_s={ENGINE_TIMEOUT_S}")  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(out.stdout + out.stderr)
        try:
            wait_until(lambda: len(steps(run_dir)) >= 5, 300, "the first steps")
            two = samples_per_s(run_dir, args.window)
            joined = scale_out(run_dir)
            four = samples_per_s(run_dir, args.window)
            hung = hung_engine(run_dir)
        finally:
            # Only this run's jobs: $SLURM_CONF may name a cluster shared with other work.
            elastic = [json.loads(p.read_text()).get("job_id") for p in (run_dir / "scale" / "ops").glob("*.json")]
            subprocess.run(["scancel", job_id(run_dir), *filter(None, elastic)], check=False)
    print(
        json.dumps(
            {
                "benchmark": "elastic",
                "samples_per_s_2_engines": round(two, 1),
                "scale_out_2_engines": {k: round(v, 2) for k, v in joined.items()},
                "samples_per_s_4_engines": round(four, 1),
                "hung_engine": {k: round(v, 2) for k, v in hung.items()},
                "job_id": job_id(run_dir),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
