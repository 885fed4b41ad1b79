"""The model folder's own processor: the only tokenizer of media.

The driver, the built-in engine and the trainer all go through `MediaProcessor`, so the token ids
a sample was generated from are the ids it is trained on:

- `prompt_ids(row)`: the chat template applied to the row's messages, tokenized: one placeholder
  token per media item (`<|image_pad|>` or `<|video_pad|>` between `<|vision_start|>`/
  `<|vision_end|>`, `<|AUDIO|>` between `<|audio_bos|>`/`<|audio_eos|>`). This is what goes to an
  engine with the media: SGLang 0.5.23 expands the placeholders itself and refuses ids that are
  expanded already.
- `process(prompt_ids, media)`: the HF processor on the decoded prompt and the decoded media: the
  expanded ids (each placeholder repeated once per image patch group or audio frame group) and
  the model's inputs (pixel_values and image_grid_thw, pixel_values_videos, video_grid_thw and
  second_per_grid_ts, input_features and feature_attention_mask). Videos go through
  relax_hpc.data.video's VideoPatcher, the model's video processor without torchvision.
  It checks that the expansion only repeated placeholders: a tokenizer whose decode and encode do
  not round-trip would otherwise shift the response against its log-probabilities.

Positions: Qwen VL models place tokens on three rotary axes (multimodal RoPE); `rope_positions`
asks the model's own `get_rope_index` (for a batch, left- or right-padded), and decoding continues
each row at (tokens so far + its delta) on all three axes.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.data.media import Kind, MediaError, decode_audio, decode_image
from relax_hpc.data.prompts import PromptRow
from relax_hpc.data.video import VIDEO_MODEL_TYPES, VideoError, VideoPatcher, VideoSpec, frames, metadata

if TYPE_CHECKING:  # torch is imported where tensors are made: the driver encodes text prompts without it
    import torch

# The processor outputs a model takes as forward arguments, concatenated over a batch's items.
MODEL_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "input_features",
    "feature_attention_mask",
)  # fmt: skip
# Special tokens a completion must not contain: a sampled placeholder would break the count of
# tokens against features when the trainer reprocesses the sample.
MEDIA_TOKENS = (
    "image_token", "video_token", "audio_token", "vision_bos_token", "vision_eos_token", "audio_bos_token",
    "audio_eos_token",
)  # fmt: skip


class ProcessorError(ValueError):
    """A prompt and its media do not make model inputs (the message says why)."""


@dataclass
class Processed:
    """A prompt with its media as a model takes it: expanded ids, and the processor's tensors."""

    input_ids: list[int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def media_kinds(model_path: str) -> set[Kind]:
    """The media the folder's model has an encoder for (from its config.json; an omni model's
    thinker holds its encoders). Video: the vision encoder of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL
    model (relax_hpc.data.video reproduces their video processors, not the Omni models')."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    model_type = config.get("model_type")
    config = config.get("thinker_config", config)
    encoders: dict[Kind, str] = {"image": "vision_config", "audio": "audio_config"}
    kinds = {kind for kind, key in encoders.items() if key in config}
    if "image" in kinds and model_type in VIDEO_MODEL_TYPES:
        kinds.add("video")
    return kinds


def video_spec(model_path: str) -> VideoSpec | None:
    """How the folder's model samples and patches videos, or None for a model without video."""
    return VideoSpec.from_folder(model_path) if "video" in media_kinds(model_path) else None


def is_multimodal(model_path: str) -> bool:
    """Whether the folder holds a model with a vision or audio encoder."""
    return bool(media_kinds(model_path))


def _load_hf_processor(model_path: str) -> Any:
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path)
    except ImportError:
        # The Qwen VL and Omni processors insist on a video processor, which needs torchvision: the
        # same class with every other sub-processor loaded and none for video.
        return _without_video(_processor_class(model_path), model_path)


