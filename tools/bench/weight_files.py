"""The file channel on CPU against today's broadcast push, in one run: bytes and seconds of a push
of the same model to the same 2 built-in engines (weights.channel broadcast, file, file + delta).

    python tools/bench/weight_files.py [--hidden 512] [--layers 8] [--bucket-mb 64] [--repeat 3]
                                       [--changed-share 0.02]

A random Qwen3-architecture model (tools/bench/weight_sync.py builds it) on two engines; the
trainer is this one process (a gloo group of one rank: one writer). Before each timed push a
`--changed-share` of the elements changes (the delta's case; the share a real run measures is in
BENCHMARKS.md). Broadcast sends the whole model to each engine over gloo; file writes the whole
version once to RUN_DIR/weights/files and both engines load it; delta writes only the changed
elements (index + bits per bucket, or the bucket where that is smaller) and both engines apply
them. Prints one JSON object: `*_bytes` is what the trainer sends (broadcast: per engine; file:
written once for every engine), `*_s_median` a push's seconds, each engine updated when it ends.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.files import ClientSettings, FileChannel
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import free_port

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import (  # the full-sync benchmark's model and engines
    bench_parser,
    scratch_run,
    timed_pushes,
    two_engines,
)


def main() -> None:
    parser = bench_parser(__doc__, bucket_mb=64.0, repeat=3)
    parser.add_argument("--changed-share", type=float, default=0.02)
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1)
    with scratch_run(args.hidden, args.layers) as (paths, model_dir, model):
        full = [(n, p.detach()) for n, p in model.named_parameters()]
        step = lambda: change(full, args.changed_share)  # noqa: E731
        limit = int(args.bucket_mb * 2**20)
        buckets = plan_buckets([(n, t.shape, t.dtype) for n, t in full], limit)
        layout = EngineLayout([(n, t.shape, t.dtype) for n, t in full])
        with two_engines(paths, model_dir) as sender:
            timed_pushes(sender, buckets, lambda: iter(full), 1, 1)  # forms the group
            broadcast_s = [timed(step, lambda v: timed_pushes(sender, buckets, lambda: iter(full), v, 1)[0], v)
                           for v in range(2, 2 + args.repeat)]  # fmt: skip
            client = ClientSettings(paths.read_token(), 120.0)
            whole = FileChannel(paths.weight_files, layout, limit, 1, paths.engines, client, delta=False)
            first = 2 + args.repeat
            file_s, file_bytes = file_pushes(whole, full, step, range(first, first + args.repeat))
            delta = FileChannel(paths.weight_files, layout, limit, 1, paths.engines, client, delta=True)
            first += args.repeat
            delta.push(lambda: iter(full), first)  # the base: the engines hold another version
            delta_s, delta_bytes = file_pushes(delta, full, step, range(first + 1, first + 1 + args.repeat))
    dist.destroy_process_group()
    model_bytes = sum(b.nbytes for b in buckets)
    print(
        json.dumps(
            {
                "benchmark": "weight_files_cpu",
                "params_m": round(sum(t.numel() for _, t in full) / 1e6, 1),
                "dtype": str(full[0][1].dtype).removeprefix("torch."),
                "engines": 2,
                "changed_share": args.changed_share,
                "broadcast_bytes": model_bytes,
                "file_bytes": statistics.median(file_bytes),
                "delta_bytes": statistics.median(delta_bytes),
                "delta_over_full_bytes": round(statistics.median(delta_bytes) / model_bytes, 4),
                "broadcast_s_median": round(statistics.median(broadcast_s), 4),
                "file_s_median": round(statistics.median(file_s), 4),
                "delta_s_median": round(statistics.median(delta_s), 4),
            }
        )
    )


def change(full: list[tuple[str, torch.Tensor]], share: float) -> None:
    """An optimizer step's worth of change: about `share` of the elements move."""
    with torch.no_grad():
        for _, t in full:
            t.add_(1e-3 * torch.randn_like(t) * (torch.rand_like(t) < share))


def timed(before: Callable[[], None], push: Callable[[int], float], version: int) -> float:
    before()
    return push(version)


def file_pushes(
    channel: FileChannel, full: list[tuple[str, torch.Tensor]], step: Callable[[], None], versions: range
) -> tuple[list[float], list[int]]:
    """Seconds and bytes written of each push (both engines loaded it when it returns)."""
    seconds, written = [], []
    for version in versions:
        step()
        start = time.perf_counter()
        assert channel.push(lambda: iter(full), version) == 2
        seconds.append(time.perf_counter() - start)
        written.append(channel.last.nbytes)
    return seconds, written


if __name__ == "__main__":
    main()
