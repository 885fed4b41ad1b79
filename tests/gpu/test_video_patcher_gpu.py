"""relax_hpc.data.video against what it replaces, on the GPU machine, where torchvision loads:
VideoPatcher against transformers' Qwen2VLVideoProcessor and Qwen3VLVideoProcessor, a Qwen3-VL
model's whole processor (its frame times in the prompt) with the patcher against with its own
video processor, and the data layer's frame resize against torchvision's (the call SGLang 0.5.23
makes). Bit for bit, on the CPU (where both processors run: the driver, the engines and the trainer
process media on the host)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_hpc.data import video as V

pytestmark = pytest.mark.gpu
torchvision = pytest.importorskip("torchvision")

# (frames, height, width, min_pixels, max_pixels): kept at size, shrunk, grown, odd frame counts
CLIPS = [
    (4, 56, 56, 56 * 56, 56 * 56),
    (6, 100, 130, 28 * 28, 56 * 56),
    (3, 40, 50, 112 * 112, 200 * 200),
    (8, 224, 336, 128 * 28 * 28, 768 * 28 * 28),
    (5, 480, 640, 128 * 28 * 28, 768 * 28 * 28),
]


@pytest.mark.parametrize("count,height,width,min_pixels,max_pixels", CLIPS)
def test_the_patcher_equals_transformers_video_processor(count, height, width, min_pixels, max_pixels):
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    frames = np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    spec = V.VideoSpec(min_pixels=min_pixels, max_pixels=max_pixels, mean=(0.5, 0.45, 0.4), std=(0.2, 0.25, 0.3))
    theirs = Qwen2VLVideoProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, image_mean=list(spec.mean),
        image_std=list(spec.std), cap_pixels_per_frame=False, do_sample_frames=False,
    )(videos=[frames], return_tensors="pt")  # fmt: skip
    ours = V.VideoPatcher(spec)([frames])
    assert ours["video_grid_thw"].tolist() == theirs["video_grid_thw"].tolist()
    gap = (ours["pixel_values_videos"] - theirs["pixel_values_videos"]).abs().max().item()
    print(f"MEASURED patcher {count}x{height}x{width}: grid {ours['video_grid_thw'].tolist()}, max gap {gap:.3e}")
    assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])


@pytest.mark.parametrize("height,width", [(480, 640), (1080, 1920), (100, 130)])
def test_the_frame_resize_equals_torchvisions_as_sglang_calls_it(height, width):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    frames = np.random.default_rng(height).integers(0, 256, (4, height, width, 3), dtype=np.uint8)
    spec = V.VideoSpec()
    ours = V.sample(V.Clip(frames, 2.0), spec).frames
    size = V.frame_size(height, width, 4, spec)
    theirs = F.resize(
        torch.from_numpy(frames).permute(0, 3, 1, 2), list(size), interpolation=InterpolationMode.BILINEAR
    )
    theirs_np = theirs.permute(0, 2, 3, 1).numpy()
    gap = int(np.abs(ours.astype(int) - theirs_np.astype(int)).max())
    print(f"MEASURED resize {height}x{width} -> {size}: max gap {gap}")
    assert np.array_equal(ours, theirs_np)


# (frames, height, width, min_pixels, max_pixels, cap_pixels_per_frame): Qwen3-VL's bounds are the
# whole clip's; the motion clips as SGLang sizes them, shrunk, grown, odd counts, capped per frame
QWEN3_CLIPS = [
    (4, 336, 336, 4 * 64 * 64, 4 * 64 * 64, False),
    (6, 100, 130, 4 * 32 * 32, 6 * 64 * 64, False),
    (3, 40, 50, 3 * 64 * 64, 3 * 128 * 128, False),
    (5, 480, 640, 128 * 32 * 32, 768 * 32 * 32, False),
    (20, 448, 784, 128 * 32 * 32, 768 * 32 * 32 * 20, True),
]


@pytest.mark.parametrize("count,height,width,min_pixels,max_pixels,cap", QWEN3_CLIPS)
def test_the_patcher_equals_transformers_qwen3_video_processor(count, height, width, min_pixels, max_pixels, cap):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    frames = np.random.default_rng(count).integers(0, 256, (count, height, width, 3), dtype=np.uint8)
    spec = V.VideoSpec(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=16, mean=(0.5, 0.45, 0.4), std=(0.2, 0.25, 0.3),
        timestamps=True, cap_pixels_per_frame=cap, max_video_tokens=64,
    )  # fmt: skip
    theirs = Qwen3VLVideoProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, image_mean=list(spec.mean),
        image_std=list(spec.std), cap_pixels_per_frame=cap, max_video_tokens=64, do_sample_frames=False,
    )(videos=[frames], return_tensors="pt")  # fmt: skip
    ours = V.VideoPatcher(spec)([frames])
    assert ours["video_grid_thw"].tolist() == theirs["video_grid_thw"].tolist()
    gap = (ours["pixel_values_videos"] - theirs["pixel_values_videos"]).abs().max().item()
    print(f"MEASURED qwen3 patcher {count}x{height}x{width}: grid {ours['video_grid_thw'].tolist()}, max gap {gap:.3e}")
    assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])


@pytest.mark.parametrize("count,fps", [(4, 2.0), (7, 2.0), (6, 1.5)])
def test_a_qwen3_vl_processor_with_the_patcher_writes_its_own_prompt_and_patches(tmp_path, count, fps):
    """The model's processor as SGLang calls it (frames already sampled, their metadata,
    do_sample_frames=False) against the same processor with the patcher in its place, as
    relax_hpc's MediaProcessor makes it: the same ids, the frame times among them, the same patches."""
    from transformers import AutoProcessor

    from relax_hpc.data.processor import MediaProcessor
    from tests.models.qwen3_family import build_qwen3_vl_video

    folder = build_qwen3_vl_video(tmp_path / "qwen3-vl")
    theirs_processor = AutoProcessor.from_pretrained(folder)
    assert type(theirs_processor.video_processor).__name__ == "Qwen3VLVideoProcessor"  # torchvision's
    ours_processor = MediaProcessor(str(folder))
    frames = np.random.default_rng(count).integers(0, 256, (count, 336, 336, 3), dtype=np.uint8)
    text = "<|vision_start|><|video_pad|><|vision_end|>which way?"
    clip = V.Clip(frames, fps)
    kwargs = {"text": [text], "videos": [frames], "return_tensors": "pt"}
    theirs = theirs_processor(**kwargs, video_metadata=[V.metadata(clip)], do_sample_frames=False)
    ours = ours_processor.hf(**kwargs, video_metadata=[V.metadata(clip)])
    print("MEASURED qwen3 prompt", ours_processor.tokenizer.decode(ours["input_ids"][0][:40]))
    assert ours["input_ids"].tolist() == theirs["input_ids"].tolist()
    assert ours["video_grid_thw"].tolist() == theirs["video_grid_thw"].tolist()
    assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])
    assert ours_processor.collapse(ours["input_ids"][0].tolist()) == ours_processor.tokenizer(text)["input_ids"]
