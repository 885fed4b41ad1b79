"""End to end: the embedded default, shortened, through every process; the reward must rise."""

import json

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import Job

pytestmark = [pytest.mark.integration, pytest.mark.learning, pytest.mark.slow]


# Long enough to show the rise with a margin, no longer (CI's time): here, 2026-12-04, the first 10
# steps' mean 0.054 and the last 10's 0.176, greedy accuracy 0.08 -> 0.34. The full run to 0.8 (the
# README's command, 400 steps) is BENCHMARKS.md's "Learning the embedded default".
STEPS = 70
# The bar on the rise (last 10 steps' mean less the first 10's) separates a learner from one at half
# speed: at 70 steps, 5 seeds rose 0.102-0.233 and with trainer.lr halved 0.057-0.106, 4 of those 5
# below 0.09 (tools/bench/learning_bars.py, BENCHMARKS.md "Learning bars"). 0.05 passed them all.
RISE = 0.09


def test_reward_rises_and_every_artifact_is_there(tmp_path):
    job = Job(tmp_path / "run", f"trainer.total_steps={STEPS}", "rollout.eval_every=35", "ckpt.every_steps=35")
    assert job.run(timeout_s=900) == 0, job.text()[-3000:]
    steps = job.steps()
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    first = sum(s["reward"] for s in steps[:10]) / 10
    last = sum(s["reward"] for s in steps[-10:]) / 10
    print(json.dumps({"first10": round(first, 3), "last10": round(last, 3)}))
    assert first < 0.15, first  # starts near chance (1 in 19)
    assert last >= first + RISE, (first, last)
    evals = read_jsonl(job.run_dir / "metrics" / "eval.jsonl")
    assert evals[0]["version"] == 0 and evals[-1]["version"] == STEPS
    assert evals[-1]["greedy_accuracy"] > evals[0]["greedy_accuracy"]
    # The artifacts a user and a resume rely on.
    run = job.run_dir
    assert (run / "ckpt" / "latest").resolve().name == f"step-{STEPS:08d}"
    assert json.loads((run / "ckpt" / "latest" / "trainer_state.json").read_text())["step"] == STEPS
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step-00000035", f"step-{STEPS:08d}"]
    assert (run / "config.yaml").is_file() and (run / "metrics" / "rollout.jsonl").is_file()
    assert f"step {STEPS}/{STEPS}" in job.text()
    assert all(0 <= s["staleness_max"] <= 1 for s in steps)
