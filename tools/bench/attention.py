"""Packed causal attention on one GPU: the megatron backend's core attention (SDPAttention) over a
row of packed documents, forward and backward, one variable-length flash call for the row
(torch.nn.attention.varlen, `flash`) against the per-document loop of scaled_dot_product_attention
calls (flash kernel, key/value heads repeated) and the same loop on cuDNN's kernel, in the same
run (RoPE excluded).

    python tools/bench/attention.py [--docs 2x4096,16x1024,64x256] [--heads 16] [--groups 8] [--repeat 20]

Qwen3-0.6B/1.7B's attention shape by default (16 query heads, 8 key/value heads, head_dim 128,
bf16). FLOPs count causal attention as done (half the square): 2 x len^2 x heads x head_dim per
document forward, 2.5 x that backward. Prints one JSON object per document layout.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from relax_hpc.models.megatron_layers import SDPAttention


def time_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="2x4096,16x1024,64x256")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    h, g, d = args.heads, args.groups, args.head_dim
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h * d,
        num_attention_heads=h,
        num_query_groups=g,
        kv_channels=d,
        attention_dropout=0.0,
        bf16=True,
    )
    attention = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    for layout in args.docs.split(","):
        count, length = (int(x) for x in layout.split("x"))
        total = count * length
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device="cuda")
        q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(total, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        grad = torch.randn(total, h * d, device="cuda", dtype=torch.bfloat16)

        def run(fn, q=q, k=k, v=v, grad=grad):
            def step():
                fn(q, k, v).backward(grad)

            return step

        def per_document_cudnn(q, k, v, cu=cu):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return attention._per_document(q, k, v, cu)

        variants: dict[str, Callable[..., torch.Tensor]] = {
            "per_document_sdpa": functools.partial(attention._per_document, cu=cu),
            "flash": functools.partial(attention._varlen, cu=cu, max_len=length),
            "per_document_cudnn": per_document_cudnn,
        }
        reference = variants["per_document_sdpa"](q, k, v).float()
        flops = 3.5 * count * 2 * length**2 * h * d
        result = {
            "benchmark": "attention",
            "docs": layout,
            "heads": h,
            "groups": g,
            "head_dim": d,
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
        }
        for name, fn in variants.items():
            try:
                err = ((fn(q, k, v).float() - reference).norm() / reference.norm()).item()
                ms = time_ms(run(fn), args.repeat)
                result[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), "rel_err": f"{err:.1e}"}
            except RuntimeError as e:  # a kernel that does not take this shape on this build
                result[name] = {"error": str(e)[:300]}
        base = result["per_document_sdpa"]["ms"]
        for name in variants:
            if "ms" in result[name]:
                result[name]["speedup"] = round(base / result[name]["ms"], 2)
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
