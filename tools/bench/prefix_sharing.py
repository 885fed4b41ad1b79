"""Shared-prefix packing against padded rows: one rank's forward and backward of the trainer's
log-probabilities (relax_hpc.trainer.batching.token_logprobs_and_entropy), the same batch both
ways in the same run, and the largest difference between the two's log-probabilities.

    python tools/bench/prefix_sharing.py [--threads 1] [--repeat 3]
    python tools/bench/prefix_sharing.py --device cuda   # a Qwen3-0.6B shape in bf16, one GPU

CPU shapes: the embedded default's (one rank's 32 groups of 16, 6-token prompts, 4-token answers,
the tiny model asset); a long-prompt shape (4 groups of 16, 128-token prompts, 16-token answers,
a random 4-layer Qwen3 of width 512); and a long-answer shape (one group of 16, 16-token prompts,
256-token answers, the same model), where the cost estimate keeps rows padded. CUDA shapes: a
random Qwen3-0.6B-shaped model (tools/bench/train_throughput.py's) in bf16, 4 groups of 16 with
256-token prompts and 64-token answers, and one group of 16 with 64-token prompts and 512-token
answers (kept padded: its packed sequence would pass 8,192 tokens). Prints one JSON object: per
shape, seconds padded and shared (medians), their ratio, whether packing applied, and the largest
log-probability difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relax_hpc.trainer.batching import TrainBatch, _packed, pad_samples, token_logprobs_and_entropy

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-qwen3-addition"


def groups_batch(groups: int, size: int, prompt: int, answer: int, vocab: int) -> TrainBatch:
    rows, masks, groups_of = [], [], []
    for g in range(groups):
        shared = torch.randint(2, vocab, (prompt,)).tolist()
        for _ in range(size):
            rows.append(shared + torch.randint(2, vocab, (answer,)).tolist())
            masks.append([0] * prompt + [1] * answer)
            groups_of.append(g)
    zeros = [[0.0] * len(r) for r in rows]
    return pad_samples(rows, masks, zeros, [0.0] * len(rows), groups_of, pad_token_id=0)


def timed(model: torch.nn.Module, batch: TrainBatch, share: bool, repeat: int) -> tuple[float, torch.Tensor]:
    times, logprobs = [], torch.empty(0)
    sync = torch.cuda.synchronize if batch.input_ids.is_cuda else (lambda: None)
    for k in range(repeat + 1):  # the first is a warm-up
        model.zero_grad()
        sync()
        start = time.perf_counter()
        logprobs, entropy = token_logprobs_and_entropy(model, batch, share_prefix=share)
        ((logprobs + 0.01 * entropy) * batch.loss_mask).sum().backward()
        sync()
        if k:
            times.append(time.perf_counter() - start)
    return statistics.median(times), logprobs.detach() * batch.loss_mask


def random_model(shape: dict, dtype: torch.dtype) -> torch.nn.Module:
    """A random Qwen3 of the tiny asset's config with `shape`'s sizes."""
    config = AutoConfig.from_pretrained(TINY)
    config.update({"max_position_embeddings": 2048, **shape})
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")


def shapes(device: str) -> dict[str, tuple[torch.nn.Module, TrainBatch]]:
    if device == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        from train_throughput import COMMON, SHAPES  # a sibling script (tools/bench is no package)

        qwen = random_model({**SHAPES["0.6b"], **COMMON}, torch.bfloat16).cuda()
        vocab = COMMON["vocab_size"]
        return {
            "0.6b bf16, 4 x 16, prompt 256, answer 64": (qwen, groups_batch(4, 16, 256, 64, vocab)),
            "0.6b bf16, 1 x 16, prompt 64, answer 512": (qwen, groups_batch(1, 16, 64, 512, vocab)),
        }
    tiny = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    wide = random_model({"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 4, "head_dim": 64,
                         "num_attention_heads": 8, "num_key_value_heads": 4}, torch.float32)  # fmt: skip
    return {
        "default (32 x 16, prompt 6, answer 4, tiny)": (tiny, groups_batch(32, 16, 6, 4, 46)),
        "long prompt (4 x 16, prompt 128, answer 16, width 512)": (wide, groups_batch(4, 16, 128, 16, 46)),
        "long answer (1 x 16, prompt 16, answer 256, width 512)": (wide, groups_batch(1, 16, 16, 256, 46)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"device": args.device, "threads": args.threads, "repeat": args.repeat, "shapes": {}}
    for name, (model, cpu_batch) in shapes(args.device).items():
        batch = cpu_batch.to(torch.device(args.device))
        padded_s, padded_lp = timed(model, batch, False, args.repeat)
        shared_s, shared_lp = timed(model, batch, True, args.repeat)
        out["shapes"][name] = {
            "packed": _packed(model, batch) is not None,
            "padded_s": round(padded_s, 4),
            "shared_s": round(shared_s, 4),
            "shared_over_padded": round(shared_s / padded_s, 3),
            "max_logprob_diff": float((shared_lp - padded_lp).abs().max()),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
