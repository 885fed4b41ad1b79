"""Engine side of weight sync on vLLM without GPUs: a gloo transfer engine in vLLM's own API.

vLLM 0.32 receives weights through a pluggable `WeightTransferEngine`
(vllm/distributed/weight_transfer/base.py), driven by its RL routes /init_weight_transfer_engine,
/start_weight_update, /update_weights and /finish_weight_update; its built-in backends need CUDA.
This one joins the trainer's gloo side group (relax_hpc.weights.group.SideGroup: the same
rendezvous as every other relax_hpc engine) and receives each bucket as one flat broadcast
(relax_hpc.weights.buckets), then hands the tensors to the model's own `load_weights`, which fuses
q/k/v and gate/up the way vLLM loads a checkpoint.

It reaches vLLM through the `vllm.general_plugins` entry point (pyproject.toml): vLLM calls
`register` in every process it starts (API server, engine core, workers), and serving with
`--weight-transfer-config '{"backend": "relax_gloo"}'` makes the workers build this class.
This module runs only inside vLLM's environment (.venv-vllm); the trainer's half is
relax_hpc.weights.vllm_channel, which imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from relax_hpc.protocol.vllm import TRANSFER_BACKEND as BACKEND
from relax_hpc.weights.buckets import BucketPlan, unpack
from relax_hpc.weights.group import SideGroup


def register() -> None:
    """The vllm.general_plugins entry point. vLLM may call it more than once in a process."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


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


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One flat bucket: the fields of vLLM's NCCLWeightTransferUpdateInfo (names, dtype names, shapes)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: SideGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:  # a new trainer group (an engine restarted elsewhere): leave the old one
            self.group.close()
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

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which has no CPU accelerator
        # to wait for; gloo's broadcast has returned with the bytes already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("relax_gloo weight transfer: /init_weight_transfer_engine first")
        plan = BucketPlan(update_info.names, update_info.dtype_names, update_info.shapes)
        flat = torch.empty(plan.nbytes, dtype=torch.uint8)
        self.group.broadcast(flat)
        self.model.load_weights(unpack(flat, plan))

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
