"""Exact deltas of a bucket (weights.delta): what changed between two versions of its packed bytes.

A bucket's tensors share one dtype (plan_buckets), so its flat buffer is compared as integers of
that width: an element changed when any bit of it did (so +0.0 and -0.0, or two NaNs, are told
apart, and applying the delta gives the new bits exactly). A delta is sparse (the flat indices of
the changed elements and their new bits) or dense (the new tensors), whichever is smaller; an
unchanged bucket has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.weights.buckets import DTYPES, BucketPlan, pack, unpack

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer of its bits


def bits(flat: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    """The bucket's packed uint8 bytes as one integer per element."""
    return flat.view(_BITS[DTYPES[plan.dtypes[0]].itemsize])


@dataclass(frozen=True, slots=True)
class SparseDelta:
    index: torch.Tensor  # flat element indices (int32 while the bucket has < 2**31 elements)
    values: torch.Tensor  # the new bits of those elements

    @property
    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.values.numel() * self.values.element_size()


def diff(old: torch.Tensor, new: torch.Tensor, plan: BucketPlan) -> tuple[SparseDelta | None, int]:
    """The sparse delta from bucket bytes `old` to `new` (None: dense is no larger), and how many
    elements changed (0: the bucket needs nothing)."""
    before, after = bits(old, plan), bits(new, plan)
    index = torch.nonzero(before != after).flatten()
    changed = index.numel()
    index = index.to(torch.int32 if after.numel() < 2**31 else torch.int64)
    sparse = SparseDelta(index, after[index.long()].clone())
    return (sparse if sparse.nbytes < new.numel() else None), changed


def apply_sparse(current: list[torch.Tensor], plan: BucketPlan, delta: SparseDelta) -> list[tuple[str, torch.Tensor]]:
    """The bucket's new tensors: `current` (its tensors now, in plan order) with the delta's bits
    written at its indices."""
    flat = pack(current)
    target = bits(flat, plan)
    if delta.index.numel() and int(delta.index.max()) >= target.numel():
        raise ValueError(f"delta index {int(delta.index.max())} beyond the bucket's {target.numel()} elements")
    if delta.values.dtype != target.dtype:
        raise ValueError(f"delta values are {delta.values.dtype}, the bucket's bits {target.dtype}")
    target[delta.index.long()] = delta.values
    return unpack(flat, plan)
