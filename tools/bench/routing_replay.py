"""MoE routing replay: the train/rollout log-probability mismatch with and without replaying the
engine's routing, and what replay costs in the training forward, measured in the same run.

    python tools/bench/routing_replay.py [--trainer torch|megatron] [--experts 32] [--top-k 4] [--layers 4]
        [--samples 64]

A random Qwen3-MoE (the character tokenizer) samples in bfloat16 in the built-in torch engine,
which answers each token's experts as SGLang does; the samples go through a spool file as the
driver writes them; the trainer's float32 forward scores them once letting its routers decide and
once replaying the engine's choices. Random routers sit near ties, where bfloat16 and float32 pick
different experts: the worst case replay exists for. `--trainer torch` (CPU): the torch backend's
HF forward; `--trainer megatron` (one CUDA GPU, engine and trainer on it): the megatron backend's
packed forward of its old log-probabilities. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.envs.base import Sampled, Trajectory
from relax_hpc.exchange.spool import read_batch, write_batch
from relax_hpc.models.hf import load_policy
from relax_hpc.models.routing import recording
from relax_hpc.models.tiny import build_char_tokenizer
from relax_hpc.protocol import requests as P
from relax_hpc.rollout.plan import Group, to_sample_batch
from relax_hpc.trainer.batching import TrainBatch, share_of, token_logprobs_and_entropy


def build(folder: Path, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a keyword its signature leaves to **kwargs
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_experts=args.experts, num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, norm_topk_prob=True,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def sample(folder: Path, args: argparse.Namespace, spool_file: Path, device: str) -> TrainBatch:
    """Samples from the bf16 engine, through a spool file, as the trainer's batch."""
    engine = TorchEngine(str(folder), "bfloat16", device)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 30, size=8).tolist() for _ in range(args.samples)]
    sampling = [
        {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "sampling_seed": k}
        for k in range(len(prompts))
    ]
    out = engine.generate(
        P.GenerateReqInput(input_ids=prompts, sampling_params=sampling, return_logprob=True, return_routed_experts=True)
    )
    assert isinstance(out, list)
    trajectories = []
    for prompt, o in zip(prompts, out, strict=True):
        routed = np.frombuffer(base64.b64decode(o["meta_info"]["routed_experts"]), dtype=np.int32)
        routed = routed.reshape(-1, args.layers * args.top_k)
        logprobs = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
        sampled = Sampled(o["output_ids"], logprobs, [0] * len(logprobs), "length", "", None, routed)
        trajectories.append(Trajectory(prompt).add_sampled(sampled))
    rewards = [0.0] * len(trajectories)
    write_batch(spool_file, to_sample_batch(0, [Group(1, 0, trajectories, rewards)]), writer="bench")
    batch = read_batch(spool_file)
    train, _ = share_of(batch, list(range(args.samples)), 0, 1, 0)
    return train


@dataclass
class Scores:
    free: torch.Tensor  # [n, T] log-probabilities, the routers deciding
    free_s: float  # median seconds of a no-grad forward
    replayed: torch.Tensor  # [n, T], the engine's experts
    replay_s: float
    own: torch.Tensor  # [n, T, layers, top_k]: the experts the trainer's routers chose themselves


def timed(score: Callable[[], torch.Tensor], repeat: int) -> tuple[torch.Tensor, float]:
    """The scores, and the median seconds of a call."""
    times = []
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            out = score()
            if out.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def torch_trainer(folder: Path, batch: TrainBatch, args: argparse.Namespace) -> Scores:
    model = load_policy(str(folder), torch.float32).eval()
    free_batch = replace(batch, routed=None)
    with recording(model) as calls:
        free, free_s = timed(lambda: token_logprobs_and_entropy(model, free_batch)[0], args.repeat)
    replayed, replay_s = timed(lambda: token_logprobs_and_entropy(model, batch)[0], args.repeat)
    n, width = batch.input_ids.shape
    own = torch.stack([c.reshape(n, width, args.top_k) for c in calls[0]], dim=2).long()
    return Scores(free, free_s, replayed, replay_s, own)


