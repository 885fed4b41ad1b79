"""Weight pushes at scale, on paper: the sharded plan of real MoE checkpoints (the bytes each
trainer rank sends, from relax_hpc.weights.sharded.balance_shares on the checkpoint's own tensor
list) and each channel's push time on 8 x 400 Gb/s links per node, from the per-byte and
per-request costs measured on the H200s (BENCHMARKS.md, "Weight sync: trainer GPU to an engine on
the other GPU"). Nothing here moves a byte: the plans are exact, the times arithmetic.

    python tools/bench/push_at_scale.py [--ranks 8 16 64] [--bucket-mb 512]

Per model (Qwen3-30B-A3B and Qwen3-235B-A22B from their configs, checkpoint names and shapes as
SGLang loads them; DeepSeek-V3 by its parameter count only, for the times): the busiest rank's
share of the bytes times N (1.0: exactly 1/N) with tensors spread (0.19.0) and with whole buckets
spread (0.18.0); and the push time of the broadcast, of the sharded channel sending in one order
from one GPU's link at a time, and of the sharded channel with weights.relay (every broadcast
through every trainer GPU, leaving over the node's 8 links), each over the line-rate bound.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import Qwen3MoeConfig

from relax_hpc.models.hf_mapping import hf_specs
from relax_hpc.weights.buckets import assign, plan_buckets
from relax_hpc.weights.sharded import balance_shares, shares

LINK_BYTES_S = 50e9  # one 400 Gb/s link
LINKS = 8  # per node
FIXED_S = 1.98e-3  # a push's HTTP round trips (pause, begin, end, continue), measured on the H200s
PER_BUCKET_S = 0.29e-3  # per bucket beyond the raw broadcast, measured on the H200s (512 MiB buckets)
PUSH_OVER_RAW = 0.706  # the whole measured raw/push ratio: the pessimistic per-byte reading

# The released checkpoints' config.json values (head_dim is a kwarg the config keeps).
CONFIGS = {
    "Qwen3-30B-A3B": Qwen3MoeConfig.from_dict({
        "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
    }),
    "Qwen3-235B-A22B": Qwen3MoeConfig.from_dict({
        "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
        "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
    }),
}  # fmt: skip
DEEPSEEK_V3_PARAMS = 671e9


def plan_figures(config: Qwen3MoeConfig, ranks: list[int], bucket_bytes: int) -> dict:
    """The busiest rank's share times N, tensors spread against whole buckets spread."""
    specs = hf_specs(config, torch.bfloat16)
    total = sum(s.numel() * d.itemsize for _, s, d in specs)
    whole = plan_buckets(specs, bucket_bytes)
    out: dict = {"params_b": round(total / 2 / 1e9, 1), "tensors": len(specs), "buckets": len(whole)}
    for n in ranks:
        buckets, owner = balance_shares(specs, bucket_bytes, lambda name: 0, [0] * n)
        old_owner = assign(whole, [range(n)] * len(whole))
        out[f"ranks_{n}"] = {
            "busiest_times_n": round(max(shares(buckets, owner, n)) * n / total, 4),
            "busiest_times_n_whole_buckets": round(max(shares(whole, old_owner, n)) * n / total, 4),
        }
    return out


def times(params: float, bucket_bytes: int) -> dict:
    """Each channel's push time over the line-rate bound (8 links carrying distinct bytes)."""
    nbytes = 2 * params
    buckets = nbytes / bucket_bytes
    bound = nbytes / (LINKS * LINK_BYTES_S)
    one_link = nbytes / LINK_BYTES_S + buckets * PER_BUCKET_S + FIXED_S  # the sender's link, one bucket at a time
    rails = bound + buckets * PER_BUCKET_S + FIXED_S  # every broadcast over the 8 links, one at a time
    return {
        "line_rate_bound_s": round(bound, 3),
        "broadcast_and_sharded_s": round(one_link, 3),
        "broadcast_and_sharded_over_bound": round(one_link / bound, 2),
        "sharded_relay_s": round(rails, 3),
        "sharded_relay_over_bound": round(rails / bound, 2),
        "sharded_relay_pessimistic_over_bound": round((bound / PUSH_OVER_RAW + FIXED_S) / bound, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    args = parser.parse_args()
    bucket_bytes = int(args.bucket_mb * 2**20)
    out: dict = {"benchmark": "push_at_scale", "bucket_mb": args.bucket_mb, "links": LINKS, "link_gb_s": 50}
    for name, config in CONFIGS.items():
        figures = plan_figures(config, args.ranks, bucket_bytes)
        out[name] = {**figures, **times(figures["params_b"] * 1e9, bucket_bytes)}
    out["DeepSeek-V3"] = {"params_b": DEEPSEEK_V3_PARAMS / 1e9, **times(DEEPSEEK_V3_PARAMS, bucket_bytes)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
