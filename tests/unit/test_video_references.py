"""relax_hpc.data.video against what it replaces, on the CPU: VideoPatcher against transformers'
Qwen2VLVideoProcessor and Qwen3VLVideoProcessor, a tiny Qwen3-VL's whole processor with the patcher
against with its own video processor, and the data layer's frame resize against torchvision's as
SGLang calls it. The originals need torchvision, which does not load here: their outputs on the
GPU test's clips (tests/gpu/test_video_patcher_gpu.py) are tests/data/video_references.json, made by
tools/make_video_references.py in a throwaway environment where it does. Bit for bit: shapes and
grids exactly, the SHA-256 of each tensor's bytes, and evenly spaced samples to say by how much."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relax_hpc.data import video as V

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "make_video_references.py"
REFERENCES = json.loads((ROOT / "tests" / "data" / "video_references.json").read_text())


def load_script() -> Any:
    """The script's module (its cases, frames and digest), without running it."""
    spec = importlib.util.spec_from_file_location("make_video_references", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = load_script()
REMAKE = f"remake them with {MAKE.COMMAND}, in a venv where torchvision loads (the steps are in its docstring)"


def assert_same(ours: Any, reference: dict[str, Any], what: str) -> None:
    """Bit for bit against a digest the script stored; a failure says the largest gap among the samples."""
    mine = MAKE.digest(ours)
    assert (mine["dtype"], mine["shape"]) == (reference["dtype"], reference["shape"]), what
    gap = np.abs(np.asarray(mine["samples"], dtype=np.float64) - np.asarray(reference["samples"])).max()
    assert mine["sha256"] == reference["sha256"], f"{what}: not bit-exact (largest gap among the samples {gap:.3e})"


def test_the_references_are_of_the_pinned_transformers():
    pin = re.search(r"^transformers==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert pin is not None, "constraints.txt pins no transformers"
    made, pinned = REFERENCES["versions"]["transformers"], pin.group(1)
    assert made == pinned, f"references made with transformers {made}, constraints.txt pins {pinned}: {REMAKE}"


def test_the_references_cover_the_gpu_tests_clips():
    """The script's cases are the GPU test's, as lists of literals there (it imports torchvision)."""
    source = (ROOT / "tests" / "gpu" / "test_video_patcher_gpu.py").read_text()
    for name, cases in (("CLIPS", MAKE.QWEN2_CLIPS), ("QWEN3_CLIPS", MAKE.QWEN3_CLIPS)):
        listed = re.search(rf"^{name} = \[\n(.*?)^\]", source, re.MULTILINE | re.DOTALL)
        # the lists hold tuples of numbers, products and booleans: evaluated with no names at all
        assert listed is not None and eval(f"[{listed.group(1)}]", {"__builtins__": {}}) == cases, name
    assert [case["clip"] for case in REFERENCES["qwen2"]] == [list(c) for c in MAKE.QWEN2_CLIPS], REMAKE
    assert [case["clip"] for case in REFERENCES["qwen3"]] == [list(c) for c in MAKE.QWEN3_CLIPS], REMAKE


@pytest.mark.parametrize("case", REFERENCES["qwen2"], ids=lambda case: "x".join(map(str, case["clip"][:3])))
def test_the_patcher_equals_transformers_qwen2_video_processor(case):
    count, height, width, min_pixels, max_pixels = case["clip"]
    spec = V.VideoSpec(min_pixels=min_pixels, max_pixels=max_pixels, mean=MAKE.MEAN, std=MAKE.STD)
    ours = V.VideoPatcher(spec)([MAKE.noise(count, height, width, count)])
    assert ours["video_grid_thw"].tolist() == case["grid"]
    assert_same(ours["pixel_values_videos"], case["pixels"], f"qwen2 {case['clip']}")


@pytest.mark.parametrize("case", REFERENCES["resize"], ids=lambda case: "x".join(map(str, case["frames"])))
def test_the_frame_resize_equals_torchvisions_as_sglang_calls_it(case):
    count, height, width = case["frames"]
    assert list(V.frame_size(height, width, count, V.VideoSpec())) == case["size"]
    ours = V.sample(V.Clip(MAKE.noise(count, height, width, height), 2.0), V.VideoSpec()).frames
    assert_same(ours, case["frames_out"], f"resize {case['frames']}")


@pytest.mark.parametrize("case", REFERENCES["qwen3"], ids=lambda case: "x".join(map(str, case["clip"][:3])))
def test_the_patcher_equals_transformers_qwen3_video_processor(case):
    count, height, width, min_pixels, max_pixels, cap = case["clip"]
    spec = V.VideoSpec(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=16, mean=MAKE.MEAN, std=MAKE.STD,
        timestamps=True, cap_pixels_per_frame=cap, max_video_tokens=64,
    )  # fmt: skip
    ours = V.VideoPatcher(spec)([MAKE.noise(count, height, width, count)])
    assert ours["video_grid_thw"].tolist() == case["grid"]
    assert_same(ours["pixel_values_videos"], case["pixels"], f"qwen3 {case['clip']}")


@pytest.fixture(scope="module")
def qwen3_processor(tmp_path_factory):
    from relax_hpc.data.processor import MediaProcessor
    from tests.models.qwen3_family import build_qwen3_vl_video

    return MediaProcessor(str(build_qwen3_vl_video(tmp_path_factory.mktemp("qwen3-vl"))))


@pytest.mark.parametrize("case", REFERENCES["qwen3_processor"], ids=lambda case: f"{case['clip'][0]}@{case['clip'][1]}")
def test_a_qwen3_vl_processor_with_the_patcher_writes_its_own_prompt_and_patches(qwen3_processor, case):
    """The model's processor as SGLang calls it (its own video processor, the frames' metadata,
    do_sample_frames=False) against the same processor with the patcher, as MediaProcessor makes it."""
    count, fps = case["clip"]
    frames = MAKE.noise(count, 336, 336, count)
    ours = qwen3_processor.hf(
        text=[MAKE.PROCESSOR_TEXT], videos=[frames], return_tensors="pt",
        video_metadata=[V.metadata(V.Clip(frames, fps))],
    )  # fmt: skip
    assert ours["input_ids"][0].tolist() == case["input_ids"]  # the frames' times among them
    assert ours["video_grid_thw"].tolist() == case["grid"]
    assert_same(ours["pixel_values_videos"], case["pixels"], f"qwen3 processor {case['clip']}")
