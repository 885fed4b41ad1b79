"""Token log-probabilities and entropies from a micro-batch's logits on one GPU, forward and
backward: relax_hpc's fused passes (relax_hpc.trainer.vocab_parallel, torch.compile'd) against
the plain form (log_softmax over the fp32 logits, gather, entropy from the probabilities, as
transformers-based trainers write it), in the same run.

    python tools/bench/logprobs.py [--tokens 8192] [--vocab 151936] [--repeat 10]

Loss = sum of log-probabilities + 0.01 x sum of entropies, so both gradients flow. Reports the
median milliseconds of forward + backward, the memory held above the logits and their gradient
(peak), and the largest difference to a float64 reference. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from relax_hpc.trainer.vocab_parallel import logprobs_and_entropy


def plain(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def measure(fn, logits: torch.Tensor, targets: torch.Tensor, repeat: int) -> dict:
    def step():
        logits.grad = None
        lp, ent = fn(logits, targets)
        (lp.sum() + 0.01 * ent.sum()).backward()
        return lp, ent

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start  # includes torch.compile's compilation
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        lp, ent = step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    assert logits.grad is not None
    return {
        "ms": round(statistics.median(times), 2),
        "first_call_s": round(first_s, 1),
        "peak_extra_gib": round(extra, 2),
        "lp": lp.detach(),
        "ent": ent.detach(),
        "grad": logits.grad.detach().clone(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    results = {
        "fused": measure(logprobs_and_entropy, logits, targets, args.repeat),
        "plain": measure(plain, logits, targets, args.repeat),
    }
    ref_in = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = plain(ref_in, targets)
    (ref_lp.sum() + 0.01 * ref_ent.sum()).backward()
    out = {
        "benchmark": "logprobs",
        "tokens": args.tokens,
        "vocab": args.vocab,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    for name, r in results.items():
        out[name] = {k: r[k] for k in ("ms", "first_call_s", "peak_extra_gib")} | {
            "max_err_logprob": f"{(r['lp'].double() - ref_lp).abs().max().item():.1e}",
            "max_err_entropy": f"{(r['ent'].double() - ref_ent).abs().max().item():.1e}",
            "max_err_grad": f"{(r['grad'].double() - ref_in.grad).abs().max().item():.1e}",
        }
    out["speedup"] = round(results["plain"]["ms"] / results["fused"]["ms"], 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
