"""kill -9 of every process at random moments, then the same command again: nothing lost, nothing
trained twice; on-policy runs reproduce the uninterrupted run's samples and losses exactly."""

import random
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from relax_hpc.paths import RunPaths
from relax_hpc.status import collect
from tests.integration.conftest import CONFIG, Job
from tests.runs import assert_nothing_lost_or_repeated, assert_reproduces

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10
# Trained batches are kept (ckpt.keep_trained_batches): the checks read what every step trained.
COMMON = (
    f"trainer.total_steps={STEPS}", "ckpt.every_steps=3", "rollout.prompts_per_step=8", "rollout.eval_every=0",
    "ckpt.keep_trained_batches=true",
)  # fmt: skip


def run_with_kills(
    run_dir: Path, kills: int, rng: random.Random, *overrides: str, steps: int = STEPS, config: Path = CONFIG
) -> None:
    """Start the job `kills` times, each killed (SIGKILL to every process) a few steps further
    on, then once more to the end. `status` calls each killed start ended (its heartbeats
    stopped) and names it as not accounted (no usage record)."""
    for attempt in range(kills):
        job = Job(run_dir, *overrides, config=config).start()
        job.wait_for_step(min(steps - 1, 3 * attempt + rng.randint(2, 4)), timeout_s=300)
        assert collect(run_dir)["state"] == "running"
        job.kill_all()  # no checkpoint, no clean stop: every process gets SIGKILL
        facts = collect(run_dir)
        assert facts["state"].startswith("ended without its end record: last seen "), facts["state"]
        assert len(facts["usage"]["unaccounted"]) == attempt + 1, facts["usage"]
    assert Job(run_dir, *overrides, config=config).run(timeout_s=400) == 0


def test_on_policy_resume_reproduces_the_uninterrupted_run(tmp_path):
    rng = random.Random(1234)
    reference = tmp_path / "reference"
    assert Job(reference, *COMMON, "rollout.max_staleness=0").run(timeout_s=400) == 0
    resumed = tmp_path / "resumed"
    run_with_kills(resumed, 2, rng, *COMMON, "rollout.max_staleness=0")

    assert_reproduces(reference, resumed, STEPS)
    assert len(list((resumed / "logs").iterdir())) == 3  # one log folder per start
    # The metrics follow the checkpoint: steps trained after it and lost in a kill appear once.
    assert [r["step"] for r in Job(resumed).steps()] == list(range(1, STEPS + 1))


def test_async_resume_loses_and_repeats_nothing(tmp_path):
    rng = random.Random(99)
    run_dir = tmp_path / "async"
    run_with_kills(run_dir, 2, rng, *COMMON, "rollout.max_staleness=2")
    assert_nothing_lost_or_repeated(run_dir, STEPS)


LORA_STEPS = 8
LORA = (
    *COMMON, f"trainer.total_steps={LORA_STEPS}", "rollout.max_staleness=0", "trainer.lora.rank=4", "trainer.lr=5e-3",
    "trainer.lora.modules_to_save=[model.norm]",
)  # fmt: skip


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory) -> Path:
    """The uninterrupted LoRA run (trainer.lora.sync merge, the built-in engine's default)."""
    reference = tmp_path_factory.mktemp("lora") / "reference"
    assert Job(reference, *LORA).run(timeout_s=400) == 0
    return reference


@pytest.mark.parametrize("sync", ["merge", "adapter"])
def test_lora_resume_reproduces_the_uninterrupted_run(tmp_path, lora_reference, sync):
    """trainer.lora: the checkpoint holds the adapters, the final norm (trained whole) and their
    optimizer state, not the frozen base; after kill -9 (engines included: they restart with the
    base and get the current adapter at the next push) the run goes on exactly as the
    uninterrupted one. adapter: the engines load each version's PEFT folder (rewritten from the
    checkpoint after the kill) and the requests name it, which reproduces the reference's merged
    run exactly too. Shortened: 8 steps, one kill."""
    resumed = tmp_path / "resumed"
    run_with_kills(resumed, 1, random.Random(7), *LORA, f"trainer.lora.sync={sync}", steps=LORA_STEPS)
    assert_reproduces(lora_reference, resumed, LORA_STEPS)
    tensors = dcp.FileSystemReader(str(resumed / "ckpt" / "latest")).read_metadata().state_dict_metadata
    model = [k for k in tensors if k.startswith("model.")]
    assert "model.model.norm.weight" in model  # the module trained whole, beside the adapters
    assert all(".lora_A." in k or ".lora_B." in k or k == "model.model.norm.weight" for k in model), model[:5]
    if sync == "adapter":  # the last versions' folders only
        assert sorted(p.name for p in RunPaths(resumed).lora_adapters.iterdir()) == ["v5", "v6", "v7", "v8"]
