"""Optimizer state in host memory while colocated engines generate (launch.colocate_offload).

Colocated, the trainer's memory stays on the device between steps although the trainer only
waits: the engines generate on the same GPU meanwhile. Adam's two moments (8 bytes a parameter in
fp32, the largest part of the training state after the fp32 master weights) are not read between
two optimizer steps, so they can wait in pinned host memory: parked after the weight push (and
any checkpoint), brought back before the next step trains, after the engines have released.

The state tensors keep their identity (their `.data` moves; a DTensor's local shard), so the
optimizer, its checkpoint code and megatron's wrappers see the same objects. The pinned buffers
are allocated once and reused every step. On the CPU there is nothing to move and both calls are
no-ops. tests/gpu/test_offload.py checks the round trip with both backends' optimizers.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class OptimizerOffload:
    """Parks the device-resident state of these optimizers in pinned host memory and back."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
        self.optimizers, self.device = optimizers, device
        self._pinned: list[torch.Tensor] = []
        self._parked: list[torch.Tensor] = []  # the state tensors now in host memory

    @torch.no_grad()  # a DTensor's to_local() is then its local shard itself, not a view
    def _state(self) -> list[torch.Tensor]:
        """Every tensor of the optimizers' state on this device (a DTensor's local shard), in a
        fixed order: parameter groups' order, then the state's keys."""
        out = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    for value in optimizer.state.get(p, {}).values():
                        local = value.to_local() if isinstance(value, DTensor) else value
                        if isinstance(local, torch.Tensor) and local.device == self.device:
                            out.append(local)
        return out

    @torch.no_grad()
    def offload(self) -> int:
        """Move the state to host memory and return its memory to the driver (the engines are
        other processes). Returns the bytes moved."""
        if self.device.type != "cuda" or self._parked:
            return 0
        state = self._state()
        if [(t.shape, t.dtype) for t in state] != [(h.shape, h.dtype) for h in self._pinned]:
            self._pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state]
        for t, host in zip(state, self._pinned, strict=True):
            host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # landed before the device memory goes
        for t, host in zip(state, self._pinned, strict=True):
            t.data = host
        self._parked = state
        torch.cuda.empty_cache()
        return sum(t.numel() * t.element_size() for t in state)

    @torch.no_grad()
    def restore(self) -> None:
        """Bring the parked state back to the device (a no-op if none is parked)."""
        for t in self._parked:
            t.data = t.data.to(self.device, non_blocking=True)
        if self._parked:
            torch.cuda.current_stream(self.device).synchronize()
        self._parked = []
