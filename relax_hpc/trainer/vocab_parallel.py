"""Token log-probabilities and entropies from logits split over the vocabulary (tensor
parallelism): each rank holds columns [start, start + V/tp) of every row.

The softmax needs the row maximum and the sum of exponentials over the whole vocabulary, so both
are all-reduced over the tensor-parallel group. Every rank of the group then computes the same
loss, so the backward of those sums is the identity (each rank's columns get their own gradient;
summing the gradients of identical copies would multiply them by tp), as in Megatron's
reduce-from-tensor-parallel region. Nothing of size V is gathered. With no group (tp = 1) this
is log_softmax on one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GroupSum(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return t if group is None else _GroupSum.apply(t, group)


class _Entropy(torch.autograd.Function):
    """H = log Z - sum_i p_i l_i over the whole vocabulary, with its analytic gradient
    dH/dl_i = -p_i (log p_i + H). Autograd through the sums would give each rank only its own
    columns' share of the path through log Z; the closed form is exact on every rank."""

    @staticmethod
    def forward(ctx, shifted: torch.Tensor, log_z: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        log_p = shifted - log_z.unsqueeze(-1)
        probs = log_p.exp()
        partial = (probs * shifted).sum(-1)
        if group is not None:
            dist.all_reduce(partial, group=group)
        entropy = log_z - partial
        ctx.save_for_backward(log_p, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        log_p, entropy = ctx.saved_tensors
        return -grad.unsqueeze(-1) * log_p.exp() * (log_p + entropy.unsqueeze(-1)), None, None


def logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V_local] (any float dtype; computed in fp32), targets [T] global token ids.
    Returns (log p(target), entropy), both fp32 [T]. `entropy_grad=False` computes the entropy
    without a graph (saves a [T, V_local] activation when no entropy bonus is trained)."""
    logits = logits.float()
    with torch.no_grad():
        row_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max.unsqueeze(-1)
    log_z = torch.log(_sum(shifted.exp().sum(-1), group))
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    logprobs = _sum(torch.where(mine, picked, torch.zeros_like(picked)), group) - log_z
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = _Entropy.apply(shifted, log_z.detach(), group)
    return logprobs, entropy
