"""Every advantage estimator and every policy loss learns the embedded default task.

Each case runs a shipped config (configs/tiny-NAME.yaml) through the single-process loop
(`python -m relax_hpc.inprocess`: the driver's batch construction, the trainer's backend
and objective, asynchrony simulated at the config's max_staleness), shortened so that all of them
fit in CI: 9 of the 100 problems (every 12th), 9 prompts x 16 samples per step, a higher
learning rate (the default recipe's 5e-4 is for 64 prompts and 400 steps), 50 or 60 steps.
Chance is 1/19 (about 0.05): the first 10 steps' mean reward stays below 0.2 and the last 10
steps' mean must reach the case's stated level. The runs are seeded and single-threaded, so each
is deterministic on a given torch build; the levels leave margin below what was measured
(docs/algorithms.md, "How it is tested").
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from relax_hpc.metrics.jsonl import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.learning]

REPO = Path(__file__).resolve().parents[2]
# config name -> (learning rate, steps, level the last 10 steps' mean reward must reach)
CASES: dict[str, tuple[float, int, float]] = {
    # advantage estimators
    "grpo": (2e-3, 50, 0.45),
    "dr-grpo": (1e-3, 50, 0.2),
    "rloo": (2e-3, 50, 0.2),
    "reinforce-pp": (1e-3, 50, 0.45),
    "reinforce-pp-baseline": (1e-3, 50, 0.35),
    "ppo": (1e-3, 50, 0.5),
    "distill": (2e-3, 60, 0.35),
    # policy losses (ppo with clip-higher: dapo; with dual-clip: decoupled-ppo; reinforce: rloo)
    "dapo": (1e-3, 50, 0.5),
    "gspo": (2e-3, 50, 0.2),
    "sapo": (2e-3, 50, 0.3),
    "cispo": (2e-3, 50, 0.3),
    "m2po": (5e-4, 60, 0.3),
    "decoupled-ppo": (1e-3, 50, 0.45),
    # off-policy corrections of the rollout/trainer mismatch (decoupled: above)
    "tis": (1e-3, 50, 0.45),
    "icepop": (1e-3, 50, 0.3),
}


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory) -> dict[str, list[dict] | str]:
    """All cases, two at a time (one per core: each run is single-threaded)."""
    root = tmp_path_factory.mktemp("learning")
    rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
    data = root / "addition-9.jsonl"
    data.write_text("\n".join(rows[::12]) + "\n")

    def run(name: str) -> tuple[str, list[dict] | str]:
        out = root / f"{name}.jsonl"
        lr, steps, _ = CASES[name]
        argv = [
            sys.executable, "-m", "relax_hpc.inprocess", "--config", f"configs/tiny-{name}.yaml",
            "--steps", str(steps), "--out", str(out), f"data.path={data}", "rollout.prompts_per_step=9",
            f"trainer.lr={lr}",
        ]  # fmt: skip
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
        return name, read_jsonl(out) if proc.returncode == 0 else proc.stderr[-3000:]

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_reward_rises(name, learning_runs):
    records = learning_runs[name]
    assert isinstance(records, list), records
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    _, steps, level = CASES[name]
    print(json.dumps({"case": name, "first10": round(first, 3), "last10": round(last, 3), "level": level}))
    assert len(records) == steps
    assert first < 0.2, first
    assert last >= level, (first, last, level)
    assert all(k in records[-1] for k in ("clip_fraction", "approx_kl", "entropy", "advantage_mean", "ratio_max"))
