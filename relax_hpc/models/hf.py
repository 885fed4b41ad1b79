"""HF transformers policies, text or multimodal, as the torch backend, the built-in engine and the
exports load them: one loader, and where each kind keeps its decoder layers and encoders."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMultimodalLM, PreTrainedModel

from relax_hpc.data.processor import is_multimodal

# Encoders of the supported multimodal families (Qwen VL's vision tower, Qwen2-Audio's audio tower)
# under the model's `model` attribute; their parameters' names start with model.NAME.
ENCODERS = ("visual", "audio_tower")
# Omni folders (thinker + talker + code2wav: what SGLang serves) whose policy is the thinker alone:
# AutoModelForMultimodalLM would build the whole model, which has no forward and keeps its
# encoders under thinker.model. The thinker class loads its part of the folder (the talker's
# weights are ignored) and is a Qwen VL-like model: model.visual, model.audio_tower, get_rope_index.
THINKERS = {
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration",
    "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
}


def _model_type(path: str) -> str | None:
    model_type: str | None = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    return model_type


def is_omni(path: str) -> bool:
    """An Omni folder, whose policy is its thinker."""
    return _model_type(path) in THINKERS


def policy_class(path: str) -> Any:
    """The class of the folder's policy: a causal LM, or a multimodal model (Qwen2/2.5-VL,
    Qwen3-VL, Qwen2-Audio, ...) with its encoders (auto classes); an Omni model's thinker."""
    model_type = _model_type(path)
    if model_type in THINKERS:
        return getattr(transformers, THINKERS[model_type])
    return AutoModelForMultimodalLM if is_multimodal(path) else AutoModelForCausalLM


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype `name` names (model.dtype, an engine's --dtype: float32, bfloat16, ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (float32, bfloat16, ...)")
    return dtype


def load_policy(path: str, dtype: torch.dtype) -> PreTrainedModel:
    model: PreTrainedModel = policy_class(path).from_pretrained(path, dtype=dtype)
    return model


def empty_policy(path: str, dtype: torch.dtype) -> PreTrainedModel:
    """The folder's policy on the meta device (no memory), to load a checkpoint's tensors into."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        if is_omni(path):
            model: PreTrainedModel = policy_class(path)._from_config(config.thinker_config, dtype=dtype)
        else:
            model = policy_class(path).from_config(config, dtype=dtype)
    return model


def checkpoint_layout(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters as the model's HF checkpoint names and shapes them (what SGLang loads):
    transformers' own reverse of the conversions it applied at load (fused MoE experts split per
    expert, an Omni thinker's names under thinker.*); views of the given tensors where it can."""
    from transformers.core_model_loading import revert_weight_conversion

    converted: dict[str, torch.Tensor] = revert_weight_conversion(model, tensors)
    return converted


def module_name(model: PreTrainedModel) -> Callable[[str], str]:
    """A checkpoint's tensor name -> the model's own parameter name: transformers' renamings of
    its load (Qwen2.5-VL's `model.layers.*` -> `model.language_model.layers.*`, `visual.*` ->
    `model.visual.*`), not its tensor conversions (fused MoE experts stay as named). A module
    name is its own."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return lambda name: rename_source_key(name, renamings, [])[0]


def module_names(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors under the model's own parameter names (module_name)."""
    rename = module_name(model)
    return {rename(name): tensor for name, tensor in tensors.items()}


class EngineParameters(Mapping[str, torch.nn.Parameter]):
    """The built-in engine's parameters by module name, which also answer to the checkpoint's
    names (module_name, resolved once per name): the megatron backend sends a vision-language
    model's weights under those, as SGLang loads them, while transformers' module holds them
    as `model.language_model.*` and `model.visual.*`. Iterates over the module names only."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._params = dict(model.named_parameters())
        self._rename: Callable[[str], str] | None = None  # built at the first name not a module's
        self._resolved: dict[str, str] = {}

    def _module_name(self, name: str) -> str:
        if name in self._params:
            return name
        if name not in self._resolved:
            if self._rename is None:
                self._rename = module_name(self._model)
            self._resolved[name] = self._rename(name)
        return self._resolved[name]

    def __getitem__(self, name: str) -> torch.nn.Parameter:
        return self._params[self._module_name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._module_name(name) in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


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
