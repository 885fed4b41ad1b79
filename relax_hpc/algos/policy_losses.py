"""Policy losses. Each returns a PolicyTerms: the per-token loss [n, T] (to be minimised; the
aggregation and the mask are applied by the caller), the importance ratio it clips (before the
clip) and which tokens it clipped: gave no gradient (PPO, GSPO, GMPO; M2PO's masked tokens), less
than half the unclipped gradient (SAPO), or a clipped weight (CISPO, whose tokens all keep a
gradient). The clip_fraction metric counts the clipped tokens with a non-zero advantage.

With r = pi_theta / pi_old per token (log-ratio clamped to +-log_ratio_clamp) and advantage A:

- ppo (Schulman et al. 2017, arXiv:1707.06347): -min(r A, clip(r, 1-eps_low, 1+eps_high) A); a
  larger eps_high is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476). Dual-clip (Ye et al.
  2020, arXiv:1912.09729) caps the loss of a negative-advantage token at -c A (c > 1).
- gspo (Zheng et al. 2025, arXiv:2507.18071), in its GSPO-token form: the ratio is the sequence's
  s_i = exp(mean_t log r_it), with the token's own gradient path sg(s_i) * r_it / sg(r_it); then
  PPO's clip on s_i. For sequence-level advantages and seq_mean_token_mean aggregation this is
  exactly GSPO's sequence objective.
- sapo (Gao et al. 2025, arXiv:2511.20347): -f(r) A with the soft gate
  f(r) = 4/tau * sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg; f'(1) = 1.
- cispo (MiniMax 2025, arXiv:2506.13585): -sg(clip(r, 1-eps_low, 1+eps_high)) A log pi_theta: the
  weight is clipped, the gradient never is.
- m2po (Zheng et al. 2025, arXiv:2510.01161): -M r A without clipping, where M drops the tokens
  with the largest (log r)^2 until the mean of (log r)^2 over the kept tokens of the whole batch is
  at most tau.
- gmpo (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of the sequence's token ratios
  instead of their arithmetic mean, each token's log-ratio clipped in log space to
  [-eps_low, eps_high] on the pessimistic side (sign(A) min(sign(A) log r, sign(A) clip(log r))):
  R_i = exp(mean_t m_it), loss -A R_i on every token of the sequence (with seq_mean_token_mean,
  exactly the paper's objective). One extreme token moves a geometric mean less than an
  arithmetic one; the paper's bounds are 0.4. Its ratio is reported unclipped, exp(mean_t log r_it);
  its clipped tokens are those outside the bounds on the pessimistic side (no gradient through them).
- reinforce: -A r with r = exp(log pi - sg(log pi)) = 1; its gradient is the plain policy
  gradient -A grad log pi (Williams 1992; RLOO's loss). pi_old is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.algos.comm import LOCAL, Comm


@dataclass(slots=True)
class PolicyTerms:
    loss: torch.Tensor  # [n, T] per token
    ratio: torch.Tensor  # [n, T] the importance ratio the loss clips, before the clip (detached)
    clipped: torch.Tensor  # [n, T] bool: see the module docstring


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, clamp: float) -> torch.Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-clamp, clamp))


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    no_grad = ((ratio > 1 + clip_high) & (adv > 0)) | ((ratio < 1 - clip_low) & (adv < 0))
    if dual_clip is not None:
        capped = (adv < 0) & (loss > -dual_clip * adv)
        loss = torch.where(capped, -dual_clip * adv, loss)
        no_grad = no_grad | capped
    return loss, no_grad


def ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
) -> PolicyTerms:
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp)
    loss, clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    return PolicyTerms(loss, ratio.detach(), clipped)


def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float,
) -> PolicyTerms:
    seq_log_ratio = _sequence_mean(logprobs - old_logprobs, mask)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)).detach()
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    loss, clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high, None)
    return PolicyTerms(loss, ratio.detach(), clipped)


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n, 1]: each sample's mean over its loss tokens (0 for an empty one)."""
    return (per_token * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def gmpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_bounds: tuple[float, float],
    log_ratio_clamp: float,
) -> PolicyTerms:
    """`log_bounds`: (low, high), the clip range of the log-ratio (the paper's (-0.4, 0.4))."""
    log_ratio = (logprobs - old_logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
    sign = torch.where(adv < 0, -1.0, 1.0).to(log_ratio.dtype)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(*log_bounds))
    ratio = torch.exp(_sequence_mean(pessimistic, mask)).expand_as(log_ratio)
    # Reported like PPO's r and GSPO's s_i: the ratio before the clip, whatever the advantage.
    unclipped = torch.exp(_sequence_mean(log_ratio.detach(), mask)).expand_as(log_ratio)
    return PolicyTerms(-adv * ratio, unclipped, pessimistic.detach() != log_ratio.detach())


def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    *,
    tau_pos: float,
    tau_neg: float,
    log_ratio_clamp: float,
) -> PolicyTerms:
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp)
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * adv
    # d gate-term / d r = 4 s (1 - s), 1 at r = 1: "clipped" = weight below half the unclipped one.
    clipped = (4.0 * gate * (1.0 - gate)).detach() < 0.5
    return PolicyTerms(loss, ratio.detach(), clipped)


def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float,
) -> PolicyTerms:
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * adv * logprobs
    return PolicyTerms(loss, ratio, (ratio != weight))


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, tau: float, comm: Comm = LOCAL) -> torch.Tensor:
    """[n, T] 0/1: the tokens M2PO keeps. The greedy removal of the largest (log r)^2 runs over the
    whole global batch (all ranks' tokens gathered); ties with the last removed value go too."""
    second = (log_ratio.detach() ** 2).to(torch.float64)
    values = comm.all_gather(second[mask > 0])
    if values.numel() == 0 or float(values.mean()) <= tau:
        return mask
    desc = torch.sort(values, descending=True).values
    n = desc.numel()
    removed = torch.arange(n + 1, dtype=torch.float64, device=desc.device)  # k tokens removed: mean of the rest
    rest_sum = desc.sum() - torch.cat([desc.new_zeros(1), desc.cumsum(0)])
    rest_mean = rest_sum / (n - removed).clamp(min=1)
    k = int(torch.nonzero(rest_mean <= tau)[0])  # k >= 1 here: the full mean exceeds tau
    return mask * (second < desc[k - 1]).to(mask.dtype)


def m2po(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float,
    log_ratio_clamp: float,
    comm: Comm = LOCAL,
) -> PolicyTerms:
    ratio = _ratio(logprobs, old_logprobs, log_ratio_clamp)
    keep = m2po_mask(logprobs - old_logprobs, mask, tau=tau, comm=comm)
    return PolicyTerms(-ratio * adv * keep, ratio.detach(), (mask > 0) & (keep == 0))


def reinforce(logprobs: torch.Tensor, adv: torch.Tensor) -> PolicyTerms:
    ratio = torch.exp(logprobs - logprobs.detach())
    return PolicyTerms(-ratio * adv, ratio.detach(), torch.zeros_like(adv, dtype=torch.bool))
