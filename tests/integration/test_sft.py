"""kind=sft as a user runs it (`python -m relax_hpc.submit --config configs/tiny-sft.yaml`): the
loss falls, an RL config takes the run as its model, and kill -9 mid-run then the same command
again computes the uninterrupted run's losses bit for bit."""

import json
import random
from pathlib import Path

import pytest

from relax_hpc.config import load_config
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.submit import check_inputs
from tests.integration.conftest import REPO, Job

pytestmark = [pytest.mark.integration]

CONFIG = REPO / "configs" / "tiny-sft.yaml"
STEPS = 40


def losses(run_dir: Path) -> dict[int, list[float]]:
    """Per step, the loss of every record of it (the record follows the checkpoint: one each)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sft") / "run"
    assert Job(run_dir, f"trainer.total_steps={STEPS}", config=CONFIG).run(timeout_s=300) == 0
    return run_dir


def test_sft_learns_and_its_run_is_an_rl_model(uninterrupted):
    steps = losses(uninterrupted)
    assert sorted(steps) == list(range(1, STEPS + 1))
    first = sum(steps[s][0] for s in range(1, 6)) / 5
    last = sum(steps[s][0] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.75 * first, (first, last)  # measured: about 1.25 -> 0.8
    logs = uninterrupted / "logs" / "0"
    # No engines, no driver: the trainer, forked by the fork server, whose own log is beside it.
    assert sorted(p.name for p in logs.iterdir()) == ["forkserver.log", "trainer.log"]
    rl = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"model.path={uninterrupted}"], base_dir=REPO)
    assert rl.model.path == str(uninterrupted / "hf")
    check_inputs(rl)  # the export is a model the RL run can load


@pytest.mark.slow
def test_sft_resume_after_kill_reproduces_the_uninterrupted_run(uninterrupted, tmp_path):
    """The same config, fewer steps and a checkpoint every 3 (neither changes a step's numbers)."""
    resumed = tmp_path / "resumed"
    common = ("trainer.total_steps=10", "ckpt.every_steps=3")
    job = Job(resumed, *common, config=CONFIG).start()
    job.wait_for_step(random.Random(7).randint(4, 5), timeout_s=200)
    job.kill_all()  # SIGKILL to every process: no checkpoint, no clean stop
    reached = job.steps()[-1]["step"]
    assert Job(resumed, *common, config=CONFIG).run(timeout_s=300) == 0

    starts = [r["step"] for r in read_jsonl(resumed / "metrics" / "train.jsonl") if r.get("event") == "start"]
    assert starts == [0, 3] and reached > 3  # steps 4.. were trained again after the kill
    # The record follows the checkpoint (each step once), and every step computed the same loss bit
    # for bit: the data position (the step), weights, optimizer and RNG came back exactly.
    got, ref = losses(resumed), losses(uninterrupted)
    assert got == {s: ref[s] for s in range(1, 11)}
