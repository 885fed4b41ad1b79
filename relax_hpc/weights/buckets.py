"""Flat buckets of parameters: the unit of one weight-sync broadcast.

A bucket holds tensors of one dtype (so every tensor starts at an offset aligned to its element
size), packed as raw bytes back to back into one uint8 buffer of at most `max_bytes` (a tensor
larger than that travels alone): SGLang's "flattened_bucket" load format. Its metadata (names,
dtypes, shapes) is what UpdateWeightsFromDistributedReqInput carries, so the receiver can split it.

Both ends keep two bucket buffers (BufferRing) so that one bucket is packed or unpacked while the
other is on the wire. A buffer is reused only after a fence of its previous use: on CUDA a c10d Work
or a CUDA event, whose wait() makes the current stream wait without blocking the host; on CPU a
gloo Work or anything else whose wait() blocks until that use is over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

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
        return sum(torch.Size(s).numel() * DTYPES[d].itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))


def plan_buckets(
    params: Iterable[tuple[str, torch.Size, torch.dtype]],
    max_bytes: int,
    key: Callable[[str], Hashable] = lambda name: None,
) -> list[BucketPlan]:
    """Group (name, shape, dtype) into buckets in the given order, one dtype per bucket, and one
    `key` (the sharded channel: the pipeline stage that holds the tensor)."""
    buckets: list[BucketPlan] = []
    current: list[tuple[str, torch.Size, torch.dtype]] = []
    size = 0
    for name, shape, dtype in params:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if current and (dtype != current[0][2] or key(name) != key(current[0][0]) or size + nbytes > max_bytes):
            buckets.append(_plan(current))
            current, size = [], 0
        current.append((name, shape, dtype))
        size += nbytes
    if current:
        buckets.append(_plan(current))
    return buckets


def assign(buckets: list[BucketPlan], candidates: Sequence[Sequence[int]]) -> list[int]:
    """The rank that sends (or writes) each bucket, one of its `candidates` (the ranks that hold
    it): the largest bucket first, each to its least loaded candidate."""
    load: dict[int, int] = {}
    owner = [0] * len(buckets)
    for k in sorted(range(len(buckets)), key=lambda k: -buckets[k].nbytes):
        owner[k] = min(candidates[k], key=lambda r: load.get(r, 0))
        load[owner[k]] = load.get(owner[k], 0) + buckets[k].nbytes
    return owner


def stream_buckets(
    buckets: Sequence[BucketPlan],
    params: Iterator[tuple[str, torch.Tensor | None]],
    mine: Callable[[int], bool],
    passes: Callable[[int], bool] = lambda k: False,
) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """(index, tensors) of each bucket `mine` picks, as soon as its last tensor has streamed past
    in `params` (the engine-side stream, every tensor of every bucket once, in the plan's order of
    last tensors: a sharded plan's buckets interleave). Other buckets' tensors are dropped as
    they pass, so a rank holds no more than its own buckets in filling; a tensor of its own that
    it does not hold (None) is an error. The buckets `passes` picks (another rank's, which this
    rank relays) come too, with no tensors, as their last tensor passes: a relay takes part in
    their broadcasts in the same order.
    Consumes `params` whole."""
    where = {name: (k, j) for k, plan in enumerate(buckets) if mine(k) for j, name in enumerate(plan.names)}
    ends = {plan.names[-1]: k for k, plan in enumerate(buckets) if passes(k) and not mine(k)}
    filling: dict[int, list[torch.Tensor]] = {}
    for name, tensor in params:
        if name in ends:
            yield ends[name], []
        if (at := where.get(name)) is None:
            continue
        k, j = at
        got = filling.setdefault(k, [])
        if tensor is None:
            raise RuntimeError(f"this rank sends bucket {k} but does not hold {name}")
        if j != len(got):
            raise RuntimeError(f"bucket {k}'s tensors streamed out of order at {name}")
        got.append(tensor)
        if len(got) == len(buckets[k].names):
            yield k, filling.pop(k)
    if filling:
        raise RuntimeError(f"buckets {sorted(filling)} did not fill: the stream ended early")


def _plan(entries: list[tuple[str, torch.Size, torch.dtype]]) -> BucketPlan:
    return BucketPlan(
        names=[n for n, _, _ in entries],
        dtypes=[DTYPE_NAMES[d] for _, _, d in entries],
        shapes=[list(s) for _, s, _ in entries],
    )


def _pack_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The tensors' bytes back to back into the uint8 buffer `flat` (exactly their size). A
    planned bucket holds one dtype (plan_buckets): the buffer is viewed as it, so each tensor
    costs one reshape (this runs once per tensor on the sender's critical path, hundreds a push);
    tensors of mixed dtypes are viewed as bytes one by one."""
    dtype = tensors[0].dtype
    if all(t.dtype == dtype for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=flat.view(dtype))
    else:
        torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors], out=flat)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes back to back in one 1-D uint8 buffer."""
    flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8, device=tensors[0].device)
    _pack_into(flat, tensors)
    return flat


def unpack(flat: torch.Tensor, plan: BucketPlan) -> list[tuple[str, torch.Tensor]]:
    """Split a received uint8 buffer back into named tensors (views of `flat`)."""
    dtypes = [DTYPES[d] for d in plan.dtypes]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(plan.shapes, dtypes, strict=True)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes, its metadata describes {sum(sizes)}")
    parts = flat.split(sizes)  # one call for every view: this runs once per bucket on the engine's critical path
    return [(n, part.view(d).view(s)) for n, part, d, s in zip(plan.names, parts, dtypes, plan.shapes, strict=True)]


class Fence(Protocol):
    """The end of one use of a buffer (see the module docstring)."""

    def wait(self) -> object: ...


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own on a CUDA device; None on CPU, where torch.cuda.stream(None) is a no-op."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def stream_done(stream: torch.cuda.Stream | None) -> Fence | None:
    """A fence for the work queued so far on `stream` (None on CPU: that work is already done)."""
    return None if stream is None else stream.record_event()


class BufferRing:
    """`count` uint8 buffers handed out in turn.

    acquire() waits, on the current stream, for the fence that release() attached to the buffer's
    previous use, and grows the buffer if the bucket is larger than it. Buffers are allocated on the
    caller's stream; drain() makes that stream wait for every fence, after which the ring can be
    dropped (the caching allocator reuses its memory only behind those waits).
    """

    def __init__(self, device: torch.device, capacity: int, count: int = 2) -> None:
        self.device = device
        self._buffers = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
        self._fences: list[Fence | None] = [None] * count
        self._next = 0
        self._held: int | None = None

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A buffer view of `nbytes`, free once the current stream gets there. One at a time."""
        assert self._held is None, "release() the previous buffer first"
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        self._wait(i)
        if self._buffers[i].numel() < nbytes:
            self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._held = i
        return self._buffers[i][:nbytes]

    def release(self, fence: Fence | None) -> None:
        """The acquired buffer's use ends with `fence` (None: it has ended already)."""
        assert self._held is not None, "nothing acquired"
        self._fences[self._held], self._held = fence, None

    def drain(self) -> None:
        self._held = None
        for i in range(len(self._buffers)):
            self._wait(i)

    def _wait(self, i: int) -> None:
        fence, self._fences[i] = self._fences[i], None
        if fence is not None:
            fence.wait()


