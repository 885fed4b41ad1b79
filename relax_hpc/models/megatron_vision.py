"""Vision-language models in the megatron backend (Qwen2.5-VL, Qwen3-VL): the language model is
megatron-core's GPT (as for a text model: Qwen2's, Qwen3's) and the HF vision tower sits beside
it, replicated on every rank.

Why the HF vision tower, not megatron-core's: megatron/core/models/vision has CLIP/SigLIP/RADIO
ViTs (learned absolute positions, full attention, a LayerNorm/MLP projector) and
megatron/core/models/multimodal the LLaVA model around them. Qwen2.5-VL's tower differs in every
one of those: 2-D rotary positions, windowed attention in all but its `fullatt_block_indexes`
blocks (over a window-ordered permutation of the patches), RMSNorm, a SwiGLU MLP with biases and a
2 x 2 patch merger (Qwen3-VL's: interpolated learned positions and DeepStack mergers). None of
megatron's blocks computes that, so the HF module runs as it is, its
parameters replicated (data parallelism all-reduces their gradients like any other; every
tensor-parallel rank computes the same tower on the same pixels, the first layer's
column-parallel input gradient having been all-reduced). It is small (675M of Qwen2.5-VL-7B's 8B).

`MultimodalGPTModel.forward` (relax_hpc/models/megatron_multimodal.py) takes the processor's
`pixel_values` and `image_grid_thw` of the images of a packed micro-batch, in token order, and
scatters the tower's merged embeddings into the token embeddings at the image-token positions (any
number per document); Qwen3-VL's DeepStack features of the tower's inner blocks are added to the
outputs of the first decoder layers at the same positions (forward hooks on those layers, for the
one forward). Multimodal RoPE: the positions
come from the HF model's own index (transformers' get_rope_index, on a weightless copy of the
model) and reach the core attention inside the packing metadata (`MropePackedSeqParams`), which
rotates each frequency by its temporal, height or width position (Qwen2.5-VL: in sections;
Qwen3-VL: interleaved; relax_hpc/models/megatron_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from relax_hpc.models.arch import arch_of

VISION_PREFIX = "vision."  # the tower's megatron parameter names: vision.<its HF name after Arch.hf_vision_prefix>


@dataclass
class MropePackedSeqParams(PackedSeqParams):
    """Packing metadata with each packed token's multimodal RoPE positions: long [3, T] (temporal,
    height, width), which megatron hands to the core attention unchanged."""

    mrope_positions: torch.Tensor | None = None


def vision_tower(hf_config: Any) -> torch.nn.Module:
    """The HF vision tower (patch embedding, blocks, merger; Qwen3-VL's and Qwen3-Omni's DeepStack
    mergers) of a vision-language or Omni config."""
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel._from_config(hf_config.vision_config)
    if hf_config.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel._from_config(hf_config.vision_config)
    if hf_config.model_type == "qwen3_omni_moe":
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

        return Qwen3OmniMoeVisionEncoder._from_config(hf_config.thinker_config.vision_config)
    raise ValueError(f"megatron backend: no vision tower for model_type={hf_config.model_type!r}")


def vision_shapes(hf_config: Any) -> dict[str, torch.Size]:
    """The tower's HF checkpoint names and shapes, in its module order (built without memory)."""
    prefix = arch_of(hf_config).hf_vision_prefix
    with torch.device("meta"):
        tower = vision_tower(hf_config)
    return {prefix + name: p.shape for name, p in tower.named_parameters()}


def rope_index_model(hf_config: Any) -> torch.nn.Module:
    """The HF model without weights (meta tensors), for `mrope_positions`: what transformers'
    get_rope_index reads is its config alone (an Omni model's: its thinker's)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        if hf_config.model_type == "qwen3_omni_moe":
            from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

            return Qwen3OmniMoeThinkerForConditionalGeneration._from_config(hf_config.thinker_config)
        return AutoModelForImageTextToText.from_config(hf_config)


def mrope_positions(
    index_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: dict[str, torch.Tensor]
) -> torch.Tensor:
    """[3, n, width] multimodal RoPE positions of a right-padded batch, as the HF model computes
    them (`index_model`: rope_index_model's)."""
    from relax_hpc.data.processor import rope_positions

    rope = rope_positions(index_model, input_ids, attention_mask, media)
    assert rope is not None, "Qwen VL models have a multimodal RoPE index"
    return rope[0]
