"""The weight channel interface (`WeightChannel`). Each implementation lives beside its transport:

- `BroadcastChannel` (sender): rank 0 broadcasts flat buckets to every engine over a side group;
- `ShardedChannel` (sharded): every rank broadcasts its share of the buckets;
- `ColocatedChannel` (colocated): every rank hands its engines the weights by reference on its own
  device, the engines releasing their memory around each step;
- `AdapterChannel` (adapters): only LoRA adapters travel, as PEFT folders the engines load;
- `VllmChannel` (vllm_channel): rank 0 pushes through vLLM's own weight-transfer routes;
- `FileChannel` (files): every rank writes its buckets as safetensors that the engines load from
  disk, with weights.delta only what changed.

The trainer holds one channel, chosen once from the config (relax_hpc.trainer.build), and calls
only this interface, so a new transport (the sharded push next) is a new class, not a branch in
the trainer. A channel is exact: after a push every engine it reports holds the trainer's
weights bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

# The backend's full parameters, a fresh stream per call (Backend.full_parameters).
FullParameters = Callable[[], Iterable[tuple[str, torch.Tensor | None]]]


class PhaseTimer(Protocol):
    """Where a channel's work around a step is timed (relax_hpc.metrics.timing.PhaseTimer)."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


class WeightChannel(Protocol):
    """How a version's weights reach the engines. One instance per trainer rank; `push` is
    collective (every rank, the same order)."""

    def push(self, full_parameters: FullParameters, version: int) -> int:
        """Collective: send `version`'s weights; returns how many engines took it (on rank 0;
        other ranks may return 0). Raises WeightSyncError when a transfer failed (the next push
        tries again with the engines that answer)."""
        ...

    def engines_changed(self, delivered: int) -> bool:
        """Rank 0: whether the engines need a push although `delivered` was pushed last (an
        engine started, restarted or left)."""
        ...

    def before_step(self, timer: PhaseTimer) -> None:
        """Every rank, before a training step: what the transport needs done (colocated: the
        engines free the device), timed by `timer`."""
        ...

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """Rank 0: the step record's fields about the last push and step (none for most)."""
        ...


class QuietHooks:
    """The hooks of a channel that needs nothing around a step and adds nothing to its record."""

    def before_step(self, timer: PhaseTimer) -> None:
        return None

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        return {}
