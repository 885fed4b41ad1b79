"""The built-in engine's weights: what SGLang's weight routes do to them (updates from a
weight-update group, from tensors by reference, from disk, a new version label), what they report
(digests, a catch-up snapshot, a parameter by name), the memory they hold released and taken back
for a colocated trainer, and the LoRA adapters served beside them. A mixin of
relax_hpc.engines.torch_engine.TorchEngine, which holds the request queue and the model; the
HTTP routes call these methods on the engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections import ChainMap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relax_hpc.models.hf import EngineParameters
from relax_hpc.models.lora import read_adapter_folder
from relax_hpc.protocol import requests as P
from relax_hpc.weights.buckets import BucketPlan
from relax_hpc.weights.catchup import CaughtUp, SnapshotReq, Stamp, catch_up, encode, plan_of
from relax_hpc.weights.digests import checker_answer, engine_digests
from relax_hpc.weights.files import DELTA_FORMAT, Loaded, load_folder
from relax_hpc.weights.group import SideGroup
from relax_hpc.weights.lora import AdapterMerger
from relax_hpc.weights.receiver import BucketReceiver
from relax_hpc.weights.tensors import FLATTENED_BUCKET, PayloadError, deserialize

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's (srt/constants.py)


class EngineBusy(RuntimeError):
    """The request cannot be served now (HTTP 503), e.g. while the weights are released."""


class EngineState:
    """What the engine's parts share: its state, made by TorchEngine.__init__."""

    device: torch.device
    params: EngineParameters
    weight_version: str
    weights_epoch: int
    whole: bool
    updating: bool
    released: dict[str, tuple[torch.Size, torch.dtype]]
    groups: dict[str, SideGroup]
    weights_timeout_s: float
    lora: AdapterMerger
    update_targets: ChainMap[str, torch.Tensor]
    receivers: dict[str, BucketReceiver]
    adapter_folders: dict[str, Path]
    adapters: dict[str, dict[str, torch.Tensor]]
    model_lock: threading.Lock
    queue: threading.Condition
    pending: list[Any]
    running: list[Any]

    def abort(self, req: P.AbortReq) -> None:
        raise NotImplementedError  # TorchEngine's: the queue's requests end

    def _writing(self) -> None:
        """Under the model lock, before a write into the weights: a copy under way is stale, and
        the weights are not one version until `_holds`."""
        self.weights_epoch += 1
        self.whole = False

    def _holds(self, version: str) -> None:
        """Under the model lock, once the weights are all of `version`."""
        self.weight_version, self.whole = version, True


class EngineAdapters(EngineState):
    """LoRA adapters served beside the weights (adapter sync): loaded from their folders, named by requests."""

    def _adapter(self, name: str) -> dict[str, torch.Tensor]:
        """Under the queue's lock: a request's adapter, loaded again from its folder if unloaded since."""
        if name not in self.adapters:
            if name not in self.adapter_folders:
                raise P.ProtocolError(f"LoRA adapter {name!r} has never been loaded; loaded: {sorted(self.adapters)}")
            self.adapters[name] = read_adapter_folder(self.adapter_folders[name])
        return self.adapters[name]

    def load_adapter(self, req: P.LoadLoRAAdapterReqInput) -> None:
        folder = Path(req.lora_path)
        try:
            adapter = read_adapter_folder(folder)
        except (OSError, KeyError, ValueError) as e:
            raise P.ProtocolError(f"LoRA adapter {req.lora_name!r}: cannot read {folder}: {e}") from None
        with self.queue:
            if req.lora_name in self.adapters:
                raise P.ProtocolError(f"Failed to load LoRA adapter {req.lora_name} because it is already loaded")
            self.adapters[req.lora_name], self.adapter_folders[req.lora_name] = adapter, folder

    def unload_adapter(self, req: P.UnloadLoRAAdapterReqInput) -> None:
        """At once: the requests queued with the adapter hold its tensors until they are sampled."""
        with self.queue:
            if self.adapters.pop(req.lora_name, None) is None:
                raise P.ProtocolError(f"LoRA with name {req.lora_name} does not exist; loaded: {sorted(self.adapters)}")


class EngineMemory(EngineState):
    """The weights' memory, released while a colocated trainer trains and taken back for the next update."""

    def release_memory(self, req: P.ReleaseMemoryOccupationReqInput) -> None:
        """Free the weights' memory while the trainer trains on the same device (colocation): the
        engine must be idle; a released engine refuses /generate until resumed and updated."""
        tags = set(req.tags or MEMORY_TAGS)
        if unknown := tags - set(MEMORY_TAGS):
            raise P.ProtocolError(f"unknown memory tags {sorted(unknown)}; SGLang's are {list(MEMORY_TAGS)}")
        with self.queue:
            if self.pending or self.running:
                raise P.ProtocolError("release_memory_occupation needs an idle engine: pause generation first")
        with self.model_lock:
            if "weights" in tags and not self.released:
                self.released = {name: (p.shape, p.dtype) for name, p in self.params.items()}
                for p in self.params.values():
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def resume_memory(self, req: P.ResumeMemoryOccupationReqInput) -> None:
        """Allocate the released weights again (no values: the next update fills them)."""
        tags = set(req.tags or MEMORY_TAGS)
        with self.model_lock:
            if "weights" in tags and self.released:
                self._writing()  # no values until the next update
                for name, (shape, dtype) in self.released.items():
                    self.params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
                self.released = {}


