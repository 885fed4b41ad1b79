"""LoRA weight sync on CPU: bytes and seconds of a push that sends only the adapters (trainer.lora),
against a push of the whole model, to the same 2 engines (HTTP + gloo) in the same run.

    python tools/bench/lora_sync.py [--hidden 512] [--layers 8] [--rank 16] [--repeat 5]

A random Qwen3-architecture model (tools/bench/weight_sync.py builds it) serves on two built-in
torch engines. Full pushes send every parameter (as a full fine-tuning run does each step); LoRA
pushes send the adapters of the attention and MLP projections plus their scaling, which each
engine merges onto its base weights before it reports the version (the merge is in the time).
Adapter pushes (trainer.lora.sync adapter) write the version's PEFT folder and have both engines
load it (/load_lora_adapter) and report the version; an engine merges an adapter at the first
batch that names it, which is not in that time: `adapter_merge_s_median` is that merge
(AdapterMerger.apply onto the base weights, here in this process), `adapter_write_s_median` the
folder's write alone.
Prints one JSON object; `bytes_ratio` and `time_ratio` are full / LoRA.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from relax_hpc.config.schema import LoraConfig
from relax_hpc.models import lora
from relax_hpc.paths import RunPaths
from relax_hpc.weights.adapters import AdapterPublisher, write_version
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.lora import SCALING, AdapterMerger

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import (  # the full-sync benchmark's model and engines
    bench_parser,
    scratch_run,
    timed_pushes,
    two_engines,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = bench_parser(__doc__, bucket_mb=512.0, repeat=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with scratch_run(args.hidden, args.layers) as (paths, model_dir, model):
        full = [(n, p.detach()) for n, p in model.named_parameters()]
        cfg = LoraConfig(rank=args.rank, alpha=2 * args.rank, target_modules=TARGETS)
        lora.add_adapters(model, cfg, str(model_dir), seed=0)
        with torch.no_grad():  # trained adapters: B away from its zero start
            for name, p in model.named_parameters():
                if lora.is_adapter_parameter(name):
                    p.normal_(0, 0.01)
        adapters = [(lora.sync_name(n), p.detach()) for n, p in model.named_parameters() if p.requires_grad]
        adapters.append((SCALING, lora.scaling(cfg)))
        limit = int(args.bucket_mb * 2**20)
        full_buckets = plan_buckets([(n, t.shape, t.dtype) for n, t in full], limit)
        lora_buckets = plan_buckets([(n, t.shape, t.dtype) for n, t in adapters], limit)
        with two_engines(paths, model_dir) as sender:
            # Full pushes first: after a LoRA push an engine merges adapters at every version's end.
            timed_pushes(sender, full_buckets, lambda: iter(full), 1, 1)  # forms the group
            full_s = timed_pushes(sender, full_buckets, lambda: iter(full), 2, args.repeat)
            lora_s = timed_pushes(sender, lora_buckets, lambda: iter(adapters), 2 + args.repeat, args.repeat)
            adapter_s, write_s = adapter_pushes(
                paths, cfg, str(model_dir), dict(adapters), 2 + 2 * args.repeat, args.repeat
            )
    full_bytes, lora_bytes = sum(b.nbytes for b in full_buckets), sum(b.nbytes for b in lora_buckets)
    full_med, lora_med = statistics.median(full_s), statistics.median(lora_s)
    print(
        json.dumps(
            {
                "benchmark": "lora_sync_cpu_gloo",
                "params_m": round(sum(t.numel() for _, t in full) / 1e6, 1),
                "lora_rank": args.rank,
                "lora_targets": TARGETS,
                "engines": 2,
                "full_mib": round(full_bytes / 2**20, 2),
                "lora_mib": round(lora_bytes / 2**20, 2),
                "bytes_ratio": round(full_bytes / lora_bytes, 1),
                "full_push_s_median": round(full_med, 4),
                "lora_push_s_median": round(lora_med, 4),
                "time_ratio": round(full_med / lora_med, 1),
                "adapter_push_s_median": round(statistics.median(adapter_s), 4),
                "adapter_write_s_median": round(statistics.median(write_s), 4),
                "adapter_merge_s_median": round(statistics.median(merges(full, dict(adapters), args.repeat)), 4),
            }
        )
    )


def adapter_pushes(
    paths: RunPaths, cfg: LoraConfig, base: str, adapter: dict[str, torch.Tensor], first: int, repeat: int
) -> tuple[list[float], list[float]]:
    """Seconds of `repeat` adapter pushes of versions first.., and of writing their folder alone."""
    write = lambda out, a: lora.write_adapter_folder(out, cfg, base, a)  # noqa: E731
    publisher = AdapterPublisher(paths.engines, paths.lora_adapters, write, paths.read_token(), 60.0)
    pushes, writes = [], []
    for version in range(first, first + repeat):
        start = time.perf_counter()
        write_version(paths.root / "write-only", version, lambda out: write(out, adapter))
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert publisher.publish(version, adapter) == 2
        pushes.append(time.perf_counter() - start)
    return pushes, writes


def merges(full: list[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor], repeat: int) -> list[float]:
    """Seconds of the merge an engine does at the first batch naming a new adapter."""
    params = {name: torch.nn.Parameter(t.clone()) for name, t in full}
    merger = AdapterMerger(params, torch.device("cpu"))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        merger.apply(adapter)
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
