"""The engine protocol: the part of SGLang's native HTTP API that relax_hpc uses.

Request bodies mirror SGLang's own request classes (sglang.srt.managers.io_struct, read from
sglang 0.5.23): the names, types and defaults below are a subset of theirs. The built-in torch
engine parses requests with these same dataclasses, and rejects fields it does not implement
rather than ignoring them (SGLang ignores unknown top-level keys). The weight-update sequence is
0.5.23's: pause_generation, begin_weight_update, update_weights_from_distributed per bucket
(weight_version on the last), end_weight_update, continue_generation. The live weight version
is read from GET /model_info.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


class ProtocolError(ValueError):
    """A request body that does not match the protocol (answered with HTTP 400)."""


# Media of a /generate request, as SGLang 0.5.23 takes them over HTTP: for one prompt an item or a
# list of items; for a batch a list with one entry (an item or a list) per prompt. An item is a
# data: URI (what relax_hpc sends; SGLang reads audio only from data URIs, not bare base64), or a
# path on the engine's machine. The prompt holds one placeholder per item, unexpanded: the engine
# expands it with the model's processor.
MediaData = str | list[str] | list[list[str]] | list[str | list[str]]


@dataclass
class GenerateReqInput:
    """POST /generate. A batch when input_ids is a list of lists."""

    input_ids: list[int] | list[list[int]]
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    # With return_logprob: meta_info.input_token_logprobs for the input tokens from this position
    # on, as [logprob, token, None]; the first entry's logprob is None (SGLang's rule: nothing
    # scores a token from its own position). None (SGLang: -1): no input log-probabilities.
    logprob_start_len: int | list[int] | None = None
    stream: bool = False
    image_data: MediaData | None = None
    audio_data: MediaData | None = None
    video_data: MediaData | None = None  # relax_hpc sends canonical clips (relax_hpc.data.video)
    # The prompt ids the engine conditioned on (placeholders expanded), as a top-level
    # `prompt_token_ids` of each answer.
    return_prompt_token_ids: bool = False
    # MoE: the experts each token's router chose, as meta_info.routed_experts (base64 of int32
    # [positions, layers, top_k], positions routed_experts_start_len .. prompt + output - 1).
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # LoRA (trainer.lora.sync adapter): the name of a loaded adapter (/load_lora_adapter) the
    # answer comes from, one for the whole request; None: the base model.
    lora_path: str | None = None


@dataclass
class InitWeightsUpdateGroupReqInput:
    """POST /init_weights_update_group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    """POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """POST /update_weights_from_distributed: one bucket, broadcast from rank 0 of the group; with
    load_format "flattened_bucket" as one uint8 tensor holding the tensors' bytes back to back."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    """POST /update_weights_from_tensor: tensors the engine maps from the sender's memory (CUDA
    IPC handles; on the CPU, shared memory). serialized_named_tensors holds one payload per
    tensor-parallel rank: a ForkingPickler pickle, base64-encoded; with load_format
    "flattened_bucket" the payload is {"flattened_tensor": uint8 tensor, "metadata": [...]}."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass
class UpdateWeightFromDiskReqInput:
    """POST /update_weights_from_disk: load the safetensors files of the folder `model_path` (a
    path on the engine's machine) into the weights; SGLang waits for the requests in flight (or
    aborts them), the built-in engine loads between batches. load_format None: the server's own
    (SGLang: safetensors); "relax_delta": a delta folder (weights.delta; the built-in engine only)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass
class ReleaseMemoryOccupationReqInput:
    """POST /release_memory_occupation: free the engine's GPU memory (tags: kv_cache, weights,
    cuda_graph; None: all) while it is idle (colocated training)."""

    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    """POST /resume_memory_occupation: take back what release freed (released weights hold no
    values until the next update)."""

    tags: list[str] | None = None


@dataclass
class GetWeightsByNameReqInput:
    """POST /get_weights_by_name: the first `truncate_size` rows of a parameter, as nested lists."""

    name: str
    truncate_size: int = 100


@dataclass
class BeginWeightUpdateReqInput:
    """POST /begin_weight_update: required before /update_weights_from_distributed (SGLang >= 0.5.21)."""

    selector: Literal["target", "draft", "all"] = "all"


@dataclass
class EndWeightUpdateReqInput:
    """POST /end_weight_update."""


@dataclass
class AbortReq:
    """POST /abort_request."""

    rid: str | None = None
    abort_all: bool = False


@dataclass
class PauseGenerationReqInput:
    """POST /pause_generation. abort: drop queued and running requests; in_place / retract: keep
    them and stop scheduling until /continue_generation."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass
class ContinueGenerationReqInput:
    """POST /continue_generation."""

    torch_empty_cache: bool = True


@dataclass
class LoadLoRAAdapterReqInput:
    """POST /load_lora_adapter: load the PEFT adapter folder `lora_path` (a path on the engine's
    machine) under `lora_name`. A name already loaded is refused ("already loaded"); the old one
    keeps serving meanwhile."""

    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRAAdapterReqInput:
    """POST /unload_lora_adapter: answered once no request in flight uses the adapter. A later
    request naming it loads it again from its folder (SGLang's rule)."""

    lora_name: str


@dataclass
class UpdateWeightVersionReqInput:
    """POST /update_weight_version: the version GET /model_info reports from now on (after an
    adapter load, which does not change it)."""

    new_version: str
    abort_all_requests: bool = True


@dataclass
class CheckWeightsReqInput:
    """POST /weights_checker: `checksum` answers each tensor's digest as the engine holds it
    (relax_hpc.weights.verify reads the answer); SGLang's other actions (snapshot, compare,
    reset_tensors) are its own tests' and the built-in engine refuses them."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


def adapter_name(version: int) -> str | None:
    """The LoRA adapter an engine serves policy version `version` with, as a request's lora_path
    names it (adapter sync, trainer.lora.sync adapter); None: the base model, version 0."""
    return f"v{version}" if version > 0 else None


# Sampling parameters the built-in engine implements (names of SGLang's SamplingParams).
SAMPLING_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "sampling_seed")


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """Type hints and fields of a request class, resolved once: parse runs on every bucket of a
    weight update, where get_type_hints alone cost 75-280 us."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def parse(cls: type, body: Any) -> Any:
    """Build request `cls` from a JSON body, rejecting unknown fields and wrong types."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: the body must be a JSON object")
    hints, fields = _schema(cls)
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unsupported fields {unknown}; supported: {sorted(fields)}")
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        if not _matches(body[name], hints[name]):
            raise ProtocolError(f"{cls.__name__}.{name}: expected {hints[name]}, got {body[name]!r}")
    return cls(**body)


def to_json(request: Any) -> dict[str, Any]:
    """The JSON body of a request, leaving out fields at their defaults (as SGLang's clients do)."""
    out = {}
    for f in dataclasses.fields(request):
        value = getattr(request, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = value
    return out
