"""Rewards: what a finished trajectory scores (relax_hpc.rewards.scoring has the rules).

Built-ins by name (`reward.name`): `exact_match`, `boxed_match` (functions of the response text
and the answer), `remote` (an HTTP service), `judge` (a generative judge model served by engines
of its own); anything else is `module:function`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax_hpc.config.schema import RewardConfig
from relax_hpc.rewards.boxed import boxed_match
from relax_hpc.rewards.exact_match import exact_match
from relax_hpc.rewards.remote import RemoteReward
from relax_hpc.rewards.scoring import RewardError, RewardInput, Scored, Scorer, resolve_function, text_reward

TEXT_REWARDS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "boxed_match": boxed_match}

__all__ = ["TEXT_REWARDS", "RewardError", "RewardInput", "Scored", "Scorer", "make_scorer"]


def make_scorer(r: RewardConfig, judge: Callable[..., Any] | None = None) -> Scorer:
    """The configured reward with its settings and failure rules. `judge`: the judge reward of
    this process (relax_hpc.rewards.judge), where reward.name is judge."""
    if r.name == "remote":
        rr = r.remote
        fn: Any = RemoteReward(rr.url, rr.timeout_s, rr.retries, rr.backoff_s, rr.concurrency, rr.token_env)
        return Scorer(fn, {}, r.batched, r.timeout_s)
    if r.name == "judge":
        if judge is None:
            raise RewardError("reward.name=judge: this process has no judge engines")
        return Scorer(judge, {}, batched=True, timeout_s=r.timeout_s)
    builtins = {name: text_reward(fn) for name, fn in TEXT_REWARDS.items()}
    if r.name in builtins and r.settings:
        raise RewardError(f"reward.settings: the built-in reward {r.name} takes no settings")
    return Scorer(resolve_function(r.name, builtins), r.settings, r.batched, r.timeout_s)
