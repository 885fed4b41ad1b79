"""Video: decoded with PyAV, sampled and sized in the data layer, carried as a lossless clip, and
cut into the model's temporal patches without torchvision.

The path of one video item:
1. `canonical(data, spec)`, in the driver, once per prompt group: decode every frame (PyAV),
   keep `spec.fps` frames per second and size them as SGLang 0.5.23's Qwen-VL processor does
   (`smart_nframes`, floor-rounded `linspace` indices, `smart_resize` to multiples of the
   model's patch factor within its pixel bounds, bilinear with antialias), and encode what is
   kept as a lossless FFV1 clip in AVI (exact RGB frames, exact frame rate). This clip is what
   the spool stores and what engines get as `video_data`.
2. Sampling and sizing are idempotent: a canonical clip sampled again keeps every frame at its
   size, so SGLang (told the same bounds through `--mm-process-config`, see `sglang_config`),
   the built-in engine and the trainer all see the frames the driver chose, bit for bit.
3. `VideoPatcher`, in the engine and the trainer: the model's video processor (transformers'
   Qwen2VLVideoProcessor or Qwen3VLVideoProcessor, which need torchvision) rewritten with torch
   ops: its resize (bicubic with antialias on uint8, as torchvision runs it on CPU), its fused
   rescale and normalisation, and its patch order. tests/gpu/test_video_patcher_gpu.py holds it
   equal to transformers' own on the GPU machine, where torchvision loads.

Qwen3-VL (`VideoSpec.timestamps`): SGLang samples and sizes its videos with the same rule and the
same constants as Qwen2.5-VL's (factor 28 and its default per-frame bounds, whatever the model's
patch size), then hands the frames to the model's own processor with their metadata and
`do_sample_frames=False`. That processor sizes them again, at the model's factor (32) within one
budget for the whole clip, and writes each temporal patch's time (`<0.2 seconds>`) before its
frame tokens, from the frame indices and rate of the clip it was given: the canonical clip's, so
every party writes the same times (those of the kept frames at the clip's even rate, which can
differ from the source's by a fraction of a frame interval).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# SGLang 0.5.23's sampling defaults (srt/multimodal/processors/qwen_vl.py); --mm-process-config
# overrides the fps and the pixel bounds, and `VideoSpec.sglang_config` sets them to the model's.
FPS, FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES = 2.0, 2, 4, 768
TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
MAX_ASPECT = 200
# transformers' Qwen2VLVideoProcessor defaults, for a folder whose configuration omits them; they
# are SGLang's per-frame bounds too, and with SAMPLE_FACTOR what it sizes a Qwen3-VL video to.
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 128 * 28 * 28, 768 * 28 * 28
SAMPLE_FACTOR = 28  # SGLang's IMAGE_FACTOR, preprocess_video's default factor
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# transformers' Qwen3VLVideoProcessor defaults (whole-clip bounds, IMAGENET_STANDARD mean and std)
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
QWEN3_MAX_VIDEO_TOKENS = 768
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
TIMESTAMPED_PROCESSORS = ("Qwen3VLVideoProcessor",)


class VideoError(ValueError):
    """A video cannot be read, sampled or patched; the message says why."""


@dataclass(frozen=True)
class Clip:
    """Decoded frames, [T, H, W, 3] uint8 RGB, and their rate."""

    frames: np.ndarray
    fps: float

    def describe(self) -> str:
        t, h, w, _ = self.frames.shape
        return f"{t} frames of {w}x{h} at {self.fps:g} fps"


@dataclass(frozen=True)
class VideoSpec:
    """How a model's videos are sampled, sized and patched (from its folder's video processor
    configuration, with transformers' defaults for what it omits). `timestamps`: Qwen3-VL's
    processor (min_pixels and max_pixels bound the whole clip's t x h x w, optionally capped per
    frame, and each temporal patch's time goes into the prompt)."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD
    fps: float = FPS
    timestamps: bool = False
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = QWEN3_MAX_VIDEO_TOKENS

    @property
    def factor(self) -> int:
        """What the model's processor makes frame sides multiples of: one merged patch group."""
        return self.patch_size * self.merge_size

    @property
    def sampling(self) -> tuple[int, int, int]:
        """(factor, min_pixels, max_pixels) of SGLang's per-frame sizing: the model's own for
        Qwen2-VL and Qwen2.5-VL; SGLang's constants for Qwen3-VL, whose bounds mean the whole clip."""
        if self.timestamps:
            return SAMPLE_FACTOR, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
        return self.factor, self.min_pixels, self.max_pixels

    @classmethod
    def from_folder(cls, model_path: str) -> VideoSpec:
        """The folder's video_preprocessor_config.json (else the min/max pixels of its
        preprocessor_config.json, which transformers also reads for video)."""
        folder = Path(model_path)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (folder / name).is_file():
                return cls.from_dict(json.loads((folder / name).read_text()), video=name.startswith("video"))
        return cls()

    @classmethod
    def from_dict(cls, config: dict[str, Any], video: bool = True) -> VideoSpec:
        size = config.get("size") if video else None
        size = size or {}
        if config.get("video_processor_type") in TIMESTAMPED_PROCESSORS:
            return cls(
                min_pixels=int(size.get("shortest_edge") or QWEN3_MIN_PIXELS),
                max_pixels=int(size.get("longest_edge") or QWEN3_MAX_PIXELS),
                patch_size=int(config.get("patch_size", 16)),
                merge_size=int(config.get("merge_size", 2)),
                temporal_patch_size=int(config.get("temporal_patch_size", 2)),
                mean=tuple(config.get("image_mean", (0.5, 0.5, 0.5))),
                std=tuple(config.get("image_std", (0.5, 0.5, 0.5))),
                fps=float(config.get("fps") or FPS),
                timestamps=True,
                cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame")),
                max_video_tokens=int(config.get("max_video_tokens", QWEN3_MAX_VIDEO_TOKENS)),
            )
        return cls(
            min_pixels=int(size.get("shortest_edge") or config.get("min_pixels") or DEFAULT_MIN_PIXELS),
            max_pixels=int(size.get("longest_edge") or config.get("max_pixels") or DEFAULT_MAX_PIXELS),
            patch_size=int(config.get("patch_size", 14)),
            merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            mean=tuple(config.get("image_mean", CLIP_MEAN)),
            std=tuple(config.get("image_std", CLIP_STD)),
            fps=float(config.get("fps") or FPS),
        )

    def sglang_config(self) -> dict[str, Any]:
        """The `video` entry of SGLang's --mm-process-config that makes its sampling this one (for
        Qwen3-VL the fps alone: its per-frame bounds stay SGLang's, and SGLang leaves the model's
        own to its processor)."""
        if self.timestamps:
            return {"fps": self.fps}
        return {"fps": self.fps, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}


def decode(data: bytes) -> Clip:
    """Every frame of a video file's first video stream, as RGB, and its average rate."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise VideoError("no video stream")
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            rate = stream.average_rate or stream.guessed_rate
    except (av.error.FFmpegError, ValueError) as e:  # VideoError is a ValueError: re-raised as is
        raise e if isinstance(e, VideoError) else VideoError(f"unreadable video ({e})") from None
    if not frames:
        raise VideoError("a video without frames")
    if not rate:
        raise VideoError("a video without a frame rate")
    return Clip(np.stack(frames), float(rate))


def frame_count(total: int, fps: float, spec: VideoSpec) -> int:
    """How many frames to keep: SGLang's smart_nframes (spec.fps per second, at least
    MIN_FRAMES, at most MAX_FRAMES and the video's own, a multiple of FRAME_FACTOR)."""
    low = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = min(max(total / fps * spec.fps, low), high, total)
    count = math.floor(wanted / FRAME_FACTOR) * FRAME_FACTOR
    if count < FRAME_FACTOR:
        raise VideoError(f"a video of {total} frame(s): at least {FRAME_FACTOR} are needed")
    return count


def frame_size(height: int, width: int, frames: int, spec: VideoSpec) -> tuple[int, int]:
    """(height, width) to size frames to: SGLang's smart_resize, with its cap on the whole
    clip's pixels shared out over the frames."""
    factor, low, high = spec.sampling
    max_pixels = max(min(high, TOTAL_PIXELS / frames * FRAME_FACTOR), int(low * 1.05))
    max_pixels = min(high, max_pixels)
    return smart_resize(height, width, factor, low, max_pixels)


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """Sides that are multiples of `factor`, with the area within the bounds and the aspect
    ratio kept as closely as that allows: SGLang 0.5.23's rule for videos (it differs from
    transformers' at the edges: at least `factor` before the bounds apply, no floor after)."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise VideoError(f"frames of {width}x{height}: the aspect ratio is over {MAX_ASPECT}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    if not (h_bar and w_bar):
        raise VideoError(f"frames of {width}x{height} size to nothing within {max_pixels:g} pixels")
    return h_bar, w_bar


def sample(clip: Clip, spec: VideoSpec) -> Clip:
    """The frames SGLang's Qwen-VL processor would take from `clip`, at the size it would give
    them; a clip this returned comes back unchanged."""
    import torch

    total = len(clip.frames)
    count = frame_count(total, clip.fps, spec)
    indices = np.unique(np.linspace(0, total - 1, num=count, dtype=np.int64))
    frames = clip.frames[indices]
    height, width = frames.shape[1:3]
    size = frame_size(height, width, len(frames), spec)
    if size != (height, width):
        # torchvision's tensor resize, which SGLang calls: float32, bilinear, antialias, rounded
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
        frames = x.round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    duration = total / clip.fps
    return Clip(frames, len(frames) / duration)


def encode(clip: Clip) -> bytes:
    """A lossless clip (FFV1 in AVI: RGB frames and the frame rate come back exactly)."""
    import av

    buffer = io.BytesIO()
    height, width = clip.frames.shape[1:3]
    with av.open(buffer, "w", format="avi") as container:
        stream = container.add_stream("ffv1", rate=Fraction(clip.fps).limit_denominator(1 << 16))
        stream.width, stream.height, stream.pix_fmt = width, height, "bgr0"
        for frame in clip.frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def canonical(data: bytes, spec: VideoSpec) -> bytes:
    """A video's canonical clip: its sampled, sized frames, lossless (what travels)."""
    return encode(sample(decode(data), spec))


def frames(data: bytes, spec: VideoSpec) -> Clip:
    """The frames a model sees of a video (a canonical clip's own frames)."""
    return sample(decode(data), spec)


class VideoPatcher:
    """transformers' Qwen2VLVideoProcessor, or Qwen3VLVideoProcessor with `spec.timestamps`, in
    torch ops (they need torchvision, which does not load beside torch's CPU build): resize, fused
    rescale and normalisation, and their patch layout (the same for both), called as the model's
    processor calls its video processor."""

    def __init__(self, spec: VideoSpec) -> None:
        self.spec = spec
        self.merge_size, self.temporal_patch_size = spec.merge_size, spec.temporal_patch_size

    def __call__(self, videos: list[np.ndarray], video_metadata: list[Any] | None = None, **_: Any) -> Any:
        """pixel_values_videos [patches, C*t*p*p] and video_grid_thw [n, 3] of clips' frames
        ([T, H, W, 3] uint8 each), with their metadata passed on (Qwen2.5-VL's processor takes
        second_per_grid_ts from each clip's rate there, Qwen3-VL's the frames' times)."""
        import torch
        from transformers.feature_extraction_utils import BatchFeature

        patches, grids = [], []
        for video in videos:
            x = torch.from_numpy(np.asarray(video)).permute(0, 3, 1, 2).contiguous()
            flat, grid = self.patchify(self.normalize(self.resize(x)))
            patches.append(flat)
            grids.append(grid)
        return BatchFeature(
            {"pixel_values_videos": torch.cat(patches), "video_grid_thw": torch.tensor(grids),
             "video_metadata": list(video_metadata or [])}
        )  # fmt: skip

    def resize(self, frames: torch.Tensor) -> torch.Tensor:
        """transformers' resize of a [T, C, H, W] uint8 clip: smart_resize to the model's
        bounds, bicubic with antialias on uint8 (torchvision's CPU path); unchanged when the
        size already fits."""
        import torch

        height, width = frames.shape[-2:]
        size = self.size(len(frames), height, width)
        if size == (height, width):
            return frames
        return torch.nn.functional.interpolate(frames, size=size, mode="bicubic", align_corners=False, antialias=True)

    def size(self, count: int, height: int, width: int) -> tuple[int, int]:
        """The model's processor's frame size: Qwen2-VL's smart_resize per frame, or Qwen3-VL's
        over the whole clip (its bounds capped per frame where the configuration says so)."""
        spec = self.spec
        if not spec.timestamps:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as per_frame

            return tuple(per_frame(height, width, spec.factor, spec.min_pixels, spec.max_pixels))
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as whole_clip

        max_pixels = spec.max_pixels
        if spec.cap_pixels_per_frame:
            cap = spec.max_video_tokens * spec.factor**2
            max_pixels = max(min(cap, spec.max_pixels // count), int(spec.min_pixels * 1.05)) * count
        size = whole_clip(count, height, width, spec.temporal_patch_size, spec.factor, spec.min_pixels, max_pixels)
        return tuple(size)

    def normalize(self, frames: torch.Tensor) -> torch.Tensor:
        """The fused rescale and normalisation: (x - 255 mean) / (255 std), in float32."""
        import torch

        mean = torch.tensor(self.spec.mean) * 255.0
        std = torch.tensor(self.spec.std) * 255.0
        return frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))

    def patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """[T, C, H, W] to [grid_t * grid_h * grid_w, C * t * p * p] in the model's order (the
        last frame repeated to fill the last temporal patch), and [grid_t, grid_h, grid_w]."""
        import torch

        t, p, m = self.spec.temporal_patch_size, self.spec.patch_size, self.spec.merge_size
        if pad := -len(frames) % t:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        count, channels, height, width = frames.shape
        gt, gh, gw = count // t, height // p, width // p
        x = frames.view(gt, t, channels, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, channels * t * p * p), [gt, gh, gw]


def metadata(clip: Clip) -> Any:
    """What transformers' processors read of a clip: its frame count and rate, and (for Qwen3-VL's
    times) which frames were kept: all of them, as SGLang's sampling of a canonical clip keeps."""
    from transformers.video_utils import VideoMetadata

    height, width = clip.frames.shape[1:3]
    count = len(clip.frames)
    return VideoMetadata(
        total_num_frames=count, fps=clip.fps, height=height, width=width, frames_indices=list(range(count))
    )
