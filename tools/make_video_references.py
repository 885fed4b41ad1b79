"""Reference outputs of what relax_hpc.data.video replaces, for tests/unit/test_video_references.py.

VideoPatcher stands in for transformers' Qwen2VLVideoProcessor and Qwen3VLVideoProcessor, and the
data layer's frame resize for torchvision's as SGLang 0.5.23 calls it. Both originals need
torchvision, which does not load beside the CPU torch build in .venv, so their outputs on the
clips of tests/gpu/test_video_patcher_gpu.py (the same seeded frames and settings) are made here,
in a throwaway environment where torchvision loads (no GPU needed), and committed. Run from the
repository root (x86_64; pip takes torch and torchvision from this machine's disk, the rest at
constraints.txt's pins):

    python3 -m venv /tmp/vref
    /tmp/vref/bin/pip install torch==2.14.1 torchvision==0.29.1
    grep -v '^torch==' constraints.txt > /tmp/vref/constraints.txt
    /tmp/vref/bin/pip install -c /tmp/vref/constraints.txt transformers numpy pillow tokenizers
    /tmp/vref/bin/python tools/make_video_references.py   # writes tests/data/video_references.json

Rerun it when constraints.txt's transformers pin moves: the test fails until the recorded version
is the pin's. What it stores, for each output: the grids and shapes exactly, the SHA-256 of the
tensor's bytes (float32 patches, uint8 frames) and SAMPLES of its values at even steps, so the test
is bit-exact and a failure says by how much. It also runs relax_hpc's own patcher and resize here
and prints whether they equal the originals in this environment (the GPU test's check, on the CPU).
References made under torch 2.14.1 (the build torchvision 0.29.1 needs) hold bit for bit under
.venv's torch 2.13.0: the resize kernels these calls reach gave the same bytes in both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "video_references.json"
COMMAND = "python tools/make_video_references.py"
SAMPLES = 256

# The GPU test's cases, kept in step with tests/gpu/test_video_patcher_gpu.py.
MEAN, STD = (0.5, 0.45, 0.4), (0.2, 0.25, 0.3)
# (frames, height, width, min_pixels, max_pixels); frames seeded by their count
QWEN2_CLIPS = [
    (4, 56, 56, 56 * 56, 56 * 56),
    (6, 100, 130, 28 * 28, 56 * 56),
    (3, 40, 50, 112 * 112, 200 * 200),
    (8, 224, 336, 128 * 28 * 28, 768 * 28 * 28),
    (5, 480, 640, 128 * 28 * 28, 768 * 28 * 28),
]
# (height, width) of 4 frames seeded by their height, sized by SGLang's rule with VideoSpec()
RESIZES = [(480, 640), (1080, 1920), (100, 130)]
# (frames, height, width, min_pixels, max_pixels, cap_pixels_per_frame), max_video_tokens=64
QWEN3_CLIPS = [
    (4, 336, 336, 4 * 64 * 64, 4 * 64 * 64, False),
    (6, 100, 130, 4 * 32 * 32, 6 * 64 * 64, False),
    (3, 40, 50, 3 * 64 * 64, 3 * 128 * 128, False),
    (5, 480, 640, 128 * 32 * 32, 768 * 32 * 32, False),
    (20, 448, 784, 128 * 32 * 32, 768 * 32 * 32 * 20, True),
]
# (frames of 336 x 336, fps) through a tiny Qwen3-VL's whole processor (tests/models/qwen3_family)
QWEN3_PROCESSOR_CLIPS = [(4, 2.0), (7, 2.0), (6, 1.5)]
PROCESSOR_TEXT = "<|vision_start|><|video_pad|><|vision_end|>which way?"


def noise(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """The GPU test's frames: [count, height, width, 3] uint8 from a seeded generator."""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def digest(array: Any) -> dict[str, Any]:
    """What a bit-exact comparison needs of a tensor or array: dtype, shape, the SHA-256 of its
    bytes (C order, this machine's little-endian) and SAMPLES values at even steps of the flat
    array, as exact numbers (a float32 goes to JSON as the float64 holding it exactly)."""
    values = np.ascontiguousarray(array.numpy() if hasattr(array, "numpy") else array)
    flat = values.reshape(-1)
    at = np.linspace(0, flat.size - 1, num=min(SAMPLES, flat.size)).astype(np.int64)
    return {
        "dtype": str(values.dtype),
        "shape": list(values.shape),
        "sha256": hashlib.sha256(values.tobytes()).hexdigest(),
        "samples": flat[at].tolist(),
    }


