"""End to end: the embedded default, shortened, through every process; the reward must rise."""

import json

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import Job

pytestmark = [pytest.mark.integration, pytest.mark.learning, pytest.mark.slow]


def test_reward_rises_and_every_artifact_is_there(tmp_path):
    job = Job(tmp_path / "run", "trainer.total_steps=100", "rollout.eval_every=50", "ckpt.every_steps=50")
    assert job.run(timeout_s=900) == 0, job.text()[-3000:]
    steps = job.steps()
    assert [s["step"] for s in steps] == list(range(1, 101))
    first = sum(s["reward"] for s in steps[:10]) / 10
    last = sum(s["reward"] for s in steps[-10:]) / 10
    assert first < 0.15, first  # starts near chance (1 in 19)
    assert last >= first + 0.05, (first, last)
    evals = read_jsonl(job.run_dir / "metrics" / "eval.jsonl")
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 100
    assert evals[-1]["greedy_accuracy"] > evals[0]["greedy_accuracy"]
    # The artifacts a user and a resume rely on.
    run = job.run_dir
    assert (run / "ckpt" / "latest").resolve().name == "step-00000100"
    assert json.loads((run / "ckpt" / "latest" / "trainer_state.json").read_text())["step"] == 100
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["latest", "step-00000050", "step-00000100"]
    assert (run / "config.yaml").is_file() and (run / "metrics" / "rollout.jsonl").is_file()
    assert "step 100/100" in job.text()
    assert all(0 <= s["staleness_max"] <= 1 for s in steps)
