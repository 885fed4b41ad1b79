"""HF transformers policies, text or multimodal, as the torch backend, the built-in engine and the
exports load them: one loader, and where each kind keeps its decoder layers and encoders."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM, PreTrainedModel

from relax_hpc.data.processor import is_multimodal

# Encoders of the supported multimodal families (Qwen VL's vision tower, Qwen2-Audio's audio tower)
# under the model's `model` attribute; their parameters' names start with model.NAME.
ENCODERS = ("visual", "audio_tower")


def policy_class(path: str) -> type[AutoModelForCausalLM] | type[AutoModelForMultimodalLM]:
    """The auto class of the folder's policy: a causal LM, or a multimodal model (Qwen2/2.5-VL,
    Qwen2-Audio, ...) with its encoders."""
    return AutoModelForMultimodalLM if is_multimodal(path) else AutoModelForCausalLM


def load_policy(path: str, dtype: torch.dtype) -> PreTrainedModel:
    model: PreTrainedModel = policy_class(path).from_pretrained(path, dtype=dtype)
    return model


def pad_token_id(model: PreTrainedModel) -> int:
    """The pad token (a multimodal config keeps it in its text config); 0 when none is set."""
    pad: int | None = model.config.get_text_config().pad_token_id
    return 0 if pad is None else pad


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language model's transformer layers (model.model.layers, or language_model.layers)."""
    decoder = model.get_decoder()  # type: ignore[operator]  # every HF generation model has one
    return list(decoder.layers)


def encoders(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's vision and audio encoders by attribute name (none for a text model)."""
    inner = getattr(model, "model", None)
    return {name: module for name in ENCODERS if (module := getattr(inner, name, None)) is not None}


def is_encoder_parameter(name: str) -> bool:
    return any(name.startswith(f"model.{encoder}.") for encoder in ENCODERS)
