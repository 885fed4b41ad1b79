"""Build the embedded multimodal defaults offline: two tiny policies and their tasks.

    python tools/make_tiny_multimodal.py --out assets          # about a minute on 2 cores
    python tools/make_tiny_multimodal.py --out assets --tasks motion   # one task only

Writes:
- assets/tiny-qwen2.5-vl-shapes/   a tiny Qwen2.5-VL (random weights, then the format warm-up)
- assets/shapes/                   pictures of 0-4 shapes and shapes.jsonl ("how many shapes?");
                                   every task folder also holds heldout.jsonl and its own media
                                   (heldout-NNNN), never trained on: the runs' data.eval_path
- assets/tiny-qwen2-audio-beeps/   a tiny Qwen2-Audio (random weights, then the format warm-up)
- assets/beeps/                    clips of 0-4 beeps and beeps.jsonl ("how many beeps?")
- assets/tiny-qwen2.5-vl-motion/   a tiny Qwen2.5-VL with a video processor configuration
- assets/motion/                   videos of a moving dot and motion.jsonl ("which way?")
- assets/motion-still/             the same questions over still videos (the one-frame baseline)

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
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="which tasks to build")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for task in args.tasks:
        torch.manual_seed(args.seed)
        name, kind, build, processor = TASKS[task]
        data = tm.write_task(args.out / task, kind, size=tm.DATASET_SIZE, seed=args.seed)
        tm.write_task(args.out / task, kind, size=tm.HELD_OUT_SIZE, seed=args.seed, held_out=True)
        if kind == "video":
            for held_out, size in ((False, tm.DATASET_SIZE), (True, tm.HELD_OUT_SIZE)):
                tm.write_task(args.out / f"{task}-still", kind, size, args.seed, still=True, held_out=held_out)
        tokenizer = tm.build_tokenizer()
        model = build(tokenizer)
        folder = args.out / name
        tm.save_model(model, tokenizer, processor(tokenizer), folder)
        if kind == "video":
            tm.write_video_processor_config(folder)
        # the motion task's warm-up answers one of its four directions: RL starts at chance (0.25)
        answers = len(tm.DIRECTIONS) if kind == "video" else 10
        loss = tm.format_warmup(folder, data, args.warmup_steps, random.Random(args.seed), answers)
        print(f"{folder}: {sum(p.numel() for p in model.parameters())} parameters, warm-up loss {loss:.3f}; {data}")


# task: (model folder, media kind, model builder, processor builder)
TASKS = {
    "shapes": ("tiny-qwen2.5-vl-shapes", "image", tm.build_vision_model, lambda t: tm.image_processor()),
    "beeps": ("tiny-qwen2-audio-beeps", "audio", tm.build_audio_model, tm.audio_processor),
    "motion": ("tiny-qwen2.5-vl-motion", "video", tm.build_vision_model, lambda t: tm.image_processor()),
}


if __name__ == "__main__":
    main()
