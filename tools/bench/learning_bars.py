"""Where a learning test's bar belongs (issue 46, item 5): the test's run for several seeds, at its
own step count, once as configured and once with `trainer.lr` halved (a stand-in for a learner at
half speed). A bar separates them when every normal seed passes it and at least 4 of 5 half-rate
seeds fail it.

    python tools/bench/learning_bars.py --steps 70 [--seeds 0 1 2 3 4] [--config configs/X.yaml] \
        [key=value ...]

Each run is `python -m relax_hpc.submit --config X run.seed=S [trainer.lr=LR/2] key=value ...` on
the local executor, one after the other. Per run it reads metrics/train.jsonl: the mean reward of
the first and the last 10 steps and their difference (the rise, what tests/integration/
test_learning.py bounds). Prints one JSON object: every run, and per rate the rises sorted, with the
widest bar that separates the two rates (null where none does).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from relax_hpc.config.load import load_config  # noqa: E402
from relax_hpc.metrics.jsonl import read_jsonl  # noqa: E402


def one_run(config: Path, run_dir: Path, seed: int, lr: float, steps: int, overrides: list[str]) -> dict:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(config), f"run.dir={run_dir}",
            f"run.seed={seed}", f"trainer.lr={lr}", f"trainer.total_steps={steps}", *overrides]  # fmt: skip
    started = time.monotonic()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    rewards = [r["reward"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if "loss" in r]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    wall_s = round(time.monotonic() - started, 1)
    return {"seed": seed, "lr": lr, "exit": code, "steps": len(rewards), "first10": round(first, 3),
            "last10": round(last, 3), "rise": round(last - first, 3), "wall_s": wall_s}  # fmt: skip


def separating_bar(normal: list[float], half: list[float]) -> float | None:
    """The midpoint between the lowest normal rise and the highest half-rate rise that still lets
    at least 4 of 5 (all but a fifth) half-rate runs fall below it; None if no bar does."""
    floor = min(normal)
    allowed = len(half) // 5  # half-rate runs that may pass the bar
    failing = sorted(half)[: len(half) - allowed]
    ceiling = max(failing)
    return round((floor + ceiling) / 2, 3) if ceiling < floor else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-grpo.yaml")
    parser.add_argument("--steps", type=int, required=True, help="the learning test's trainer.total_steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="the test's other key=value overrides")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="learning-bars-"))
    out.mkdir(parents=True, exist_ok=True)
    lr = load_config(args.config, args.overrides, base_dir=REPO).trainer.lr
    runs = [
        one_run(args.config, out / f"seed{seed}-lr{rate}", seed, lr * rate, args.steps, args.overrides)
        for rate in (1.0, 0.5)
        for seed in args.seeds
    ]
    rises = {rate: sorted(r["rise"] for r in runs if r["lr"] == lr * rate) for rate in (1.0, 0.5)}
    bar = separating_bar(rises[1.0], rises[0.5])
    print(json.dumps({"config": str(args.config), "steps": args.steps, "lr": lr, "overrides": args.overrides,
                      "rises_normal": rises[1.0], "rises_half_lr": rises[0.5], "bar": bar, "runs": runs},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
