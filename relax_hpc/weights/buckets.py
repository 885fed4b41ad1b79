"""Flat buckets of parameters: the unit of one weight-sync broadcast.

A bucket holds tensors of one dtype, packed back to back into a 1-D buffer, at most `max_bytes`
(a tensor larger than that travels alone). Its metadata (names, dtypes, shapes) is exactly what
SGLang's UpdateWeightsFromDistributedReqInput carries, so the receiver can split it again.
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
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtypes[0]]


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


def pack(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate flattened tensors into one 1-D buffer (reusing `out` when given)."""
    if out is None:
        return torch.cat([t.reshape(-1) for t in tensors])
    torch.cat([t.reshape(-1) for t in tensors], out=out)
    return out


def unpack(flat: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """Split a received buffer back into named tensors (views of `flat`)."""
    out, start = [], 0
    for name, shape in zip(plan.names, plan.shapes):
        n = int(torch.Size(shape).numel())
        out.append((name, flat[start : start + n].view(shape)))
        start += n
    if start != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} elements, its metadata describes {start}")
    return out
