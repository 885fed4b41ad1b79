"""The critic's loss (PPO, Schulman et al. 2017): per token,

    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)

with R the GAE returns and V_old the critic's values before this batch's first update; the clip
keeps one batch from moving a value by more than c (the "clipped value loss" of PPO2 and verl).
"""

from __future__ import annotations

import torch


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, whether the clipped term was the larger: that token gave no gradient)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), (clipped_sq > unclipped_sq).detach()