def _processor_class(model_path: str) -> type:
    """The processor class the folder names (processor_class in its processor or preprocessor
    config), else the one transformers maps its model_type to (an Omni thinker's folder says
    qwen3_omni_moe_thinker: its processor is the Omni model's)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    folder = Path(model_path)
    for file in ("processor_config.json", "preprocessor_config.json"):
        if (folder / file).is_file() and (name := json.loads((folder / file).read_text()).get("processor_class")):
            named: type = getattr(transformers, name)
            return named
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    name = PROCESSOR_MAPPING_NAMES.get(model_type) or PROCESSOR_MAPPING_NAMES.get(model_type.removesuffix("_thinker"))
    if name is None:
        raise ProcessorError(f"{model_path}: no processor is known for model_type {model_type!r}")
    cls: type = getattr(transformers, name)
    return cls


def _without_video(cls: Any, model_path: str) -> Any:
    """`cls` built from the folder's tokenizer, image processor and feature extractor (those it
    takes), with video_processor=None: the sub-processors are passed by name, so this holds for
    any order of __init__'s arguments (Qwen2.5-VL/Qwen3-VL: image, tokenizer, video; Qwen3-Omni:
    image, video, feature extractor, tokenizer)."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    loaders: dict[str, Any] = {
        "tokenizer": AutoTokenizer,
        "image_processor": AutoImageProcessor,
        "feature_extractor": AutoFeatureExtractor,
    }
    subs = {name: loaders[name].from_pretrained(model_path) for name in cls.get_attributes() if name in loaders}
    processor_dict, _ = cls.get_processor_dict(model_path)
    chat_template = processor_dict.get("chat_template") or subs["tokenizer"].chat_template

    def check_argument_for_proper_class(self: Any, name: str, argument: Any) -> Any:
        if name == "video_processor" and argument is None:
            return None  # its class cannot even be looked up without torchvision
        return cls.check_argument_for_proper_class(self, name, argument)

    without = type(
        f"ImageOnly{cls.__name__}", (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class}
    )
    return without(**subs, video_processor=None, chat_template=chat_template)


class MediaProcessor:
    """The HF processor of a multimodal model folder, and what relax_hpc needs of it."""

    def __init__(self, model_path: str) -> None:
        self.hf = _load_hf_processor(model_path)
        self.video = video_spec(model_path)
        if self.video is not None:  # one video path on every machine, with or without torchvision
            self.hf.video_processor = VideoPatcher(self.video)
        self.tokenizer = self.hf.tokenizer
        extractor = getattr(self.hf, "feature_extractor", None)
        self.sampling_rate: int | None = getattr(extractor, "sampling_rate", None)
        self.placeholders: dict[Kind, int] = {}
        kinds: tuple[tuple[Kind, str], ...] = (
            ("image", "image_token"),
            ("audio", "audio_token"),
            ("video", "video_token"),
        )
        for kind, name in kinds:
            token = getattr(self.hf, name, None) or getattr(self.tokenizer, name, None)
            if token is not None:
                self.placeholders[kind] = self.tokenizer.convert_tokens_to_ids(token)
        # Qwen3-VL writes each video frame as <time> <|vision_start|> pads <|vision_end|>
        self.frame_start, self.frame_end = (
            self.tokenizer.convert_tokens_to_ids(getattr(self.hf, name, None) or "")
            for name in ("vision_start_token", "vision_end_token")
        )
        self.media_token_ids = sorted(
            {
                self.tokenizer.convert_tokens_to_ids(t)
                for t in (getattr(self.tokenizer, n, None) for n in MEDIA_TOKENS)
                if t
            }
        )

    def prompt_ids(self, row: PromptRow) -> list[int]:
        """The row's messages through the chat template, with one placeholder per media item."""
        text = self.hf.apply_chat_template(row.messages(), tokenize=False, add_generation_prompt=True)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def process(self, prompt_ids: list[int], media: list[tuple[Kind, bytes]]) -> Processed:
        """Expand the prompt's placeholders for its media and make the model's inputs."""
        images = [decode_image(data) for kind, data in media if kind == "image"]
        audios = [decode_audio(data, self.sampling_rate or 16000) for kind, data in media if kind == "audio"]
        clips = [self._clip(data) for kind, data in media if kind == "video"]
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
        if audios:
            kwargs.update(audio=audios, sampling_rate=self.sampling_rate)
        if clips:
            kwargs.update(videos=[c.frames for c in clips], video_metadata=[metadata(c) for c in clips])
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        try:
            out = self.hf(text=[text], return_tensors="pt", **kwargs)
        except ValueError as e:  # the HF processors' own count checks
            raise ProcessorError(str(e)) from None
        expanded: list[int] = out["input_ids"][0].tolist()
        if self.collapse(expanded) != prompt_ids:
            raise ProcessorError("the processor's expansion changed the prompt beyond its placeholders")
        return Processed(expanded, {k: out[k] for k in MODEL_INPUTS if k in out})

    def _clip(self, data: bytes) -> Any:
        if self.video is None:
            raise ProcessorError("a video for a model without a video processor (the Qwen2/2.5/3-VL models have one)")
        try:
            return frames(data, self.video)
        except VideoError as e:
            raise MediaError(str(e)) from None

    def collapse(self, ids: list[int]) -> list[int]:
        """Expanded ids back to one placeholder per item (runs of a placeholder become one, and a
        Qwen3-VL video's timed frames its one placeholder)."""
        if self.video is not None and self.video.timestamps:
            ids = self._untimed(ids)
        out: list[int] = []
        repeatable = set(self.placeholders.values())
        for token in ids:
            if not (out and token == out[-1] and token in repeatable):
                out.append(token)
        return out

    def _untimed(self, ids: list[int]) -> list[int]:
        """Qwen3-VL's video expansion undone: <|vision_start|>, then per frame its time's text,
        <|vision_start|>, video pads and <|vision_end|>, then the template's <|vision_end|>, back
        to <|vision_start|><|video_pad|><|vision_end|>."""
        out: list[int] = []
        i = 0
        while i < len(ids):
            out.append(ids[i])
            closing = self._frames_end(ids, i + 1) if ids[i] == self.frame_start else None
            if closing is None:
                i += 1
            else:
                out.append(self.placeholders["video"])
                i = closing
        return out

    def _frames_end(self, ids: list[int], i: int) -> int | None:
        """Where a run of timed frames starting at `i` closes (the template's <|vision_end|>), or
        None if the ids from `i` are not one."""
        start, end, pad = self.frame_start, self.frame_end, self.placeholders["video"]
        frames = 0
        while i < len(ids):
            if ids[i] == end and frames:
                return i
            time = i  # the frame's time: text up to its <|vision_start|>
            while i < len(ids) and ids[i] not in (start, end, pad):
                i += 1
            if i == time or i >= len(ids) or ids[i] != start:
                return None
            pads = i = i + 1
            while i < len(ids) and ids[i] == pad:
                i += 1
            if i == pads or i >= len(ids) or ids[i] != end:
                return None
            i, frames = i + 1, frames + 1
        return None


