"""Shared-prefix packing: a prompt group's common prefix runs through the model once.

The rows of a GRPO group start with the same prompt. Padded, each of the group's K rows carries
its own copy of it through every layer, forward and backward. Packed, a group becomes one
sequence: the prefix once, then each row's continuation after it, with a block mask (a
continuation attends to the prefix and to its own earlier tokens, never to another row's) and
each token at its original position, so every logit is the padded forward's up to float rounding,
and the gradient reaching a prefix token is the sum of its rows' (what the padded backward sums
over K copies through the shared weights).

On the embedded default (6-token prompts, 4-token answers, groups of 16) a group is 70 tokens
instead of 160, and one rank's forward and backward take 0.43 of the padded time
(tests/unit/test_prefix.py checks the values and gradients; BENCHMARKS.md, "Shared-prefix
packing"). The dense mask grows with the square of a packed sequence, so long continuations, where
the attention over the packed sequence would cost more than the prompt copies it saves, stay
padded (`worth_it`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_PACKED_TOKENS = 8192  # a group's packed sequence; its mask is this squared, in bytes


@dataclass(frozen=True, slots=True)
class PackedGroups:
    """A padded batch's rows packed by group. `input_ids`, `position_ids` [G, L] and `mask`
    [G, 1, L, L] (True: may attend) are the model's inputs; row i's position t is the packed
    sequence `group[i]`'s position `index[i, t]` (padding positions point at 0, their values
    unused: the loss mask is 0 there)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor  # long [n]
    index: torch.Tensor  # long [n, T]

    def rows(self, packed: torch.Tensor) -> torch.Tensor:
        """[G, L, ...] values at the rows' positions: [n, T, ...]."""
        return packed[self.group[:, None], self.index]


def pack_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, group_ids: torch.Tensor) -> PackedGroups:
    """Pack right-padded rows [n, T] by `group_ids`: each group's longest common prefix (within
    every row's length) once, then each row's remainder, in row order. Tensor work only (no
    per-row Python: a GPU batch holds thousands of rows)."""
    n, width = input_ids.shape
    device = input_ids.device
    lengths = attention_mask.sum(1)
    _, group, per_group = torch.unique(group_ids, return_inverse=True, return_counts=True)
    count = per_group.numel()
    # each group's first row is its reference; a row's prefix runs until its first difference
    first = torch.full((count,), n, dtype=torch.long, device=device).scatter_reduce(
        0, group, torch.arange(n, device=device), "amin"
    )
    positions = torch.arange(width, device=device)
    agree = (input_ids == input_ids[first[group]]) & (positions < lengths[:, None])
    row_prefix = agree.long().cumprod(1).sum(1)
    prefix = torch.full((count,), width, dtype=torch.long, device=device).scatter_reduce(0, group, row_prefix, "amin")
    # each row's remainder follows the prefix and the remainders of the group's earlier rows
    rest = lengths - prefix[group]
    order = torch.argsort(group, stable=True)  # the rows group by group, each group's in row order
    before = torch.cumsum(rest[order], 0) - rest[order]  # remainders ahead of the row in that order
    group_start = torch.zeros(count, dtype=torch.long, device=device).scatter_reduce(
        0, group[order], before, "amin", include_self=False
    )
    offset = torch.empty_like(rest)
    offset[order] = prefix[group[order]] + before - group_start[group[order]]  # where the row's remainder starts
    total = prefix + torch.zeros_like(prefix).scatter_add(0, group, rest)
    size = int(total.max())
    start = prefix[group][:, None]
    in_prefix, real = positions < start, positions < lengths[:, None]
    index = torch.where(in_prefix, positions, offset[:, None] + positions - start)
    index = torch.where(real, index, 0)
    flat = group[:, None] * size + index  # each real token's packed slot
    packed_ids = torch.zeros(count * size, dtype=input_ids.dtype, device=device)
    packed_ids[flat[real]] = input_ids[real]
    packed_pos = torch.zeros(count * size, dtype=torch.long, device=device)
    packed_pos[flat[real]] = positions.expand(n, width)[real]
    # whose each slot is: -1 the prefix, r >= 0 row r's remainder, -2 padding
    owner = torch.full((count * size,), -2, dtype=torch.long, device=device)
    owner[flat[real]] = torch.where(in_prefix, -1, torch.arange(n, device=device)[:, None])[real]
    packed_pos, owner = packed_pos.view(count, size), owner.view(count, size)
    causal = packed_pos[:, :, None] >= packed_pos[:, None, :]
    visible = (owner[:, None, :] == -1) | (owner[:, :, None] == owner[:, None, :])
    mask = (causal & visible)[:, None]
    return PackedGroups(packed_ids.view(count, size), packed_pos, mask, group, index)


def worth_it(packed: PackedGroups, padded_rows: int, padded_width: int, hidden: int) -> bool:
    """Whether the packed forward costs less than the padded one. Per layer, a token's projections
    and MLP cost about 12 * hidden^2 multiply-adds and a pair of attending positions about
    2 * hidden (scores and values), here summed in units of 4 * hidden: 3 * hidden per token, 1
    per pair (the dense mask's pairs, also the masked ones: the kernels compute them)."""
    groups, size = packed.input_ids.shape
    if size > MAX_PACKED_TOKENS:
        return False
    packed_cost = groups * size * 3 * hidden + groups * size * size
    padded_cost = padded_rows * padded_width * 3 * hidden + padded_rows * padded_width**2
    return packed_cost < padded_cost
