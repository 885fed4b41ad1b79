"""What the megatron backend needs to know of an HF model, from its config alone: the facts the
megatron model and the weight mapping depend on (`Arch`), and whether the job's parallel layout
fits them. Imports neither torch nor megatron-core, so that submit runs these checks before
anything is queued, on a login node without GPUs.

Architectures outside what the mapping reproduces exactly (sliding-window layers, RoPE scaling,
Qwen3 attention biases, MoE models with dense layers) are refused with the reason, never
approximated.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from relax_hpc.config.engines import engine_kind
from relax_hpc.config.schema import MegatronConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
# Vision-language models: the language model as megatron's GPT (its text_config, as the text model
# type it is built like), the vision tower beside it (relax_hpc/models/megatron_vision.py); the
# checkpoint's prefixes of the language model's and the tower's tensors.
VISION_MODEL_TYPES = {
    "qwen2_5_vl": ("qwen2", "model.", "visual."),
    "qwen3_vl": ("qwen3", "model.language_model.", "model.visual."),
}
# Audio-language models: the language model as megatron's GPT, the audio tower and its projector
# beside it (relax_hpc/models/megatron_audio.py); the checkpoint's prefix of the language model's
# tensors and its output layer's name (the tower's and projector's names are the checkpoint's own).
AUDIO_MODEL_TYPES = {"qwen2_audio": ("qwen2", "language_model.model.", "language_model.lm_head.weight")}
# Omni models: the thinker (its thinker_config) is a vision-language model with an audio tower too,
# its language model a Qwen3-MoE; every tensor under thinker.* (the talker and code2wav are not
# trained). The policy is the thinker alone, as on the torch backend (relax_hpc/models/hf.py).
OMNI_MODEL_TYPES = {"qwen3_omni_moe": "qwen3_moe"}


@dataclass(frozen=True)
class Arch:
    """The facts of an HF config that the megatron model and the weight mapping depend on."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (megatron: query groups)
    head_dim: int
    ffn: int  # dense MLP intermediate size
    vocab: int
    tied: bool
    qkv_bias: bool  # Qwen2: q/k/v projections have biases, o_proj has none
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    num_experts: int  # 0: dense
    moe_ffn: int
    topk: int
    norm_topk: bool
    rope_theta: float
    norm_eps: float
    max_positions: int
    # Vision-language: the multimodal RoPE's sections of head_dim / 2 (temporal, height, width),
    # empty for a text model.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL: the axes take turns over the frequencies
    deepstack_layers: int = 0  # Qwen3-VL: layers whose outputs get the tower's DeepStack features
    hf_prefix: str = "model."  # the checkpoint names of the language model's tensors start with it
    hf_vision_prefix: str = ""  # and the vision tower's with this
    hf_lm_head: str = "lm_head.weight"  # the untied output layer's checkpoint name
    # An audio encoder before the first layer: "qwen2_audio" (tower and projector) or "qwen3_omni"
    # (the Omni thinker's tower), its tensors' checkpoint names under hf_audio_prefix.
    audio_encoder: str = ""
    hf_audio_prefix: str = ""

    @property
    def vision(self) -> bool:
        return bool(self.mrope_section)

    @property
    def audio(self) -> bool:
        return bool(self.audio_encoder)

    @property
    def encoders(self) -> bool:
        """Media encoders sit before the first layer (vision or audio)."""
        return self.vision or self.audio

    @property
    def hf_tower_prefixes(self) -> tuple[str, ...]:
        """The checkpoint's prefixes of the towers, what trainer.freeze_encoder keeps as loaded
        (as the torch backend: Qwen2-Audio's projector trains)."""
        return (self.hf_vision_prefix,) * self.vision + (self.hf_audio_prefix + "audio_tower.",) * self.audio

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def arch_of(hf_config: Any) -> Arch:
    """Read and validate an HF config; raise ValueError for anything this module cannot reproduce.
    A vision-language config gives its language model's facts, with its multimodal RoPE."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in VISION_MODEL_TYPES:
        text_type, hf_prefix, hf_vision_prefix = VISION_MODEL_TYPES[model_type]
        return _vision_arch(hf_config, text_type, hf_prefix, hf_vision_prefix)
    if model_type in AUDIO_MODEL_TYPES:
        text_type, hf_prefix, hf_lm_head = AUDIO_MODEL_TYPES[model_type]
        arch = _text_arch(hf_config, text_type)
        return replace(arch, audio_encoder="qwen2_audio", hf_prefix=hf_prefix, hf_lm_head=hf_lm_head)
    if model_type in OMNI_MODEL_TYPES:
        thinker = media_config(hf_config)
        arch = _vision_arch(thinker, OMNI_MODEL_TYPES[model_type], "thinker.model.", "thinker.visual.")
        lm_head = "thinker.lm_head.weight"
        return replace(arch, audio_encoder="qwen3_omni", hf_audio_prefix="thinker.", hf_lm_head=lm_head)
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = (*SUPPORTED_MODEL_TYPES, *VISION_MODEL_TYPES, *AUDIO_MODEL_TYPES, *OMNI_MODEL_TYPES)
        raise ValueError(
            f"megatron backend: unsupported architecture model_type={model_type!r}; supported: {', '.join(supported)}"
        )
    if hf_config.hidden_act != "silu":
        raise ValueError(f"megatron backend: hidden_act={hf_config.hidden_act!r} is not supported (SwiGLU/silu only)")
    _refuse_sliding_window(hf_config)
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError("megatron backend: attention_bias=True (biases on q/k/v/o) is not supported")
    heads = hf_config.num_attention_heads
    num_experts = _num_experts(hf_config)
    return Arch(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        moe_ffn=hf_config.moe_intermediate_size if num_experts else 0,
        topk=hf_config.num_experts_per_tok if num_experts else 0,
        norm_topk=bool(getattr(hf_config, "norm_topk_prob", False)),
        rope_theta=_rope_theta(hf_config),
        norm_eps=hf_config.rms_norm_eps,
        max_positions=hf_config.max_position_embeddings,
    )


def media_config(hf_config: Any) -> Any:
    """The config that holds the encoders' configs and media token ids: an Omni model's
    thinker_config, any other model's own (config.json read as a dict, or transformers')."""
    thinker = getattr(hf_config, "thinker_config", None)
    if thinker is None:
        return hf_config
    return SimpleNamespace(**thinker) if isinstance(thinker, dict) else thinker


def _text_config(hf_config: Any) -> Any:
    """A multimodal config's language model config (config.json read as a dict, or transformers')."""
    text = hf_config.text_config
    return SimpleNamespace(**text) if isinstance(text, dict) else text


def _text_arch(hf_config: Any, text_type: str) -> Arch:
    """The Arch of a multimodal config's language model, built like a `text_type` model."""
    fields = {**vars(_text_config(hf_config)), "model_type": text_type}
    fields["tie_word_embeddings"] = getattr(hf_config, "tie_word_embeddings", False)  # the top level ties
    return arch_of(SimpleNamespace(**fields))


