"""relax_hpc.data.video against what it replaces, on the GPU machine, where torchvision loads:
VideoPatcher against transformers' Qwen2VLVideoProcessor, and the data layer's frame resize
against torchvision's (the call SGLang 0.5.23 makes). Bit for bit, on the CPU (where both
processors run: the driver, the engines and the trainer process media on the host)."""

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
