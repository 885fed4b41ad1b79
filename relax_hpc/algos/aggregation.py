"""Reducing a per-token loss to the scalar the optimizer minimises.

Every mode divides by counts of the whole global batch (all ranks, this mini-batch), passed in as
a Normalizer, so that summing the ranks' results gives the loss of the whole batch whatever the
sharding. `sequences` counts the samples with at least one loss token; fully masked or empty
completions add nothing to any numerator or denominator.

    token_mean                sum_i sum_t l_it / sum_i |o_i|                 (DAPO, verl's default)
    seq_mean_token_mean       1/N sum_i (sum_t l_it / |o_i|)                 (GRPO paper, GSPO)
    seq_mean_token_sum        1/N sum_i sum_t l_it
    seq_mean_token_sum_norm   1/N sum_i sum_t l_it / L, L a constant         (Dr. GRPO)
    token_sum                 sum_i sum_t l_it                               (no normalisation)

token_mean weights every token equally (long answers weigh more); seq_mean_token_mean weights
every sample equally, which favours short wrong answers and long right ones (Dr. GRPO's length
bias); seq_mean_token_sum_norm is unbiased and its scale does not drift with lengths; token_sum
scales with the batch (the learning rate must then shrink as the batch grows), as in the
implementations that sum the per-token loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.config.schema import Aggregation


@dataclass(frozen=True, slots=True)
class Normalizer:
    tokens: float  # loss tokens in the global (mini-)batch
    sequences: float  # samples with at least one loss token in it
    constant: float = 1.0  # L of seq_mean_token_sum_norm (e.g. the generation limit)


def local_counts(mask: torch.Tensor) -> tuple[float, float]:
    """(tokens, sequences) of this rank's share; the caller sums them over ranks."""
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm: Normalizer) -> torch.Tensor:
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(norm.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(norm.sequences, 1.0)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(norm.sequences, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (max(norm.sequences, 1.0) * norm.constant)
    if mode == "token_sum":
        return masked.sum()
    raise ValueError(f"unknown loss aggregation {mode!r}")