def concat_inputs(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The processor tensors of several prompts as one batch's forward arguments (in order)."""
    import torch

    keys = [k for k in MODEL_INPUTS if any(k in item for item in items)]
    return {k: torch.cat([item[k] for item in items if k in item]) for k in keys}


def media_processor(model_path: str) -> MediaProcessor | None:
    """The folder's MediaProcessor if it holds a multimodal model, else None."""
    return MediaProcessor(model_path) if is_multimodal(model_path) else None


def sampling_rate(model_path: str) -> int | None:
    """The audio sampling rate the model's feature extractor expects (from the folder's
    preprocessor_config.json, without loading the processor), or None for a model without one."""
    config = Path(model_path) / "preprocessor_config.json"
    if not config.is_file():
        return None
    rate = json.loads(config.read_text()).get("sampling_rate")
    return int(rate) if rate else None


def prompt_encoder(model_path: str, processor: MediaProcessor | None = None) -> Callable[[PromptRow], list[int]]:
    """The function that turns a row into the prompt ids an engine gets: plain text through the
    tokenizer (as it is); messages and media through the chat template (`processor`'s, for a
    multimodal model: one placeholder per item)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)

    def encode(row: PromptRow) -> list[int]:
        if not row.is_chat:
            ids: list[int] = tokenizer(row.prompt)["input_ids"]
            return ids
        if processor is not None:
            return processor.prompt_ids(row)
        text = tokenizer.apply_chat_template(row.messages(), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    return encode


def up_to_media_token(completion: list[int], media_token_ids: list[int]) -> int:
    """How much of a completion to keep: everything before its first media special token. A
    sampled placeholder would break the count of tokens against features when the trainer
    processes the sample; the completion is cut there (and scored as cut)."""
    for k, token in enumerate(completion):
        if token in media_token_ids:
            return k
    return len(completion)


def rope_positions(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(positions [3, n, T], deltas [n, 1]) from the model's own multimodal RoPE index, or None
    for a model with one-dimensional positions (Qwen2-Audio, text models)."""
    inner = getattr(model, "model", None)
    rope_index = getattr(inner, "get_rope_index", None)
    if rope_index is None:
        return None
    if "mm_token_type_ids" not in inspect.signature(rope_index).parameters:
        # Qwen2.5-Omni / Qwen3-Omni thinker: get_rope_index(input_ids, image_grid_thw, video_grid_thw,
        # attention_mask, use_audio_in_video, audio_seqlens, second_per_grids); an audio item's
        # positions come from its clip's feature length (the processor's feature_attention_mask)
        features = inputs.get("feature_attention_mask")
        positions, deltas = rope_index(
            input_ids,
            image_grid_thw=inputs.get("image_grid_thw"),
            attention_mask=attention_mask,
            audio_seqlens=None if features is None else features.sum(-1),
        )
        return positions, deltas
    config = model.config
    image_id: int = getattr(config, "image_token_id", -1)
    video_id: int = getattr(config, "video_token_id", -1)
    mm_token_type_ids = input_ids.eq(image_id).long() + 2 * input_ids.eq(video_id).long()
    videos = {k: inputs[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in inputs}
    positions, deltas = rope_index(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=attention_mask,
        **videos,
    )
    return positions, deltas
