"""Engine side of weight sync on vLLM without GPUs: a gloo transfer engine in vLLM's own API.

vLLM 0.32 receives weights through a pluggable `WeightTransferEngine`
(vllm/distributed/weight_transfer/base.py), driven by its RL routes /init_weight_transfer_engine,
/start_weight_update, /update_weights and /finish_weight_update; its built-in backends need CUDA.
This one joins the trainer's gloo side group (relax_hpc.weights.group.SideGroup: the same
rendezvous as every other relax_hpc engine) and receives each bucket as one flat broadcast
(relax_hpc.weights.buckets), then hands the tensors to the model's own `load_weights`, which fuses
q/k/v and gate/up the way vLLM loads a checkpoint.

With weights.delta (`keep_base`) it keeps each bucket's bytes as received, in host memory, and a
bucket may come as a delta: the flat indices of its changed elements and their new bits, patched
into that copy. vLLM's own sparse loader (load_checkpoint_weight_patches, which sparse_nccl uses)
patches the model's tensors in place, but vLLM's CPU backend packs its linear layers' weights for
oneDNN and drops the raw ones (model_executor/layers/utils.py), so there is nothing in place to
patch: here every bucket, changed or not, is loaded whole from the copy, inside the same layerwise
reload as a whole push (which needs every tensor of a layer to rebuild it).

It reaches vLLM through the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls
`register` in every process it starts (API server, engine core, workers), and serving with
`--weight-transfer-config '{"backend": "relax_gloo"}'` makes the workers build this class.
This module runs only inside vLLM's environment (.venv-vllm); the trainer's half is
relax_hpc.weights.vllm_channel, which imports no vLLM.
"""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from relax_hpc.protocol.vllm import DIE_WITH_PARENT
from relax_hpc.protocol.vllm import GLOO_TRANSFER as BACKEND
from relax_hpc.weights.buckets import BucketPlan, unpack
from relax_hpc.weights.delta import bits, bits_dtype
from relax_hpc.weights.group import SideGroup


def register() -> None:
    """The vllm.general_plugins entry point. vLLM may call it more than once in a process."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if os.environ.get(DIE_WITH_PARENT) == "1":
        die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies. relax_hpc's engine wrapper gives the API server
    this (PR_SET_PDEATHSIG) when it starts it; vLLM's engine core and workers, which the server
    starts, get it here, the only relax_hpc code they run. Without it a killed engine (kill -9 of
    the wrapper) left its engine core and workers running as orphans, and the restarted engine's
    server hung in its start-up beside them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """The side group: the trainer is rank 0 and hosts the store; this worker is rank_offset + its
    rank among the engine's workers."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 600.0
    keep_base: bool = False  # weights.delta: keep every bucket's bytes, to patch with the next deltas


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One flat bucket: the fields of vLLM's NCCLWeightTransferUpdateInfo (names, dtype names,
    shapes). A delta also gives how many elements changed: their flat indices (`index_dtype`) and
    then their bits travel instead of the bucket."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    num_updates: int | None = None
    index_dtype: str = "int32"


class GlooWeightTransferEngine(WeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: SideGroup | None = None
        self._tied: list[list[tuple[torch.nn.Module, str]]] | None = None  # found at the first update
        self.keep_base = False
        self.bases: dict[tuple[str, ...], tuple[BucketPlan, torch.Tensor]] = {}  # keep_base: bucket -> its bytes
        self._received: set[tuple[str, ...]] = set()  # the buckets this update has sent

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:  # a new trainer group (an engine restarted elsewhere): leave the old one
            self.group.close()
        # A new group's first push is whole (the trainer's copies of what each engine holds go with its group).
        self.keep_base, self.bases = init_info.keep_base, {}
        pc = self.parallel_config
        worker_rank = pc.data_parallel_index * pc.world_size + pc.rank
        self.group = SideGroup(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker_rank,
            init_info.world_size,
            init_info.group_name,
            "gloo",
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._tied is None:  # once: an update that failed leaves the layers on meta, untied
            self._tied = shared_parameters(self.model)
        self._received = set()
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        for key, (plan, flat) in self.bases.items():
            if key not in self._received:  # unchanged since the last version: loaded again from its copy
                self.model.load_weights(unpack(flat, plan))
        finalize_layerwise_reload(self.model, self.model_config)
        retie(self._tied or [])

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has no CPU accelerator
        # to wait for; gloo's broadcast has returned with the bytes already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("relax_gloo weight transfer: /init_weight_transfer_engine first")
        plan = BucketPlan(update_info.names, update_info.dtype_names, update_info.shapes)
        key = tuple(plan.names)
        if update_info.num_updates is None:
            flat = torch.empty(plan.nbytes, dtype=torch.uint8)
            self.group.broadcast(flat)
        else:
            flat = self._patched(key, plan, update_info.num_updates, getattr(torch, update_info.index_dtype))
        if self.keep_base:
            self.bases[key] = (plan, flat)
            self._received.add(key)
        self.model.load_weights(unpack(flat, plan))

    def _patched(self, key: tuple[str, ...], plan: BucketPlan, changed: int, index_dtype: torch.dtype) -> torch.Tensor:
        """The bucket's kept bytes with a delta's bits written in (both broadcasts are taken first,
        so that a refusal leaves the group's collectives matched)."""
        assert self.group is not None
        index = torch.empty(changed, dtype=index_dtype)
        values = torch.empty(changed * bits_dtype(plan).itemsize, dtype=torch.uint8)  # gloo has no int16
        self.group.broadcast(index)
        self.group.broadcast(values)
        held = self.bases.get(key)
        if held is None or held[0] != plan:
            raise RuntimeError(
                f"relax_gloo weight transfer: a delta of bucket {key[0]}.. that this engine holds no copy of"
            )
        bits(held[1], plan)[index.long()] = values.view(bits_dtype(plan))
        return held[1]

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def shared_parameters(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Every (module, name) pair that holds one Parameter together with others, the first the
    owner in registration order: tied embeddings (a ParallelLMHead whose weight IS embed_tokens')."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    return [pairs for pairs in holders.values() if len(pairs) > 1]


def retie(groups: list[list[tuple[torch.nn.Module, str]]]) -> None:
    """vLLM's layerwise reload gives each reloaded layer new tensors, which unties what was tied:
    the LM head kept the embedding it was built with, so a pushed embedding changed the input
    side only (the log-probabilities showed it; vLLM's weight checker lists a shared tensor once).
    Point every holder at its owner's new Parameter again, and let the holder's quant method
    process it again (on CPU that rebuilds the prepacked GEMM handle from the new weight)."""
    for (owner, owner_name), *others in groups:
        param = getattr(owner, owner_name)
        for module, name in others:
            setattr(module, name, param)
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
