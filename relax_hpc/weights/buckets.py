"""Flat buckets of parameters: the unit of one weight-sync broadcast.

A bucket holds tensors of one dtype (so every tensor starts at an offset aligned to its element
size), packed as raw bytes back to back into one uint8 buffer of at most `max_bytes` (a tensor
larger than that travels alone): SGLang's "flattened_bucket" load format. Its metadata (names,
dtypes, shapes) is what UpdateWeightsFromDistributedReqInput carries, so the receiver can split it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True, slots=True)
class BucketPlan:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() * DTYPES[d].itemsize for s, d in zip(self.shapes, self.dtypes))


def plan_buckets(params: Iterable[tuple[str, torch.Size, torch.dtype]], max_bytes: int) -> list[BucketPlan]:
    """Group (name, shape, dtype) into buckets in the given order, one dtype per bucket."""
    buckets: list[BucketPlan] = []
    current: list[tuple[str, torch.Size, torch.dtype]] = []
    size = 0
    for name, shape, dtype in params:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if current and (dtype != current[0][2] or size + nbytes > max_bytes):
            buckets.append(_plan(current))
            current, size = [], 0
        current.append((name, shape, dtype))
        size += nbytes
    if current:
        buckets.append(_plan(current))
    return buckets


def _plan(entries: list[tuple[str, torch.Size, torch.dtype]]) -> BucketPlan:
    return BucketPlan(
        names=[n for n, _, _ in entries],
        dtypes=[DTYPE_NAMES[d] for _, _, d in entries],
        shapes=[list(s) for _, s, _ in entries],
    )


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back in one 1-D uint8 buffer."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(flat: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """Split a received uint8 buffer back into named tensors (views of `flat`)."""
    out, start = [], 0
    for name, dtype, shape in zip(plan.names, plan.dtypes, plan.shapes):
        nbytes = torch.Size(shape).numel() * DTYPES[dtype].itemsize
        out.append((name, flat[start : start + nbytes].view(DTYPES[dtype]).view(shape)))
        start += nbytes
    if start != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, its metadata describes {start}")
    return out
