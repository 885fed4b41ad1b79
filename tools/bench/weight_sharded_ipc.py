"""The sharded push by reference (weights.channel sharded with launch.colocate) against today's
colocated push, on one GPU: trainer ranks and one built-in engine as processes on the same device,
weights handed over by CUDA IPC (NCCL refuses two processes on one GPU, so this is how several
senders can share one here), beside a plain device-to-device copy of the same bytes.

    python tools/bench/weight_sharded_ipc.py [--size 0.6b] [--ranks 1 2 4] [--bucket-mb 512]
                                             [--repeat 3] [--device cuda]

A random Qwen3-shaped model (tools/bench/train_throughput.py's shapes, bf16) is saved and served
by one built-in engine. Each trainer rank is a process (gloo for the channel's own collectives)
that holds only the tensors of the buckets it sends, as a megatron stage's ranks hold their own
layers: `colocated` is today's push (one rank, relax_hpc.weights.channel.ColocatedChannel: the
whole model from one sender); `sharded_N` is ShardedColocatedChannel over N ranks, each handing
its share to the engine. After the last push of each, the engine's weights are read back through
its catch-up route and compared bit for bit with what the ranks sent. `--device cpu` runs the same
on shared memory (a small check of the script; the figures are the GPU's). Prints one JSON object
per size: bytes of the busiest rank, the push's seconds (median; a push is its slowest rank's),
each rank's peak device memory, and whether the engine holds the weights exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.catchup import SNAPSHOT, SnapshotReq, decode
from relax_hpc.weights.colocated import ColocatedChannel, ColocatedSender
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sharded import ShardedColocatedChannel, shares

sys.path.insert(0, str(Path(__file__).parent))
from colocated_update import build, copy_seconds  # the model folder, the device copy baseline
from weight_sync import spawn_ranks


def pushed(name: str, tensor: torch.Tensor, version: int) -> torch.Tensor:
    """Version `version` of a tensor: the saved one plus noise seeded by its name and the version,
    so every process computes the same bytes without holding the others' tensors."""
    seed = int.from_bytes(hashlib.sha256(f"{name}/{version}".encode()).digest()[:4], "little")
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return (tensor.float() + 0.01 * noise).to(tensor.dtype)


def trainer_rank(rank: int, world: int, port: int, run: str, model_dir: str, device: str, args: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    paths, dev = RunPaths(Path(run)), torch.device(device)
    weights = safe_open(str(Path(model_dir) / "model.safetensors"), "pt")
    names = weights.keys()  # a safetensors handle: no iteration of its own
    specs = [(n, torch.Size(weights.get_slice(n).get_shape()), torch.bfloat16) for n in names]
    layout = EngineLayout(specs, None)
    bucket_bytes = int(args["bucket_mb"] * 2**20)
    sender = ColocatedSender(paths.engines, paths.read_token(), 300.0, rank, world)
    channel: ColocatedChannel
    if args["sharded"]:
        channel = ShardedColocatedChannel(sender, layout, bucket_bytes, (0, {}))
        mine = {n for plan, o in zip(channel.buckets, channel.owner, strict=True) if o == rank for n in plan.names}
        sent = shares(channel.buckets, channel.owner, world)[rank]
    else:
        channel = ColocatedChannel(sender, layout, bucket_bytes)
        mine, sent = set(names), sum(b.nbytes for b in channel.buckets)
    saved = {n: weights.get_tensor(n).clone() for n in sorted(mine)}  # this rank's share only (a copy: not the mmap)
    held = {n: t.to(dev, copy=True) for n, t in saved.items()}

    def full_parameters() -> Iterator[tuple[str, torch.Tensor | None]]:
        return ((name, held.get(name)) for name, _, _ in specs)  # None: another rank's

    seconds = []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for version in range(1, args["repeat"] + 2):
        with torch.no_grad():
            for name, tensor in held.items():
                tensor.copy_(pushed(name, saved[name], version).to(dev))
        dist.barrier()
        start = time.perf_counter()
        channel.push(full_parameters, version)
        took = [0.0] * world
        dist.all_gather_object(took, time.perf_counter() - start)
        seconds.append(max(took))
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    report = {"sent_bytes": sent, "push_s": seconds[1:], "peak_mib": peak / 2**20}  # the first maps the handles
    (Path(run) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_case(paths: RunPaths, model_dir: Path, device: str, ranks: int, sharded: bool, args: dict) -> list[dict]:
    options = {**args, "sharded": sharded}
    return spawn_ranks(trainer_rank, ranks, paths.root, str(paths.root), str(model_dir), device, options)


def exact(paths: RunPaths, model_dir: Path, version: int) -> bool:
    """Whether the engine holds version `version` of every tensor, bit for bit (read back in one
    bucket through the engine's catch-up route)."""
    record = read_records(paths.engines)[0]
    held, stamp = decode(EngineClient(record.url, paths.read_token(), 60).fetch(SNAPSHOT, SnapshotReq(0, 2**40)))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as saved:
        names = saved.keys()
        return stamp.version == str(version) and all(
            torch.equal(held[n], pushed(n, saved.get_tensor(n), version)) for n in names
        )


def measure(size: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / size
        model = build(size, model_dir, args.device)
        params = [p.detach() for p in model.parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        copy_s = statistics.median(copy_seconds(params, args.repeat)) if args.device == "cuda" else None
        buckets = len(plan_buckets([(n, p.shape, p.dtype) for n, p in model.named_parameters()],
                                   int(args.bucket_mb * 2**20)))  # fmt: skip
        del model, params
        paths = RunPaths(Path(tmp) / "run")
        paths.create()
        engine = subprocess.Popen(
            [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root), "--engine-id",
             "engine-0", "--model-path", str(model_dir), "--dtype", "bfloat16", "--device",
             f"{args.device}:0" if args.device == "cuda" else "cpu"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "4"},
        )  # fmt: skip
        out: dict = {"benchmark": "weight_sharded_ipc", "size": size, "device": args.device,
                     "gib": round(nbytes / 2**30, 2), "buckets": buckets, "bucket_mb": args.bucket_mb,
                     "d2d_copy_s": copy_s}  # fmt: skip
        try:
            while not read_records(paths.engines):
                assert engine.poll() is None, "the engine exited"
                time.sleep(0.2)
            options = {"bucket_mb": args.bucket_mb, "repeat": args.repeat}
            cases = [("colocated", 1, False)] + [(f"sharded_{n}", n, True) for n in args.ranks]
            for name, ranks, sharded in cases:
                reports = run_case(paths, model_dir, args.device, ranks, sharded, options)
                push_s = statistics.median(max(r["push_s"][i] for r in reports) for i in range(args.repeat))
                out[name] = {
                    "busiest_rank_mib": round(max(r["sent_bytes"] for r in reports) / 2**20),
                    "push_s_median": round(push_s, 4),
                    "peak_mib_by_rank": [round(r["peak_mib"]) for r in reports],
                    "exact": exact(paths, model_dir, args.repeat + 1),
                }
                if copy_s:
                    out[name]["copy_over_push"] = round(copy_s / push_s, 3)
        finally:
            engine.terminate()
            engine.wait()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", action="append", help="repeatable; default 0.6b (cpu: vl-tiny)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    for size in args.size or (["0.6b"] if args.device == "cuda" else ["vl-tiny"]):
        print(json.dumps(measure(size, args)), flush=True)


if __name__ == "__main__":
    main()