def _vision_arch(hf_config: Any, text_type: str, hf_prefix: str, hf_vision_prefix: str) -> Arch:
    text = _text_config(hf_config)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    section = tuple(params.get("mrope_section") or ())
    arch = _text_arch(hf_config, text_type)
    if 2 * sum(section) != arch.head_dim:
        raise ValueError(
            f"megatron backend: mrope_section={list(section)} must split head_dim / 2 = {arch.head_dim // 2}"
        )
    vision = hf_config.vision_config
    vision = SimpleNamespace(**vision) if isinstance(vision, dict) else vision
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    if deepstack > arch.num_layers:
        raise ValueError(f"megatron backend: {deepstack} DeepStack features for {arch.num_layers} layers")
    # Qwen3's families (Qwen3-VL, Qwen3-Omni) interleave the axes over the frequencies.
    interleaved = text_type.startswith("qwen3") or bool(params.get("mrope_interleaved"))
    return replace(
        arch, mrope_section=section, mrope_interleaved=interleaved, deepstack_layers=deepstack,
        hf_prefix=hf_prefix, hf_vision_prefix=hf_vision_prefix,
    )  # fmt: skip


def _refuse_sliding_window(hf_config: Any) -> None:
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("megatron backend: sliding-window attention layers are not supported")


def _num_experts(hf_config: Any) -> int:
    if hf_config.model_type != "qwen3_moe":
        return 0
    # megatron's MoE spec here makes every layer an MoE layer; a mixed model would load wrongly.
    if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
        raise ValueError(
            "megatron backend: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
            "is not supported; every layer must be an MoE layer"
        )
    return hf_config.num_experts


