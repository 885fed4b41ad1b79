"""A non-default objective through every process: 2 trainer ranks under FSDP, 2 engines, the
driver. PPO with a critic and GAE, a KL reference, two mini-batches per rollout batch, and the
driver's dynamic sampling and overlong penalty (DAPO). Killed mid-run and started again, the
on-policy run reproduces the uninterrupted one bit for bit; that holds only if the critic, its
optimizer and the reference are restored exactly and the driver regenerates the same rounds."""

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import Job
from tests.runs import assert_reproduces

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 8
OVERRIDES = (
    f"trainer.total_steps={STEPS}",
    "ckpt.every_steps=3",
    "rollout.prompts_per_step=8",
    "rollout.group_size=8",
    "rollout.eval_every=0",
    "rollout.max_staleness=0",
    "ckpt.keep_trained_batches=true",  # the checks read what every step trained
    "algo.advantage.estimator=gae",
    "algo.kl.coef=0.01",
    "algo.minibatches=2",
    "algo.dynamic_sampling.enabled=true",
    "algo.overlong.buffer=1",
    "algo.overlong.penalty=0.5",
)


def test_ppo_with_critic_and_dynamic_sampling_resumes_exactly(tmp_path):
    reference = tmp_path / "reference"
    assert Job(reference, *OVERRIDES).run(timeout_s=400) == 0
    resumed = tmp_path / "resumed"
    job = Job(resumed, *OVERRIDES).start()
    job.wait_for_step(5, timeout_s=300)  # past the checkpoint at step 3: the critic is in it
    job.kill_all()
    assert Job(resumed, *OVERRIDES).run(timeout_s=400) == 0

    assert_reproduces(reference, resumed, STEPS)
    steps = Job(reference).steps()
    assert all({"value_loss", "kl_ref", "return_mean"} <= set(s) for s in steps)
    assert all(s["tokens"] > 0 and s["kl_ref"] >= 0 for s in steps)
    rollout = read_jsonl(reference / "metrics" / "rollout.jsonl")
    # Near chance most groups are all-wrong: dynamic sampling drops them and samples more rounds.
    assert sum(r["groups_dropped"] for r in rollout) > 0
    assert max(r["sampling_rounds"] for r in rollout) > 1
    # The policy's reward on its batches is reported apart from the kept groups': with all-wrong
    # groups dropped the kept ones score higher than what was sampled.
    assert all(-0.5 <= r["reward_sampled"] <= 1 for r in rollout)  # shaped: the overlong penalty is 0.5
    assert sum(r["reward_sampled"] < r["reward"] for r in rollout) > 0
