"""A workload with a long-tailed completion length: the single-turn task, but each episode's
length is fixed in advance, most short and a few near the limit (what reasoning models produce,
and what holds a synchronous step back). For measuring rollout modes (tools/bench/
partial_rollout.py, the partial-rollout tests), not for learning anything.

Settings: `long_share` (default 0.1) of the episodes run `long_tokens` (default 64) tokens, the
others `short_tokens` (default 4); end-of-sequence is ignored, so lengths are exactly these.
Which episodes are long follows from their seeds, so a batch's lengths are fixed.
"""

from __future__ import annotations

from typing import Any

from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs.base import Context, Trajectory


class LongTail:
    def __init__(self, settings: dict[str, Any]) -> None:
        unknown = set(settings) - {"long_share", "long_tokens", "short_tokens"}
        if unknown:
            raise ValueError(f"rollout.env.settings: unknown long_tail settings {sorted(unknown)}")
        self.long_share = float(settings.get("long_share", 0.1))
        self.long_tokens = int(settings.get("long_tokens", 64))
        self.short_tokens = int(settings.get("short_tokens", 4))

    async def rollout(self, row: PromptRow, ctx: Context) -> Trajectory:
        long = (ctx.seed % 1000) < self.long_share * 1000
        tokens = self.long_tokens if long else self.short_tokens
        trajectory = ctx.trajectory()
        return trajectory.add_sampled(
            await ctx.generate(trajectory.ids, {"max_new_tokens": tokens, "ignore_eos": True})
        )
