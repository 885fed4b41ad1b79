"""Grid search of recipes in single-process runs (relax_hpc.inprocess), side by side.

Every run is the in-process loop: the driver's batch construction and the trainer's backend and
objective on a world of one, so a grid of settings x seeds fits on one machine, one CPU thread
each:

    python tools/recipe_sweep.py --config configs/tiny-grpo.yaml \
        --grid '{"trainer.lr": [3e-4, 1e-3], "rollout.group_size": [8, 16]}' --seeds 0 1 2 --steps 300

--grid maps config keys to lists of values (or is a JSON list of such maps: the union of their
products); --set adds fixed overrides. Prints one JSON line per (setting, seed): the batch reward
of every step, its 10-step means, and greedy accuracy every --greedy-every steps and at the end.
BENCHMARKS.md's recipe tables came from this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time

from relax_hpc import cli


def run_one(job: tuple[str, list[str], dict, int, int, int]) -> dict:
    import torch

    from relax_hpc.config.load import load_config
    from relax_hpc.inprocess import run_inprocess

    config, fixed, setting, seed, steps, greedy_every = job
    torch.set_num_threads(1)  # one thread per run: runs side by side, not threads fighting over cores
    overrides = [*fixed, *(f"{k}={json.dumps(v)}" for k, v in setting.items()), f"run.seed={seed}"]
    cfg = load_config(config, overrides)
    start = time.perf_counter()
    elapsed: list[float] = []
    records = run_inprocess(cfg, steps, greedy_every, on_step=lambda _: elapsed.append(time.perf_counter() - start))
    # The reward of the batch's own prompts before dynamic sampling drops any group: the policy's.
    rewards = [round(r["reward_sampled"], 3) for r in records]
    crossing = first_crossing(rewards, 0.8)
    return {
        "setting": setting,
        "seed": seed,
        "seconds": round(elapsed[-1], 1),
        "first_step_at_0.8": crossing,
        "seconds_to_0.8": None if crossing is None else round(elapsed[crossing - 1], 1),
        "reward_10step_means": [
            round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)
        ],
        "greedy": [(r["step"], r["greedy_accuracy"]) for r in records if "greedy_accuracy" in r],
        "rewards": rewards,
    }


def first_crossing(rewards: list[float], level: float, window: int = 10) -> int | None:
    """The first step (1-based) whose trailing `window`-step mean reward reaches `level`."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= level:
            return end
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the job config every run starts from")
    parser.add_argument("--grid", default="{}", help="JSON: config key -> list of values (or a list of such maps)")
    parser.add_argument("--set", nargs="*", default=[], help="fixed key=value overrides for every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300, help="trainer steps of each run")
    parser.add_argument(
        "--greedy-every", type=int, default=0, help="greedy accuracy every N steps (0 = at the end only)"
    )
    parser.add_argument("--workers", type=int, default=mp.cpu_count(), help="runs side by side")
    args = parser.parse_args()
    grid = json.loads(args.grid)
    grids = grid if isinstance(grid, list) else [grid]
    settings = [dict(zip(g, values, strict=True)) for g in grids for values in itertools.product(*g.values())] or [{}]
    greedy = args.greedy_every or args.steps
    jobs = [(args.config, args.set, s, seed, args.steps, greedy) for s in settings for seed in args.seeds]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for result in pool.imap_unordered(run_one, jobs):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    cli.run(main)
