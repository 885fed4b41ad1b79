"""Host work of a megatron training step on one GPU: how long the GPU waits for the host.

    python tools/bench/train_host.py [--size 0.6b | --model DIR] [--samples 8192] [--prompt 256]
                                     [--completion 256] [--group 16] [--steps 2] [--out DIR]

One trainer rank (this process) takes `steps` training steps on a batch of `samples` random
samples of prompt + completion tokens, from the spool's flat layout (`SampleBatch`) through
`share_of` (padding) and the megatron backend's `train_step` (packing, log-probabilities,
advantages, the objective, the optimizer) with the default objective (GRPO, PPO clip, entropy
bonus); no generation. A first step on an eighth of the batch warms up (kernels compile, the
allocator grows). Then each step's wall time (share_of + train_step, the GPU synchronised) and one
more step under torch.profiler (CUDA kernels only, so that the profiler adds little to the host):
`host_fraction` = 1 - GPU busy / wall, the share of the step the GPU waited for the host (a
second JSON line, after the first with the timings alone). With
--out, the profiled step's kernel table (and with --trace its timeline, CPU and CUDA, for small
batches) goes there. `--size` makes a random Qwen3-shaped model (train_throughput.py's shapes);
`--model` takes a folder (the embedded task's tiny model: assets/tiny-qwen3-addition).
`--host-only` times share_of and packing alone on the CPU, no GPU needed.

At the 0.6B shape with the defaults (8,192 x 512 tokens: 256 micro-batches of 16,384) a step is
estimated at about a minute on an H200 (one micro-batch of 16,384 took 0.26 s, BENCHMARKS.md), so a
run takes several minutes: 160 s was not enough for one (2026-12-02).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from train_throughput import make_model  # tools/bench is the script's folder, first on sys.path

from relax_hpc.config.schema import JobConfig
from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.trainer.backend import Backend
from relax_hpc.trainer.batching import share_of
from relax_hpc.trainer.build import build_backend


def spool_batch(samples: int, prompt: int, completion: int, group: int, vocab: int) -> SampleBatch:
    rng = np.random.default_rng(0)
    return SampleBatch.from_samples(
        seq=0,
        sequences=rng.integers(1, vocab, (samples, prompt + completion)).tolist(),
        prompt_lens=[prompt] * samples,
        logprobs=(-rng.random((samples, completion))).tolist(),
        rewards=rng.random(samples).tolist(),
        group_ids=[i // group for i in range(samples)],
        policy_version=[0] * samples,
        prompt_index=list(range(samples)),
    )


def one_step(backend: Backend, batch: SampleBatch, step: int, pad: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    share, _ = share_of(batch, list(range(batch.num_samples)), 0, 1, pad)
    backend.train_step(share, step)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def profiled_step(backend: Backend, batch: SampleBatch, pad: int, out: Path | None, trace: bool) -> dict[str, Any]:
    """GPU busy time (kernels and copies, one stream) against the wall time of one step."""
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if trace else [])]
    with profile(activities=activities) as prof:
        wall = one_step(backend, batch, 99, pad)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in events) / 1e6
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        sort = "self_cpu_time_total" if trace else "self_device_time_total"
        (out / "kernels.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=50))
        if trace:
            prof.export_chrome_trace(str(out / "trace.json"))
    return {"profiled_wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4), "host_fraction": round(1 - busy / wall, 3)}


def host_profile(backend: Backend, batch: SampleBatch, pad: int, out: Path) -> None:
    """--cprofile: one step under cProfile, the host's Python by own and by cumulative time (a
    sync shows as the time of the call that waits, e.g. `item`)."""
    import cProfile
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    profiler.enable()
    one_step(backend, batch, 98, pad)
    profiler.disable()
    with (out / "host_profile.txt").open("w") as f:
        for key in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=f).sort_stats(key).print_stats(60)


def host_paths(args: argparse.Namespace) -> None:
    """--host-only: share_of, then plan + pack + unpack of its micro-batches, on the CPU (where the
    device's work is host work too), CPU seconds, median of 3. Runs against an older checkout's
    relax_hpc as well (one pack() per bin where it has no pack_all)."""
    from relax_hpc.trainer import packing

    batch = spool_batch(args.samples, args.prompt, args.completion, args.group, 151936)
    times = []
    for _ in range(3):
        start = time.process_time()
        share, _ = share_of(batch, list(range(batch.num_samples)), 0, 1, 0)
        padded = time.process_time()
        lengths = share.attention_mask.sum(1)
        bins = packing.plan(lengths.tolist(), 16384)
        if hasattr(packing, "pack_all"):
            mbs = packing.pack_all(share, bins, lengths.numpy(), 0)
        else:
            mbs = [packing.pack(share, rows, 0) for rows in bins]
        for mb in mbs:
            mb.unpack(torch.zeros(mb.num_tokens))
        times.append((padded - start, time.process_time() - padded))
    share_s, pack_s = (statistics.median(t[i] for t in times) for i in (0, 1))
    print(json.dumps({"benchmark": "host_paths", "samples": args.samples, "share_of_cpu_s": round(share_s, 3),
                      "pack_cpu_s": round(pack_s, 3)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.6b")
    parser.add_argument("--model", help="a model folder instead of a random --size model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--microbatch-tokens", type=int, default=16384, help="trainer.megatron.max_tokens_per_microbatch"
    )
    parser.add_argument("--out", type=Path, help="write the profiled step's kernel table (and trace) here")
    parser.add_argument("--trace", action="store_true", help="profile the host too and write a timeline")
    parser.add_argument("--cprofile", action="store_true", help="one more step under cProfile (needs --out)")
    parser.add_argument("--host-only", action="store_true", help="time share_of and packing alone, on the CPU")
    args = parser.parse_args()
    if args.host_only:
        return host_paths(args)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tmp
        if not args.model:
            make_model(args.size, Path(tmp))
        job = JobConfig.model_validate(
            {
                "model": {"path": model, "dtype": args.dtype},
                "rollout": {"max_staleness": 0, "max_new_tokens": args.completion, "group_size": args.group},
                "trainer": {
                    "backend": "megatron",
                    "num_ranks": 1,
                    "lr": 1e-6,
                    "megatron": {"max_tokens_per_microbatch": args.microbatch_tokens},
                },
            }
        )
        backend = build_backend(job, torch.device("cuda", 0))
    vocab, pad = backend.hf_config.vocab_size, backend.pad_token_id  # type: ignore[attr-defined]  # megatron's
    batch = spool_batch(args.samples, args.prompt, args.completion, args.group, vocab)
    warm = spool_batch(max(args.samples // 8, args.group), args.prompt, args.completion, args.group, vocab)
    first = one_step(backend, warm, 0, pad)
    walls = [one_step(backend, batch, 1 + s, pad) for s in range(args.steps)]
    result = {
        "benchmark": "train_host",
        "model": args.model or args.size,
        "samples": args.samples,
        "microbatch_tokens": args.microbatch_tokens,
        "tokens": args.samples * (args.prompt + args.completion),
        "first_step_s": round(first, 3),
        "step_s": round(statistics.median(walls), 4),
        "steps_s": [round(w, 4) for w in walls],
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    print(json.dumps(result), flush=True)  # the timings first: a run cut short by a time limit keeps them
    print(json.dumps(result | profiled_step(backend, batch, pad, args.out, args.trace)), flush=True)
    if args.cprofile and args.out is not None:
        host_profile(backend, batch, pad, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
