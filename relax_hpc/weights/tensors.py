"""Weights by reference: tensors an engine on the same device maps from the trainer's memory
(SGLang 0.5.23's /update_weights_from_tensor). Colocated training's weight path.

The payload is a bucket's list of (name, tensor) pickled with torch's ForkingPickler and
base64-encoded, one payload per tensor-parallel rank of the engine, load_format None (what SGLang
hands to model.load_weights). Pickling shares a tensor's storage rather than its bytes: a CUDA
IPC handle on a GPU (tensors of one allocation share a handle), a shared-memory file on the CPU
(torch's file_system sharing strategy, which unrelated processes can open by name). The sender
keeps the tensors alive and unchanged until the engine has answered.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.multiprocessing.reductions  # registers the tensor and storage reductions with ForkingPickler

from relax_hpc.weights.buckets import DTYPES

# The globals a payload may name, exactly (as SGLang's SafeUnpickler: a module prefix such as
# torch.* would admit callables that run code): torch's rebuilds of shared tensors and storages.
_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_GLOBALS = frozenset(
    {("builtins", n) for n in ("list", "tuple", "dict", "slice")}
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
    """The payloads of a bucket (one per tensor-parallel rank: the same for each)."""
    if any(t.device.type == "cpu" for _, t in named):
        share_cpu_memory_by_name()
    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(named)
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


def deserialize(payload: str) -> list[tuple[str, torch.Tensor]]:
    share_cpu_memory_by_name()
    try:
        named = _Unpickler(io.BytesIO(base64.b64decode(payload))).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise PayloadError(f"the weight payload does not decode ({e})") from None
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in named
    ):
        raise PayloadError("a weight payload holds a list of (name, tensor) pairs")
    return named
