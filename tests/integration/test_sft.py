"""kind=sft as a user runs it (`python -m relax_hpc.submit --config configs/tiny-sft.yaml`): the
loss falls and the exported model answers better, an RL config takes the run as its model, and
kill -9 mid-run then the same command again reproduces the uninterrupted run bit for bit."""

import json
import random
from pathlib import Path

import pytest
from safetensors.torch import load_file

from relax_hpc.config import load_config
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.submit import check_inputs
from tests.integration.conftest import REPO, Job

pytestmark = [pytest.mark.integration]

CONFIG = REPO / "configs" / "tiny-sft.yaml"


def losses(run_dir: Path) -> dict[int, list[float]]:
    """Per step, the loss of every attempt at it (a kill may have thrown one away)."""
    out: dict[int, list[float]] = {}
    for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def test_sft_learns_and_its_run_is_an_rl_model(tmp_path):
    run_dir = tmp_path / "sft"
    assert Job(run_dir, "trainer.total_steps=60", config=CONFIG).run(timeout_s=300) == 0
    steps = losses(run_dir)
    assert sorted(steps) == list(range(1, 61))
    first = sum(steps[s][0] for s in range(1, 6)) / 5
    last = sum(steps[s][0] for s in range(56, 61)) / 5
    assert last < 0.6 * first, (first, last)  # measured: about 1.25 -> 0.5
    assert not list((run_dir / "logs" / "0").glob("engine-*")) and not (run_dir / "logs" / "0" / "driver.log").exists()
    rl = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"model.path={run_dir}"], base_dir=REPO)
    assert rl.model.path == str(run_dir / "hf")
    check_inputs(rl)  # the export is a model the RL run can load


@pytest.mark.slow
def test_sft_resume_after_kill_reproduces_the_uninterrupted_run(tmp_path):
    common = ("trainer.total_steps=10", "ckpt.every_steps=3", "sft.batch_size=16")
    reference = tmp_path / "reference"
    assert Job(reference, *common, config=CONFIG).run(timeout_s=300) == 0
    resumed = tmp_path / "resumed"
    job = Job(resumed, *common, config=CONFIG).start()
    job.wait_for_step(random.Random(7).randint(4, 5), timeout_s=200)
    job.kill_all()  # SIGKILL to every process: no checkpoint, no clean stop
    reached = job.steps()[-1]["step"]
    assert Job(resumed, *common, config=CONFIG).run(timeout_s=300) == 0

    starts = [r["step"] for r in read_jsonl(resumed / "metrics" / "train.jsonl") if r.get("event") == "start"]
    assert starts == [0, 3] and reached > 3  # steps 4.. were trained again after the kill
    ref, got = losses(reference), losses(resumed)
    # The record follows the checkpoint (each step once), and every step computed the same loss bit
    # for bit: the data position (the step), weights, optimizer and RNG came back exactly.
    assert got == ref and sorted(got) == list(range(1, 11)) and all(len(v) == 1 for v in got.values())
    ref_w, got_w = (load_file(d / "hf" / "model.safetensors") for d in (reference, resumed))
    assert ref_w.keys() == got_w.keys() and all(ref_w[k].equal(got_w[k]) for k in ref_w)
