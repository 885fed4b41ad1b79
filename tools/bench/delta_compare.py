"""The trainer's side of weights.delta to vLLM engines per bucket (VllmTransfer.payload: pack the
bucket, compare it with the last version's bytes kept in host memory, keep the new ones), on the
CPU and, where there is one, on the GPU, against a raw copy of the bucket to host memory in the
same run.

    python tools/bench/delta_compare.py [--bucket-mb 512] [--changed-share 0.02] [--repeat 3]

One bf16 bucket of random values; before each timed payload a `--changed-share` of its elements
moves. Prints one JSON object: seconds per GiB of the bucket, medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from relax_hpc.weights.buckets import BucketPlan
from relax_hpc.weights.vllm_channel import PushBytes, SparseNcclTransport, VllmTransfer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_gib(device: torch.device, elements: int, share: float, repeat: int) -> dict[str, float]:
    """Seconds per GiB of one delta payload of the bucket, and of its raw copy to host memory."""
    g = torch.Generator(device=device).manual_seed(0)
    tensor = torch.randn(elements, generator=g, device=device).bfloat16()
    plan = BucketPlan(["w"], ["bfloat16"], [[elements]])
    transfer = VllmTransfer([], "key", SparseNcclTransport(device, 1.0, bytes(128)), 2**40, 1.0, delta=True)
    base: dict[int, torch.Tensor] = {}
    transfer.payload(0, plan, [tensor], PushBytes(), base)
    transfer.base = base
    host = torch.empty(elements, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    payload_s, copy_s = [], []
    for _ in range(repeat):
        moved = torch.rand(elements, generator=g, device=device) < share
        tensor[moved] += 0.5
        _sync(device)
        begin = time.perf_counter()
        pushed, kept = PushBytes(), dict[int, torch.Tensor]()
        transfer.payload(0, plan, [tensor], pushed, kept)
        _sync(device)
        payload_s.append(time.perf_counter() - begin)
        transfer.base = kept  # the next delta is against this version, as after a push
        begin = time.perf_counter()
        host.copy_(tensor)
        _sync(device)
        copy_s.append(time.perf_counter() - begin)
    gib = elements * 2 / 2**30
    transfer.close()
    return {
        "payload_s_per_gib": round(statistics.median(payload_s) / gib, 4),
        "raw_copy_to_host_s_per_gib": round(statistics.median(copy_s) / gib, 4),
        "changed_share_measured": round(pushed.changed / pushed.elements, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--changed-share", type=float, default=0.02)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    elements = int(args.bucket_mb * 2**20) // 2
    out: dict = {"benchmark": "delta_compare", "bucket_mb": args.bucket_mb, "changed_share": args.changed_share}
    out["threads"] = torch.get_num_threads()
    out["cpu"] = per_gib(torch.device("cpu"), elements, args.changed_share, args.repeat)
    if torch.cuda.is_available():
        out["gpu"] = per_gib(torch.device("cuda"), elements, args.changed_share, args.repeat)
        out["gpu_name"] = torch.cuda.get_device_name()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
