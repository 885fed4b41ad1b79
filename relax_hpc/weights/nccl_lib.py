"""NCCL's C API through ctypes: a communicator built from a unique id, for peers outside
torch.distributed (vLLM's workers join the trainer's weight-transfer group this way).

torch.distributed cannot build a communicator from a given unique id, and torch.cuda.nccl's
`init_rank` fails on Python 3.12 with torch 2.11 ("PY_SSIZE_T_CLEAN macro must be defined",
measured on the GPU machine), so the few calls needed come from the libnccl that torch itself
loads (the nvidia-nccl wheel), as vLLM's own pynccl does. Every call is enqueued on a given CUDA
stream; `abort` ends a communicator whose collective will never complete (a peer died).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
SUM = 0  # ncclSum
# ncclDataType_t (nccl.h)
DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.bool: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}


class NcclError(RuntimeError):
    pass


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


@cache
def _lib() -> ctypes.CDLL:
    torch.cuda.init()  # loads libtorch_cuda and with it the libnccl it links
    lib = ctypes.CDLL("libnccl.so.2")
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
    # (send, receive, count, data type, op or root, communicator, stream)
    collective: list[type[ctypes._SimpleCData[Any]]] = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.ncclAllReduce.argtypes = collective
    lib.ncclBroadcast.argtypes = collective
    lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
    return lib


def _check(result: int) -> None:
    if result != 0:
        raise NcclError(f"NCCL error {result}: {_lib().ncclGetErrorString(result).decode()}")


def unique_id() -> bytes:
    """A fresh unique id (what rank 0 mints and every peer joins with)."""
    uid = _UniqueId()
    _check(_lib().ncclGetUniqueId(ctypes.byref(uid)))
    return bytes(uid.internal)


class Communicator:
    """Rank `rank` of `world_size` from `uid`, on the current CUDA device. The constructor
    returns once every rank has joined (NCCL's init is collective)."""

    def __init__(self, uid: bytes, world_size: int, rank: int) -> None:
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        handle = _UniqueId()
        ctypes.memmove(handle.internal, uid, UNIQUE_ID_BYTES)
        self._comm = ctypes.c_void_p()
        _check(_lib().ncclCommInitRank(ctypes.byref(self._comm), world_size, handle, rank))

    def all_reduce(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Sum `tensor` across the ranks, in place."""
        ptr = ctypes.c_void_p(tensor.data_ptr())
        _check(_lib().ncclAllReduce(ptr, ptr, tensor.numel(), _dtype(tensor), SUM, self._comm, _raw(stream)))

    def broadcast(self, tensor: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None:
        """`root`'s `tensor` into every rank's (a contiguous tensor: NCCL sends numel from data_ptr)."""
        assert tensor.is_contiguous(), "NCCL broadcasts a contiguous tensor"
        ptr = ctypes.c_void_p(tensor.data_ptr())
        _check(_lib().ncclBroadcast(ptr, ptr, tensor.numel(), _dtype(tensor), root, self._comm, _raw(stream)))

    def abort(self) -> None:
        """End the communicator now, collectives in flight included (a peer that died)."""
        if self._comm.value:
            _check(_lib().ncclCommAbort(self._comm))
            self._comm = ctypes.c_void_p()

    def destroy(self) -> None:
        if self._comm.value:
            _check(_lib().ncclCommDestroy(self._comm))
            self._comm = ctypes.c_void_p()


def _dtype(tensor: torch.Tensor) -> int:
    if tensor.dtype not in DTYPES:
        raise NcclError(f"NCCL has no type for {tensor.dtype}")
    return DTYPES[tensor.dtype]


def _raw(stream: torch.cuda.Stream) -> ctypes.c_void_p:
    return ctypes.c_void_p(stream.cuda_stream)
