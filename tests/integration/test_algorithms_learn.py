"""Every advantage estimator and every policy loss learns the embedded default task.

Each case runs a shipped config (configs/tiny-NAME.yaml) through the single-process loop
(`python -m relax_hpc.inprocess`: the driver's batch construction, the trainer's backend
and objective, asynchrony simulated at the config's max_staleness), shortened so that all of them
fit in CI: 9 of the 100 problems (every 12th), 9 prompts x 16 samples per step, at most 100 steps
at the schema's default learning rate (5e-4). Chance is 1/19 (about 0.05): the first 10 steps'
mean reward stays below 0.2 and the last 10 steps' mean must reach the case's stated level. A run
stops as soon as they do (from step 20 on, when the last 10 steps are past the first 10): it has
shown what the test asks by then.

The runs are seeded and single-threaded, so each is deterministic on a given machine, but not
across machines (other CPUs round differently, and a short run at this scale is chaotic): every
setting here learned for 3 of 3 seeds on one machine of the CI machine's kind, and each level
sat at about three quarters of the lowest of them (some are higher now: below); a case that
misses it at seed 0 runs again at seed 1 (on another machine of that kind, seed 0 of icepop and
seq-mis collapsed; BENCHMARKS.md, "The algorithm suite learns": those two run seed 1 first).
Shorter runs at higher learning rates (the settings before 0.2) passed for seed 0 on one machine
and collapsed for other seeds or machines: one batch whose groups all score 0 leaves only noise
(and the entropy bonus) to drive the next updates, and the policy drifted to answers that never
stop or never start. Four cases differ from their shipped config: sapo without the entropy bonus
(with it, 1 seed of 3 collapsed), m2po on-policy (at staleness 1 or 2 it collapsed in 1 or 2 of
3 seeds; docs/algorithms.md), seq-tis and seq-mis on-policy (at staleness 1, 1 seed of 3 each).
GRPO with LoRA (rank 32 on every projection, the final norm trained whole) trains at its config's
rate (2e-3: adapters move less per step); its last 10 steps reached 0.41 / 0.55 / 0.47 for seeds 0 / 1 / 2.

Against a learner at half speed (issue 46, item 5; BENCHMARKS.md, "Learning bars"): each case's
run, for all 100 steps, at seeds 0-4 at its rate and at half of it (`tools/bench/learning_bars.py
--case NAME`, the 2-core development machine, 2026-12-05). The comment above a case gives the
ranges of the last 10 steps' mean (at lr / at lr/2). Where a level above the old one is reached by
all five seeds at the rate and missed by at least four at half of it, the case's level moved there;
where the old level already parts them, it stayed; where no level parts them at 100 steps, the
level stayed and the comment says so (the runs were not lengthened: at these rates and steps a
half-rate learner's spread overlaps the learner's). Since a case passes when its seed 0 or seed 1
reaches the level, a half-rate learner passes wherever either of those seeds does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from relax_hpc.launch.forkserver import ForkServer
from relax_hpc.metrics.jsonl import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.learning]

REPO = Path(__file__).resolve().parents[2]
STEPS, LR = 100, 5e-4
MIN_STEPS = 20  # a run stops once its last 10 steps reach the level, but not before this step
# config name -> (level the last 10 steps' mean reward must reach, overrides of the shipped config)
CASES: dict[str, tuple[float, tuple[str, ...]]] = {
    # advantage estimators
    # lr / lr/2, seeds 0-4: 0.532-0.824 / 0.290-0.540: no level parts them
    "grpo": (0.6, ()),
    # lr / lr/2, seeds 0-4: 0.215-0.634 / 0.200-0.406: 0.213 parts 4 of 5, not lr/2 seed 0; 0.3 kept
    "dr-grpo": (0.3, ()),
    # lr / lr/2, seeds 0-4: 0.217-0.567 / 0.214-0.415: no level parts them
    "rloo": (0.15, ()),
    # lr / lr/2, seeds 0-4: 0.212-0.426 / 0.195-0.225: no level parts them
    "remax": (0.15, ()),
    # lr / lr/2, seeds 0-4: 0.613-0.703 / 0.352-0.528: raised from 0.45 to part them
    "reinforce-pp": (0.52, ()),
    # lr / lr/2, seeds 0-4: 0.410-0.711 / 0.216-0.501: raised from 0.25 to part them
    "reinforce-pp-baseline": (0.408, ()),
    # lr / lr/2, seeds 0-4: 0.757-0.990 / 0.767-0.978: no level parts them
    "ppo": (0.55, ()),
    # lr / lr/2, seeds 0-4: 0.213-0.387 / 0.122-0.183: the level parts them
    "distill": (0.2, ()),
    # policy losses (ppo with clip-higher: dapo; with dual-clip: decoupled-ppo; reinforce: rloo)
    # lr / lr/2, seeds 0-4: 0.614-0.800 / 0.419-0.714: raised from 0.45 to part them
    "dapo": (0.6, ()),
    # lr / lr/2, seeds 0-4: 0.334-0.397 / 0.104-0.179: the level parts them
    "gspo": (0.25, ()),
    # lr / lr/2, seeds 0-4: 0.412-0.717 / 0.305-0.536: no level parts them
    "gmpo": (0.2, ()),
    # lr / lr/2, seeds 0-4: 0.001-0.639 / 0.181-0.520 (lr seed 2 collapsed): no level parts them
    "sapo": (0.15, ("algo.policy_loss.entropy_coef=0",)),
    # lr / lr/2, seeds 0-4: 0.426-0.643 / 0.371-0.558: no level parts them
    "cispo": (0.35, ()),
    # lr / lr/2, seeds 0-4: 0.438-0.688 / 0.368-0.551: no level parts them
    "m2po": (0.25, ("rollout.max_staleness=0",)),
    # lr / lr/2, seeds 0-4: 0.219-0.731 / 0.013-0.745: no level parts them
    "decoupled-ppo": (0.25, ()),
    # off-policy corrections of the rollout/trainer mismatch (decoupled: above)
    # lr / lr/2, seeds 0-4: 0.219-0.944 / 0.544-0.715: no level parts them
    "tis": (0.5, ()),
    # lr / lr/2, seeds 0-4: 0.192-0.867 / 0.586-0.670: no level parts them
    "icepop": (0.45, ()),
    # lr / lr/2, seeds 0-4: 0.763-0.967 / 0.664-0.772: no level parts them
    "seq-tis": (0.5, ("rollout.max_staleness=0",)),
    # lr / lr/2, seeds 0-4: 0.765-0.947 / 0.585-0.772: raised from 0.55 to part them
    "seq-mis": (0.74, ("rollout.max_staleness=0",)),
    # LoRA adapters (trainer.lora: rank 32 on every projection, the final norm) at the shipped config's rate
    # lr / lr/2, seeds 0-4: 0.000-0.564 / 0.410-0.435 (lr seed 3 collapsed): no level parts them
    "grpo-lora": (0.3, ("trainer.lr=2e-3",)),
}


SEEDS = (0, 1)  # a case whose first seed misses its level runs again with the second
# Seed 0 of these collapses on machines of the CI machine's kind (both seeds reached their level
# on the machine the levels were set on; BENCHMARKS.md): seed 1 goes first, not 100 wasted steps.
SEED_1_FIRST = {"icepop", "seq-mis"}


def seeds(name: str) -> tuple[int, ...]:
    return SEEDS[::-1] if name in SEED_1_FIRST else SEEDS


def last10(records: list[dict]) -> float:
    return sum(r["reward"] for r in records[-10:]) / 10


def write_problems(path: Path) -> Path:
    """The suite's 9 problems (every 12th of the embedded task's 100), as a JSONL file at `path`."""
    rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
    path.write_text("\n".join(rows[::12]) + "\n")
    return path


def case_lr(name: str) -> float:
    """The learning rate a case trains at: LR unless its overrides set trainer.lr."""
    rates = [float(o.split("=", 1)[1]) for o in CASES[name][1] if o.startswith("trainer.lr=")]
    return rates[-1] if rates else LR


def case_argv(name: str, seed: int, data: Path, out: Path, *extra: str) -> list[str]:
    """One case's run at `seed` (`extra` overrides go last, so they win; tools/bench/learning_bars.py
    halves trainer.lr with one)."""
    return [
        sys.executable, "-m", "relax_hpc.inprocess", "--config", str(REPO / "configs" / f"tiny-{name}.yaml"),
        "--steps", str(STEPS), "--out", str(out), f"data.path={data}", "rollout.prompts_per_step=9",
        f"trainer.lr={LR}", f"run.seed={seed}", *CASES[name][1], *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory) -> dict[str, list[list[dict] | str]]:
    """All cases, two at a time (one per core: each run is single-threaded), each forked from one
    process that imported the loop once (the local executor's fork server: a fresh interpreter
    per run spent about 5 CPU-seconds importing, over 20 runs a third of the suite's CPU). A case
    that misses its level at seed 0 runs again at seed 1: these short runs are chaotic, and which
    seed collapses depends on the CPU's rounding (seq-mis reached 0.744 at seed 0 on the machine
    its level was set on, 0.030 on another of the same kind, where seeds 1 and 2 reached 0.944 and
    0.852). One seed reaching the level shows the objective learns; BENCHMARKS.md has 3 seeds."""
    root = tmp_path_factory.mktemp("learning")
    data = write_problems(root / "addition-9.jsonl")
    forks = ForkServer({"relax_hpc.inprocess"}, os.environ)

    def run_seed(name: str, seed: int) -> list[dict] | str:
        """One case's run, ended as soon as its last 10 steps reach the level (past step
        MIN_STEPS): the run has then shown what the test asks, and the rest is CI time."""
        out, log = root / f"{name}-{seed}.jsonl", root / f"{name}-{seed}.log"
        level = CASES[name][0]
        proc = forks.start(case_argv(name, seed, data, out), os.environ, log)
        records: list[dict] = []
        reached, deadline = False, time.monotonic() + 600
        while not reached and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            records = read_jsonl(out)  # one record per step, each written whole
            reached = len(records) >= MIN_STEPS and last10(records) >= level
        proc.kill()
        proc.wait(timeout=60)
        if not reached:
            records = read_jsonl(out)
        if len(records) < STEPS and not reached:
            return log.read_text()[-3000:]
        return records

    def run(name: str) -> tuple[str, list[list[dict] | str]]:
        tries: list[list[dict] | str] = []
        for seed in seeds(name):
            tries.append(run_seed(name, seed))
            if isinstance(tries[-1], list) and last10(tries[-1]) >= CASES[name][0]:
                break
        return name, tries

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(pool.map(run, CASES))
    finally:
        forks.close()


@pytest.mark.parametrize("name", list(CASES))
def test_reward_rises(name, learning_runs):
    level, _ = CASES[name]
    for seed, records in zip(seeds(name), learning_runs[name], strict=False):
        assert isinstance(records, list), records
        rewards = [r["reward"] for r in records]
        first, last = sum(rewards[:10]) / 10, last10(records)
        facts = {"first10": round(first, 3), "last10": round(last, 3)}
        print(json.dumps({"case": name, "seed": seed, "steps": len(records), **facts}))
        assert MIN_STEPS <= len(records) <= STEPS
        assert first < 0.2, (seed, first)
        assert all(k in records[-1] for k in ("clip_fraction", "approx_kl", "entropy", "advantage_mean", "ratio_max"))
    assert last >= level, f"no seed of {seeds(name)} reached {level}: the last one ended at {last}"
