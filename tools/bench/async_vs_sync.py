"""Asynchronous against synchronous rollout: wall time for N steps of the embedded default with
rollout.max_staleness 0 (the baseline: engines idle while the trainer trains) and 2 (engines keep
generating), run one after the other on this machine.

    python tools/bench/async_vs_sync.py [--steps 50] [--staleness 2]

Prints one JSON object; `speedup` = synchronous seconds / asynchronous seconds for the steps
(from the first finished step to the last, so process start-up is left out; job wall times are
reported too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


def run(run_dir: Path, steps: int, staleness: int) -> dict:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / "tiny-grpo.yaml"),
            f"run.dir={run_dir}", f"trainer.total_steps={steps}", f"rollout.max_staleness={staleness}",
            "rollout.eval_every=0", f"ckpt.every_steps={steps}"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [r for r in read_jsonl(RunPaths(run_dir).train_metrics) if "loss" in r]
    span = records[-1]["time"] - records[0]["time"]
    return {
        "job_wall_s": round(wall, 1),
        "steps_s": round(span * steps / (steps - 1), 1),  # first record marks the end of step 1
        "s_per_step": round(span / (steps - 1), 3),
        "final_reward": round(sum(r["reward"] for r in records[-10:]) / 10, 3),
        "staleness_mean": round(sum(r["staleness_mean"] for r in records) / len(records), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--staleness", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", args.steps, 0)
        asyn = run(Path(tmp) / "async", args.steps, args.staleness)
    print(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "steps": args.steps,
                "sync": sync,
                f"async_k{args.staleness}": asyn,
                "speedup": round(sync["steps_s"] / asyn["steps_s"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
