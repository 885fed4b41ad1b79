"""The sharded channel against today's broadcast push, in one run on CPU processes: bytes sent by
the busiest trainer rank, the peak memory a push adds to any trainer rank, and a push's seconds,
for the same model pushed to the same 2 built-in engines, beside a raw gloo broadcast of its bytes.

    python tools/bench/weight_sharded.py [--hidden 2048] [--layers 16] [--bucket-mb 256]
                                         [--repeat 3] [--ranks 2]

A random Qwen3-architecture model (tools/bench/weight_sync.py builds it; the defaults make 1.1B
parameters) in bfloat16, held by `--ranks` trainer processes under FSDP2 (gloo), as the torch
backend holds it; each push streams every full tensor (FSDP2's full_tensor, on every rank) through
the channel: `broadcast` (weights.channel broadcast: rank 0 sends every bucket), `sharded` (every
rank sends its share over a group of its own, concurrently: the built-in engine's way) and
`sharded_ordered` (the same, every bucket in one order: SGLang's way) and `sharded_relay` (in one
order, every other rank passing each broadcast on: weights.relay). A push's peak is the rise of the rank's
resident memory over its level before the push (the kernel's high-water mark, reset first).
Prints one JSON object.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.channel import WeightChannel
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import BroadcastChannel, WeightSender
from relax_hpc.weights.sharded import ShardedChannel

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import (  # the engines, the raw baseline
    bench_parser,
    raw_broadcast,
    scratch_run,
    spawn_ranks,
    two_engines,
)


def resident_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (the high-water mark since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def trainer_rank(rank: int, world: int, port: int, run: str, model_dir: str, bucket_mb: float, repeat: int) -> None:
    faulthandler.enable()  # a rank that aborts in C++ says where
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    paths = RunPaths(Path(run))
    layout = EngineLayout([(n, p.shape, p.dtype) for n, p in model.named_parameters()], None)

    def full_parameters() -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, p.full_tensor().detach()) for n, p in model.named_parameters())  # type: ignore[attr-defined]  # DTensors under FSDP2

    def sender() -> WeightSender:
        return WeightSender(paths.engines, paths.read_token(), "gloo", 300.0)

    bucket_bytes = int(bucket_mb * 2**20)
    channels: dict[str, WeightChannel] = {
        "broadcast": BroadcastChannel(sender() if rank == 0 else None, layout, bucket_bytes),
        "sharded_ordered": ShardedChannel(sender(), layout, bucket_bytes, (0, {}), concurrent=False),
        "sharded": ShardedChannel(sender(), layout, bucket_bytes, (0, {})),
        "sharded_relay": ShardedChannel(sender(), layout, bucket_bytes, (0, {}), concurrent=False, relay=True),
    }
    report, version = {}, 1
    for name, channel in channels.items():
        assert channel.push(full_parameters, version) in (2, 0)  # forms the group(s)
        seconds, peaks = [], []
        for version in range(version + 1, version + 1 + repeat):  # noqa: B020  # the versions go on
            dist.barrier()
            before = resident_kib("VmRSS")
            reset_peak()
            start = time.perf_counter()
            channel.push(full_parameters, version)
            seconds.append(time.perf_counter() - start)
            peaks.append(resident_kib("VmHWM") - before)
        version += 1
        buckets = channel.buckets  # type: ignore[attr-defined]  # both channels plan buckets
        whole = sum(b.nbytes for b in buckets)  # the broadcast: rank 0 sends it all
        shares = channel.shares() if isinstance(channel, ShardedChannel) else [whole] + [0] * (world - 1)
        report[name] = {"sent_bytes": shares[rank], "push_s": seconds, "peak_mib": max(peaks) / 1024}
        # Every group stays formed to the end: a group dropped lets its connections go on a thread
        # of its own, which the process's exit would cut short (gloo then aborts the process).
    (Path(run) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    parser = bench_parser(__doc__, bucket_mb=256.0, repeat=3)
    parser.set_defaults(hidden=2048, layers=16)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    with scratch_run(args.hidden, args.layers, torch.bfloat16) as (paths, model_dir, model):
        params_b = sum(p.numel() for p in model.parameters()) / 1e9
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        specs = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
        buckets = [b.nbytes for b in plan_buckets(specs, int(args.bucket_mb * 2**20))]
        del model
        with two_engines(paths, model_dir, "bfloat16"):
            reports = spawn_ranks(trainer_rank, args.ranks, paths.root, str(paths.root), str(model_dir),
                                  args.bucket_mb, args.repeat)  # fmt: skip
            token = paths.read_token()
            versions = [EngineClient(r.url, token, 30).weight_version() for r in read_records(paths.engines)]
        raw = statistics.median(raw_broadcast(buckets, args.repeat))
    out: dict = {"benchmark": "weight_sharded_cpu_gloo", "params_b": round(params_b, 2), "mib": round(nbytes / 2**20),
                 "ranks": args.ranks, "engines": 2, "bucket_mb": args.bucket_mb, "engine_versions": versions,
                 "raw_broadcast_s_median": round(raw, 3)}  # fmt: skip
    for name in ("broadcast", "sharded_ordered", "sharded", "sharded_relay"):
        sent = [rep[name]["sent_bytes"] for rep in reports]
        push_s = statistics.median(max(rep[name]["push_s"][i] for rep in reports) for i in range(args.repeat))
        out[name] = {
            "busiest_rank_mib": round(max(sent) / 2**20),
            "sent_mib_by_rank": [round(s / 2**20) for s in sent],
            "peak_push_mib_by_rank": [round(rep[name]["peak_mib"]) for rep in reports],
            "push_s_median": round(push_s, 3),
            "push_over_raw": round(push_s / raw, 2),
        }
    out["busiest_rank_bytes_ratio"] = round(
        out["sharded"]["busiest_rank_mib"] / out["broadcast"]["busiest_rank_mib"], 3
    )
    out["push_s_ratio"] = round(out["sharded"]["push_s_median"] / out["broadcast"]["push_s_median"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
