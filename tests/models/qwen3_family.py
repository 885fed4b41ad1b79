"""Tiny random-init Qwen3-VL and Qwen3-Omni folders, built offline for the tests (seconds).

The architectures relax_hpc's GPU recipes train (configs/qwen3-vl-4b-grpo.yaml,
qwen3-omni-grpo.yaml), at toy scale: what the tests check is that the trainer, the built-in
engine, the processor and the export handle these model families as transformers defines them.
The Omni folder is the full model (thinker, talker, code2wav), as its checkpoints ship and as
SGLang 0.5.23 serves it; relax_hpc trains its thinker.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    WhisperFeatureExtractor,
)

from relax_hpc.models.tiny import EOS_TOKEN, PAD_TOKEN
from relax_hpc.models.tiny_multimodal import build_tokenizer, char_tokenizer, save_model, token_id

PIXELS = 64 * 64  # one 64 x 64 picture: 4 x 4 patches of 16, merged 2 x 2: 4 tokens


def image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": PIXELS, "longest_edge": PIXELS},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip


def build_qwen3_vl(out: Path) -> Path:
    torch.manual_seed(0)
    tok = build_tokenizer()

    def ids(token: str) -> int:
        return token_id(tok, token)

    config = Qwen3VLConfig(
        text_config={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
                     "vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )  # fmt: skip
    save_model(Qwen3VLForConditionalGeneration(config), tok, image_processor(), out)
    return out


def build_qwen3_vl_video(out: Path) -> Path:
    """The tiny Qwen3-VL with a video processor configuration (transformers' Qwen3VLVideoProcessor,
    which cannot be built without torchvision): a clip's frames end at 64 x 64 whatever SGLang's
    sampling sized them to (4 frames: 2 temporal patches of 2 x 2 merged tokens, each after its time)."""
    build_qwen3_vl(out)
    clip = 4 * PIXELS  # the whole clip's budget: t x h x w
    config = {
        "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": clip, "longest_edge": clip}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "fps": 2, "do_sample_frames": True,
        "cap_pixels_per_frame": False, "resample": 3, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    }  # fmt: skip
    (out / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# Qwen3-Omni's own placeholders: <|audio_start|><|audio_pad|><|audio_end|> for audio.
OMNI_SPECIALS = [
    PAD_TOKEN, EOS_TOKEN, "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>",
]  # fmt: skip
OMNI_NAMED = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>", "audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}  # fmt: skip
OMNI_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def omni_tokenizer() -> PreTrainedTokenizerFast:
    return char_tokenizer(OMNI_SPECIALS, OMNI_NAMED, OMNI_CHAT)


def build_qwen3_omni(out: Path) -> Path:
    """The full Omni model (a 4-expert MoE thinker, a token talker and code2wav)."""
    torch.manual_seed(0)
    tok = omni_tokenizer()
    i = tok.convert_tokens_to_ids
    thinker = {
        "text_config": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 4,
                        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": len(tok),
                        "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [6, 5, 5],
                                            "mrope_interleaved": True}},
        "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                          "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]},
        "audio_config": {"num_mel_bins": 32, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
                         "d_model": 64, "output_dim": 128, "downsample_hidden_size": 16, "max_source_positions": 100,
                         "n_window": 50, "n_window_infer": 100},
        "audio_token_id": i("<|audio_pad|>"), "audio_start_token_id": i("<|audio_start|>"),
        "image_token_id": i("<|image_pad|>"), "video_token_id": i("<|video_pad|>"),
        "vision_start_token_id": i("<|vision_start|>"), "position_id_per_seconds": 13,
        "user_token_id": i("<|im_start|>"),
    }  # fmt: skip
    talker = {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 2,
                        "num_experts_per_tok": 1, "num_hidden_layers": 1, "shared_expert_intermediate_size": 64,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64},
        "code_predictor_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                  "vocab_size": 64, "num_code_groups": 4},
        "num_code_groups": 4, "thinker_hidden_size": 128, "accept_hidden_layer": 1, "spatial_merge_size": 2,
        "vision_start_token_id": 3,
    }  # fmt: skip
    code2wav = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 2, "codebook_size": 64, "num_quantizers": 4, "decoder_dim": 32}  # fmt: skip
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True
    )
    Qwen3OmniMoeForConditionalGeneration(config).save_pretrained(out)
    tok.save_pretrained(out)
    # One preprocessor_config.json for both processors, as Qwen3-Omni's checkpoints ship it.
    extractor = WhisperFeatureExtractor(
        feature_size=32, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400, return_attention_mask=True
    )
    merged = {**image_processor().to_dict(), **extractor.to_dict(), "processor_class": "Qwen3OmniMoeProcessor"}
    merged.pop("mel_filters", None)
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=1))
    return out


def build_qwen3_moe(out: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, 2 per token, 2 layers) with the character tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from relax_hpc.models.tiny import build_char_tokenizer

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a keyword its signature leaves to **kwargs
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        norm_topk_prob=True,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out
