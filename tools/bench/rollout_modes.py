"""Rollout modes on the same work: synchronous (rollout.max_staleness 0: the engines idle while the
trainer trains), asynchronous (max_staleness k: the engines generate the next batches meanwhile)
and, optionally, partial rollout (asynchronous, and generations in flight at a weight update are
continued with the new weights instead of finishing with the old ones), run one after the other.

    python tools/bench/rollout_modes.py [--steps 50] [--staleness 2] [--long-tail] [--partial]

`--long-tail` uses the long_tail environment (relax_hpc/envs/long_tail.py: most completions 4
tokens, `--long-share` of them `--long-tokens`), the case partial rollout is for.

Prints one JSON object. Per mode: the steps' time (from the end of step 1 to the end of the last,
so start-up is left out), training samples/s, the mean generate and train time per step. The
baseline is the synchronous run; its phase times give the overlap bound (T_rollout + T_train) /
max(T_rollout, T_train), the most any overlap of the two can gain, and each other mode's speed-up
is reported as a share of it.
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
BUSY = ("time_read", "time_fwd_bwd", "time_optimizer", "time_push", "time_checkpoint")


def run(run_dir: Path, steps: int, overrides: list[str]) -> dict:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / "tiny-grpo.yaml"),
            f"run.dir={run_dir}", f"trainer.total_steps={steps}", "rollout.eval_every=0",
            f"ckpt.every_steps={steps}", *overrides]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [r for r in read_jsonl(RunPaths(run_dir).train_metrics) if "loss" in r]
    span = records[-1]["time"] - records[0]["time"]
    rest = records[1:]  # step 1's times include start-up
    samples = sum(r["samples"] for r in rest)
    return {
        "job_wall_s": round(wall, 1),
        "steps_s": round(span * steps / (steps - 1), 1),  # the first record marks the end of step 1
        "s_per_step": round(span / (steps - 1), 3),
        "samples_per_s": round(samples / span, 1),
        "generate_s": round(sum(r["time_generate"] for r in rest) / len(rest), 3),
        "train_s": round(sum(sum(r[k] for k in BUSY) for r in rest) / len(rest), 3),
        "staleness_mean": round(sum(r["staleness_mean"] for r in records) / len(records), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--long-tail", action="store_true", help="the long_tail environment instead of the task's")
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--long-tokens", type=int, default=48)
    parser.add_argument("--partial", action="store_true", help="also run partial rollout")
    args = parser.parse_args()
    task: list[str] = []
    if args.long_tail:
        task = [
            "rollout.env.name=long_tail", f"rollout.max_new_tokens={args.long_tokens}",
            f"rollout.env.settings={{long_share: {args.long_share}, long_tokens: {args.long_tokens}}}",
        ]  # fmt: skip
    modes = {
        "sync": ["rollout.max_staleness=0"],
        f"async_k{args.staleness}": [f"rollout.max_staleness={args.staleness}"],
    }
    if args.partial:
        modes[f"partial_k{args.staleness}"] = [f"rollout.max_staleness={args.staleness}", "rollout.partial=true"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(Path(tmp) / name, args.steps, task + overrides) for name, overrides in modes.items()}
    sync = results["sync"]
    bound = (sync["generate_s"] + sync["train_s"]) / max(sync["generate_s"], sync["train_s"], 1e-9)
    for result in results.values():
        speedup = result["samples_per_s"] / sync["samples_per_s"]
        result.update(speedup=round(speedup, 2), share_of_bound=round(speedup / bound, 2))
    task_name = "long_tail" if args.long_tail else "default"
    summary = {"benchmark": "rollout_modes", "steps": args.steps, "task": task_name, "overlap_bound": round(bound, 2)}
    print(json.dumps({**summary, **results}, indent=1))


if __name__ == "__main__":
    main()
