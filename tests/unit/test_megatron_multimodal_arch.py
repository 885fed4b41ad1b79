"""Qwen2.5-VL, Qwen3-VL, Qwen2-Audio and the Qwen3-Omni thinker in the megatron backend, the parts
that need no model: what the config gives and refuses, and SDPAttention's multimodal RoPE against
transformers' (the whole models against the torch backend: tests/integration/test_megatron_multimodal.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, rotate_half
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from relax_hpc.config.schema import MegatronConfig
from relax_hpc.models.arch import arch_of, check_megatron_job, use_transformer_engine
from relax_hpc.models.megatron import SDPAttention
from relax_hpc.models.megatron_vision import MropePackedSeqParams
from tests.models.qwen3_family import build_qwen3_omni, build_qwen3_vl
from tests.unit.test_hf_mapping import mp

__all__ = ["mp"]  # the fixture, requested by name
MODEL = Path(__file__).resolve().parents[2] / "assets/tiny-qwen2.5-vl-shapes"
AUDIO = Path(__file__).resolve().parents[2] / "assets/tiny-qwen2-audio-beeps"


def test_the_language_model_is_read_from_the_text_config_with_its_multimodal_rope():
    config = AutoConfig.from_pretrained(MODEL)
    arch = arch_of(config)
    text = config.text_config
    assert (arch.hidden, arch.num_layers, arch.vocab, arch.groups) == (
        text.hidden_size, text.num_hidden_layers, text.vocab_size, text.num_key_value_heads,
    )  # fmt: skip
    assert arch.qkv_bias and arch.tied and arch.vision and arch.mrope_section == (4, 6, 6)
    assert not use_transformer_engine("auto", arch)  # whether or not Transformer Engine is installed
    assert check_megatron_job(str(MODEL), MegatronConfig()) == []


def test_qwen3_vl_reads_as_qwen3_with_interleaved_rope_and_deepstack(tmp_path):
    arch = arch_of(AutoConfig.from_pretrained(build_qwen3_vl(tmp_path)))
    assert arch.qk_norm and not arch.qkv_bias and arch.mrope_interleaved and arch.deepstack_layers == 2
    assert (arch.hf_prefix, arch.hf_vision_prefix) == ("model.language_model.", "model.visual.")
    problems = check_megatron_job(str(tmp_path), MegatronConfig(recompute=True))
    assert problems == ["Qwen3-VL's DeepStack features need trainer.megatron.recompute=false"]


def test_a_layout_the_vision_model_cannot_take_is_refused_with_the_reason():
    problems = check_megatron_job(str(MODEL), MegatronConfig(pipeline_parallel=2, context_parallel=2))
    assert "a vision-language model needs trainer.megatron.pipeline_parallel=1" in problems
    assert "a vision-language model needs trainer.megatron.context_parallel=1" in problems
    config = AutoConfig.from_pretrained(MODEL)
    config.text_config.rope_parameters["mrope_section"] = [4, 6, 4]
    with pytest.raises(ValueError, match=r"mrope_section=\[4, 6, 4\] must split head_dim / 2 = 16"):
        arch_of(config)


def test_qwen2_audio_reads_as_qwen2_under_its_checkpoint_names():
    config = AutoConfig.from_pretrained(AUDIO)
    arch = arch_of(config)
    assert arch.audio and not arch.vision and arch.qkv_bias and not arch.tied
    assert arch.hidden == config.text_config.hidden_size and arch.vocab == config.text_config.vocab_size
    assert (arch.hf_prefix, arch.hf_lm_head) == ("language_model.model.", "language_model.lm_head.weight")
    assert arch.hf_tower_prefixes == ("audio_tower.",)  # trainer.freeze_encoder: the projector trains
    assert use_transformer_engine("auto", arch) is use_transformer_engine("auto")  # one-dimensional RoPE
    assert check_megatron_job(str(AUDIO), MegatronConfig()) == []
    problems = check_megatron_job(str(AUDIO), MegatronConfig(pipeline_parallel=2, context_parallel=2))
    assert "an audio-language model needs trainer.megatron.pipeline_parallel=1" in problems
    assert "an audio-language model needs trainer.megatron.context_parallel=1" in problems


def test_the_omni_thinker_reads_as_qwen3_moe_with_both_towers_and_refuses_the_built_in_engine(tmp_path):
    folder = build_qwen3_omni(tmp_path / "omni")
    arch = arch_of(AutoConfig.from_pretrained(folder))
    assert arch.moe and arch.qk_norm and arch.vision and arch.audio and arch.mrope_interleaved
    assert arch.deepstack_layers == 2 and arch.audio_encoder == "qwen3_omni" and not arch.tied
    assert (arch.hf_prefix, arch.hf_vision_prefix, arch.hf_lm_head) == (
        "thinker.model.", "thinker.visual.", "thinker.lm_head.weight",
    )  # fmt: skip
    assert arch.hf_tower_prefixes == ("thinker.visual.", "thinker.audio_tower.")
    assert check_megatron_job(str(folder), MegatronConfig(), "sglang") == []
    problems = check_megatron_job(str(folder), MegatronConfig(pipeline_parallel=2), "torch")
    assert "an omni model needs trainer.megatron.pipeline_parallel=1" in problems
    assert any(p.startswith("rollout.engine=torch with trainer.backend=megatron and an MoE model") for p in problems)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_sdpa_attention_rotates_as_transformers_multimodal_rope(family, mp, tmp_path):
    """Qwen2.5-VL's sections and Qwen3-VL's interleaved axes, against transformers' rotary modules."""
    config = AutoConfig.from_pretrained(MODEL if family == "qwen2.5-vl" else build_qwen3_vl(tmp_path))
    arch, text = arch_of(config), config.text_config
    head_dim = arch.head_dim
    config = TransformerConfig(
        num_layers=1, hidden_size=text.hidden_size, num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads, kv_channels=head_dim, attention_dropout=0.0,
    )  # fmt: skip
    attention = SDPAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
        rotary_base=arch.rope_theta, mrope_section=arch.mrope_section, mrope_interleaved=arch.mrope_interleaved,
    )  # fmt: skip
    tokens = 12
    # Temporal, height and width positions that differ: a picture's tokens in a grid, then text.
    positions = torch.stack([torch.randint(0, 40, (tokens,)) for _ in range(3)])
    params = MropePackedSeqParams(qkv_format="thd", mrope_positions=positions)
    q = torch.randn(tokens, text.num_attention_heads, head_dim)
    got, _ = attention._rotate(q, q, attention._positions(params, torch.tensor([0, tokens]), tokens))
    rotary = Qwen2_5_VLRotaryEmbedding if family == "qwen2.5-vl" else Qwen3VLTextRotaryEmbedding
    cos, sin = rotary(text)(q, positions[:, None])  # [1, tokens, head_dim]
    expected = q * cos[0, :, None] + rotate_half(q) * sin[0, :, None]
    assert torch.allclose(got, expected, atol=1e-5)
    # the first section's positions alone (one-dimensional RoPE by the temporal axis) are not it
    one_d = attention._rotate(q, q, positions[0])[0]
    assert not torch.allclose(one_d, expected, atol=1e-2)
    with pytest.raises(ValueError, match=r"multimodal RoPE needs mrope_positions \[3, 12\]"):
        attention._positions(MropePackedSeqParams(qkv_format="thd"), torch.tensor([0, tokens]), tokens)
