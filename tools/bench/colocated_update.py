"""Colocated weight update on one GPU: seconds to hand a model to an engine on the same GPU by
reference (/update_weights_from_tensor, CUDA IPC), against a plain device-to-device copy of the
same bytes, measured in the same run.

    python tools/bench/colocated_update.py [--size 0.6b --size 1.7b] [--bucket-mb 512] [--repeat 5]
        [--models DIR]

For each size: a random Qwen3-shaped model (bf16, tools/bench/train_throughput.py's shapes, the
character tokenizer) is saved to DIR/SIZE (kept, for a run to use), one built-in torch engine
serves it on cuda:0, and this process holds the same parameters on cuda:0 as a trainer rank
would. Each repetition is what a colocated step does around training: release the engine's
memory, then resume it and update its weights (ColocatedSender): packed into flat buckets and
sent as SGLang's "flattened_bucket" (what a run does) and, for comparison, each tensor shared
where it lies ("in place", load_format None). `ratio` = the copy's time / the update's time (the
update's bandwidth over the copy's). What bounds it, measured in the same run: `pack_s`, packing
the model into bucket buffers (a second device-to-device copy of the same bytes), and `rtt_s`,
one request's round trip to the engine (answered at once) (an update is at least four: begin, the buckets, end,
continue, pipelined over one connection).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from relax_hpc.models.tiny import build_char_tokenizer
from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import RequestPipeline
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import BucketPacker, plan_buckets
from relax_hpc.weights.colocated import ColocatedSender

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import COMMON, SHAPES  # the shapes of the throughput benchmark


def build(size: str, folder: Path, device: str = "cuda") -> torch.nn.Module:
    """The model on `device`, saved with the character tokenizer for the engine to load."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[size], **COMMON, dtype="bfloat16")).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to() as taking a model
    if not (folder / "config.json").exists():
        model.save_pretrained(folder)
        build_char_tokenizer().save_pretrained(folder)
    return model


def copy_seconds(params: list[torch.Tensor], repeat: int) -> list[float]:
    """A plain device-to-device copy of the same tensors (one fused launch per repetition)."""
    dst = [torch.empty_like(p) for p in params]
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch._foreach_copy_(dst, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]  # the first one warms up


def pack_seconds(params: list[torch.Tensor], buckets: list, repeat: int) -> float:
    """Packing the model into two reused bucket buffers, as the sender does."""
    packer, it = BucketPacker(params[0].device, max(b.nbytes for b in buckets)), iter(params)
    groups = [[next(it) for _ in b.names] for b in buckets]
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for group in groups:
            packer.pack(group)
            packer.consumed(None)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def round_trip_seconds(url: str, token: str, repeat: int = 20) -> float:
    """One request answered at once (/continue_generation, the engine not paused) over a kept
    connection: a request's fixed cost."""
    pipe, times = RequestPipeline(url, token, 30), []
    try:
        for _ in range(repeat + 1):
            start = time.perf_counter()
            pipe.send("/continue_generation", P.ContinueGenerationReqInput())
            pipe.wait_answers()
            times.append(time.perf_counter() - start)
    finally:
        pipe.close()
    return statistics.median(times[1:])


def measure(size: str, models: Path, bucket_mb: float, repeat: int) -> dict:
    model = build(size, models / size)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for _, p in named)
    buckets = plan_buckets([(n, p.shape, p.dtype) for n, p in named], int(bucket_mb * 2**20))
    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "run")
        paths.create()
        engine = subprocess.Popen(
            [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root), "--engine-id",
             "engine-0", "--model-path", str(models / size), "--dtype", "bfloat16", "--device", "cuda:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "4"},
        )  # fmt: skip
        try:
            while not read_records(paths.engines):
                assert engine.poll() is None, "the engine exited"
                time.sleep(0.2)
            out: dict = {"rtt_s": round_trip_seconds(read_records(paths.engines)[0].url, paths.read_token())}
            for label, pack in (("packed", True), ("in_place", False)):
                sender = ColocatedSender(paths.engines, paths.read_token(), 300, 0, 1, pack=pack)
                release, resume, update = [], [], []
                for version in range(repeat + 1):
                    release.append(sender.release())
                    served, resume_s, update_s = sender.push(buckets, iter(named), version + 1)
                    assert served == 1
                    resume.append(resume_s)
                    update.append(update_s)
                out[label] = {
                    "update_s": statistics.median(update[1:]),  # the first maps the handles
                    "first_update_s": update[0],
                    "release_s": statistics.median(release[1:]),
                    "resume_s": statistics.median(resume[1:]),
                }
        finally:
            engine.terminate()
            engine.wait()
    copy_s = statistics.median(copy_seconds([p for _, p in named], repeat))
    out["pack_s"] = pack_seconds([p for _, p in named], buckets, repeat)
    for part in (out["packed"], out["in_place"]):
        part["ratio"] = round(copy_s / part["update_s"], 3)
        part["update_gib_per_s"] = round(nbytes / 2**30 / part["update_s"], 1)
    return {
        "benchmark": "colocated_update",
        "size": size,
        "gib": round(nbytes / 2**30, 2),
        "buckets": len(buckets),
        "d2d_copy_s": copy_s,
        "d2d_copy_gib_per_s": round(nbytes / 2**30 / copy_s, 1),
        **out,
        "device": torch.cuda.get_device_name(0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", action="append", choices=sorted(SHAPES), help="repeatable; default: all")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "relax-colocated-models")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("colocated_update.py measures CUDA IPC: it needs a GPU")
    for size in args.size or sorted(SHAPES):
        print(json.dumps(measure(size, args.models, args.bucket_mb, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
