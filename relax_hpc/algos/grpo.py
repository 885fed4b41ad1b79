"""GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

Advantages, one scalar per sample, broadcast over its completion tokens:

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)        with normalize_std
    A_i =  r_i - mean_g(r)                            without (Dr. GRPO, arXiv:2503.20783)

where g is the sample's prompt group and std is the unbiased (Bessel-corrected) standard deviation,
as in TRL and verl. A group of one sample has no baseline: its advantage is 0.

Policy loss per completion token t of sample i (PPO clip with separate low/high epsilons):

    ratio = exp(logp - logp_old)
    l_it  = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i) - entropy_coef * H_it

aggregated as the mean over all completion tokens of the global batch (token-mean). Departures
from the paper: no KL term to a reference policy (its coefficient is 0 in most recent recipes);
`logp_old` is either the trainer's own log-probabilities before the update (then the ratio is 1
and this is the on-policy policy gradient) or the rollout engine's log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sample GRPO advantages. rewards: float [n]; group_ids: int [n] (any labels)."""
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group, rewards) / count
    centred = rewards - mean[group]
    if not normalize_std:
        return torch.where(count[group] > 1, centred, torch.zeros_like(centred))
    sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group, centred**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    adv = centred / (std[group] + eps)
    return torch.where(count[group] > 1, adv, torch.zeros_like(adv))


@dataclass(frozen=True, slots=True)
class PolicyLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    entropy_coef: float = 0.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    num_tokens: float,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip GRPO loss, summed over masked tokens and divided by `num_tokens`.

    Args:
        logprobs, old_logprobs, entropy, loss_mask: [n, T]; advantages: [n].
        num_tokens: completion tokens in the whole global batch (all ranks), so that summing this
            loss over ranks gives the global token-mean.
    """
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    per_token = pg - cfg.entropy_coef * entropy
    loss = (per_token * mask).sum() / num_tokens
    with torch.no_grad():
        clip_frac = (((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)).to(mask.dtype) * mask).sum()
        metrics = {
            "pg_loss_sum": float((pg * mask).sum()),
            "entropy_sum": float((entropy * mask).sum()),
            "clipped_tokens": float(clip_frac),
        }
    return loss, metrics
