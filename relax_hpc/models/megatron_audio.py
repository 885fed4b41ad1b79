"""Audio-language models in the megatron backend (Qwen2-Audio): the language model is megatron-core's
GPT (Qwen2's) and the HF audio tower with its projector sits beside it, replicated on every rank,
as the vision tower does (relax_hpc/models/megatron_vision.py says why the HF module runs as it
is: megatron-core has no Whisper-style encoder either).

`AudioEncoder` computes what transformers' Qwen2AudioModel scatters into the token embeddings:
the tower over each clip's log-mel features (its attention masked to the clip's own frames), the
projector, then the valid frames of every clip in order, one per audio token.
"""

from __future__ import annotations

from typing import Any

import torch

AUDIO_PREFIX = "audio."  # megatron's parameter names: audio.<the checkpoint's name>
HF_AUDIO_PREFIXES = ("audio_tower.", "multi_modal_projector.")  # the checkpoint's names of AudioEncoder's


class AudioEncoder(torch.nn.Module):
    """Qwen2-Audio's `audio_tower` and `multi_modal_projector`, under the checkpoint's names."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        from transformers.models.qwen2_audio.modeling_qwen2_audio import (
            Qwen2AudioEncoder,
            Qwen2AudioMultiModalProjector,
        )

        self.audio_tower = Qwen2AudioEncoder._from_config(hf_config.audio_config)
        self.multi_modal_projector = Qwen2AudioMultiModalProjector(hf_config)
        # Every tensor trains, as in the model transformers' from_pretrained gives (the torch
        # backend's): the encoder's init freezes its position table, which loading replaces.
        self.requires_grad_(True)

    def forward(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        """[audio tokens, hidden]: every clip's valid frames after the tower and the projector."""
        from transformers.masking_utils import create_bidirectional_mask

        tower = self.audio_tower
        conv_lengths, out_lengths = tower._get_feat_extract_output_lengths(feature_attention_mask.sum(-1))
        clips, _, mel_frames = input_features.shape
        frames = (mel_frames - 2) // 2 + 1  # after the tower's strided convolution
        valid = torch.arange(frames, device=conv_lengths.device)[None, :] < conv_lengths[:, None]
        mask = create_bidirectional_mask(
            config=tower.config,
            inputs_embeds=torch.zeros((clips, frames, 1), dtype=tower.conv1.weight.dtype, device=valid.device),
            attention_mask=valid.long(),
        )
        hidden = self.multi_modal_projector(tower(input_features, attention_mask=mask).last_hidden_state)
        kept = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < out_lengths.to(hidden.device)[:, None]
        return hidden[kept]


def audio_shapes(hf_config: Any) -> dict[str, torch.Size]:
    """The encoder's HF checkpoint names and shapes, in its module order (built without memory)."""
    with torch.device("meta"):
        encoder = AudioEncoder(hf_config)
    return {name: p.shape for name, p in encoder.named_parameters()}
