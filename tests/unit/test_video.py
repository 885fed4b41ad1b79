"""Video in the data layer: decoding, SGLang's sampling and sizing rules (checked against SGLang
0.5.23's own functions), the lossless canonical clip, and the torchvision-free patcher (its layout
checked against transformers' image processor here; tests/gpu/test_video_patcher_gpu.py holds it
equal to transformers' video processor where torchvision loads)."""

from __future__ import annotations

import ast
import importlib.util
import io
import math
import os
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import av
import numpy as np
import pytest
import torch

from relax_hpc.data import video as V
from relax_hpc.data.media import MediaError, MediaRef, sniff_mime
from relax_hpc.data.processor import media_kinds
from relax_hpc.data.prompts import DatasetError, load_prompts

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MOTION_MODEL = ASSETS / "tiny-qwen2.5-vl-motion"


def mp4(frames: np.ndarray, fps: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"crf": "18"})
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def noise(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def test_the_canonical_clip_is_lossless_and_keeps_a_fractional_rate():
    clip = V.Clip(noise(6, 56, 84), 48 / 25)
    data = V.encode(clip)
    assert sniff_mime("video", data) == "video/x-msvideo"
    back = V.decode(data)
    assert np.array_equal(back.frames, clip.frames) and back.fps == pytest.approx(48 / 25, abs=1e-9)


def test_sampling_keeps_two_frames_per_second_and_is_idempotent():
    spec = V.VideoSpec(min_pixels=28 * 28, max_pixels=56 * 84)
    source = V.Clip(noise(20, 56, 84), 10.0)  # 2 s at 10 fps
    kept = V.sample(source, spec)
    assert len(kept.frames) == 4 and kept.fps == pytest.approx(2.0)
    assert np.array_equal(kept.frames, source.frames[[0, 6, 12, 19]])  # floor(linspace(0, 19, 4))
    again = V.sample(V.decode(V.encode(kept)), spec)
    assert np.array_equal(again.frames, kept.frames) and again.fps == pytest.approx(kept.fps)


def test_frames_are_sized_to_the_factor_within_the_bounds_and_stay_once_sized():
    spec = V.VideoSpec(min_pixels=56 * 56, max_pixels=112 * 112)
    kept = V.sample(V.Clip(noise(4, 200, 300), 2.0), spec)
    height, width = kept.frames.shape[1:3]
    assert height % 28 == 0 and width % 28 == 0 and 56 * 56 <= height * width <= 112 * 112
    assert np.array_equal(V.sample(kept, spec).frames, kept.frames)


@pytest.fixture(scope="module")
def qwen_vl() -> SimpleNamespace:
    """SGLang 0.5.23's own sampling and sizing functions and constants, taken from its Qwen-VL
    processor's source (importing the module pulls its model classes and their GPU packages)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("sglang is not installed: tools/install.sh installs it")
        pytest.skip("sglang is not installed (tools/install.sh installs it)")
    source = Path(spec.origin).parent / "srt/multimodal/processors/qwen_vl.py"
    tree = ast.parse(source.read_text())
    wanted = {"smart_resize", "round_by_factor", "ceil_by_factor", "floor_by_factor", "smart_nframes"}
    constants = {"IMAGE_FACTOR", "MIN_PIXELS", "MAX_RATIO", "VIDEO_TOTAL_PIXELS", "VIDEO_MIN_PIXELS",
                 "VIDEO_MAX_PIXELS", "FRAME_FACTOR", "FPS", "FPS_MIN_FRAMES", "FPS_MAX_FRAMES"}  # fmt: skip
    nodes: list[ast.stmt] = [
        n for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name in wanted)
        or (isinstance(n, ast.Assign) and {getattr(t, "id", None) for t in n.targets} & constants)
    ]  # fmt: skip
    names: dict[str, Any] = {
        "math": math,
        "os": os,
        "logger": SimpleNamespace(warning=lambda *a: None),
        "MAX_PIXELS": 0,
    }
    exec(compile(ast.Module(nodes, type_ignores=[]), str(source), "exec"), names)
    assert wanted | constants <= set(names), sorted(wanted | constants - set(names))
    return SimpleNamespace(**names)


def test_frame_counts_and_sizes_are_sglangs(qwen_vl):
    spec = V.VideoSpec()
    for total, fps in ((8, 4.0), (300, 30.0), (175, 24.0), (3, 30.0), (2000, 30.0), (13, 2.0), (5, 1.0)):
        assert V.frame_count(total, fps, spec) == qwen_vl.smart_nframes({}, total, fps), (total, fps)
    for height, width, frames in (
        (56, 56, 4),
        (480, 640, 20),
        (1080, 1920, 400),
        (33, 999, 8),
        (720, 1280, 768),
        (10, 1000, 4),
    ):
        max_pixels = max(
            min(qwen_vl.VIDEO_MAX_PIXELS, qwen_vl.VIDEO_TOTAL_PIXELS / frames * qwen_vl.FRAME_FACTOR),
            int(qwen_vl.VIDEO_MIN_PIXELS * 1.05),
        )
        expected = qwen_vl.smart_resize(height, width, 28, qwen_vl.VIDEO_MIN_PIXELS, max_pixels)
        assert V.frame_size(height, width, frames, spec) == expected, (height, width, frames)
    # Qwen3-VL: SGLang's preprocess_video runs at its default factor and bounds (only fps is passed),
    # whatever the model's own: a Qwen3-VL spec samples with exactly those
    qwen3 = V.VideoSpec(timestamps=True, patch_size=16, min_pixels=4096, max_pixels=10**8)
    assert qwen3.sampling == (qwen_vl.IMAGE_FACTOR, qwen_vl.VIDEO_MIN_PIXELS, qwen_vl.VIDEO_MAX_PIXELS)
    sglang_size = qwen_vl.smart_resize(56, 56, qwen_vl.IMAGE_FACTOR, qwen_vl.VIDEO_MIN_PIXELS, qwen_vl.VIDEO_MAX_PIXELS)
    assert V.frame_size(56, 56, 4, qwen3) == sglang_size


def test_the_patcher_lays_out_patches_as_the_models_image_processor_does():
    """A clip of one picture held for two frames is the picture, as the image processor repeats
    it to fill a temporal patch: the same patches in the same order."""
    from transformers import Qwen2VLImageProcessorPil

    picture = noise(1, 56, 84, seed=3)
    spec = V.VideoSpec(min_pixels=56 * 84, max_pixels=56 * 84, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    out = V.VideoPatcher(spec)([np.repeat(picture, 2, axis=0)])
    images = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 56 * 84, "longest_edge": 56 * 84},
        image_mean=list(spec.mean), image_std=list(spec.std),
    )(images=[picture[0]], return_tensors="pt")  # fmt: skip
    assert out["video_grid_thw"].tolist() == images["image_grid_thw"].tolist() == [[1, 4, 6]]
    torch.testing.assert_close(out["pixel_values_videos"], images["pixel_values"], atol=1e-5, rtol=0)


def test_the_patcher_repeats_the_last_frame_and_is_deterministic():
    spec = V.VideoSpec(min_pixels=28 * 28, max_pixels=56 * 56)
    frames = noise(3, 56, 56)
    patcher = V.VideoPatcher(spec)
    out = patcher([frames])
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    padded = patcher([np.concatenate([frames, frames[-1:]])])
    assert torch.equal(out["pixel_values_videos"], padded["pixel_values_videos"])
    resized = patcher([noise(4, 100, 130)])  # sized into the bounds first: 28 x 56
    assert resized["video_grid_thw"].tolist() == [[2, 2, 4]]
    assert torch.equal(resized["pixel_values_videos"], patcher([noise(4, 100, 130)])["pixel_values_videos"])


def test_a_video_reads_as_its_canonical_clip_and_bad_videos_are_refused(tmp_path):
    spec = V.VideoSpec.from_folder(str(MOTION_MODEL))
    assert (spec.min_pixels, spec.max_pixels, spec.fps) == (56 * 56, 56 * 56, 2.0)
    path = tmp_path / "a.mp4"
    path.write_bytes(mp4(noise(8, 56, 56), 4))
    clip = V.decode(MediaRef("video", str(path), spec).read())
    assert clip.frames.shape == (4, 56, 56, 3) and clip.fps == pytest.approx(2.0)
    assert MediaRef("video", str(path)).read() == path.read_bytes()  # without a spec: the file as it is
    (tmp_path / "bad.mp4").write_bytes(b"not a video at all")
    with pytest.raises(MediaError, match="unreadable video"):
        MediaRef("video", str(tmp_path / "bad.mp4"), spec).read()
    single = tmp_path / "one.mp4"
    single.write_bytes(mp4(noise(1, 56, 56), 4))
    with pytest.raises(MediaError, match=r"a video of 1 frame\(s\): at least 2 are needed"):
        MediaRef("video", str(single), spec).read()
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "<video>which way?", "answer": "1", "videos": ["bad.mp4"]}\n')
    with pytest.raises(DatasetError, match=r"rows.jsonl:1: video .*bad.mp4: unreadable video"):
        load_prompts(rows, "prompt", "answer", {"video": "videos"}, check_media=True, video=spec)


def test_qwen_vl_models_take_videos_and_omni_models_are_refused(tmp_path):
    from relax_hpc.config.schema import JobConfig
    from relax_hpc.submit import dataset_problems
    from tests.models.qwen3_family import build_qwen3_omni, build_qwen3_vl_video

    assert media_kinds(str(MOTION_MODEL)) == {"image", "video"}
    qwen3 = build_qwen3_vl_video(tmp_path / "qwen3-vl")
    assert media_kinds(str(qwen3)) == {"image", "video"}
    omni = build_qwen3_omni(tmp_path / "omni")
    assert media_kinds(str(omni)) == {"image", "audio"}
    data = {"path": str(ASSETS / "motion/motion.jsonl"), "media": {"video": "videos"}}
    assert dataset_problems(JobConfig.model_validate({"model": {"path": str(qwen3)}, "data": data})) == []
    (problem,) = dataset_problems(JobConfig.model_validate({"model": {"path": str(omni)}, "data": data}))
    assert "not a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model" in problem and "Omni" in problem


def test_qwen3_vl_sampling_is_sglangs_and_its_processor_sizes_the_whole_clip(tmp_path):
    """Qwen3-VL: SGLang samples and sizes frames with its own constants (factor 28, per-frame
    bounds), which --mm-process-config leaves alone (fps only); the model's processor then sizes
    the whole clip at factor 32 within its t x h x w budget, optionally capped per frame."""
    from tests.models.qwen3_family import build_qwen3_vl_video

    spec = V.VideoSpec.from_folder(str(build_qwen3_vl_video(tmp_path / "q")))
    assert spec.timestamps and spec.factor == 32 and spec.sampling == (28, 128 * 28 * 28, 768 * 28 * 28)
    assert spec.sglang_config() == {"fps": 2.0}
    assert V.frame_size(56, 56, 4, spec) == (336, 336)  # SGLang's per-frame minimum, at factor 28
    patcher = V.VideoPatcher(spec)
    assert patcher.size(4, 336, 336) == (64, 64)  # the clip's budget: 4 x 64 x 64
    whole = V.VideoSpec(timestamps=True, patch_size=16, min_pixels=4096, max_pixels=32 * 32 * 768 * 10)
    # 20 frames share 7.86 M pixels: scaled by sqrt(20 x 720 x 1280 / 7.86 M), floored to 32
    assert V.VideoPatcher(whole).size(20, 720, 1280) == (448, 832)
    capped = V.VideoSpec(**{**whole.__dict__, "cap_pixels_per_frame": True, "max_video_tokens": 64})
    assert V.VideoPatcher(capped).size(20, 720, 1280) == (192, 320)  # at most 64 tokens (65,536 pixels) a frame
    out = patcher([np.zeros((5, 336, 336, 3), np.uint8)], [V.metadata(V.Clip(np.zeros((5, 8, 8, 3)), 2.0))])
    # 5 frames: the last repeated into a third temporal patch, and 32 x 32 frames (4 x 64 x 64 is the budget)
    assert out["video_grid_thw"].tolist() == [[3, 2, 2]]
    assert out["video_metadata"][0].frames_indices == [0, 1, 2, 3, 4]


def test_the_clip_rate_survives_as_a_fraction():
    data = V.encode(V.Clip(noise(4, 28, 28), 14 * 24 / 175))
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].average_rate == Fraction(14 * 24, 175)
