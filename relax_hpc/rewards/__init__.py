"""Verifiable rewards: functions (completion text, reference answer) -> float.

To add one, write the function and register it in REWARDS; configs select it by name
(`rollout.reward`).
"""

from collections.abc import Callable

from relax_hpc.rewards.exact_match import exact_match

RewardFn = Callable[[str, str], float]

REWARDS: dict[str, RewardFn] = {"exact_match": exact_match}
