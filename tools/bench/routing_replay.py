"""MoE routing replay: the train/rollout log-probability mismatch with and without replaying the
engine's routing, and what replay costs in the training forward, measured in the same run.

    python tools/bench/routing_replay.py [--experts 32] [--top-k 4] [--layers 4] [--samples 64]

A random Qwen3-MoE (the character tokenizer) samples in bfloat16 in the built-in torch engine,
which answers each token's experts as SGLang does; the samples go through a spool file as the
driver writes them; the trainer's float32 forward scores them once letting its routers decide and
once replaying the engine's choices. Random routers sit near ties, where bfloat16 and float32 pick
different experts: the worst case replay exists for. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from relax_hpc.data.plan import Group, to_sample_batch
from relax_hpc.engines.torch_engine import TorchEngine
from relax_hpc.envs.base import Sampled, Trajectory
from relax_hpc.exchange.spool import read_batch, write_batch
from relax_hpc.models.hf import load_policy
from relax_hpc.models.routing import recording
from relax_hpc.models.tiny import build_char_tokenizer
from relax_hpc.protocol import requests as P
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


def sample(folder: Path, args: argparse.Namespace, spool_file: Path) -> TrainBatch:
    """Samples from the bf16 engine, through a spool file, as the trainer's batch."""
    engine = TorchEngine(str(folder), "bfloat16")
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


def forward(model: torch.nn.Module, batch: TrainBatch, repeat: int) -> tuple[torch.Tensor, float]:
    """Log-probabilities, and the median seconds of a no-grad forward."""
    times = []
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            logprobs, _ = token_logprobs_and_entropy(model, batch)
            times.append(time.perf_counter() - start)
    return logprobs, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        replayed_batch = sample(folder, args, Path(tmp) / "b000000000.h5")
        model = load_policy(str(folder), torch.float32).eval()
        free_batch = replace(replayed_batch, routed=None)
        with recording(model) as calls:
            free, free_s = forward(model, free_batch, args.repeat)
        replayed, replay_s = forward(model, replayed_batch, args.repeat)
    mask = replayed_batch.loss_mask.bool()
    rollout = replayed_batch.rollout_logprobs[mask]
    assert replayed_batch.routed is not None
    engine_choice = replayed_batch.routed.reshape(*replayed_batch.routed.shape[:2], args.layers, args.top_k)
    own = torch.stack([c.reshape(*engine_choice.shape[:2], args.top_k) for c in calls[0]], dim=2).long()
    recorded = (engine_choice >= 0).all(-1)
    flipped = (engine_choice.sort(-1).values != own.sort(-1).values).any(-1) & recorded
    print(
        json.dumps(
            {
                "benchmark": "routing_replay",
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
                "forward_s": {"without_replay": free_s, "with_replay": replay_s},
                "overhead": round(replay_s / free_s - 1, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
