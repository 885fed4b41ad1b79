"""torchrun worker for test_weight_sync: perturb the sharded model, push it through the weight
channel (relax_hpc.weights.channel) the path names, record what to expect.

argv: run dir, output file, version, and the path: "broadcast" (rank 0 broadcasts to every engine),
"colocated" (each rank releases its own engines' memory first, then hands them the weights by
reference), "adapter" (trainer.lora.sync adapter: rank 0 writes PEFT folders the engines load;
two versions, the first one's greedy answers recorded too) or "file" (weights.channel file, the
run's config says whether with weights.delta: four versions, each a sparse change of the one
before, and the second engine stopped (SIGSTOP) during the third, so that it misses it). With
trainer.lora in the run's config only the adapters are perturbed and sent, and what to expect is
the base with the adapters merged (relax_hpc.weights.lora)."""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.metrics.timing import PhaseTimer
from relax_hpc.models.lora import write_adapter_folder
from relax_hpc.models.tiny import addition_problems
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient, EngineUnavailable
from relax_hpc.protocol.registry import read_records
from relax_hpc.protocol.requests import GenerateReqInput
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.build import build_channel
from relax_hpc.trainer.torch_backend import TorchBackend
from relax_hpc.weights.adapters import AdapterPublisher
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.channel import AdapterChannel, BroadcastChannel, ColocatedChannel, WeightChannel
from relax_hpc.weights.colocated import ColocatedSender
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.lora import merge_all
from relax_hpc.weights.sender import WeightSender


def main() -> None:
    paths, out, version, path = RunPaths(Path(sys.argv[1])), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cfg = read_frozen(paths.config)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    backend = TorchBackend(BackendConfig.of(cfg), torch.device("cpu"))
    perturb(backend.model)
    buckets = plan_buckets(backend.parameter_specs(), int(cfg.weights.bucket_mb * 2**20))
    channel = make_channel(path, cfg, paths, backend, rank)
    timer, refused, previous = PhaseTimer(), None, None
    served = push_files(channel, paths, backend, version) if path == "file" else []
    engines = served[-1] if served else 0
    # Adapter and colocated: two versions of different weights; the engine holds the second
    # exactly, and (adapter) a request naming the first is answered with it after the second's load.
    for pushed in (version - 1, version) if path in ("adapter", "colocated") else () if path == "file" else (version,):
        if pushed == version and path in ("adapter", "colocated"):
            previous = dict(backend.full_parameters()) if path == "adapter" else None
            perturb(backend.model)
        channel.before_step(timer)  # colocated: the engines release their memory
        if isinstance(channel, ColocatedChannel):
            refused = all(refuses_generation(r.url, paths.read_token()) for r in channel.sender.engines())
        engines = channel.push(backend.full_parameters, pushed)
    full = dict(backend.full_parameters())
    if rank == 0:
        full, greedy = expected(cfg.model.path, cfg.trainer.lora is not None, full)
        out.write_text(
            json.dumps(
                {
                    "engines": engines,
                    "served": served,
                    "folders": sorted(p.name for p in paths.weight_files.iterdir()) if path == "file" else None,
                    "refused_while_released": refused,
                    "buckets": len(buckets),
                    "bytes": sum(b.nbytes for b in buckets),
                    "greedy": greedy,
                    "previous_greedy": None if previous is None else expected(cfg.model.path, True, previous)[1],
                    "weights": {name: t[:2].tolist() for name, t in full.items()},
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


def push_files(channel: WeightChannel, paths: RunPaths, backend: TorchBackend, version: int) -> list[int]:
    """Four versions through the file channel; the second engine misses the third (stopped).
    Returns how many engines each push served."""
    stopped = sorted(read_records(paths.engines), key=lambda r: r.engine_id)[1].pid if dist.get_rank() == 0 else None
    served = []
    for pushed in range(version - 3, version + 1):
        if pushed > version - 3:
            perturb(backend.model, share=0.02)
        if pushed == version - 1 and stopped is not None:
            os.kill(stopped, signal.SIGSTOP)
        served.append(channel.push(backend.full_parameters, pushed))
        if pushed == version - 1 and stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        dist.barrier()
    return served


def make_channel(path: str, cfg: JobConfig, paths: RunPaths, backend: TorchBackend, rank: int) -> WeightChannel:
    """The channel `path` names, built as relax_hpc.trainer.build builds it for a run."""
    token, bucket_bytes = paths.read_token(), int(cfg.weights.bucket_mb * 2**20)
    layout = EngineLayout(backend.parameter_specs(), None)
    if path == "file":  # as a run builds it: the run's config says whether with weights.delta
        return build_channel(cfg, paths, backend, torch.device("cpu"))
    if path == "adapter":
        lora = cfg.trainer.lora
        assert lora is not None, "the adapter path is a LoRA run's"
        write = lambda out, adapter: write_adapter_folder(out, lora, cfg.model.path, adapter)  # noqa: E731
        return AdapterChannel(
            AdapterPublisher(paths.engines, paths.lora_adapters, write, token, 30.0) if rank == 0 else None
        )
    if path == "colocated":
        return ColocatedChannel(
            ColocatedSender(paths.engines, token, 30.0, rank, dist.get_world_size()), layout, bucket_bytes
        )
    return BroadcastChannel(
        WeightSender(paths.engines, token, "gloo", 30.0) if rank == 0 else None, layout, bucket_bytes
    )


def expected(model_path: str, lora: bool, full: dict) -> tuple[dict, list[list[int]]]:
    """The engine's weights (LoRA: the base with the adapters merged) and their greedy answers."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reference = AutoModelForCausalLM.from_pretrained(model_path).eval()
    if lora:
        full = merge_all(reference.state_dict(), full)
    reference.load_state_dict(full, strict=False)
    prompts = [tokenizer(p)["input_ids"] for p, _ in addition_problems()]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    n = len(prompts)
    greedy = sample(reference, prompts, [spec] * n, [None] * n, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return full, [c.output_ids for c in greedy]


def perturb(model: torch.nn.Module, share: float = 1.0) -> None:
    """Change every trainable element, or about `share` of them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # LoRA: the adapters (B starts at zero), never the frozen base
                p.add_(0.3 * torch.randn_like(p) * (torch.rand_like(p) < share))


def refuses_generation(url: str, token: str) -> bool:
    """A released engine answers /generate with 503 (busy) rather than from emptied weights."""
    try:
        EngineClient(url, token, 10.0).generate(
            GenerateReqInput(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 1})
        )
    except EngineUnavailable as e:
        return "HTTP 503" in str(e)
    return False


if __name__ == "__main__":
    main()
