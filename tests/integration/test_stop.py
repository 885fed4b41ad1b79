"""A local run told to stop stops with a checkpoint, and says so in its exit status."""

import pytest

from relax_hpc.ckpt.layout import read_trainer_state
from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import Job

pytestmark = [pytest.mark.integration]


def test_max_wall_time_stops_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(
        run_dir,
        "launch.max_wall_s=30",
        "trainer.total_steps=1000",
        "rollout.prompts_per_step=8",
        "rollout.eval_every=0",
    )
    assert job.run(timeout_s=180) == 75, job.text()[-2000:]
    assert "launch.max_wall_s (30 s) reached" in job.text()
    ends = [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if r.get("event") == "end"]
    assert len(ends) == 1 and ends[0]["completed"] is False
    state = read_trainer_state(run_dir / "ckpt")
    assert state is not None and state["step"] == ends[0]["step"] > 0