def _rope_theta(hf_config: Any) -> float:
    """RoPE base; transformers 5 keeps it in rope_parameters, older configs in rope_theta."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"megatron backend: RoPE scaling type {rope_type!r} is not implemented (default RoPE only)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("megatron backend: the HF config has no rope_theta")
    return float(theta)


def use_transformer_engine(attention: str, arch: Arch | None = None) -> bool:
    """`te`: required; `auto`: when transformer_engine is importable, except for a vision-language
    `arch` (its multimodal RoPE is SDPAttention's alone); `sdpa`: never."""
    available = importlib.util.find_spec("transformer_engine") is not None
    if attention == "te" and not available:
        raise ValueError("trainer.megatron.attention=te but transformer_engine is not installed")
    vision = arch is not None and arch.vision
    return attention == "te" or (attention == "auto" and available and not vision)


def padded_vocab_size(vocab: int, tensor_parallel: int) -> int:
    """The embedding/output rows: the HF vocabulary, padded only as far as TP divisibility needs.
    Logits of the padded rows (zero weights) are not tokens: the backend drops them."""
    return math.ceil(vocab / tensor_parallel) * tensor_parallel


def megatron_problems(arch: Arch, par: MegatronConfig, te: bool) -> list[str]:
    """What keeps the job's parallel layout from fitting the model, one message each."""
    problems = []
    tp = par.tensor_parallel
    if arch.heads % tp or arch.groups % tp:
        # A TP rank must hold whole query groups (q heads with their k/v head) for the mapping.
        problems.append(
            f"trainer.megatron.tensor_parallel={tp} must divide num_attention_heads={arch.heads} "
            f"and num_key_value_heads={arch.groups} of the model"
        )
    if arch.num_layers % par.pipeline_parallel:
        problems.append(
            f"trainer.megatron.pipeline_parallel={par.pipeline_parallel} must divide the model's "
            f"num_hidden_layers={arch.num_layers}"
        )
    if par.context_parallel > 1 and not te:
        problems.append("trainer.megatron.context_parallel > 1 needs Transformer Engine attention")
    if arch.moe and arch.num_experts % par.expert_parallel:
        problems.append(
            f"trainer.megatron.expert_parallel={par.expert_parallel} must divide num_experts={arch.num_experts}"
        )
    if not arch.moe and par.expert_parallel > 1:
        problems.append("trainer.megatron.expert_parallel > 1 needs an MoE model")
    return problems + _encoder_problems(arch, par, te)


def _encoder_problems(arch: Arch, par: MegatronConfig, te: bool) -> list[str]:
    """A vision- or audio-language model: its encoders sit before the first layer, replicated, and
    their embeddings go into the full (not sequence-split) token embeddings; a vision-language
    model's RoPE is multimodal."""
    if not arch.encoders:
        return []
    kind = {(True, True): "an omni model", (True, False): "a vision-language model"}.get(
        (arch.vision, arch.audio), "an audio-language model"
    )
    problems = []
    if te and arch.vision:
        problems.append(
            "a vision-language model's multimodal RoPE needs trainer.megatron.attention=sdpa or auto "
            "(Transformer Engine's RoPE is one-dimensional)"
        )
    if par.pipeline_parallel > 1:
        problems.append(f"{kind} needs trainer.megatron.pipeline_parallel=1")
    if par.context_parallel > 1:
        problems.append(f"{kind} needs trainer.megatron.context_parallel=1")
    if arch.deepstack_layers and par.recompute:
        # the features join the layers' outputs by forward hooks that recomputation would miss
        problems.append("Qwen3-VL's DeepStack features need trainer.megatron.recompute=false")
    return problems


def check_megatron_job(model_dir: str, par: MegatronConfig, engine: str | None = None) -> list[str]:
    """The checks of a megatron job that need only the model's config.json (what submit runs);
    `engine`: rollout.engine, when the job has engines."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"model.path: cannot read {model_dir}/config.json ({e})"]
    try:
        arch = arch_of(SimpleNamespace(**config))
        te = use_transformer_engine(par.attention, arch)
    except (ValueError, AttributeError) as e:
        return [f"trainer.backend=megatron: {e}"]
    problems = megatron_problems(arch, par, te)
    if arch.moe and engine is not None and not engine_kind(engine).hf_layout:
        # megatron exports the checkpoint's layout (one tensor per expert, what SGLang loads); the
        # built-in engine holds transformers' in-memory one, whose experts are fused.
        problems.append(
            f"rollout.engine={engine} with trainer.backend=megatron and an MoE model: {engine_kind(engine).label} "
            "holds transformers' fused experts and megatron sends one tensor per expert; use rollout.engine=sglang"
        )
    return problems
