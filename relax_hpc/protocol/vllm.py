"""vLLM 0.32's HTTP API, the part relax_hpc uses: token-in, token-out generation and the RL routes.

Field names follow vLLM's own classes (checked against them by tests/unit/test_vllm_contract.py,
which imports them from .venv-vllm):

- POST /inference/v1/generate (served with `--enable-scale-out`): GenerateRequest
  (vllm/entrypoints/scale_out/token_in_token_out/protocol.py) with vllm.SamplingParams; the
  answer's choices carry `token_ids`, `logprobs.content[i].logprob` and `weight_versions`, spans
  [start, end) of output tokens sampled by one weight version (vllm.outputs.WeightVersionSpan):
  per-token versions, which partial rollout needs;
- the RL routes (vllm/entrypoints/rl/online/api_router.py, served with VLLM_SERVER_DEV_MODE=1):
  /pause?mode=abort|wait|keep, /resume, /abort_requests, /init_weight_transfer_engine,
  /start_weight_update, /update_weights, /finish_weight_update (which sets the weight version),
  /weight_info, /weight_checker.

This module only builds bodies and reads answers; it imports no vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

GENERATE = "/inference/v1/generate"
PAUSE = "/pause"  # ?mode=...: a query parameter, not a body field
RESUME = "/resume"
ABORT = "/abort_requests"
INIT_WEIGHT_TRANSFER = "/init_weight_transfer_engine"
START_WEIGHT_UPDATE = "/start_weight_update"
UPDATE_WEIGHTS = "/update_weights"
FINISH_WEIGHT_UPDATE = "/finish_weight_update"
WEIGHT_INFO = "/weight_info"
WEIGHT_CHECKER = "/weight_checker"

PauseMode = Literal["abort", "wait", "keep"]
# The engines' --weight-transfer-config backend: relax_hpc.weights.vllm_gloo, registered by its plugin.
TRANSFER_BACKEND = "relax_gloo"


@dataclass
class SamplingParams:
    """vllm.SamplingParams, the fields relax_hpc sets. `logprobs=0`: the sampled token's own
    log-probability only; `detokenize=False`: token ids are the answer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (vLLM); relax_hpc's -1 means the same
    seed: int | None = None
    logprobs: int = 0
    detokenize: bool = False


@dataclass
class GenerateRequest:
    """POST /inference/v1/generate: one prompt, one completion."""

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    output_mode: Literal["tokens"] = "tokens"


@dataclass
class Completion:
    """One answer of /inference/v1/generate, as the driver keeps it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    token_versions: list[int] = field(default_factory=list)


def generate_request(request_id: str, input_ids: list[int], sampling: dict[str, Any], seed: int) -> GenerateRequest:
    """The request for one call, from the driver's SGLang-style sampling settings
    (max_new_tokens, temperature, top_p, top_k: relax_hpc.rollout.rounds.sampling_params)."""
    top_k = int(sampling.get("top_k", -1))
    params = SamplingParams(
        max_tokens=int(sampling["max_new_tokens"]),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        seed=seed,
    )
    return GenerateRequest(request_id, list(input_ids), params)


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    return asdict(request)


def parse_completion(answer: dict[str, Any]) -> Completion:
    """The first choice of a /inference/v1/generate answer; raises ValueError naming what is
    missing (an answer without log-probabilities or versions cannot be trained on)."""
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"vLLM answered {len(choices)} choices, expected 1")
    choice = choices[0]
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(ids):
        raise ValueError(f"vLLM answered {len(ids)} tokens with {len(logprobs)} log-probabilities")
    return Completion(ids, logprobs, str(choice.get("finish_reason")), token_versions(choice, len(ids)))


def token_versions(choice: dict[str, Any], count: int) -> list[int]:
    """The weight version of each output token, from the choice's `weight_versions` spans."""
    versions = [-1] * count
    for span in choice.get("weight_versions") or []:
        for i in range(int(span["start"]), int(span["end"])):
            versions[i] = int(span["version"])
    if -1 in versions:
        raise ValueError(f"vLLM's weight_versions spans do not cover all {count} output tokens")
    return versions
