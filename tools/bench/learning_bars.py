"""Where a learning test's bar belongs (issue 46, item 5): the test's run for several seeds, at its
own step count, once as configured and once with `trainer.lr` halved (a stand-in for a learner at
half speed). A bar separates them when every normal seed passes it and at least 4 of 5 half-rate
seeds fail it.

    python tools/bench/learning_bars.py --steps 70 [--seeds 0 1 2 3 4] [--config configs/X.yaml] \
        [--figure rise|last10|best10] [--json FILE] [--out DIR] [key=value ...]
    python tools/bench/learning_bars.py --case NAME [--seeds 0 1 2 3 4] [--out DIR] [--json FILE]

Default mode (tests/integration/test_learning.py): each run is `python -m relax_hpc.submit --config
X run.seed=S [trainer.lr=LR/2] key=value ...` on the local executor, one after the other. Per run it
reads metrics/train.jsonl: the mean reward of the first and the last 10 steps, their difference
(the rise, what that test bounds, and the figure separated by default) and best10, the best mean of
10 consecutive steps from step 20 on (--figure best10: what a test that stops its run once learned,
conftest's Job.run_until_learned, checks; such a test's run is measured for all its steps). A run
folder that already holds every step is read, not run again, and --json is rewritten after every
run.

--case NAME (a case of tests/integration/test_algorithms_learn.py): each run is that test's own
command (its case_argv: configs/tiny-NAME.yaml, its 9 problems, its step count, rate and overrides,
run through `python -m relax_hpc.inprocess`), plus `trainer.lr=` half the case's rate for the
half-rate runs, one after the other and for all of the test's steps (the test stops a run once it
reaches its level). The figure separated is the last 10 steps' mean reward (the test's level); the
first 10 steps' mean is recorded too. A run whose output already holds every step is read, not run
again, and the JSON is rewritten after every run (--json), so a cut-off measurement resumes.

Prints one JSON object: every run, and per rate the separated figure sorted, with the widest bar
that separates the two rates (null where none does); "figure" names the figure ("rise",
"last10" or "best10").
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIN_STEPS = 20  # tests/integration/conftest.py, Job.run_until_learned's min_steps
sys.path.insert(0, str(REPO))
from relax_hpc.config.load import load_config  # noqa: E402
from relax_hpc.metrics.jsonl import read_jsonl  # noqa: E402
from tests.integration import test_algorithms_learn as suite  # noqa: E402


def summary(rewards: list[float]) -> dict:
    """A run's figures: the mean reward of the first and the last 10 steps, their difference (the
    rise), and best10, the highest mean of 10 consecutive steps ending at step MIN_STEPS or later
    (what a test that stops a run once it is learned, conftest's Job.run_until_learned, checks)."""
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    windows = [sum(rewards[k - 10 : k]) / 10 for k in range(MIN_STEPS, len(rewards) + 1)]
    return {"steps": len(rewards), "first10": round(first, 3), "last10": round(last, 3),
            "rise": round(last - first, 3), "best10": round(max(windows), 3) if windows else None}  # fmt: skip


def one_run(config: Path, run_dir: Path, seed: int, lr: float, steps: int, overrides: list[str]) -> dict:
    """One run of the default mode; a run folder that already holds every step is read instead."""
    train = run_dir / "metrics" / "train.jsonl"
    code, wall_s = 0, None
    if not train.exists() or len([r for r in read_jsonl(train) if "loss" in r]) < steps:
        shutil.rmtree(run_dir, ignore_errors=True)  # a cut-off run starts again
        argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(config), f"run.dir={run_dir}",
                f"run.seed={seed}", f"trainer.lr={lr}", f"trainer.total_steps={steps}", *overrides]  # fmt: skip
        started = time.monotonic()
        with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
            code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        wall_s = round(time.monotonic() - started, 1)
    rewards = [r["reward"] for r in read_jsonl(train) if "loss" in r] if train.exists() else []
    return {"seed": seed, "lr": lr, "exit": code, **summary(rewards), "wall_s": wall_s}


def separating_bar(normal: list[float], half: list[float]) -> float | None:
    """The midpoint between the lowest normal rise and the highest half-rate rise that still lets
    at least 4 of 5 (all but a fifth) half-rate runs fall below it; None if no bar does."""
    floor = min(normal)
    allowed = len(half) // 5  # half-rate runs that may pass the bar
    failing = sorted(half)[: len(half) - allowed]
    ceiling = max(failing)
    return round((floor + ceiling) / 2, 3) if ceiling < floor else None


