"""Where a colocated bucket's time goes: one flattened bucket handed by CUDA IPC to another
process on the same GPU, each piece timed, against a plain device-to-device copy of the same
bytes in the same run.

    python tools/bench/ipc_bucket.py [--mb 512] [--repeat 10]

This process (the trainer's side) fills a bucket buffer and pickles it as the colocated sender
does (relax_hpc.weights.tensors.serialize_bucket: `share_s`, the IPC handle, event and reference
counter). A child process (the engine's side) maps it (`map_s`: unpickling, opening the handle),
copies it into its own memory and waits for the copy (`copy_s`), and drops the mapping
(`unmap_s`). Two ways: `fresh`, the mapping dropped after each bucket (what an engine does
today), and `kept`, the child holding the last mapping, so that the same buffer sent again is
found in torch's cache of opened handles instead of opened again (what keeping the sender's
bucket buffers across pushes would allow). `d2d_copy_s`: the same copy within one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from relax_hpc.weights.buckets import BucketPlan
from relax_hpc.weights.tensors import FLATTENED_BUCKET, bucket_records, deserialize, serialize_bucket


def engine_side(keep: bool) -> None:
    """The child: one payload a line on stdin, its timings a line on stdout."""
    held: list[torch.Tensor] = []  # kept: the last mapping, alive until the next one replaces it
    dst: torch.Tensor | None = None
    for line in sys.stdin:
        start = time.perf_counter()
        ((_, tensor),) = deserialize(line.strip(), FLATTENED_BUCKET)
        mapped = time.perf_counter()
        dst = torch.empty_like(tensor) if dst is None else dst
        dst.copy_(tensor)
        torch.cuda.synchronize()
        copied = time.perf_counter()
        held[:] = [tensor] if keep else []
        del tensor
        unmapped = time.perf_counter()
        times = {"map_s": mapped - start, "copy_s": copied - mapped, "unmap_s": unmapped - copied}
        print(json.dumps(times), flush=True)


def trainer_side(mb: float, repeat: int, keep: bool) -> dict:
    numel = int(mb * 2**20) // 2
    flat = torch.randn(numel, dtype=torch.bfloat16, device="cuda").view(torch.uint8)
    plan = BucketPlan(["bucket"], ["bfloat16"], [[numel]])
    child = subprocess.Popen(
        [sys.executable, __file__, "--engine-side", "--keep" if keep else "--fresh"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    rows = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        (payload,) = serialize_bucket(flat, bucket_records(plan))
        shared = time.perf_counter()
        child.stdin.write(payload + "\n")
        child.stdin.flush()
        rows.append({**json.loads(child.stdout.readline()), "share_s": shared - start,
                     "total_s": time.perf_counter() - start})  # fmt: skip
    child.stdin.close()
    child.wait()
    return {key: statistics.median(r[key] for r in rows[1:]) for key in rows[0]}  # the first warms up


def copy_seconds(mb: float, repeat: int) -> float:
    src = torch.empty(int(mb * 2**20), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=512.0, help="bucket size")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        engine_side(args.keep)
        return
    if not torch.cuda.is_available():
        sys.exit("ipc_bucket.py measures CUDA IPC: it needs a GPU")
    result = {"benchmark": "ipc_bucket", "mb": args.mb, "d2d_copy_s": copy_seconds(args.mb, args.repeat)}
    for label, keep in (("fresh", False), ("kept", True)):
        result[label] = trainer_side(args.mb, args.repeat, keep)
        result[label]["ratio"] = round(result["d2d_copy_s"] / result[label]["total_s"], 3)
    print(json.dumps({**result, "device": torch.cuda.get_device_name(0)}))


if __name__ == "__main__":
    main()
