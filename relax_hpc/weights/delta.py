"""Exact deltas of a bucket (weights.delta): what changed between two versions of its packed bytes.

A bucket's tensors share one dtype (plan_buckets), so its flat buffer is compared as integers of
that width: an element changed when any bit of it did (so +0.0 and -0.0, or two NaNs, are told
apart, and applying the delta gives the new bits exactly). A delta is sparse (the flat indices of
the changed elements and their new bits) or dense (the new tensors), whichever is smaller; an
unchanged bucket has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from relax_hpc.weights.buckets import DTYPES, BucketPlan

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> the integer of its bits


def bits_dtype(plan: BucketPlan) -> torch.dtype:
    """The integer type as wide as the bucket's elements."""
    return _BITS[DTYPES[plan.dtypes[0]].itemsize]


def bits(flat: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    """The bucket's packed uint8 bytes as one integer per element."""
    return flat.view(bits_dtype(plan))


@dataclass(frozen=True, slots=True)
class SparseDelta:
    index: torch.Tensor  # flat element indices (int32 while the bucket has < 2**31 elements)
    values: torch.Tensor  # the new bits of those elements

    @property
    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.values.numel() * self.values.element_size()


def diff(old: torch.Tensor, new: torch.Tensor, plan: BucketPlan, dense: bool = True) -> tuple[SparseDelta | None, int]:
    """The sparse delta from bucket bytes `old` to `new` (None: dense is no larger), and how many
    elements changed (0: the bucket needs nothing). `dense=False`: sparse whatever its size (for
    a receiver that takes nothing else: vLLM's sparse_nccl)."""
    before, after = bits(old, plan), bits(new, plan)
    mask = before != after
    changed = int(mask.count_nonzero())  # a bool sum widens to int64 first: 20x slower
    index_dtype = torch.int32 if after.numel() < 2**31 else torch.int64
    if dense and changed * (index_dtype.itemsize + after.element_size()) >= new.numel():
        return None, changed  # dense: the indices of most of the bucket are not worth finding
    index = torch.nonzero(mask).flatten()
    return SparseDelta(index.to(index_dtype), after[index].clone()), changed


@dataclass(frozen=True, slots=True)
class Patch:
    """A sparse delta's part in one tensor: the new bits at its flat indices."""

    name: str
    index: torch.Tensor  # int64, into the tensor's elements
    values: torch.Tensor

    def apply(self, tensor: torch.Tensor) -> None:
        """Write the bits into `tensor` (contiguous) in place: the work is the changed elements'."""
        tensor.view(-1).view(self.values.dtype)[self.index.to(tensor.device)] = self.values.to(tensor.device)


def split(plan: BucketPlan, delta: SparseDelta) -> list[Patch]:
    """The delta of a bucket as one patch per tensor it changes; checked (indices inside the
    bucket, bits of its width) before anything is written."""
    width = bits_dtype(plan)
    if delta.values.dtype != width or delta.values.shape != delta.index.shape:
        raise ValueError(f"delta values are {delta.values.dtype} {list(delta.values.shape)}, the bucket's bits {width}")
    ends = torch.tensor([math.prod(s) for s in plan.shapes], device=delta.index.device).cumsum(0)
    index = delta.index.long()
    if index.numel() and (int(index.max()) >= int(ends[-1]) or int(index.min()) < 0):
        raise ValueError(f"delta indices outside the bucket's {int(ends[-1])} elements")
    owner = torch.searchsorted(ends, index, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    patches = []
    for t in owner.unique().tolist():
        mine = owner == t
        patches.append(Patch(plan.names[t], index[mine] - starts[t], delta.values[mine]))
    return patches