class EngineWeights(EngineAdapters, EngineMemory):
    """What the weight routes do to the weights, and what they report of them."""

    def update_version(self, req: P.UpdateWeightVersionReqInput) -> bool:
        """Report `new_version` from now on: after an adapter load, or once every rank's buckets of
        a sharded colocated push are in (the weights are then all of it). Returns True: it changed
        the weight version."""
        if req.abort_all_requests:
            self.abort(P.AbortReq(abort_all=True))
        with self.model_lock:  # between batches, as a pushed version
            self._holds(req.new_version)
        return True

    def weights_snapshot(self, req: SnapshotReq) -> bytearray:
        """One bucket of the weights for an engine catching up (or, `inspect`, for a check of
        them), stamped with the version and epoch it was read at (relax_hpc.weights.catchup)."""
        if (self.adapter_folders or self.lora.adapter) and not req.inspect:
            raise P.ProtocolError("catch-up copies whole weights; this engine serves LoRA adapters")
        if req.bucket_bytes <= 0:
            raise P.ProtocolError(f"bucket_bytes must be positive, got {req.bucket_bytes}")
        plans = plan_of(self.params, req.bucket_bytes)
        if not 0 <= req.bucket < len(plans):
            raise P.ProtocolError(f"bucket {req.bucket}: the weights are {len(plans)} buckets")
        with self.model_lock:  # the bucket is serialised under it: one version
            if self.released or not self.whole:
                raise EngineBusy("the weights are being updated or are released; ask again")
            return encode(self.params, plans[req.bucket], Stamp(self.weight_version, self.weights_epoch, len(plans)))

    def check_weights(self, req: P.CheckWeightsReqInput) -> dict[str, Any]:
        """SGLang's /weights_checker, action checksum (relax_hpc.weights.verify): the digest
        (relax_hpc.weights.digests.held_hash) of every tensor a push writes, as the engine holds
        it (its parameters and the LoRA tensors received beside them; with adapter sync, the
        adapter of the version it serves), read under the model lock at one version, which the
        answer says with the hash."""
        if req.action != "checksum":
            raise P.ProtocolError(f"weights_checker action {req.action!r}: the built-in engine answers checksum only")
        skip = req.skip_tensor_list or []
        if self.adapter_folders:  # adapter sync: the adapter of the version (none for version 0, the base)
            version = self.weight_version
            name = P.adapter_name(int(version))
            with self.queue:
                tensors = dict(self._adapter(name)) if name is not None else {}
        else:
            with self.model_lock:
                if self.released or not self.whole:
                    raise EngineBusy("the weights are being updated or are released; ask again")
                version = self.weight_version
                tensors = {n: t for n, t in self.update_targets.items() if not any(s in n for s in skip)}
                checksums, how = engine_digests(tensors)
                return checker_answer(checksums, how, version)
        checksums, how = engine_digests({n: t for n, t in tensors.items() if not any(s in n for s in skip)})
        return checker_answer(checksums, how, version)

    def catch_up(self, registry: Path, engine_id: str, api_key: str, bucket_bytes: int) -> tuple[CaughtUp | None, str]:
        """At start, before the engine registers: copy the weights of the engine at the highest
        version (what was copied, or None and why not; the engine then keeps its own)."""
        done, staged, why = catch_up(registry, engine_id, api_key, self.params, bucket_bytes, self.weights_timeout_s)
        if done is not None:
            with self.model_lock, torch.no_grad():
                self._writing()
                Loaded(whole=staged).apply(self.params)
                self._holds(done.version)
        return done, why

    def init_group(self, req: P.InitWeightsUpdateGroupReqInput) -> None:
        old = self.groups.pop(req.group_name, None)
        if old is not None:
            old.close()
        self.groups[req.group_name] = SideGroup(
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
            self.weights_timeout_s,
        )

    def destroy_group(self, req: P.DestroyWeightsUpdateGroupReqInput) -> None:
        """An update still waiting in this group's broadcast gives up (the trainer abandoned the
        push: a member failed), releasing the model; the group is let go off this thread."""
        group = self.groups.pop(req.group_name, None)
        self.receivers.pop(req.group_name, None)
        if group is not None:
            group.cancel()
            group.close_soon()

    def weights_by_name(self, req: P.GetWeightsByNameReqInput) -> list[Any] | float:
        if req.name not in self.params:
            raise P.ProtocolError(f"no parameter named {req.name!r}")
        with self.model_lock:
            param = self.params[req.name].detach()
            return param[: req.truncate_size].tolist() if param.dim() else param.item()

    def update_from_tensor(self, req: P.UpdateWeightsFromTensorReqInput) -> bool:
        """Copy tensors mapped from the trainer's memory into the parameters (this engine's
        tensor-parallel rank 0 payload). Returns whether it changed the weight version."""
        if not self.updating:
            raise P.ProtocolError(
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        if req.load_format not in (None, "direct", FLATTENED_BUCKET):
            raise P.ProtocolError(
                f"load_format {req.load_format!r}: the torch engine takes None, direct or {FLATTENED_BUCKET}"
            )
        try:
            named = deserialize(req.serialized_named_tensors[0], req.load_format)
        except PayloadError as e:
            raise P.ProtocolError(str(e)) from None
        unknown = [name for name, _ in named if name not in self.params]
        if unknown:
            raise P.ProtocolError(f"unknown parameter names {unknown[:5]}")
        with self.model_lock, torch.no_grad():
            self._writing()
            torch._foreach_copy_([self.params[n] for n, _ in named], [t.to(self.device) for _, t in named])
            if self.device.type == "cuda":  # the answer says the bytes are copied: the sender reuses the buffer
                torch.cuda.current_stream(self.device).synchronize()
            if req.weight_version is None:
                return False
            self._holds(req.weight_version)
            return True

    def update_from_disk(self, req: P.UpdateWeightFromDiskReqInput) -> bool:
        """Load a version's folder (weights.channel file): whole, or a delta of the version held
        (load_format relax_delta), read and checked in full before any weight changes, then
        copied in between batches. Returns whether it changed the weight version."""
        if req.load_format not in (None, "safetensors", DELTA_FORMAT):
            raise P.ProtocolError(
                f"load_format {req.load_format!r}: the torch engine takes None, safetensors or {DELTA_FORMAT}"
            )
        if self.lora.adapter or self.released:
            raise P.ProtocolError("update_weights_from_disk loads whole weights: not with LoRA or released memory")
        if req.abort_all_requests:
            self.abort(P.AbortReq(abort_all=True))
        folder = Path(req.model_path)
        if not folder.is_dir():
            raise P.ProtocolError(f"no folder {folder}")
        with self.model_lock, torch.no_grad():  # between batches: a completion never mixes two versions
            loaded = load_folder(folder, self.params, req.load_format == DELTA_FORMAT, self.weight_version)
            self._writing()
            loaded.apply(self.params)
            if req.weight_version is None:
                return False
            self._holds(req.weight_version)
            return True

    def begin_update(self, req: P.BeginWeightUpdateReqInput) -> None:
        if req.selector == "draft":
            raise P.ProtocolError("selector 'draft': the torch engine has no draft model")
        self.updating = True

    def end_update(self) -> None:
        with self.model_lock:
            for receiver in list(self.receivers.values()):
                receiver.settle(wait=False)
        self.updating = False

    @contextlib.contextmanager
    def _write_guard(self) -> Iterator[None]:
        """Around a copy into the weights: between generation batches, the weights marked written."""
        with self.model_lock:
            self._writing()
            yield

    def update_from_distributed(self, req: P.UpdateWeightsFromDistributedReqInput) -> bool:
        """Receive one bucket into the parameters. Returns whether it changed the weight version."""
        if not self.updating:
            raise P.ProtocolError("call /begin_weight_update before /update_weights_from_distributed")
        group = self.groups.get(req.group_name)
        if group is None:
            raise P.ProtocolError(f"no weight update group named {req.group_name!r}; call /init_weights_update_group")
        if req.abort_all_requests:
            self.abort(P.AbortReq(abort_all=True))
        plan = BucketPlan(req.names, req.dtypes, req.shapes)
        self.lora.slots(req.names, req.dtypes, req.shapes)
        # One receiver (buffers, copy stream) per group: the sharded channel's ranks send at once.
        receiver = self.receivers.setdefault(req.group_name, BucketReceiver(self.update_targets, self.device))
        # Checked now, raised once received (see BucketReceiver.receive).
        unknown = receiver.unknown_names(plan)
        flattened = req.load_format == "flattened_bucket"
        receiver.receive(group, plan, flattened=flattened, copy=not unknown, guard=self._write_guard)
        if unknown:
            raise P.ProtocolError(f"unknown parameter names {unknown[:5]}")
        if req.weight_version is None:
            return False
        with self.model_lock:  # between batches: a completion never mixes two versions
            for each in list(self.receivers.values()):  # the engine reports the new version only once it holds it
                each.settle(wait=True)
            if self.lora.adapter:
                self.lora.merge()
            self._holds(req.weight_version)
            return True
