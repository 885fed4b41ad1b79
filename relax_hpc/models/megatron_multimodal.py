"""megatron's GPTModel with media encoders before its first layer: a vision tower
(relax_hpc/models/megatron_vision.py: Qwen2.5-VL, Qwen3-VL; pictures and, for Qwen2.5-VL, videos), an audio encoder
(relax_hpc/models/megatron_audio.py: Qwen2-Audio), or both (the Qwen3-Omni thinker; one document
may hold pictures and clips). Each encoder's embeddings replace the token
embeddings at its placeholder tokens (any number per document of a packed micro-batch, in token
order); the decoder is the text model's, unchanged. Built by relax_hpc.models.megatron.build_model
(one pipeline stage: the config refuses more)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from relax_hpc.models.arch import arch_of, media_config
from relax_hpc.models.megatron_audio import AudioEncoder
from relax_hpc.models.megatron_vision import vision_tower


class MultimodalGPTModel(GPTModel):
    """GPTModel plus `vision` (the HF vision tower) and/or `audio` (AudioEncoder), per the HF config."""

    def __init__(self, *args: Any, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        arch, media = arch_of(hf_config), media_config(hf_config)
        self.vision = vision_tower(hf_config) if arch.vision else None
        self.audio = AudioEncoder(hf_config) if arch.audio else None
        self.image_token_id = int(media.image_token_id) if arch.vision else -1
        self.video_token_id = int(getattr(media, "video_token_id", -1)) if arch.vision else -1
        self.audio_token_id = int(media.audio_token_id) if arch.audio else -1

    def towers(self) -> list[torch.nn.Module]:
        """What trainer.freeze_encoder keeps as loaded (Arch.hf_tower_prefixes' modules)."""
        return [m for m in (self.vision, self.audio and self.audio.audio_tower) if m is not None]

    def forward(  # GPTModel's, plus the media
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        feature_attention_mask: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,  # positions only: in the mrope positions already
        **kwargs: Any,
    ) -> torch.Tensor:
        if pixel_values is None and input_features is None and pixel_values_videos is None:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
        if decoder_input is not None:
            raise ValueError("MultimodalGPTModel: pass media or decoder_input, not both")
        embeds = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        hooks: list[Any] = []
        if pixel_values is not None:
            embeds, hooks = self._images(input_ids, embeds, pixel_values, image_grid_thw)
        if pixel_values_videos is not None:
            # a video is the tower's input as a picture is, its frames in temporal patches
            embeds, video_hooks = self._images(input_ids, embeds, pixel_values_videos, video_grid_thw, "video")
            hooks += video_hooks
        if input_features is not None:
            embeds = self._audio(input_ids, embeds, input_features, feature_attention_mask)
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input=embeds, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    def _images(
        self,
        input_ids: torch.Tensor,
        embeds: torch.Tensor,
        pixel_values: torch.Tensor,
        grid: torch.Tensor | None,
        kind: str = "image",
    ) -> tuple[torch.Tensor, list[Any]]:
        """The embeddings with the tower's at the image (video) tokens, and the forward hooks that
        add Qwen3-VL's DeepStack features to the first layers' outputs (removed after the forward)."""
        if self.vision is None:
            raise ValueError(f"MultimodalGPTModel: {kind}s for a model without a vision tower")
        if grid is None:
            raise ValueError(f"MultimodalGPTModel: {kind} pixel values need their {kind}_grid_thw")
        out = self.vision(pixel_values.to(embeds.dtype), grid_thw=grid)
        token_id = self.video_token_id if kind == "video" else self.image_token_id
        slots = _slots(input_ids, token_id, out.pooler_output, kind)
        deepstack = getattr(out, "deepstack_features", None) or []  # Qwen3-VL: one per first layers
        hooks = [
            layer.register_forward_hook(functools.partial(_add_deepstack, slots=slots, features=features))
            for layer, features in zip(self.decoder.layers[: len(deepstack)], deepstack, strict=True)
        ]
        return _scatter(embeds, slots, out.pooler_output), hooks

    def _audio(
        self, input_ids: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.audio is None:
            raise ValueError("MultimodalGPTModel: audio for a model without an audio tower")
        if mask is None:
            raise ValueError("MultimodalGPTModel: input_features need feature_attention_mask")
        frames = self.audio(features, mask)
        return _scatter(embeds, _slots(input_ids, self.audio_token_id, frames, "audio"), frames)


def _slots(input_ids: torch.Tensor, token_id: int, features: torch.Tensor, kind: str) -> torch.Tensor:
    """[s, b, 1]: where the placeholder tokens are. One host sync per micro-batch and kind: a
    mismatch would silently shift every item."""
    slots = (input_ids == token_id).transpose(0, 1).unsqueeze(-1)
    if int(slots.sum()) != features.shape[0]:
        raise ValueError(
            f"MultimodalGPTModel: {int(slots.sum())} {kind} tokens but the {kind} items give "
            f"{features.shape[0]} embeddings"
        )
    return slots


def _scatter(hidden: torch.Tensor, slots: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """`hidden` [s, b, h] with `features` [slots, h] in place of the rows `slots` marks."""
    return hidden.masked_scatter(slots, features.to(hidden.dtype))


def _add_deepstack(layer: torch.nn.Module, args: Any, output: Any, slots: torch.Tensor, features: torch.Tensor) -> Any:
    """Qwen3-VL's DeepStack: a decoder layer's output plus the tower's features of that depth at
    the image tokens (transformers' _deepstack_process), as a forward hook on the layer. A
    megatron layer returns (hidden_states, context)."""
    hidden = output[0] if isinstance(output, tuple) else output
    added = hidden + _scatter(torch.zeros_like(hidden), slots, features)
    return (added, *output[1:]) if isinstance(output, tuple) else added