def megatron_trainer(folder: Path, batch: TrainBatch, args: argparse.Namespace) -> Scores:
    """The megatron backend (one rank, float32) scoring the batch as its old log-probabilities."""
    import torch.distributed as dist

    from relax_hpc.config.schema import JobConfig
    from relax_hpc.models import megatron_routing
    from relax_hpc.trainer.build import build_backend
    from relax_hpc.trainer.megatron_backend import MegatronBackend

    device = torch.device("cuda", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=device)  # fmt: skip
    job = JobConfig.model_validate(
        {
            "model": {"path": str(folder), "dtype": "float32"},
            "trainer": {"backend": "megatron", "num_ranks": 1},
            "algo": {"off_policy": {"routing_replay": True}},
        }
    )
    backend = build_backend(job, device)
    assert isinstance(backend, MegatronBackend)
    batch = batch.to(device)
    free_batch = replace(batch, routed=None)

    def score(b: TrainBatch) -> torch.Tensor:
        out = backend._frozen_logprobs(backend.model, b)
        assert out is not None, "one pipeline stage: the last"
        return out

    with megatron_routing.recording(backend.model) as calls:
        free, free_s = timed(lambda: score(free_batch), args.repeat)
    replayed, replay_s = timed(lambda: score(batch), args.repeat)
    own = torch.full((*batch.input_ids.shape, args.layers * args.top_k), -1, dtype=torch.long, device=device)
    for mb, chosen in zip(backend._microbatches(batch), calls, strict=False):  # the first forward's
        own[mb.rows] = torch.stack([mb.unpack(column) for column in chosen.T], dim=-1)
    dist.destroy_process_group()
    cpu = torch.device("cpu")
    own = own.to(cpu).reshape(*own.shape[:2], args.layers, args.top_k)
    return Scores(free.to(cpu), free_s, replayed.to(cpu), replay_s, own)


def versions(trainer: str) -> dict[str, str]:
    found = {"torch": str(torch.__version__)}
    if trainer == "megatron":
        from megatron.core import package_info

        found["megatron-core"] = package_info.__version__
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["torch", "megatron"], default="torch")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "moe"
        build(folder, args)
        device = "cuda" if args.trainer == "megatron" else "cpu"
        batch = sample(folder, args, Path(tmp) / "b000000000.h5", device)
        trainer = megatron_trainer if args.trainer == "megatron" else torch_trainer
        scores = trainer(folder, batch, args)
    free, replayed = scores.free, scores.replayed
    mask = batch.loss_mask.bool()
    rollout = batch.rollout_logprobs[mask]
    assert batch.routed is not None
    engine_choice = batch.routed.reshape(*batch.routed.shape[:2], args.layers, args.top_k)
    recorded = (engine_choice >= 0).all(-1)
    flipped = (engine_choice.sort(-1).values != scores.own.sort(-1).values).any(-1) & recorded
    print(
        json.dumps(
            {
                "benchmark": "routing_replay",
                "trainer": args.trainer,
                "versions": versions(args.trainer),
                "experts": args.experts,
                "top_k": args.top_k,
                "moe_layers": args.layers,
                "tokens": int(mask.sum()),
                "routing_differs_share": round(float(flipped.sum() / recorded.sum()), 4),
                "mismatch_abs_mean": {
                    "without_replay": float((free[mask] - rollout).abs().mean()),
                    "with_replay": float((replayed[mask] - rollout).abs().mean()),
                },
                "mismatch_abs_max": {
                    "without_replay": float((free[mask] - rollout).abs().max()),
                    "with_replay": float((replayed[mask] - rollout).abs().max()),
                },
                "forward_s": {"without_replay": scores.free_s, "with_replay": scores.replay_s},
                "overhead": round(scores.replay_s / scores.free_s - 1, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