class BucketPacker:
    """Packs buckets into a BufferRing: the double-buffered sending side of weight sync.

    On CUDA the copies run on a side stream, so packing bucket k+1 overlaps the broadcast of bucket
    k. pack() leaves the caller's stream waiting for the pack: a broadcast issued next on that
    stream (ProcessGroupNCCL makes its stream wait for the current one) sends complete bytes, and
    the caller may free or overwrite the source tensors right away. consumed() names the fence (the
    broadcast's Work) before which the buffer must not be packed again.
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self._ring = BufferRing(device, capacity)
        self._stream = side_stream(device)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The same bytes as pack(tensors), in the next buffer once its previous consumer is done."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        caller = torch.cuda.current_stream(self._ring.device) if self._stream is not None else None
        with torch.cuda.stream(self._stream):
            if self._stream is not None and caller is not None:
                self._stream.wait_stream(caller)  # the tensors were made on the caller's stream
            flat = self._ring.acquire(nbytes)
            _pack_into(flat, tensors)
        if caller is not None and self._stream is not None:
            caller.wait_stream(self._stream)
        return flat

    def consumed(self, fence: Fence | None) -> None:
        """The buffer pack() returned last is in use until `fence`."""
        self._ring.release(fence)

    def drain(self) -> None:
        """The caller's stream waits until every buffer is consumed (call before dropping the packer)."""
        self._ring.drain()
