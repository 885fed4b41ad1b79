"""Advantage estimators. Each returns per-token advantages [n, T] (0 outside the mask).

- GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (r_i - mean_g r) / (std_g r + eps), with the
  unbiased (Bessel) std as in TRL and verl; without the division it is Dr. GRPO (Liu et al. 2025,
  arXiv:2503.20783).
- RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = r_i - mean_{j in g, j != i} r_j.
- ReMax (Li et al. 2024, arXiv:2310.10505): A_i = r_i - b_g, b_g the reward of the prompt's
  greedy completion (sampled by the rollout alongside the group, not trained); where the greedy
  reward failed, the group's mean reward stands in.
- REINFORCE++ (Hu 2025, arXiv:2501.03262): token rewards (the outcome on the last completion token
  plus any per-token KL penalty), discounted returns G_t = sum_{s>=t} gamma^(s-t) r_s, whitened
  over the global batch.
- REINFORCE++-baseline (same paper, v3): the outcome minus its group mean, then as REINFORCE++.
- GAE (Schulman et al. 2016, arXiv:1506.02438) with a learned critic V:
  delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, returns = A + V.
- On-policy distillation (Agarwal et al. 2024, arXiv:2306.13649; Lu & Thinking Machines 2025):
  A_t = log pi_teacher(y_t) - log pi_student(y_t), the negative per-token reverse KL on the
  student's own sample, undiscounted.

Group statistics count every sample of the group, an empty completion included (its reward is
real); a group of one sample has no baseline and gets advantage 0. Masked-out positions inside a
completion (e.g. tool output) are skipped by the recursions: they are not steps of the episode.
"""

from __future__ import annotations

import torch

from relax_hpc.algos.comm import LOCAL, Comm


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, (int(index.max()) + 1 if index.numel() else 0)


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _informative(r: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[n] bool: the sample's group has more than one sample and not all rewards equal."""
    high = torch.full((num_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, index, r, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, index, r, "amin")
    return (high - low)[index] > 0


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool, eps: float) -> torch.Tensor:
    """Per-sample GRPO (or, without normalize_std, Dr. GRPO) advantages [n].

    Statistics run in float64, and a group whose rewards are all equal gets exactly 0: its float32
    mean's rounding error divided by a std made of rounding error would otherwise be O(1)."""
    index, num_groups = _group_index(group_ids)
    r = rewards.double()
    count = _group_sum(torch.ones_like(r), index, num_groups)[index]
    centred = r - (_group_sum(r, index, num_groups)[index] / count)
    if normalize_std:
        var = _group_sum(centred**2, index, num_groups)[index] / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    return torch.where(_informative(r, index, num_groups), centred, 0.0).to(rewards.dtype)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample leave-one-out advantages [n]: r_i minus the mean of the others in its group
    (float64; exactly 0 for a group of one or of all-equal rewards)."""
    index, num_groups = _group_index(group_ids)
    r = rewards.double()
    count = _group_sum(torch.ones_like(r), index, num_groups)[index]
    others = (_group_sum(r, index, num_groups)[index] - r) / (count - 1).clamp(min=1)
    return torch.where(_informative(r, index, num_groups), r - others, 0.0).to(rewards.dtype)


def remax(rewards: torch.Tensor, baselines: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-sample ReMax advantages [n]: r_i minus the greedy baseline (NaN: the group's mean)."""
    index, num_groups = _group_index(group_ids)
    r = rewards.double()
    mean = _group_sum(r, index, num_groups)[index] / _group_sum(torch.ones_like(r), index, num_groups)[index]
    b = baselines.double()
    return (r - torch.where(torch.isnan(b), mean, b)).to(rewards.dtype)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample values [n] over each sample's completion tokens."""
    return advantages.unsqueeze(-1) * mask


def outcome_on_last_token(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n, T] token rewards: each sample's reward on its last completion token (none if empty)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1, keepdim=True).values
    return torch.where(positions == last, rewards.unsqueeze(-1), 0.0) * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t'} over completion tokens, t' the next completion token."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        on = mask[:, t] > 0
        running = torch.where(on, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(on, running, 0.0)
    return returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, comm: Comm = LOCAL, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the global batch (unbiased std).

    Two passes in float64 (mean, then the centred second moment): the one-pass E[x^2] - mean^2
    loses everything to cancellation when the values sit far from zero."""
    xd, m = x.double(), mask.double()
    total, count = comm.all_sum(torch.stack([(xd * m).sum(), m.sum()])).tolist()
    if count < 2:
        return torch.zeros_like(x)
    centred = (xd - total / count) * m
    var = float(comm.all_sum((centred * centred).sum().reshape(1))) / (count - 1)
    return (centred / (var**0.5 + eps)).to(x.dtype)


def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, comm: Comm = LOCAL) -> torch.Tensor:
    """REINFORCE++: globally whitened discounted returns of the token rewards."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask, comm)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [n, T]; the value after the last completion token is 0."""
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[-1])):
        on = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(on, adv, 0.0)
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, adv, next_adv)
    return advantages, (advantages + values) * mask


def distillation(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantage log pi_teacher - log pi_student (minus the sampled reverse KL)."""
    return (teacher_logprobs - student_logprobs) * mask
