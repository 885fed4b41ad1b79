"""The weight channel interface (`WeightChannel`), and one implementation per transport:

- `BroadcastChannel`: rank 0 broadcasts flat buckets to every engine over a side group (sender);
- `ColocatedChannel`: every rank hands its engines the weights by reference on its own device,
  the engines releasing their memory around each step (colocated);
- `AdapterChannel`: only LoRA adapters travel, as PEFT folders the engines load (adapters);
- `VllmChannel`: rank 0 pushes through vLLM's own weight-transfer routes (vllm_channel);
- `FileChannel` (relax_hpc.weights.files, which builds on this module): every rank writes its
  buckets as safetensors that the engines load from disk, with weights.delta only what changed.

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
import torch.distributed as dist

from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.adapters import AdapterPublisher, push_adapter
from relax_hpc.weights.buckets import BucketPlan, plan_buckets
from relax_hpc.weights.colocated import ColocatedSender
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import WeightSender, push
from relax_hpc.weights.vllm_channel import VllmSender

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


class _Quiet:
    """The hooks of a channel that needs nothing around a step and adds nothing to its record."""

    def before_step(self, timer: PhaseTimer) -> None:
        return None

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        return {}


class BroadcastChannel(_Quiet):
    """Rank 0 broadcasts the buckets to every engine (relax_hpc.weights.sender); every rank takes
    part in the parameters' gathers. `sender` is None on the other ranks. With `catch_up`, a new
    engine copies the weights from another engine at its start (relax_hpc.weights.catchup)."""

    def __init__(
        self, sender: WeightSender | None, layout: EngineLayout, bucket_bytes: int, catch_up: bool = False
    ) -> None:
        self.sender, self.layout, self.catch_up = sender, layout, catch_up
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)

    def push(self, full_parameters: FullParameters, version: int) -> int:
        return push(self.sender, self.buckets, lambda: self.layout.tensors(full_parameters()), version)

    def engines_changed(self, delivered: int) -> bool:
        """An engine started, restarted or left. With catch-up, only when an engine that answers
        holds another version: one that caught up holds `delivered` and needs no push (the group
        takes it in at the next push). Version 0 is the trainer's to push: an engine that did not
        catch up reports 0 too."""
        assert self.sender is not None, "rank 0 decides"
        if self.catch_up and delivered > 0:
            return any(r.weight_version != str(delivered) for r in self.sender.live_engines())
        return self.sender.engine_set_changed()


class ColocatedChannel:
    """Every rank serves the engines on its device by reference (relax_hpc.weights.colocated);
    the engines release their memory before each step and take it back with the push."""

    def __init__(self, sender: ColocatedSender, layout: EngineLayout, bucket_bytes: int) -> None:
        self.sender, self.layout = sender, layout
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)
        self.resume_s = self.update_s = 0.0  # the last push's parts

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = self.layout.tensors(full_parameters())
        mine, self.resume_s, self.update_s = self.sender.push(self.buckets, params, version)
        everyone: list[int] = [0] * self.sender.world
        dist.all_gather_object(everyone, mine)
        return sum(everyone)

    def engines_changed(self, delivered: int) -> bool:
        """An engine (re)started since the last push: it reports another version."""
        return any(int(r.weight_version) != delivered for r in read_records(self.sender.registry))

    def before_step(self, timer: PhaseTimer) -> None:
        with timer.phase("release"):  # the engines free the device for the step
            self.sender.release()

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """The push is the engines' memory coming back, then the update by reference; and what
        the trainer still holds on the device while the engines generate (mem_held_gb)."""
        out = {"time_resume": self.resume_s, "time_update": self.update_s, "time_release": phases.get("release", 0.0)}
        if device.type == "cuda":
            out["mem_held_gb"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
        return out


class AdapterChannel(_Quiet):
    """Only the LoRA adapters travel, as PEFT folders (relax_hpc.weights.adapters); every rank
    takes part in the gathers, rank 0 (whose `publisher` is not None) publishes."""

    def __init__(self, publisher: AdapterPublisher | None) -> None:
        self.publisher = publisher

    def push(self, full_parameters: FullParameters, version: int) -> int:
        return push_adapter(self.publisher, full_parameters(), version)

    def engines_changed(self, delivered: int) -> bool:
        assert self.publisher is not None, "rank 0 decides"
        return self.publisher.engine_set_changed()


class VllmChannel:
    """Rank 0 pushes to vLLM engines through vLLM's weight-transfer API (relax_hpc.weights.
    vllm_channel) in the HF checkpoint's layout, which vLLM's load_weights takes; every rank takes
    part in the parameters' gathers. `sender` is None on the other ranks. Colocated
    (VllmSender.colocated), rank 0 puts the engines to sleep before each step."""

    def __init__(self, sender: VllmSender | None, layout: EngineLayout, bucket_bytes: int) -> None:
        self.sender, self.layout = sender, layout
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = iter(self.layout.tensors(full_parameters()))
        try:
            return 0 if self.sender is None else self.sender.push(params, self.buckets, version)
        finally:
            for _ in params:  # every rank gathers every parameter, also after a failure: keep the collectives matched
                pass

    def engines_changed(self, delivered: int) -> bool:
        assert self.sender is not None, "rank 0 decides"
        return self.sender.engine_set_changed()

    def before_step(self, timer: PhaseTimer) -> None:
        if self.sender is not None and self.sender.colocated:
            with timer.phase("release"):  # the engines sleep through the step
                self.sender.release()

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """Colocated, the time the engines took to sleep; with weights.delta, the last push's bytes
        sent and the share of elements that changed."""
        if self.sender is None:
            return {}
        out = {"time_release": phases.get("release", 0.0)} if self.sender.colocated else {}
        last = self.sender.last
        if self.sender.delta and last.elements:
            out |= {
                "weights_sent_mb": round(last.sent / 2**20, 3),
                "weights_changed_share": last.changed / last.elements,
            }
        return out
