"""The supervised fine-tuning loss (kind=sft): the negative log-likelihood of the response tokens.

    loss = aggregate(-log p(y_t | y_<t), mask)       mask: 1 on response tokens, 0 on prompt and padding

aggregated like the policy losses (relax_hpc/algos/aggregation.py), over the counts of the global
batch, so that the ranks' losses sum to the whole batch's whatever the sharding. Prompt tokens are
conditioned on and never scored.
"""

from __future__ import annotations

import torch

from relax_hpc.algos.aggregation import Normalizer, aggregate
from relax_hpc.algos.stats import Stats
from relax_hpc.config.schema import Aggregation


def sft_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm: Normalizer
) -> tuple[torch.Tensor, Stats]:
    """logprobs [n, T]: of each target token; mask [n, T]: the response targets. Returns the loss
    and its statistics (the mean token NLL, its range, the tokens counted)."""
    nll = -logprobs
    stats = Stats()
    stats.mean_of("nll", nll, mask)
    stats.range_of("nll", nll, mask)
    stats.add_sum("tokens", mask.sum())
    return aggregate(nll, mask, mode, norm), stats
