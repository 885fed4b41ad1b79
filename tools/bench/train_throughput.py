"""Training throughput on one GPU: tokens/s and MFU of the megatron backend against the torch
backend, on the same random Qwen3-shaped model and the same batch, measured in the same run.

    python tools/bench/train_throughput.py [--sizes 0.6b,1.7b,4b,vl-2b] [--seq 4096] [--batch 4] [--steps 5]
                                           [--microbatch-tokens 16384] [--recompute] [--repeats 1]
                                           [--image-tokens 256] [--profile STEPS] [--profile-dir DIR] [--cpu]

`vl-2b` is a Qwen3-VL-2B-shaped vision-language model (its language model is 1.7b's shape, with
multimodal RoPE; a 24-block vision tower with DeepStack mergers): each sample opens with one
picture of `image-tokens` merged tokens (4 patches of 16 x 16 pixels each), random pixels.
`vl-tiny` is a toy of the same family, for checking the script on a CPU (`--cpu`: gloo, float32,
the torch backend only, since the megatron backend needs CUDA; MFU is then meaningless).

Each (size, backend) runs in its own process (one trainer rank under torchrun), on a batch of
`batch` samples of `seq` tokens (prompt half, completion half) trained with the default
objective (GRPO, PPO clip, entropy bonus) through the backend's own train_step. FLOPs per token
count every matrix multiply (6 x parameters, the LM head included, the embedding lookup not)
plus attention in full (12 x layers x seq x heads x head_dim, not halved for causality), and for
a vision-language model the tower's likewise per patch (attention over the picture's patches)
and its mergers' per merged token; MFU is against the H200's dense bf16 peak, 989 TFLOP/s. Prints
one JSON object per size. With --repeats N each (size, backend) runs N times, each in a fresh
process: its figures are then the median run's, with every run's in `runs` and `mfu_spread`
(largest minus smallest); each run's line also goes to stderr as it ends. With both backends the
JSON holds `megatron_over_torch` (tokens/s, the medians').

--profile STEPS profiles that many more steps after the timed ones (in the first run of each
(size, backend)) with tools/bench/kernel_profile.py: the step's time by kind of kernel
(attention, gemm, norm_elementwise, optimizer, communication, memcpy_memset, other) and idle,
the share the kinds account for, the top kernels and what bounds the step, under `profile` in the
JSON; --profile-dir keeps each Chrome trace there (DIR/SIZE-BACKEND.json.gz; --profile-dir alone
profiles one step).

Memory options: --recompute recomputes each layer's activations in the backward pass (megatron:
trainer.megatron.recompute; torch: trainer.gradient_checkpointing); --microbatch-tokens bounds the
megatron backend's packed micro-batches (the torch backend runs the batch at once). A backend that
runs out of memory reports `error`; `max_memory_gib` is the peak allocated by torch.

The parent process never touches the GPU: the random model is made and saved by a short child
process (on the CPU with --cpu), and the card's name comes from nvidia-smi. (On the H100 of
2026-12-05 the parent made the model on the GPU and held its CUDA context, 610 MiB, through every
run, and the 1.7B and 4B runs ran out of memory by less than that margin's worth.) The exit status
is 1 when some (size, backend) has no finished run, its JSON then naming it under `failed`
(the same day every 1.7B and 4B run died and the script still exited 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {  # Qwen3-0.6B, 1.7B and 4B (tied embeddings)
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32},
    "vl-2b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16},
    "vl-tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8},
}
# The vision towers of the vision-language shapes (Qwen3-VL-2B's config.json; a toy one).
VISION: dict[str, dict[str, Any]] = {
    "vl-2b": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "out_hidden_size": 2048,
              "deepstack_visual_indexes": [5, 11, 17], "num_position_embeddings": 2304},
    "vl-tiny": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
                "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 64},
}  # fmt: skip
PATCH, MERGE, TEMPORAL = 16, 2, 2  # pixels per patch side, patches merged per side, frames per patch
# Qwen3-VL's special tokens; the random text stays below them.
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 151655, 151652, 151653, 151656
COMMON: dict[str, Any] = {
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
}
PEAK_FLOPS = 989e12


def flops_per_token(shape: dict, seq: int) -> float:
    h, inter, layers, heads = (
        shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    )
    q, kv = heads * COMMON["head_dim"], COMMON["num_key_value_heads"] * COMMON["head_dim"]
    matmul_params = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter) + h * COMMON["vocab_size"]
    return 6 * matmul_params + 12 * layers * seq * q


def vision_flops_per_sample(size: str, image_tokens: int) -> float:
    """One picture through the tower and its mergers, forward and backward (0 for a text model)."""
    if size not in VISION:
        return 0.0
    v = VISION[size]
    h, patches, merged_h = v["hidden_size"], image_tokens * MERGE**2, v["hidden_size"] * MERGE**2
    per_patch = 3 * TEMPORAL * PATCH**2 * h + v["depth"] * (4 * h * h + 2 * h * v["intermediate_size"])
    per_merged = (1 + len(v["deepstack_visual_indexes"])) * (merged_h * merged_h + merged_h * v["out_hidden_size"])
    return 6 * (patches * per_patch + image_tokens * per_merged) + 12 * v["depth"] * patches * patches * h


def make_model(size: str, folder: Path, device: str = "cuda") -> None:
    """Save a random model of `size` in `folder`: bf16 on a GPU, float32 on the CPU. The parent
    calls it through `model_in_child` for a GPU run, so that no CUDA context stays behind."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if size in VISION:
        text = {**SHAPES[size], **COMMON, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                "mrope_section": [24, 20, 20], "mrope_interleaved": True}}  # fmt: skip
        config: Any = Qwen3VLConfig(
            text_config=text, vision_config={**VISION[size], "patch_size": PATCH, "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL}, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=True,
            dtype=dtype,
        )  # fmt: skip
        model_class: Any = Qwen3VLForConditionalGeneration
    else:
        config, model_class = Qwen3Config(**SHAPES[size], **COMMON, dtype=dtype), Qwen3ForCausalLM
    with torch.device(device):
        model = model_class(config).to(dtype)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers need it: the 4B shape peaks near 80 GiB


def model_in_child(size: str, folder: Path) -> None:
    """make_model(size, folder, "cuda") in a process of its own: the parent holds no GPU memory."""
    argv = [sys.executable, __file__, "--make-model", "--size", size, "--model", str(folder)]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise SystemExit(f"making the {size} model failed:\n{(out.stderr or out.stdout)[-3000:]}")


def gpu_name() -> str:
    """The first visible card's name, from nvidia-smi (torch.cuda would open a context here)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    names = out.stdout.strip().splitlines()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    index = int(visible) if visible.isdigit() and int(visible) < len(names) else 0
    return names[index].strip() if names else "unknown"


def random_batch(args: argparse.Namespace) -> Any:
    """`batch` samples of `seq` random tokens (prompt half, completion half); for a
    vision-language model each prompt opens with one picture of `image_tokens` merged tokens."""
    import torch

    from relax_hpc.trainer.batching import pad_samples

    g = torch.Generator().manual_seed(0)
    half = args.seq // 2
    high = VISION_START if args.size in VISION else COMMON["vocab_size"]  # a text model: the same batch as before
    seqs = torch.randint(1, high, (args.batch, args.seq), generator=g).tolist()
    media: tuple[dict[str, torch.Tensor], ...] = ()
    if args.size in VISION:
        side = int(args.image_tokens**0.5) * MERGE  # patches per side of a square picture
        if side * side != args.image_tokens * MERGE**2 or args.image_tokens + 2 > half:
            raise SystemExit(f"--image-tokens {args.image_tokens}: a square number below seq / 2 - 2")
        picture = [VISION_START] + [IMAGE_TOKEN] * args.image_tokens + [VISION_END]
        seqs = [picture + s[len(picture) :] for s in seqs]
        pixels = (side * side, 3 * TEMPORAL * PATCH**2)
        grid = torch.tensor([[1, side, side]])
        media = tuple({"pixel_values": torch.randn(pixels, generator=g), "image_grid_thw": grid} for _ in seqs)
    masks = [[0] * half + [1] * half] * args.batch
    logps = [[-2.0] * args.seq] * args.batch
    rewards = torch.rand(args.batch, generator=g).tolist()
    return pad_samples(seqs, masks, logps, rewards, [i // 2 for i in range(args.batch)], 0, media)


def worker(args: argparse.Namespace) -> None:
    """One (size, backend): run under torchrun with one rank; prints a JSON line."""
    import torch
    import torch.distributed as dist

    from relax_hpc.config.schema import JobConfig
    from relax_hpc.trainer.build import build_backend

    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if args.cpu:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    job = JobConfig.model_validate(
        {
            "model": {"path": args.model, "dtype": "float32" if args.cpu else "bfloat16"},
            "rollout": {"max_staleness": 0, "max_new_tokens": args.seq // 2, "group_size": 2},
            "trainer": {
                "backend": args.backend,
                "num_ranks": 1,
                "lr": 1e-6,
                "megatron": {"max_tokens_per_microbatch": args.microbatch_tokens, "recompute": args.recompute},
                "gradient_checkpointing": args.recompute,
            },
        }
    )
    backend = build_backend(job, device)
    batch = random_batch(args)
    synchronize = torch.cuda.synchronize if not args.cpu else lambda: None
    for _ in range(2):  # warm-up: allocator, kernels' autotuning
        backend.train_step(batch, 0)
    synchronize()
    start = time.perf_counter()
    for step in range(args.steps):
        backend.train_step(batch, step)
    synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    tokens_per_s = args.batch * args.seq / seconds
    flops = (
        flops_per_token(SHAPES[args.size], args.seq) + vision_flops_per_sample(args.size, args.image_tokens) / args.seq
    )
    result = {
        "backend": args.backend,
        "step_s": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s),
        "mfu": round(tokens_per_s * flops / PEAK_FLOPS, 3),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if not args.cpu else None,
    }
    if args.profile:
        from kernel_profile import profile_steps  # beside this script, which torchrun puts on sys.path

        trace = Path(args.profile_dir) / f"{args.size}-{args.backend}.json.gz" if args.profile_dir else None
        result["profile"] = profile_steps(lambda: backend.train_step(batch, 0), args.profile, not args.cpu, trace)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run(size: str, backend: str, model: Path, args: argparse.Namespace, profile: int) -> dict:
    """One (size, backend) in a fresh process; `wall_s` is the process's whole time, start-up included."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
            "--worker", "--size", size, "--backend", backend, "--model", str(model), "--seq", str(args.seq),
            "--batch", str(args.batch), "--steps", str(args.steps),
            "--microbatch-tokens", str(args.microbatch_tokens), "--image-tokens", str(args.image_tokens)]  # fmt: skip
    if args.cpu:
        argv.append("--cpu")
    if profile:
        argv += ["--profile", str(profile)] + (["--profile-dir", args.profile_dir] if args.profile_dir else [])
    if args.recompute:
        argv.append("--recompute")
    start = time.perf_counter()
    out = subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    wall = round(time.perf_counter() - start, 1)
    if out.returncode or not lines:
        return {"backend": backend, "error": (out.stderr or out.stdout)[-3000:], "wall_s": wall}
    return json.loads(lines[-1][len("RESULT ") :]) | {"wall_s": wall}


