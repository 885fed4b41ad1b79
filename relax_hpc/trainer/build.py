"""What the config picks once for the trainer: its backend (imported lazily: megatron-core is an
optional dependency), its weight channel and the check of what the engines hold after a push."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relax_hpc.config.engines import engine_kind
from relax_hpc.config.schema import DeltaOption, FileWeights, JobConfig, LoraConfig, ShardedWeights, WeightsConfig
from relax_hpc.models.lora import write_adapter_folder
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.vllm import PauseMode, client_class
from relax_hpc.trainer.backend import Backend, BackendConfig
from relax_hpc.weights.adapters import AdapterChannel, AdapterPublisher
from relax_hpc.weights.channel import WeightChannel
from relax_hpc.weights.colocated import ColocatedChannel, ColocatedSender
from relax_hpc.weights.files import ClientSettings, FileChannel
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import BroadcastChannel, WeightSender
from relax_hpc.weights.sharded import ShardedChannel, ShardedColocatedChannel
from relax_hpc.weights.verify import WeightCheck
from relax_hpc.weights.vllm_channel import VllmChannel, VllmSender

Events = Callable[[dict[str, Any]], None]  # a record for RUN_DIR/metrics/events.jsonl


def build_backend(job: JobConfig, device: torch.device) -> Backend:
    if job.trainer.backend == "megatron":
        if device.type != "cuda":  # megatron's kernels and optimizer are GPU code (tests patch them onto the CPU)
            raise RuntimeError("trainer.backend=megatron needs CUDA GPUs; use trainer.backend=torch on CPU")
        from relax_hpc.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(BackendConfig.of(job), device)
    from relax_hpc.trainer.torch_backend import TorchBackend

    return TorchBackend(BackendConfig.of(job), device)


def build_channel(job: JobConfig, paths: RunPaths, backend: Backend, device: torch.device) -> WeightChannel:
    """The weight channel of this trainer rank: adapter sync (trainer.lora.sync adapter), files
    (weights.channel file, on any engine kind), vLLM's weight-transfer API (rollout.engine vllm),
    colocated (launch.colocate: every rank serves the engines on its device), every rank's share
    (weights.channel sharded), or rank 0's broadcast."""
    rank, world = dist.get_rank(), dist.get_world_size()
    token, timeout_s = paths.read_token(), job.weights.timeout_s
    if job.lora_adapters:  # its folders hold PEFT's names: no layout, no buckets
        assert job.trainer.lora is not None, "adapter sync is a LoRA run's"
        speaks = client_class(job.rollout.engine)  # the engines' adapter routes
        publisher = _publisher(job.trainer.lora, job.model.path, paths, timeout_s, speaks) if rank == 0 else None
        return AdapterChannel(publisher)
    layout = engine_layout(job.rollout.engine, backend)
    weights = job.weights
    bucket_bytes = int(weights.bucket_mb * 2**20)
    delta = isinstance(weights, DeltaOption) and weights.delta
    if isinstance(weights, FileWeights):
        # Every rank of the torch backend holds each full tensor in turn and writes its share; the
        # megatron backend gives rank 0 alone the full tensors (Backend.full_parameters): it writes all.
        writers = world if job.trainer.backend == "torch" else 1
        client = ClientSettings(token, timeout_s, job.rollout.partial, client_class(job.rollout.engine))
        registry = paths.engines if rank == 0 else None
        return FileChannel(paths.weight_files, layout, bucket_bytes, writers, registry, client, delta)
    if job.rollout.kind.api == "vllm":  # partial rollout: in-flight requests return, the driver continues them
        pause: PauseMode = "abort" if job.rollout.partial else "keep"
        backend_ = weights.backend
        if rank != 0:
            return VllmChannel(None, layout, bucket_bytes)
        colocated = job.launch.colocate  # the engines sleep through each step
        return VllmChannel(
            VllmSender(paths.engines, token, timeout_s, bucket_bytes, pause, backend_, device, colocated, delta),
            layout, bucket_bytes,
        )  # fmt: skip
    if job.launch.colocate:
        by_reference = ColocatedSender(paths.engines, token, timeout_s, rank, world)
        if isinstance(weights, ShardedWeights):  # every rank hands its share to every engine of the node
            return ShardedColocatedChannel(by_reference, layout, bucket_bytes, backend.weight_stages())
        return ColocatedChannel(by_reference, layout, bucket_bytes)
    auto = "nccl" if device.type == "cuda" else "gloo"
    group_backend = weights.backend if weights.backend != "auto" else auto
    sender = WeightSender(paths.engines, token, group_backend, timeout_s, job.rollout.partial)
    if isinstance(weights, ShardedWeights):  # every rank sends its share over a group of its own
        # SGLang's weight updates take turns (one connection, in order), and so do relayed broadcasts.
        concurrent = job.rollout.kind.concurrent_updates and not weights.relay
        stages, relay, senders = backend.weight_stages(), weights.relay, weights.senders
        return ShardedChannel(sender, layout, bucket_bytes, stages, job.engine_catch_up, concurrent, relay, senders)
    return BroadcastChannel(sender if rank == 0 else None, layout, bucket_bytes, job.engine_catch_up)


def engine_layout(engine: str, backend: Backend) -> EngineLayout:
    """What engines of kind `engine` (rollout.engine) call the pushed tensors: SGLang and vLLM
    load the HF checkpoint's layout; the built-in engine the trainer's own."""
    convert = backend.checkpoint_layout() if engine_kind(engine).hf_layout else None
    return EngineLayout(backend.parameter_specs(), convert)


def build_check(
    weights: WeightsConfig, engine: str, adapters: bool, paths: RunPaths, backend: Backend, device: torch.device,
    events: Events, model_path: str,
) -> WeightCheck | None:  # fmt: skip
    """Rank 0's check of what the engines of kind `engine` hold after a push (weights.verify_every;
    None: off, or another rank). Adapter sync (`adapters`) pushes PEFT's names: no layout, and no
    probe of the model (`model_path`: its HF config, for the layers an engine cannot digest)."""
    if weights.verify_every == 0 or dist.get_rank() != 0:
        return None
    layout = None if adapters else engine_layout(engine, backend)
    return WeightCheck(
        engine, weights.verify_every, paths.engines, paths.weights_quarantine, events, paths.read_token(),
        weights.timeout_s, layout, device, None if adapters else model_path,
    )  # fmt: skip


def _publisher(
    lora: LoraConfig, base: str, paths: RunPaths, timeout_s: float, client: type[EngineClient]
) -> AdapterPublisher:
    """Rank 0's adapter publisher: each version goes out as a PEFT folder the engines load."""
    write = lambda out, adapter: write_adapter_folder(out, lora, base, adapter)  # noqa: E731
    return AdapterPublisher(paths.engines, paths.lora_adapters, write, paths.read_token(), timeout_s, client)