def case_run(name: str, data: Path, out: Path, seed: int, lr: float, rate: float) -> dict:
    """One run of the algorithm suite's case `name` at `seed` for all of the test's steps, at its
    rate times `rate`; an output that already holds every step is read instead."""
    jsonl = out / f"seed{seed}-lr{lr * rate:g}.jsonl"
    records = read_jsonl(jsonl) if jsonl.exists() else []
    code, wall_s = 0, None
    if len(records) < suite.STEPS:
        jsonl.unlink(missing_ok=True)
        argv = suite.case_argv(name, seed, data, jsonl, *(() if rate == 1.0 else (f"trainer.lr={lr * rate:g}",)))
        started = time.monotonic()
        with jsonl.with_suffix(".log").open("w") as log:
            code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        wall_s = round(time.monotonic() - started, 1)
        records = read_jsonl(jsonl) if jsonl.exists() else []
    return {"seed": seed, "lr": lr * rate, "exit": code, **summary([r["reward"] for r in records]), "wall_s": wall_s}


def case_main(name: str, seeds: list[int], out: Path, json_path: Path | None) -> None:
    """--case: the suite's case at both rates; the JSON after every run, the bar once all are in."""
    out.mkdir(parents=True, exist_ok=True)
    data = suite.write_problems(out / "addition-9.jsonl")
    lr, level = suite.case_lr(name), suite.CASES[name][0]
    runs: list[dict] = []
    result: dict = {}
    for rate in (1.0, 0.5):
        for seed in seeds:
            runs.append(case_run(name, data, out, seed, lr, rate))
            lasts = {k: sorted(r["last10"] for r in runs if r["lr"] == lr * k) for k in (1.0, 0.5)}
            done = len(runs) == 2 * len(seeds)
            bar = separating_bar(lasts[1.0], lasts[0.5]) if done else None
            # the test passes a case when its first or its second seed reaches the level
            tried = [r["last10"] for r in runs if r["lr"] == lr * 0.5 and r["seed"] in suite.SEEDS]
            result = {"case": name, "figure": "last10", "steps": suite.STEPS, "lr": lr,
                      "overrides": list(suite.CASES[name][1]), "level": level, "complete": done,
                      "last10_normal": lasts[1.0], "last10_half_lr": lasts[0.5], "bar": bar,
                      "half_lr_passes_test_at_bar": None if bar is None or not done else max(tried) >= bar,
                      "half_lr_passes_test_at_level": max(tried) >= level if done else None, "runs": runs}  # fmt: skip
            if json_path is not None:
                json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-grpo.yaml")
    parser.add_argument("--steps", type=int, help="the learning test's trainer.total_steps (default mode)")
    parser.add_argument("--case", choices=list(suite.CASES), help="a case of the algorithm suite (its test's name)")
    parser.add_argument("--json", type=Path, default=None, help="the JSON is also written here, after each run")
    parser.add_argument(
        "--figure",
        choices=("rise", "last10", "best10"),
        default="rise",
        help="default mode: the figure separated (best10: a test that stops once learned)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="the test's other key=value overrides (default mode)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="learning-bars-"))
    if args.case:
        if args.overrides or args.steps is not None or args.figure != "rise":
            parser.error("--case runs the test's own step count and overrides, and parts last10")
        case_main(args.case, args.seeds, out, args.json)
        return
    if args.steps is None:
        parser.error("--steps is required without --case")
    out.mkdir(parents=True, exist_ok=True)
    lr = load_config(args.config, args.overrides, base_dir=REPO).trainer.lr
    runs: list[dict] = []
    result: dict = {}
    for rate in (1.0, 0.5):
        for seed in args.seeds:
            run_dir = out / f"seed{seed}-lr{rate}"
            runs.append(one_run(args.config, run_dir, seed, lr * rate, args.steps, args.overrides))
            figures = {k: sorted(r[args.figure] for r in runs if r["lr"] == lr * k) for k in (1.0, 0.5)}
            done = len(runs) == 2 * len(args.seeds)
            result = {"config": str(args.config), "figure": args.figure, "steps": args.steps, "lr": lr,
                      "overrides": args.overrides, "complete": done, f"{args.figure}_normal": figures[1.0],
                      f"{args.figure}_half_lr": figures[0.5],
                      "bar": separating_bar(figures[1.0], figures[0.5]) if done else None, "runs": runs}  # fmt: skip
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
