"""The single-turn environment: one completion of the row's prompt, scored by the configured
reward. The default, and what every run before environments existed did."""

from __future__ import annotations

from relax_hpc.data.prompts import PromptRow
from relax_hpc.envs.base import Context, Trajectory


async def single_turn(row: PromptRow, ctx: Context) -> Trajectory:
    trajectory = ctx.trajectory()
    return trajectory.add_sampled(await ctx.generate(trajectory.ids, media=bool(row.media)))
