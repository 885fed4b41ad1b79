"""Weight sync on CPU: seconds to push a model to 2 engines (HTTP + gloo, bucketed), against a raw
gloo broadcast of the same bytes to 2 plain processes, measured in the same run.

    python tools/bench/weight_sync.py [--hidden 512] [--layers 8] [--bucket-mb 512] [--repeat 5]

Builds a random Qwen3-architecture model of the given size (no hub), starts two built-in torch
engines on it, and times WeightSender pushes with the group already formed (as every step after
the first). Prints one JSON object; `ratio` = push time / raw broadcast time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.group import SideGroup
from relax_hpc.weights.sender import WeightSender, free_port, push


def receive(port: int, rank: int, sizes: list[int], repeat: int) -> None:
    torch.set_num_threads(1)
    group = SideGroup("127.0.0.1", port, rank, 3, "raw", "gloo", 60)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(repeat):
        for buf in buffers:
            group.broadcast(buf)


def raw_broadcast(sizes: list[int], repeat: int) -> list[float]:
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=receive, args=(port, r, sizes, repeat)) for r in (1, 2)]
    for p in procs:
        p.start()
    group = SideGroup("127.0.0.1", port, 0, 3, "raw", "gloo", 60)
    buffers = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for buf in buffers:
            group.broadcast(buf)
        times.append(time.perf_counter() - start)
    for p in procs:
        p.join()
    return times


def random_qwen3(folder: Path, hidden: int, layers: int, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """A random Qwen3-architecture model of the given size, saved to `folder` for the engines."""
    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config).to(dtype)  # type: ignore[arg-type]  # transformers' stub of to()
    model.save_pretrained(folder)
    return model


def bench_parser(doc: str | None, bucket_mb: float, repeat: int) -> argparse.ArgumentParser:
    """The options every weight benchmark here shares: the model's shape, the bucket, repeats."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=bucket_mb)
    parser.add_argument("--repeat", type=int, default=repeat)
    return parser


@contextlib.contextmanager
def scratch_run(
    hidden: int, layers: int, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[RunPaths, Path, Qwen3ForCausalLM]]:
    """A run folder and a random Qwen3 of this shape saved beside it, in a temporary folder; one
    torch thread (the engines beside it get the other cores)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = RunPaths(Path(tmp) / "run")
        paths.create()
        model_dir = Path(tmp) / "model"
        yield paths, model_dir, random_qwen3(model_dir, hidden, layers, dtype)


@contextlib.contextmanager
def two_engines(paths: RunPaths, model_dir: Path, dtype: str = "float32") -> Iterator[WeightSender]:
    """Two built-in engines on the model, registered in `paths`; yields a sender to them."""
    engines = [
        subprocess.Popen([sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root),
                          "--engine-id", f"engine-{i}", "--model-path", str(model_dir), "--dtype", dtype],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
        for i in range(2)
    ]  # fmt: skip
    try:
        while len(read_records(paths.engines)) < 2:
            time.sleep(0.2)
        sender = WeightSender(paths.engines, paths.read_token(), "gloo", 120)
        yield sender
        sender.drop_group()
    finally:
        for e in engines:
            e.terminate()
            e.wait()


def spawn_ranks(target: Callable[..., None], world: int, run: Path, *args: object) -> list[dict]:
    """`world` trainer ranks, each `target(rank, world, port, *args)` in a spawned process (the
    port their process group's), run to the end; each rank's report, RUN/rank{r}.json."""
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, f"a trainer rank exited with {proc.exitcode}"
    return [json.loads((run / f"rank{r}.json").read_text()) for r in range(world)]


def timed_pushes(sender: WeightSender, buckets: list, params: Callable, first: int, repeat: int) -> list[float]:
    """Seconds of `repeat` pushes of versions first.. (the group already formed)."""
    times = []
    for version in range(first, first + repeat):
        start = time.perf_counter()
        assert push(sender, buckets, params, version) == 2
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    args = bench_parser(__doc__, bucket_mb=512.0, repeat=5).parse_args()
    with scratch_run(args.hidden, args.layers) as (paths, model_dir, model):
        params = list(model.named_parameters())
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        buckets = plan_buckets([(n, p.shape, p.dtype) for n, p in params], int(args.bucket_mb * 2**20))
        with two_engines(paths, model_dir) as sender:
            tensors = lambda: ((n, p.detach()) for n, p in params)  # noqa: E731
            push(sender, buckets, tensors, version=1)  # forms the group
            push_s = timed_pushes(sender, buckets, tensors, 2, args.repeat)
        raw_s = raw_broadcast([b.nbytes for b in buckets], args.repeat)
    push_med, raw_med = statistics.median(push_s), statistics.median(raw_s)
    print(
        json.dumps(
            {
                "benchmark": "weight_sync_cpu_gloo",
                "params_m": round(sum(p.numel() for _, p in params) / 1e6, 1),
                "mib": round(nbytes / 2**20, 1),
                "buckets": len(buckets),
                "engines": 2,
                "push_s_median": round(push_med, 4),
                "raw_broadcast_s_median": round(raw_med, 4),
                "ratio": round(push_med / raw_med, 2),
                "push_gib_per_s": round(nbytes / 2**30 / push_med, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
