"""A test-only reward (reward.name=tests.integration.anti_reward:reward) that makes GRPO unlearn:
in training it rewards a wrong answer, so a model that adds well gets worse step after step; on the
rows of the evaluation's dataset (those with `"eval": true`) it is exact match, so the run's
greedy accuracy still measures correct answers, and falls. The flag is needed because a run's
evaluations score with the run's own reward (relax_hpc/rollout/rounds.py, evaluation_rewards)."""

from __future__ import annotations

from relax_hpc.rewards import RewardInput
from relax_hpc.rewards.exact_match import exact_match


def reward(item: RewardInput) -> float:
    right = exact_match(item.response, item.answer)
    return right if item.row.fields.get("eval") else 1.0 - right
