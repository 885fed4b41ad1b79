"""A whole run on vLLM engines against the same run on the built-in engine, one after the other.

    python tools/bench/vllm_run.py [--steps 40] [--parent CHECKOUT] [key=value ...]

The run is CI's (tests/integration/test_vllm_run.py, without the kill): the embedded default on
9 of the 100 problems, 9 prompts x 16 samples per step, on-policy, 2 engines, 2 trainer ranks,
`python -m relax_hpc.submit` as a user runs it. Per engine kind: seconds from the submit to the
first trained step (start-up: engines, trainer, driver, first batch), the steps' mean rollout
samples/s and seconds per step after the first, the mean reward of the last 10 steps, and the
largest logprob_diff_abs (trainer against engine log-probabilities of the sampled tokens: how
exactly the engines hold the trainer's weights). With `--parent`, a checkout of another commit
(`git worktree add /tmp/parent HEAD~1`) makes the same two runs first, from its own code (its
folder on PYTHONPATH), and `vllm_rollout_ratio` is this checkout's vLLM rollout samples/s over
the parent's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.metrics.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]


def one_run(tmp: Path, engine: str, steps: int, repo: Path = REPO, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    rows = (repo / "assets" / "addition.jsonl").read_text().splitlines()
    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "addition-9.jsonl"
    data.write_text("\n".join(rows[::12]) + "\n")
    run_dir = tmp / f"run-{engine}"
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", "configs/tiny-grpo.yaml", f"run.dir={run_dir}",
        f"rollout.engine={engine}", "rollout.vllm.max_model_len=64", f"data.path={data}",
        "rollout.prompts_per_step=9", "rollout.max_staleness=0", f"trainer.total_steps={steps}",
        "rollout.eval_every=0", f"ckpt.every_steps={steps}", *overrides,
    ]  # fmt: skip
    started, started_at = time.monotonic(), time.time()  # the records' times are epoch seconds
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=1800, check=False)
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed ({done.returncode}):\n{done.stdout[-3000:]}")
    train = [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if "loss" in r]
    rollout = read_jsonl(run_dir / "metrics" / "rollout.jsonl")
    later = [r for r in rollout if "samples_per_s" in r][1:]
    return {
        "start_to_first_step_s": round(train[0]["time"] - started_at, 1),
        "seconds_per_step": round((train[-1]["time"] - train[0]["time"]) / (len(train) - 1), 2),
        "rollout_samples_per_s": round(sum(r["samples_per_s"] for r in later) / len(later), 1),
        "last10_reward": round(sum(r["reward"] for r in train[-10:]) / 10, 3),
        "max_logprob_diff_abs": max(r["logprob_diff_abs"] for r in train),
        "wall_s": round(wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--parent", type=Path, default=None, help="a checkout whose same runs come first")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of every run")
    args = parser.parse_args()
    out: dict[str, Any] = {"steps": args.steps, "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        if args.parent is not None:
            parent = args.parent.resolve()
            runs = {e: one_run(Path(tmp) / "parent", e, args.steps, parent, args.overrides) for e in ("torch", "vllm")}
            out["parent"] = {"checkout": str(parent), **runs}
        for engine in ("torch", "vllm"):
            out[engine] = one_run(Path(tmp), engine, args.steps, REPO, args.overrides)
    if args.parent is not None:
        out["vllm_rollout_ratio"] = round(
            out["vllm"]["rollout_samples_per_s"] / out["parent"]["vllm"]["rollout_samples_per_s"], 2
        )
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
