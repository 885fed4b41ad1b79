"""Weight sync over NCCL between two GPUs: seconds to push a Qwen3-1.7B-shaped bf16 model from this
process (GPU 0, the trainer's side) to one built-in torch engine (GPU 1), against a raw NCCL
broadcast of the same bytes between two plain processes on the same GPUs, in the same run.

    python tools/bench/weight_sync_nccl.py [--bucket-mb 512] [--repeat 10] [--layers 28 ...]
    python tools/bench/weight_sync_nccl.py --cpu-smoke    # the same plumbing on CPU + gloo, tiny model

The model is random (no hub): built on GPU 0, saved once with safetensors for the engine to load,
then given other random values so that a push that did not arrive shows. After one warm-up push
(it forms the group), N pushes are timed, each from before begin() until every engine answered,
with the GPU synchronised on both sides of the clock. The raw baseline broadcasts the same bucket
sizes one after the other (`raw_bucketed`), and the whole size as one tensor (`raw_single`).
`ratio` = push / raw_bucketed seconds; `bandwidth_fraction` = its inverse (target: >= 0.90).
Breakdown: `fixed_http_s` is a push with no bucket (registry, connections, pause, begin, end,
continue); `pack_serial_s` is the GPU time of packing every bucket back to back, which a push
overlaps with the broadcasts. Prints one JSON object; an engine log tail goes to stderr on failure.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_hpc.paths import RunPaths
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_records
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, plan_buckets
from relax_hpc.weights.group import SideGroup
from relax_hpc.weights.sender import WeightSender, free_port, push

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "assets" / "tiny-qwen3-addition"  # any tokenizer: the engine never generates here
CHILDREN: list[subprocess.Popen] = []
TEMP_DIRS: list[str] = []  # removed by the deadline too (the model alone is 3.2 GiB)
SMOKE = {
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "intermediate": 128,
    "vocab": 1024,
    "bucket_mb": 0.05,
    "repeat": 3,
}


# -- setup ----------------------------------------------------------------------------------------


def arm_deadline(seconds: float) -> None:
    """Every wait below has its own timeout; this one bounds them all (a hung NCCL call included):
    dump every thread's stack, stop the children, exit."""

    def expire() -> None:
        print(f"weight_sync_nccl: no result after {seconds:.0f} s; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in CHILDREN:
            child.kill()
        for folder in TEMP_DIRS:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def child_env(gpu: str | None) -> dict[str, str]:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def second_gpu() -> str:
    """GPU 1 of this process's view, named the way a child's CUDA_VISIBLE_DEVICES wants it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[1].strip() if visible else "1"


def build_model(args: argparse.Namespace, device: torch.device) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        tie_word_embeddings=True,
    )
    with torch.device(device):  # initialised where it lives: seconds, not minutes, for 1.7B
        model = Qwen3ForCausalLM(config)
    return model.to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers types .to() as taking a model; in place: the tied embedding stays tied


def save_for_engine(model: Qwen3ForCausalLM, folder: Path) -> None:
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)


def rerandomize(model: torch.nn.Module) -> None:
    """New values: the engine loaded the saved ones, so a check after a push sees the transfer."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)


def start_engine(args: argparse.Namespace, paths: RunPaths, model_dir: Path, log_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(paths.root),
            "--engine-id", "engine-0", "--model-path", str(model_dir), "--dtype", "bfloat16",
            "--device", "cpu" if args.cpu_smoke else "cuda", "--threads", "1" if args.cpu_smoke else "4",
            "--weights-timeout-s", str(args.op_timeout_s)]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(None if args.cpu_smoke else second_gpu()),
        )
    CHILDREN.append(proc)
    return proc


def wait_registered(paths: RunPaths, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not read_records(paths.engines):
        if proc.poll() is not None:
            fail(f"the engine exited ({proc.returncode}) before serving")
        if time.monotonic() > deadline:
            fail(f"the engine did not serve within {timeout_s:.0f} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def fail(message: str) -> None:
    raise SystemExit(f"weight_sync_nccl: {message}")


# -- measurements ---------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], object], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def time_pushes(sender: WeightSender, buckets: list[BucketPlan], model: torch.nn.Module, repeat: int) -> dict:
    device = next(model.parameters()).device

    def params() -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, p.detach()) for n, p in model.named_parameters())

    if push(sender, buckets, params, version=1) != 1:  # forms the group, starts NCCL (WeightSyncError: failed)
        fail("the warm-up push reached no engine")
    versions = iter(range(2, 2 + repeat))
    push_s = timed(device, lambda: push(sender, buckets, params, next(versions)), repeat)
    fixed_s = timed(device, lambda: push(sender, [], lambda: iter(()), 0), repeat)
    return {"push": push_s, "fixed_http": fixed_s, "version": str(1 + repeat)}


