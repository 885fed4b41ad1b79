"""Video: what the motion task takes to learn, and what videos cost, each against its baseline
measured in the same run.

    python tools/bench/video.py learn [--seeds 0 1 2] [--steps 250] [--cores-per-run 2]
    python tools/bench/video.py cost [--repeat 3]
    python tools/bench/video.py heldout [--steps 150]

- learn: configs/tiny-video-grpo.yaml for each seed, and its still twin (assets/motion-still: one
  frame held, the same questions) as the baseline that must stay near chance (0.25). Runs go side
  by side when the machine has `cores-per-run` cores for each (each pinned to its own cores with
  taskset), else one after another. Per run: the first step whose 10-step mean reward reaches
  0.7, the seconds from the command to that step, the last 10 steps' mean, and the greedy
  accuracy on the task's 40 held-out clips (heldout.jsonl, never trained on) every 20 versions.
- cost: spool bytes per sample of the canonical clip stored once per group (what the spool does)
  against once per sample, and against the source file, for the motion task's clips and a
  photo-like 448 x 448 one; the processor's time per sample (decode the clip, patch its frames,
  expand the placeholder: what every trainer rank does once per group) against the tiny model's
  forward pass over the same sample.
- heldout: the tiny model trained supervised (AdamW, lr 2e-3, 32 clips a step) on the first 160
  clips of the motion task and of its still twin, and its accuracy on the other 40 every 25 steps:
  what a run can learn of the rows by heart (the still clips) against what carries to new clips.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from multimodal import processor_vs_forward  # a sibling script (tools/bench is no package)
from recipe_sweep import first_crossing  # tools/recipe_sweep.py: the same 10-step window

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/tiny-video-grpo.yaml"
MODEL = REPO / "assets/tiny-qwen2.5-vl-motion"
LEVEL, CHANCE = 0.7, 0.25
EVAL_EVERY = 20  # versions between held-out evaluations (40 clips never trained on, greedy)
QUESTION = "<video>which way does it move? 0 left 1 right 2 up 3 down"


def learn(seeds: list[int], steps: int, cores_per_run: int, out: Path, still: bool = True) -> dict[str, Any]:
    runs = [(f"seed{s}", s, "assets/motion") for s in seeds]
    if still:
        runs.append(("still", seeds[0], "assets/motion-still"))
    cores = sorted(os.sched_getaffinity(0))
    parallel = len(cores) >= cores_per_run * len(runs)
    started: dict[str, tuple[float, subprocess.Popen[bytes]]] = {}
    results = {}
    for k, (name, seed, folder) in enumerate(runs):
        pin = (
            ["taskset", "-c", ",".join(map(str, cores[k * cores_per_run : (k + 1) * cores_per_run]))]
            if parallel
            else []
        )
        command = [
            *pin, sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={out / name}",
            f"run.seed={seed}", f"data.path={folder}/{Path(folder).name}.jsonl",
            f"data.eval_path={folder}/heldout.jsonl", f"trainer.total_steps={steps}",
            f"rollout.eval_every={EVAL_EVERY}",
        ]  # fmt: skip
        log = (out / f"{name}.log").open("wb")
        started[name] = (time.time(), subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        if not parallel:
            results[name] = finish_run(out / name, *started[name], LEVEL)
    for name, (start, process) in started.items():
        if name not in results:
            results[name] = finish_run(out / name, start, process, LEVEL)
    return {"parallel": parallel, "cores_per_run": cores_per_run, "level": LEVEL, "chance": CHANCE, "runs": results}


def finish_run(run_dir: Path, start: float, process: subprocess.Popen[bytes], level: float) -> dict[str, Any]:
    """A run's figures once its command ends: the first step whose 10-step mean reward reaches
    `level` and the seconds from `start` (the command's) to it, the first, last and best 10
    steps' means, and its evaluations' greedy accuracy by version."""
    code = process.wait()
    records = [json.loads(line) for line in (run_dir / "metrics/train.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    rewards = [r["reward"] for r in steps]
    reached = first_crossing(rewards, level)
    evals = [json.loads(line) for line in (run_dir / "metrics/eval.jsonl").read_text().splitlines()]
    return {
        "exit": code,
        "steps": len(rewards),
        "first10": round(float(np.mean(rewards[:10])), 3),
        "last10": round(float(np.mean(rewards[-10:])), 3),
        "best10": round(max(float(np.mean(rewards[i - 10 : i])) for i in range(10, len(rewards) + 1)), 3),
        "step_at_level": reached,
        "s_to_level": None if reached is None else round(steps[reached - 1]["time"] - start, 1),
        "s_total": round(time.time() - start, 1),
        "greedy": {r["version"]: round(r["greedy_accuracy"], 3) for r in evals if "greedy_accuracy" in r},
    }


def photo_video(side: int, frames: int, fps: int) -> bytes:
    """An H.264 clip that compresses like camera footage: smooth shapes drifting, sensor noise."""
    import av

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:side, 0:side] / side
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "23"})
        stream.width, stream.height, stream.pix_fmt = side, side, "yuv420p"
        for k in range(frames):
            t = k / fps
            base = np.stack([np.sin(6 * x + t), np.cos(5 * y - t), x * y], axis=-1)
            pixels = np.clip((base * 0.5 + 0.5) * 255 + rng.normal(0, 8, (side, side, 3)), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def spool_bytes(source: bytes, spec: Any, group_size: int, folder: Path) -> dict[str, Any]:
    from relax_hpc.data.video import canonical
    from relax_hpc.exchange.spool import SampleBatch, write_batch

    clip = canonical(source, spec)
    n = 4 * group_size  # four groups
    sizes = {}
    for name, per_sample in (("per_group", False), ("per_sample", True)):
        group_ids = list(range(n)) if per_sample else [i // group_size for i in range(n)]
        batch = SampleBatch.from_samples(
            seq=0, sequences=[[5] * 100 + [7] * 20] * n, prompt_lens=[100] * n, logprobs=[[-0.5] * 20] * n,
            rewards=[0.0] * n, group_ids=group_ids, policy_version=[0] * n, prompt_index=group_ids,
            media={g: [("video", clip)] for g in set(group_ids)},
        )  # fmt: skip
        path = folder / f"{name}.h5"
        write_batch(path, batch, writer="bench")
        sizes[name] = path.stat().st_size / n
    return {
        "source_bytes": len(source),
        "canonical_bytes": len(clip),
        "bytes_per_sample_per_group": round(sizes["per_group"]),
        "bytes_per_sample_per_sample": round(sizes["per_sample"]),
        "ratio": round(sizes["per_sample"] / sizes["per_group"], 2),
    }


def cost(repeat: int) -> dict[str, Any]:
    from relax_hpc.data.video import VideoSpec, canonical

    motion = (REPO / "assets/motion/0000.mp4").read_bytes()
    spec = VideoSpec.from_folder(str(MODEL))
    photo = photo_video(448, 240, 24)  # 10 s at 24 fps: 20 frames kept
    with tempfile.TemporaryDirectory() as tmp:
        return {
            "spool_motion": spool_bytes(motion, spec, 8, Path(tmp)),
            "spool_photo_448": spool_bytes(photo, VideoSpec(), 8, Path(tmp)),
            "processor_motion": processor_vs_forward(MODEL, QUESTION, [("video", canonical(motion, spec))], 2, repeat),
        }


def heldout(steps: int) -> dict[str, Any]:
    import random

    import torch

    from relax_hpc.data.processor import MediaProcessor, concat_inputs, video_spec
    from relax_hpc.data.prompts import load_prompts
    from relax_hpc.models.hf import load_policy

    out = {}
    for name in ("motion", "motion-still"):
        torch.manual_seed(0)
        rows = load_prompts(
            REPO / f"assets/{name}/{name}.jsonl", "prompt", "answer", {"video": "videos"}, video=video_spec(str(MODEL))
        )  # fmt: skip
        processor = MediaProcessor(str(MODEL))
        model = load_policy(str(MODEL), torch.float32).train()
        answer = processor.tokenizer.convert_tokens_to_ids
        items = [
            (processor.process(processor.prompt_ids(r), [("video", r.media[0].read())]), answer(r.answer)) for r in rows
        ]  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

        def logits(model: torch.nn.Module, batch: list[Any]) -> torch.Tensor:
            ids = torch.tensor([b[0].input_ids for b in batch])
            inputs = concat_inputs([b[0].tensors for b in batch])
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[:, -1]

        rng, curve = random.Random(0), []
        for step in range(1, steps + 1):
            batch = rng.sample(items[:160], 32)
            loss = torch.nn.functional.cross_entropy(logits(model, batch), torch.tensor([b[1] for b in batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 25 == 0:
                with torch.no_grad():
                    right = logits(model, items[160:]).argmax(-1) == torch.tensor([b[1] for b in items[160:]])
                curve.append(
                    {"step": step, "train_loss": round(float(loss), 3), "heldout": float(right.float().mean())}
                )
        out[name] = curve
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python tools/bench/video.py", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["learn", "cost", "heldout"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--cores-per-run", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="learn: where the runs go (a temporary folder)")
    parser.add_argument("--no-still", action="store_true", help="learn: leave out the still baseline")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.part == "cost":
        print(json.dumps(cost(args.repeat), indent=1))
        return
    if args.part == "heldout":
        print(json.dumps(heldout(args.steps), indent=1))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="video-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(learn(args.seeds, args.steps, args.cores_per_run, out, not args.no_still), indent=1))


if __name__ == "__main__":
    main()
