"""Weights by reference: tensors an engine on the same device maps from the trainer's memory
(SGLang 0.5.23's /update_weights_from_tensor). Colocated training's weight path.

A payload is pickled with torch's ForkingPickler and base64-encoded, one payload per
tensor-parallel rank of the engine, in one of SGLang's two load formats:

- "flattened_bucket" (what the colocated sender sends): {"flattened_tensor": the bucket's uint8
  buffer, "metadata": [one record per tensor: name, shape, dtype, start_idx, end_idx, numel]},
  one shared tensor per bucket. Pickling a CUDA tensor costs an IPC event, a reference counter
  and a handle in the sender and opening them in the engine, a few hundred microseconds; per
  tensor (hundreds in a model) that was most of an update's time (BENCHMARKS.md). SGLang reads
  the records by attribute; they travel as types.SimpleNamespace, a class SGLang's unpickler
  admits, so a sender needs no SGLang installed.
- None: a list of (name, tensor) pairs, each shared where it lies (what SGLang hands to
  model.load_weights).

Pickling shares a tensor's storage rather than its bytes: a CUDA IPC handle on a GPU, a
shared-memory file on the CPU (torch's file_system sharing strategy, which unrelated processes
can open by name). The sender keeps the tensors alive and unchanged until the engine has answered.
"""

from __future__ import annotations

import base64
import io
import itertools
import math
import pickle
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # registers the tensor and storage reductions with ForkingPickler

from relax_hpc.weights.buckets import DTYPES, BucketPlan

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format of a one-buffer bucket

# The globals a payload may name, exactly (as SGLang's SafeUnpickler: a module prefix such as
# torch.* would admit callables that run code): torch's rebuilds of shared tensors and storages.
_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_GLOBALS = frozenset(
    {("builtins", n) for n in ("list", "tuple", "dict", "slice")}
    | {("types", "SimpleNamespace")}  # a flattened bucket's metadata records
    | {
        ("torch", n)
        for n in (
            "Size",
            "Tensor",
            "device",
            "dtype",
            "uint8",
            *(str(d).removeprefix("torch.") for d in DTYPES.values()),
        )
    }
    | {("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch._utils", "_rebuild_tensor_v2")}
    | {
        (_REDUCTIONS, n)
        for n in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_storage_filename",
            "rebuild_storage_fd",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        )
    }
)


def share_cpu_memory_by_name() -> None:
    """CPU tensors shared by file name, which a process the sender did not start can open (the
    default passes file descriptors over a connection that only related processes share)."""
    mp.set_sharing_strategy("file_system")


def serialize(named: list[tuple[str, torch.Tensor]], tp_size: int = 1) -> list[str]:
    """The payloads of a bucket in load_format None (one per tensor-parallel rank: the same for each)."""
    return _payloads(named, any(t.device.type == "cpu" for _, t in named), tp_size)


def bucket_records(plan: BucketPlan) -> list[SimpleNamespace]:
    """A packed bucket's records in load_format "flattened_bucket": where each tensor lies in the
    buffer (the same every push: a sender builds them once per plan)."""
    records, start = [], 0
    for name, dtype_name, shape in zip(plan.names, plan.dtypes, plan.shapes, strict=True):
        dtype, size = DTYPES[dtype_name], torch.Size(shape)
        end = start + size.numel() * dtype.itemsize
        records.append(
            SimpleNamespace(name=name, shape=size, dtype=dtype, start_idx=start, end_idx=end, numel=end - start)
        )
        start = end
    return records


def serialize_bucket(flat: torch.Tensor, records: list[SimpleNamespace], tp_size: int = 1) -> list[str]:
    """The payloads of a packed bucket (relax_hpc.weights.buckets.pack) in load_format
    "flattened_bucket": one shared tensor, the records (bucket_records) say where each
    parameter lies in it."""
    if records and records[-1].end_idx != flat.numel():
        raise ValueError(f"the bucket buffer holds {flat.numel()} bytes, its records {records[-1].end_idx}")
    return _payloads({"flattened_tensor": flat, "metadata": records}, flat.device.type == "cpu", tp_size)


def _payloads(obj: object, on_cpu: bool, tp_size: int) -> list[str]:
    if on_cpu:
        share_cpu_memory_by_name()
    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
    payload = base64.b64encode(out.getvalue()).decode()
    return [payload] * tp_size


class PayloadError(ValueError):
    """A payload that does not decode to (name, tensor) pairs, or names a global it may not."""


class _Unpickler(pickle.Unpickler):
    """Only torch's tensor and storage rebuilds (and containers): a payload cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise PayloadError(f"a weight payload may not name {module}.{name}")


def deserialize(payload: str, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a payload in load_format None or "flattened_bucket" (then views
    of the one shared buffer)."""
    share_cpu_memory_by_name()
    try:
        obj = _Unpickler(io.BytesIO(base64.b64decode(payload))).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise PayloadError(f"the weight payload does not decode ({e})") from None
    if load_format == FLATTENED_BUCKET:
        return _bucket_views(obj)
    if not isinstance(obj, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in obj
    ):
        raise PayloadError("a weight payload holds a list of (name, tensor) pairs")
    return obj


_RECORD = ("name", "shape", "dtype", "start_idx", "end_idx")


def _bucket_views(obj: object) -> list[tuple[str, torch.Tensor]]:
    """Each record's view of the flattened tensor, after checking that it lies inside and its
    byte range fits its shape and dtype. Records of one dtype back to back (what relax_hpc's
    sender packs) are split in one call: a bucket holds hundreds of tensors, and this runs on
    the engine's critical path."""
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    records = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise PayloadError("a flattened bucket holds a 1-D uint8 'flattened_tensor'")
    if not isinstance(records, list) or not all(all(hasattr(r, f) for f in _RECORD) for r in records):
        raise PayloadError(f"a flattened bucket's 'metadata' lists records with {', '.join(_RECORD)}")
    for r in records:
        _check_record(r, flat.numel())
    if records and all(
        b.dtype == records[0].dtype and b.start_idx == a.end_idx for a, b in itertools.pairwise(records)
    ):
        dtype = records[0].dtype
        span = flat[records[0].start_idx : records[-1].end_idx].view(dtype)
        parts = span.split([(r.end_idx - r.start_idx) // dtype.itemsize for r in records])
        return [(r.name, part.view(r.shape)) for r, part in zip(records, parts, strict=True)]
    return [(r.name, flat[r.start_idx : r.end_idx].view(r.dtype).view(r.shape)) for r in records]


def _check_record(r: Any, nbytes: int) -> None:
    if not isinstance(r.dtype, torch.dtype) or not isinstance(r.shape, torch.Size | list | tuple):
        raise PayloadError(f"{r.name}: a record's dtype is a torch.dtype and its shape a torch.Size")
    size = math.prod(r.shape) * r.dtype.itemsize
    inside = 0 <= r.start_idx <= r.end_idx <= nbytes and r.start_idx % r.dtype.itemsize == 0
    if not inside or r.end_idx - r.start_idx != size:
        raise PayloadError(
            f"{r.name}: bytes {r.start_idx}..{r.end_idx} of a {nbytes}-byte bucket "
            f"do not hold a {r.dtype} tensor of shape {list(r.shape)}"
        )
