"""Engine-to-engine catch-up on CPU against the trainer's full push, in one run: seconds and bytes
that bring a restarted engine to the current version (rollout.catch_up engine or trainer).

    python tools/bench/catch_up.py [--hidden 512] [--layers 8] [--dtype float32] [--bucket-mb 512] [--repeat 3]

A random Qwen3-architecture model (tools/bench/weight_sync.py builds it) on two built-in engines,
the trainer being this process (WeightSender, gloo). Each round kills the third engine (-9) and
starts it again as the launcher would:
- catch-up: the engine copies the weights from a healthy engine before it registers; its event in
  metrics/events.jsonl gives the seconds (finding the seed, copying, loading) and the bytes;
- trainer: what a restart cost before (and still costs with rollout.catch_up trainer): the
  trainer's next push forms the group again with the restarted engine and sends the whole model
  to every engine (each engine pauses generation meanwhile).
Also the steady push (group formed, as every step). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.sender import push

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import (  # the full-sync benchmark's model and engines
    bench_parser,
    scratch_run,
    timed_pushes,
    two_engines,
)


def start_engine(paths: RunPaths, model_dir: Path, dtype: str, bucket_mb: float | None) -> subprocess.Popen:
    """engine-2, copying from the others at its start when `bucket_mb` is given."""
    argv = [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root),
            "--engine-id", "engine-2", "--model-path", str(model_dir), "--dtype", dtype]  # fmt: skip
    if bucket_mb is not None:
        argv += ["--catch-up-bucket-mb", str(bucket_mb)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def registered(paths: RunPaths, proc: subprocess.Popen) -> None:
    while not any(r.engine_id == "engine-2" and r.pid == proc.pid for r in read_records(paths.engines)):
        assert proc.poll() is None, "engine-2 exited"
        time.sleep(0.1)


def main() -> None:
    parser = bench_parser(__doc__, bucket_mb=512.0, repeat=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    with scratch_run(args.hidden, args.layers) as (paths, model_dir, fp32_model):
        model = fp32_model.to(getattr(torch, args.dtype))
        model.save_pretrained(model_dir)
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        tensors = lambda: iter(params)  # noqa: E731
        buckets = plan_buckets([(n, t.shape, t.dtype) for n, t in params], int(args.bucket_mb * 2**20))
        copy_s, copy_bytes, restart_push_s = [], [], []
        with two_engines(paths, model_dir, args.dtype) as sender:
            push(sender, buckets, tensors, version=1)  # forms the group
            steady_s = timed_pushes(sender, buckets, tensors, 2, args.repeat)
            version = 2 + args.repeat
            third = None
            for _ in range(args.repeat):
                for bucket_mb in (args.bucket_mb, None):  # catch-up, then the trainer's push
                    if third is not None:
                        third.kill()
                        third.wait()
                    third = start_engine(paths, model_dir, args.dtype, bucket_mb)
                    registered(paths, third)
                    if bucket_mb is None:  # the group is formed again, with 3 engines
                        start = time.perf_counter()
                        assert push(sender, buckets, tensors, version) == 3
                        restart_push_s.append(time.perf_counter() - start)
                        version += 1
                events = [e for e in read_jsonl(paths.events_metrics) if e.get("outcome") == "copied"]
                copy_s.append(events[-1]["seconds"])
                copy_bytes.append(events[-1]["bytes"])
            if third is not None:
                third.kill()
                third.wait()
    nbytes = sum(b.nbytes for b in buckets)
    print(
        json.dumps(
            {
                "benchmark": "catch_up_cpu",
                "params_m": round(sum(t.numel() for _, t in params) / 1e6, 1),
                "dtype": args.dtype,
                "model_bytes": nbytes,
                "catch_up_bytes": statistics.median(copy_bytes),
                "catch_up_s_median": statistics.median(copy_s),
                "trainer_restart_push_bytes_per_engine": nbytes,
                "trainer_restart_push_engines": 3,
                "trainer_restart_push_s_median": round(statistics.median(restart_push_s), 4),
                "trainer_steady_push_s_median": round(statistics.median(steady_s), 4),
                "catch_up_over_restart_push": round(statistics.median(copy_s) / statistics.median(restart_push_s), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
