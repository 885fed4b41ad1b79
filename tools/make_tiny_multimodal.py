"""Build the embedded multimodal defaults offline: two tiny policies and their tasks.

    python tools/make_tiny_multimodal.py --out assets          # about a minute on 2 cores

Writes:
- assets/tiny-qwen2.5-vl-shapes/   a tiny Qwen2.5-VL (random weights, then the format warm-up)
- assets/shapes/                   pictures of 0-4 shapes and shapes.jsonl ("how many shapes?")
- assets/tiny-qwen2-audio-beeps/   a tiny Qwen2-Audio (random weights, then the format warm-up)
- assets/beeps/                    clips of 0-4 beeps and beeps.jsonl ("how many beeps?")

The warm-up (relax_hpc.models.tiny_multimodal.format_warmup) teaches the answer format only: one
digit, then the end of the answer, whatever the picture or clip holds, so RL starts near chance.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from relax_hpc.models import tiny_multimodal as tm


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python tools/make_tiny_multimodal.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("assets"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=tm.WARMUP_STEPS, help="format warm-up steps per model")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    shapes = tm.write_task(args.out / "shapes", "image", size=tm.DATASET_SIZE, seed=args.seed)
    beeps = tm.write_task(args.out / "beeps", "audio", size=tm.DATASET_SIZE, seed=args.seed)
    for name, build, processor, data in (
        ("tiny-qwen2.5-vl-shapes", tm.build_vision_model, lambda t: tm.image_processor(), shapes),
        ("tiny-qwen2-audio-beeps", tm.build_audio_model, tm.audio_processor, beeps),
    ):
        tokenizer = tm.build_tokenizer()
        model = build(tokenizer)
        folder = args.out / name
        tm.save_model(model, tokenizer, processor(tokenizer), folder)
        loss = tm.format_warmup(folder, data, args.warmup_steps, random.Random(args.seed))
        print(f"{folder}: {sum(p.numel() for p in model.parameters())} parameters, warm-up loss {loss:.3f}")
    print(f"{shapes}\n{beeps}")


if __name__ == "__main__":
    main()
