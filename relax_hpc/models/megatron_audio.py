"""Audio encoders in the megatron backend: Qwen2-Audio's tower and projector, and the Qwen3-Omni
thinker's tower. The language model is megatron-core's GPT and the HF encoder sits beside it,
replicated on every rank, as the vision tower does (relax_hpc/models/megatron_vision.py says why
the HF module runs as it is: megatron-core has no Whisper-style encoder either).

`AudioEncoder` computes what transformers scatters into the token embeddings, one row per audio
token, every clip's in order:
- Qwen2-Audio (Qwen2AudioModel): the tower over each clip's log-mel features, its attention masked
  to the clip's own frames, then the projector, then each clip's valid frames;
- Qwen3-Omni (the thinker's get_audio_features): the clips' valid mel frames, concatenated, through
  the tower, which windows them per clip and projects them itself.
"""

from __future__ import annotations

from typing import Any

import torch

from relax_hpc.models.arch import arch_of, media_config

AUDIO_PREFIX = "audio."  # megatron's parameter names: audio.<the name under Arch.hf_audio_prefix>
HF_AUDIO_PREFIXES = ("audio_tower.", "multi_modal_projector.")  # AudioEncoder's, under Arch.hf_audio_prefix


class AudioEncoder(torch.nn.Module):
    """The audio tower (and Qwen2-Audio's projector), under the checkpoint's names."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.kind = arch_of(hf_config).audio_encoder
        config = media_config(hf_config)
        if self.kind == "qwen2_audio":
            from transformers.models.qwen2_audio.modeling_qwen2_audio import (
                Qwen2AudioEncoder,
                Qwen2AudioMultiModalProjector,
            )

            self.audio_tower = Qwen2AudioEncoder._from_config(config.audio_config)
            self.multi_modal_projector = Qwen2AudioMultiModalProjector(config)
        elif self.kind == "qwen3_omni":
            from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

            self.audio_tower = Qwen3OmniMoeAudioEncoder._from_config(config.audio_config)
        else:
            raise ValueError(f"megatron backend: no audio encoder for model_type={hf_config.model_type!r}")
        # Every tensor trains, as in the model transformers' from_pretrained gives (the torch
        # backend's): an encoder's init may freeze its position table, which loading replaces.
        self.requires_grad_(True)

    def forward(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
        """[audio tokens, hidden]: every clip's embeddings, in order."""
        if self.kind == "qwen3_omni":
            lengths = feature_attention_mask.sum(-1)
            frames = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
            out: torch.Tensor = self.audio_tower(frames, feature_lens=lengths).last_hidden_state
            return out
        return self._qwen2_audio(input_features, feature_attention_mask)

    def _qwen2_audio(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> torch.Tensor:
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
    prefix = arch_of(hf_config).hf_audio_prefix
    with torch.device("meta"):
        encoder = AudioEncoder(hf_config)
    return {prefix + name: p.shape for name, p in encoder.named_parameters()}
