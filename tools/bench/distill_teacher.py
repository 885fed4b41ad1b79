"""On-policy distillation with the teacher in the trainer (configs/tiny-distill.yaml, the baseline)
and on an engine of its own (configs/tiny-distill-engines.yaml), one after the other, on the same
work.

    python tools/bench/distill_teacher.py [--steps 30]

Prints one JSON object. Per placement: the job's wall time, the seconds per step (from the end of
step 1 to the end of the last, start-up left out), the median generate time per batch (with the
engine, the teacher's scoring is inside it: `teacher_s`), the first and last five steps' mean
advantage (the negative per-token reverse KL to the teacher) and the last ten steps' reward. And
how far the two runs agree: the steps whose trained rewards are equal and losses within 1e-5
before the first that is not (sampling is chaotic: one flipped token, and the runs part), and the
largest loss difference over those steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
PLACEMENTS = {"trainer": "tiny-distill.yaml", "engine": "tiny-distill-engines.yaml"}


def run(run_dir: Path, config: str, steps: int) -> tuple[dict, list[dict]]:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / config),
            f"run.dir={run_dir}", f"trainer.total_steps={steps}", "rollout.eval_every=0",
            f"ckpt.every_steps={steps}"]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    paths = RunPaths(run_dir)
    records = [r for r in read_jsonl(paths.train_metrics) if "loss" in r]
    batches = read_jsonl(paths.rollout_metrics)
    span = records[-1]["time"] - records[0]["time"]
    mean = statistics.mean
    return {
        "job_wall_s": round(wall, 1),
        "s_per_step": round(span / (steps - 1), 3),
        "generate_s": round(statistics.median(r["time_generate"] for r in records[1:]), 3),
        "teacher_s": round(statistics.median(b.get("teacher_seconds", 0.0) for b in batches), 3),
        "advantage_first5": round(mean(r["advantage_mean"] for r in records[:5]), 3),
        "advantage_last5": round(mean(r["advantage_mean"] for r in records[-5:]), 3),
        "reward_last10": round(mean(r["reward"] for r in records[-10:]), 3),
    }, records


def agreement(baseline: list[dict], other: list[dict]) -> dict:
    same = 0
    for a, b in zip(baseline, other, strict=True):
        if a["reward"] != b["reward"] or abs(a["loss"] - b["loss"]) > 1e-5:
            break
        same += 1
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(baseline[:same], other[:same], strict=True)]
    return {"steps_agreeing": same, "max_loss_diff": max(diffs, default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run(Path(tmp) / name, config, args.steps) for name, config in PLACEMENTS.items()}
    result = {name: summary for name, (summary, _) in runs.items()}
    print(json.dumps({"steps": args.steps, **result, "agreement": agreement(runs["trainer"][1], runs["engine"][1])}))


if __name__ == "__main__":
    main()
