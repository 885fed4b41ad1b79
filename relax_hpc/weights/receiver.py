"""Engine side of weight sync: buckets received over a side group, copied into the parameters.

The built-in engine keeps one receiver per weight-update group and calls `receive` once per
/update_weights_from_distributed request, and `settle` after the last bucket. Received buckets land
in two reusable buffers (BufferRing) and are copied into the parameters on a stream of their own,
so that the next bucket's broadcast overlaps the copy (CUDA only; on the CPU the broadcast blocks
until the bytes are here). Only the copy holds the engine's `guard` (its model lock: between
generation batches, so that no completion sees half a bucket); the wait for the bytes does not, so
buckets of different groups (the sharded channel's ranks) arrive at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch

from relax_hpc.weights.buckets import DTYPES, BucketPlan, BufferRing, side_stream, stream_done, unpack
from relax_hpc.weights.group import SideGroup

# Held around each copy into the parameters (the engine's model lock, marking the weights written).
Guard = Callable[[], AbstractContextManager[None]]


class BucketReceiver:
    def __init__(self, params: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.params = params
        self.device = device
        self._ring: BufferRing | None = None  # allocated per update, freed by settle()
        self._copy_stream = side_stream(device)

    def unknown_names(self, plan: BucketPlan) -> list[str]:
        return [name for name in plan.names if name not in self.params]

    def receive(self, group: SideGroup, plan: BucketPlan, flattened: bool, copy: bool, guard: Guard) -> None:
        """Join the bucket's broadcast and (when `copy`) load it into the parameters, holding
        `guard` for the copy only. An engine must join even a bucket it cannot load: skipping the
        broadcast would take the next bucket's bytes for this one's."""
        if flattened:
            self._receive_flat(group, plan, copy, guard)
        else:
            self._receive_each(group, plan, copy, guard)

    def _receive_flat(self, group: SideGroup, plan: BucketPlan, copy: bool, guard: Guard) -> None:
        """Into the next ring buffer, then into the parameters; no host sync on CUDA: the broadcast
        waits (on the current stream) for the copy out of the buffer's previous use, the copy
        waits (on the copy stream) for the broadcast."""
        if self._ring is None:
            self._ring = BufferRing(self.device, plan.nbytes)
        flat = self._ring.acquire(plan.nbytes)
        try:
            work = group.broadcast_async(flat)
            with torch.cuda.stream(self._copy_stream), torch.no_grad():  # None: a no-op on CPU
                group.wait(work)  # CUDA: the copy stream waits for the broadcast; gloo: until received
                received = unpack(flat, plan)
                if copy and received:  # one launch for the bucket: the host must keep ahead of the broadcasts
                    with guard():
                        torch._foreach_copy_([self.params[n] for n, _ in received], [t for _, t in received])
        finally:
            self._ring.release(stream_done(self._copy_stream))

    def _receive_each(self, group: SideGroup, plan: BucketPlan, copy: bool, guard: Guard) -> None:
        """One broadcast per tensor (load_format None): SGLang's default, not what relax_hpc sends."""
        with torch.no_grad():
            for name, dtype, shape in zip(plan.names, plan.dtypes, plan.shapes, strict=True):
                tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
                group.broadcast(tensor)
                if copy:
                    with guard():
                        self.params[name].copy_(tensor)

    def settle(self, wait: bool) -> None:
        """After the last bucket: later work on the current stream (generation) sees every copy,
        and the ring's buffers go back to the allocator (behind that wait)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
            if wait:
                torch.cuda.current_stream(self.device).synchronize()
        self._ring = None