def time_packing(buckets: list[BucketPlan], model: torch.nn.Module, repeat: int) -> list[float]:
    device = next(model.parameters()).device
    params = dict(model.named_parameters())
    tensors = [[params[n].detach() for n in plan.names] for plan in buckets]
    packer = BucketPacker(device, max(b.nbytes for b in buckets))

    def pack_all() -> None:
        for bucket in tensors:
            packer.pack(bucket)
            packer.consumed(None)

    return timed(device, pack_all, repeat)


def verify(paths: RunPaths, model: torch.nn.Module, version: str) -> None:
    """The engine holds the sender's values (first, middle and last parameter) and the version."""
    record = read_records(paths.engines)[0]
    client = EngineClient(record.url, paths.read_token(), 60)
    if client.weight_version() != version:
        fail(f"the engine reports weight version {client.weight_version()}, expected {version}")
    named = list(model.named_parameters())
    for name, param in (named[0], named[len(named) // 2], named[-1]):
        got = client.post("/get_weights_by_name", P.GetWeightsByNameReqInput(name=name, truncate_size=2))
        if got != param.detach()[:2].tolist():
            fail(f"{name} on the engine differs from the sender's")


def raw_rounds(group: SideGroup, buffers: list[torch.Tensor], rounds: int) -> Iterator[None]:
    """Issue one round of broadcasts of `buffers` per step; the caller times each step."""
    for _ in range(rounds):
        works = [group.broadcast_async(b) for b in buffers]
        for work in works:
            work.wait()  # gloo: until sent; NCCL: the current stream waits (synchronize() follows)
        yield


def time_raw(args: argparse.Namespace, device: torch.device, sizes: list[int]) -> dict:
    """Rank 0 of a plain two-process group; the peer (GPU 1) runs raw_peer() with the same plan."""
    port = free_port("127.0.0.1")
    argv = [sys.executable, str(Path(__file__).resolve()), "--raw-peer", "--port", str(port),
            "--sizes", ",".join(map(str, sizes)), "--repeat", str(args.repeat),
            "--op-timeout-s", str(args.op_timeout_s), *(["--cpu-smoke"] if args.cpu_smoke else [])]  # fmt: skip
    env = child_env(None if args.cpu_smoke else second_gpu())
    peer = subprocess.Popen(argv, cwd=REPO, stdout=sys.stderr, env=env)  # stdout: the JSON line only
    CHILDREN.append(peer)
    group = SideGroup("127.0.0.1", port, 0, 2, "raw", backend(args), args.op_timeout_s)
    result = {}
    for name, buffers in raw_plan(sizes, device):
        steps = raw_rounds(group, buffers, args.repeat + 1)
        next(steps)  # warm-up: connections
        result[name] = timed(device, functools.partial(next, steps), args.repeat)
    if peer.wait(timeout=args.op_timeout_s) != 0:
        fail(f"the raw-broadcast peer exited with {peer.returncode}")
    return result


def raw_plan(sizes: list[int], device: torch.device) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """The same buffers, in the same order, on both ranks (the root's hold random bytes)."""
    yield "raw_bucketed", [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes]
    yield "raw_single", [torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, device=device)]


def raw_peer(args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.cpu_smoke else "cuda:0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = SideGroup("127.0.0.1", args.port, 1, 2, "raw", backend(args), args.op_timeout_s)
    for _, buffers in raw_plan([int(n) for n in args.sizes.split(",")], device):
        for _ in raw_rounds(group, buffers, args.repeat + 1):
            pass  # no sync per round: the next round's receives are already queued when the root starts it
        synchronize(device)


def backend(args: argparse.Namespace) -> str:
    return "gloo" if args.cpu_smoke else "nccl"


# -- the run --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    """Prints the result before any teardown: the groups are never destroyed (the process ends
    with os._exit), so a destructor waiting on a peer that left first cannot hold the result back."""
    device = torch.device("cpu" if args.cpu_smoke else "cuda:0")
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            fail(f"needs two GPUs, sees {torch.cuda.device_count()}")
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory(prefix="weight_sync_nccl-") as tmp:
        TEMP_DIRS.append(tmp)
        paths = RunPaths(Path(tmp) / "run")
        paths.create()
        model = build_model(args, device)
        save_for_engine(model, Path(tmp) / "model")
        rerandomize(model)
        log_path = Path(tmp) / "engine.log"
        engine = start_engine(args, paths, Path(tmp) / "model", log_path)
        try:
            measure(args, device, paths, engine, model)
        except BaseException:
            print(f"--- engine log, end ---\n{log_path.read_text(errors='replace')[-6000:]}", file=sys.stderr)
            raise
        finally:
            stop(engine)


def measure(
    args: argparse.Namespace, device: torch.device, paths: RunPaths, engine: subprocess.Popen, model: torch.nn.Module
) -> None:
    wait_registered(paths, engine, args.op_timeout_s)
    sender = WeightSender(paths.engines, paths.read_token(), backend(args), args.op_timeout_s)
    specs = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    buckets = plan_buckets(specs, int(args.bucket_mb * 2**20))
    pushes = time_pushes(sender, buckets, model, args.repeat)
    verify(paths, model, pushes["version"])
    pack_s = time_packing(buckets, model, args.repeat)
    raw = time_raw(args, device, [b.nbytes for b in buckets])  # the engine idles meanwhile
    print(json.dumps(report(args, device, model, buckets, pushes, pack_s, raw)), flush=True)


def report(
    args: argparse.Namespace,
    device: torch.device,
    model: torch.nn.Module,
    buckets: list[BucketPlan],
    pushes: dict,
    pack_s: list[float],
    raw: dict,
) -> dict:
    nbytes = sum(b.nbytes for b in buckets)
    gib = nbytes / 2**30
    med = {k: statistics.median(v) for k, v in {**pushes, **raw, "pack_serial": pack_s}.items() if k != "version"}
    return {
        "benchmark": "weight_sync_cpu_smoke" if args.cpu_smoke else "weight_sync_nccl",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": backend(args),
        "torch": torch.__version__,
        "nccl": str(torch.cuda.nccl.version()) if device.type == "cuda" else None,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "gib": round(gib, 3),
        "buckets": len(buckets),
        "bucket_mb": args.bucket_mb,
        "largest_bucket_mib": round(max(b.nbytes for b in buckets) / 2**20, 1),
        "repeat": args.repeat,
        "push_s_median": round(med["push"], 5),
        "raw_bucketed_s_median": round(med["raw_bucketed"], 5),
        "raw_single_s_median": round(med["raw_single"], 5),
        "ratio": round(med["push"] / med["raw_bucketed"], 3),
        "bandwidth_fraction": round(med["raw_bucketed"] / med["push"], 3),
        # Leaving out what a push with no bucket costs (HTTP round trips, Python): the data path.
        "bandwidth_fraction_without_fixed_http": round(med["raw_bucketed"] / (med["push"] - med["fixed_http"]), 3),
        "push_gib_per_s": round(gib / med["push"], 1),
        "raw_bucketed_gib_per_s": round(gib / med["raw_bucketed"], 1),
        "raw_single_gib_per_s": round(gib / med["raw_single"], 1),
        "breakdown": {
            "fixed_http_s_median": round(med["fixed_http"], 5),
            "pack_serial_s_median": round(med["pack_serial"], 5),
        },
        "push_s_all": [round(t, 5) for t in pushes["push"]],
        "verified": True,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--op-timeout-s",
        type=float,
        default=300.0,
        help="bound on each wait (engine start, HTTP answers, stores, gloo)",
    )
    parser.add_argument("--deadline-s", type=float, default=540.0, help="bound on the whole run")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="gloo on CPU with a tiny model (sizes below the defaults)"
    )
    parser.add_argument("--raw-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_smoke:  # shrink whatever was left at its default
        for key, value in SMOKE.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before any communicator exists (NVLS is off on these machines)
    torch.set_num_threads(1 if args.cpu_smoke else 4)
    arm_deadline(args.deadline_s)
    code = 0
    try:
        raw_peer(args) if args.raw_peer else run(args)
    except SystemExit as e:  # fail(): its message, and no teardown either
        print(e, file=sys.stderr)
        code = 1
    except BaseException:  # noqa: BLE001  # Ctrl-C too: report it, then os._exit (no NCCL teardown)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see run()


if __name__ == "__main__":
    main()
