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

The trainer holds one always (off unless launch.colocate_offload is `optimizer`: then every hook
is a no-op and adds nothing to the record). It is the trainer's hook, not the weight channel's:
it moves the trainer's own optimizer state, and would do the same whichever channel sends the
weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from relax_hpc.metrics.timing import PhaseTimer


class OptimizerOffload:
    """Parks the device-resident state of these optimizers in pinned host memory and back
    (`enabled` False: never)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], device: torch.device, enabled: bool = True) -> None:
        self.optimizers, self.device, self.enabled = optimizers, device, enabled
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
        if not self.enabled or self.device.type != "cuda" or self._parked:
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

    # -- the trainer's hooks around a step -------------------------------------------------------

    def before_step(self, timer: PhaseTimer) -> None:
        """Bring the state back for the step (after the engines released the device)."""
        if self.enabled:
            with timer.phase("restore"):
                self.restore()

    def after_step(self, timer: PhaseTimer) -> dict[str, float]:
        """After the push and any checkpoint: park the state until the next step; the record's
        field of what moved (on a GPU)."""
        if not self.enabled:
            return {}
        with timer.phase("offload"):
            moved = self.offload()
        return {"mem_offloaded_gb": round(moved / 2**30, 3)} if self.device.type == "cuda" else {}

    def record(self, phases: dict[str, float]) -> dict[str, float]:
        """The step record's time fields of the hooks."""
        if not self.enabled:
            return {}
        return {"time_offload": phases.get("offload", 0.0), "time_restore": phases.get("restore", 0.0)}