def qwen2_references() -> list[dict[str, Any]]:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    cases = []
    for count, height, width, min_pixels, max_pixels in QWEN2_CLIPS:
        theirs = Qwen2VLVideoProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, image_mean=list(MEAN),
            image_std=list(STD), cap_pixels_per_frame=False, do_sample_frames=False,
        )(videos=[noise(count, height, width, count)], return_tensors="pt")  # fmt: skip
        cases.append(
            {"clip": [count, height, width, min_pixels, max_pixels], "grid": theirs["video_grid_thw"].tolist(),
             "pixels": digest(theirs["pixel_values_videos"])}
        )  # fmt: skip
    return cases


def resize_references() -> list[dict[str, Any]]:
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    from relax_hpc.data import video as V

    cases = []
    for height, width in RESIZES:
        frames = noise(4, height, width, height)
        size = V.frame_size(height, width, 4, V.VideoSpec())  # SGLang's smart_resize
        theirs = F.resize(
            torch.from_numpy(frames).permute(0, 3, 1, 2), list(size), interpolation=InterpolationMode.BILINEAR
        )
        out = digest(theirs.permute(0, 2, 3, 1))
        cases.append({"frames": [4, height, width], "size": list(size), "frames_out": out})
    return cases


def qwen3_references() -> list[dict[str, Any]]:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    cases = []
    for count, height, width, min_pixels, max_pixels, cap in QWEN3_CLIPS:
        theirs = Qwen3VLVideoProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, image_mean=list(MEAN),
            image_std=list(STD), cap_pixels_per_frame=cap, max_video_tokens=64, do_sample_frames=False,
        )(videos=[noise(count, height, width, count)], return_tensors="pt")  # fmt: skip
        cases.append(
            {"clip": [count, height, width, min_pixels, max_pixels, cap], "grid": theirs["video_grid_thw"].tolist(),
             "pixels": digest(theirs["pixel_values_videos"])}
        )  # fmt: skip
    return cases


def processor_references() -> list[dict[str, Any]]:
    """The tiny Qwen3-VL's own processor (its Qwen3VLVideoProcessor) as SGLang calls it."""
    from transformers import AutoProcessor

    from relax_hpc.data import video as V
    from tests.models.qwen3_family import build_qwen3_vl_video

    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        processor = AutoProcessor.from_pretrained(build_qwen3_vl_video(Path(tmp) / "qwen3-vl"))
        assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
        for count, fps in QWEN3_PROCESSOR_CLIPS:
            frames = noise(count, 336, 336, count)
            theirs = processor(
                text=[PROCESSOR_TEXT], videos=[frames], return_tensors="pt",
                video_metadata=[V.metadata(V.Clip(frames, fps))], do_sample_frames=False,
            )  # fmt: skip
            cases.append(
                {"clip": [count, fps], "input_ids": theirs["input_ids"][0].tolist(),
                 "grid": theirs["video_grid_thw"].tolist(), "pixels": digest(theirs["pixel_values_videos"])}
            )  # fmt: skip
    return cases


def compare_here(references: dict[str, Any]) -> None:
    """relax_hpc's patcher and resize in this environment against the references just made."""
    from relax_hpc.data import video as V

    for case in references["qwen2"]:
        count, height, width, low, high = case["clip"]
        spec = V.VideoSpec(min_pixels=low, max_pixels=high, mean=MEAN, std=STD)
        ours = V.VideoPatcher(spec)([noise(count, height, width, count)])["pixel_values_videos"]
        print(f"qwen2 {case['clip']}: patcher here equal: {digest(ours) == case['pixels']}")
    for case in references["resize"]:
        count, height, width = case["frames"]
        ours = V.sample(V.Clip(noise(count, height, width, height), 2.0), V.VideoSpec()).frames
        print(f"resize {case['frames']}: data layer here equal: {digest(ours) == case['frames_out']}")
    for case in references["qwen3"]:
        count, height, width, low, high, cap = case["clip"]
        spec = V.VideoSpec(
            min_pixels=low, max_pixels=high, patch_size=16, mean=MEAN, std=STD, timestamps=True,
            cap_pixels_per_frame=cap, max_video_tokens=64,
        )  # fmt: skip
        ours = V.VideoPatcher(spec)([noise(count, height, width, count)])["pixel_values_videos"]
        print(f"qwen3 {case['clip']}: patcher here equal: {digest(ours) == case['pixels']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # relax_hpc and tests, from this checkout

    import torch
    import torchvision
    import transformers

    versions = {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "torchvision": torchvision.__version__, "numpy": np.__version__,
    }  # fmt: skip
    references = {
        "made_by": COMMAND + " (in a venv with torchvision; see its docstring)",
        "versions": versions,
        "mean": list(MEAN),
        "std": list(STD),
        "samples": SAMPLES,
        "qwen2": qwen2_references(),
        "resize": resize_references(),
        "qwen3": qwen3_references(),
        "qwen3_processor": processor_references(),
    }
    args.out.write_text(json.dumps(references, indent=1) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    compare_here(references)


if __name__ == "__main__":
    main()
