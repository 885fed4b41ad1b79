"""Rollout-side shaping of what the trainer sees (DAPO, Yu et al. 2025, arXiv:2503.14476).

- Overlong penalty ("soft overlong punishment"): with L the completion limit and B the buffer,
  a completion of length l gets 0 when l <= L - B and -penalty * (l - (L - B)) / B inside the
  buffer, so -penalty at the limit (generation never goes beyond L). It is added to the reward.
- Dynamic sampling: a group whose rewards are all equal has zero advantage under any group
  baseline and only dilutes the batch; it is dropped and more prompts are sampled instead.
"""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    if buffer <= 0 or penalty == 0:
        return 0.0
    start = max_len - buffer
    return -penalty * min(1.0, max(0, length - start) / buffer)


def informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (so that its advantages are not all zero)."""
    return max(rewards) - min(rewards) > 1e-9