def repeated(size: str, backend: str, model: Path, args: argparse.Namespace) -> dict:
    """`repeats` runs of one (size, backend), the first profiled: the median run's figures (by MFU,
    among the runs that finished), every run's, and the spread of MFU."""
    runs = []
    for i in range(args.repeats):
        runs.append(run(size, backend, model, args, args.profile if i == 0 else 0))
        print(f"# run {i + 1}/{args.repeats} {size} {backend}: {json.dumps(runs[-1])}", file=sys.stderr, flush=True)
    done = sorted((r for r in runs if "error" not in r), key=lambda r: r["mfu"])
    if args.repeats == 1 or not done:
        return runs[0]
    median = {k: v for k, v in done[(len(done) - 1) // 2].items() if k != "profile"}
    keys = ("step_s", "tokens_per_s", "mfu", "max_memory_gib", "wall_s")
    median["runs"] = [
        {k: r[k] for k in keys if k in r} | ({"error": r["error"][-300:]} if "error" in r else {}) for r in runs
    ]
    median["mfu_spread"] = round(done[-1]["mfu"] - done[0]["mfu"], 3)
    if "profile" in runs[0]:
        median["profile"] = runs[0]["profile"]
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.6b,1.7b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatch-tokens", type=int, default=16384)
    parser.add_argument("--backends", default="megatron,torch")
    parser.add_argument("--recompute", action="store_true", help="recompute each layer's activations in backward")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (size, backend), each a fresh process")
    parser.add_argument(
        "--profile", type=int, default=0, help="profile this many more steps (tools/bench/kernel_profile.py)"
    )
    parser.add_argument("--profile-dir", help="keep each profile's Chrome trace here (alone: --profile 1)")
    parser.add_argument("--image-tokens", type=int, default=256, help="merged tokens of each sample's picture (vl-*)")
    parser.add_argument("--cpu", action="store_true", help="check the script on a CPU (toy sizes, torch backend)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--make-model", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile_dir and not args.profile:
        args.profile = 1  # the earlier meaning of --profile-dir alone: one profiled step
    if args.worker:
        return worker(args)
    if args.make_model:
        return make_model(args.size, Path(args.model), "cuda")
    import torch  # for its version only: no CUDA call in this process

    gpu = "cpu" if args.cpu else gpu_name()
    failed = []  # (size, backend) with no finished run
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if args.cpu:
                make_model(size, Path(tmp), "cpu")
            else:
                model_in_child(size, Path(tmp))
            results = {b: repeated(size, b, Path(tmp), args) for b in args.backends.split(",")}
        failed_here = [b for b, r in results.items() if "error" in r]
        failed += [f"{size} {b}" for b in failed_here]
        ratio = {}  # tokens/s, megatron's over torch's, where both ran
        if all("tokens_per_s" in results.get(b, {}) for b in ("megatron", "torch")):
            ratio["megatron_over_torch"] = round(
                results["megatron"]["tokens_per_s"] / results["torch"]["tokens_per_s"], 3
            )
        print(
            json.dumps(
                {
                    "benchmark": "train_throughput",
                    "size": size,
                    "seq": args.seq,
                    "batch": args.batch,
                    "microbatch_tokens": args.microbatch_tokens,
                    "recompute": args.recompute,
                    "image_tokens": args.image_tokens if size in VISION else 0,
                    "flops_per_token": flops_per_token(SHAPES[size], args.seq)
                    + vision_flops_per_sample(size, args.image_tokens) / args.seq,
                    "gpu": gpu,
                    "torch": torch.__version__,
                    **results,
                    **ratio,
                    **({"failed": failed_here} if failed_here else {}),
                }
            ),
            flush=True,
        )
    if failed:
        print(f"no finished run: {', '.join(failed)}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
