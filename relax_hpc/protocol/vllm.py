"""vLLM 0.32's HTTP API, the part relax_hpc uses: token-in, token-out generation and the RL routes.

Field names follow vLLM's own classes (checked against them by tests/unit/test_vllm_contract.py,
which imports them from .venv-vllm):

- POST /inference/v1/generate (served with `--enable-scale-out`): GenerateRequest
  (vllm/entrypoints/scale_out/token_in_token_out/protocol.py) with vllm.SamplingParams; the
  answer's choices carry `token_ids`, `logprobs.content[i].logprob` and `weight_versions`, spans
  [start, end) of output tokens sampled by one weight version (vllm.outputs.WeightVersionSpan):
  per-token versions, which partial rollout needs;
- routing replay: served with `--enable-return-routed-experts`, a choice's `routed_experts` is
  base64 of a `.npy` array [input positions, layers, top_k] (every position of prompt and output
  but the last token, which no forward has read), converted to SGLang's raw int32 of that shape;
- scoring (a teacher's input log-probabilities): SamplingParams.prompt_logprobs=0, answered in
  the response's `prompt_logprobs` (one {token id: Logprob} per prompt position, None first);
- a LoRA adapter is chosen by the request's `model` (its name, as loaded through
  /v1/load_lora_adapter: vllm/entrypoints/serve/lora, served with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1);
- the RL routes (vllm/entrypoints/rl/online/api_router.py, served with VLLM_SERVER_DEV_MODE=1):
  /pause?mode=abort|wait|keep, /resume, /abort_requests, /init_weight_transfer_engine,
  /start_weight_update, /update_weights, /finish_weight_update (which sets the weight version),
  /weight_info, /weight_checker;
- the file channel: /collective_rpc (vllm/entrypoints/serve/dev/rpc) with method
  `reload_weights` and kwargs {weights_path}: the worker's in-place reload from a folder of
  safetensors files in the checkpoint's names (vllm/model_executor/model_loader/reload), between
  /pause and /resume, then /update_weight_version;
- memory release for colocation (vllm/entrypoints/serve/dev/sleep, VLLM_SERVER_DEV_MODE=1):
  /sleep?level=&mode= (level 1: weights to host memory, KV cache freed; scheduling paused) and
  /wake_up?tags=weights|kv_cache (scheduling resumes once every tag is awake).

`VllmClient` is the driver's adapter: an EngineClient whose `generate` takes the SGLang-style
batch the driver builds (relax_hpc.protocol.requests.GenerateReqInput), sends one token-in,
token-out request per group, all at once (vLLM batches concurrent requests itself), and answers
in SGLang's shape, with each token's version in `meta_info.token_versions`, and a scoring
request's (`logprob_start_len`) in SGLang's `input_token_logprobs`. A group is a run of
consecutive prompts alike in all but their seeds, which run on from the first (s, s + 1, ...:
relax_hpc.rollout.plan): one request with `n` samples and seed s, for which vLLM seeds sample i
with s + i (vllm/v1/engine/parallel_sampling.py), samples what the prompts sent one by one would.
vLLM reads the prompt once for the group and batches its samples. The prefix cache's counters
come from the server's Prometheus /metrics. It imports no vLLM.
"""

from __future__ import annotations

import base64
import io
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from relax_hpc.config.engines import engine_kind
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient

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
SLEEP = "/sleep"  # ?level=...&mode=...: query parameters
WAKE_UP = "/wake_up"  # ?tags=...
COLLECTIVE_RPC = "/collective_rpc"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
LOAD_LORA_ADAPTER = "/v1/load_lora_adapter"  # served with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
UNLOAD_LORA_ADAPTER = "/v1/unload_lora_adapter"
METRICS = "/metrics"  # Prometheus text; the prefix cache's counters, in tokens:
PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"

PauseMode = Literal["abort", "wait", "keep"]
# Set by the engine wrapper in the server's environment: each vLLM process then dies with its parent.
DIE_WITH_PARENT = "RELAX_HPC_DIE_WITH_PARENT"
# The engines' --weight-transfer-config backend: relax_hpc's gloo engine (relax_hpc.weights.
# vllm_gloo, registered by its plugin), or vLLM's own nccl engine.
GLOO_TRANSFER, NCCL_TRANSFER, SPARSE_NCCL_TRANSFER = "relax_gloo", "nccl", "sparse_nccl"
# How vLLM 0.32 refuses /start_weight_update while an earlier update was never finished
# (vllm/v1/worker/gpu_worker.py): relax_hpc.weights.vllm_channel then finishes that one first.
UPDATE_STILL_ACTIVE = "a weight update is already active"


def transfer_backend(weights_backend: str, delta: bool = False) -> str:
    """vLLM's transfer engine for weights.backend: nccl only when asked for (a vLLM engine may
    serve from the CPU, which gloo reaches either way), gloo for `gloo` and `auto`; with
    weights.delta, nccl is vLLM's sparse_nccl (relax_gloo takes deltas itself)."""
    if weights_backend != "nccl":
        return GLOO_TRANSFER
    return SPARSE_NCCL_TRANSFER if delta else NCCL_TRANSFER


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
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # 0: each prompt token's own log-probability (scoring)
    n: int = 1  # samples of the prompt, seeded seed, seed + 1, ... (at most the server's max_num_seqs)


@dataclass
class GenerateRequest:
    """POST /inference/v1/generate: one prompt, one completion."""

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    output_mode: Literal["tokens"] = "tokens"
    model: str | None = None  # a loaded LoRA adapter's name (adapter sync); None: the base model


@dataclass
class LoadLoRAAdapterRequest:
    """POST /v1/load_lora_adapter (vllm/entrypoints/serve/lora/protocol.py); answered in plain text.
    `load_inplace`: replace an adapter of that name (vLLM refuses the name otherwise)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


@dataclass
class UnloadLoRAAdapterRequest:
    """POST /v1/unload_lora_adapter; answered in plain text."""

    lora_name: str


@dataclass
class Completion:
    """One answer of /inference/v1/generate, as the driver keeps it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    token_versions: list[int] = field(default_factory=list)
    routed_experts: str | None = None  # SGLang's format: base64 of int32 [positions, layers, top_k]


def generate_request(
    request_id: str,
    input_ids: list[int],
    sampling: dict[str, Any],
    seed: int | None,
    adapter: str | None = None,
    n: int = 1,
) -> GenerateRequest:
    """The request for `n` samples of one prompt, from the driver's SGLang-style sampling
    settings (max_new_tokens, temperature, top_p, top_k: relax_hpc.rollout.rounds.sampling_params;
    an environment may add stop_token_ids and ignore_eos)."""
    top_k = int(sampling.get("top_k", -1))
    params = SamplingParams(
        max_tokens=int(sampling["max_new_tokens"]),
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        seed=seed,
        stop_token_ids=[int(t) for t in sampling.get("stop_token_ids") or []],
        ignore_eos=bool(sampling.get("ignore_eos", False)),
        n=n,
    )
    return GenerateRequest(request_id, list(input_ids), params, model=adapter)


def scoring_request(request_id: str, input_ids: list[int]) -> GenerateRequest:
    """The request that scores `input_ids` (SGLang's max_new_tokens 0 with return_logprob): the
    prompt's log-probabilities at temperature 1 without top-k or top-p, as SGLang scores input
    tokens; vLLM samples at least one token, which is dropped."""
    return GenerateRequest(request_id, list(input_ids), SamplingParams(max_tokens=1, prompt_logprobs=0))


def scored_answer(answer: dict[str, Any], input_ids: list[int], start: int) -> dict[str, Any]:
    """A scoring answer in SGLang's shape: `input_token_logprobs` from position `start` on, entry 0
    None (SGLang's rule for the first scored position); raises ValueError when vLLM scored other
    tokens than those sent."""
    scored = answer.get("prompt_logprobs")
    if scored is None or len(scored) != len(input_ids):
        raise ValueError(f"vLLM scored {len(scored or [])} prompt positions, not {len(input_ids)}")
    entries: list[list[Any]] = [[None, input_ids[start], None]]
    for token, position in zip(input_ids[start + 1 :], scored[start + 1 :], strict=True):
        logprob = (position or {}).get(str(token))
        if logprob is None:
            raise ValueError(f"vLLM's prompt_logprobs lack the log-probability of token {token}")
        entries.append([float(logprob["logprob"]), token, None])
    return {"output_ids": [], "meta_info": {"input_token_logprobs": entries, "finish_reason": {"type": "length"}}}


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    return asdict(request)


def parse_completion(answer: dict[str, Any]) -> Completion:
    """The one choice of a /inference/v1/generate answer (see parse_completions)."""
    (completion,) = parse_completions(answer, 1)
    return completion


def parse_completions(answer: dict[str, Any], n: int) -> list[Completion]:
    """The `n` choices of a /inference/v1/generate answer, in the order of their `index` (sample
    i of the request, seeded seed + i); raises ValueError naming what is missing (an answer
    without log-probabilities or versions cannot be trained on)."""
    choices = sorted(answer.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if [int(c.get("index", 0)) for c in choices] != list(range(n)):
        raise ValueError(f"vLLM answered {len(choices)} choices, expected {n}")
    return [_completion(choice) for choice in choices]


def _completion(choice: dict[str, Any]) -> Completion:
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(ids):
        raise ValueError(f"vLLM answered {len(ids)} tokens with {len(logprobs)} log-probabilities")
    routed = choice.get("routed_experts")
    return Completion(
        ids, logprobs, str(choice.get("finish_reason")), token_versions(choice, len(ids)),
        None if routed is None else sglang_routed_experts(routed),
    )  # fmt: skip


def sglang_routed_experts(npy_base64: str) -> str:
    """vLLM's routed experts (base64 of a .npy of uint8, uint16 or int32) as SGLang answers them."""
    choices = np.load(io.BytesIO(base64.b64decode(npy_base64)), allow_pickle=False)
    return base64.b64encode(np.ascontiguousarray(choices, dtype=np.int32).tobytes()).decode()


def token_versions(choice: dict[str, Any], count: int) -> list[int]:
    """The weight version of each output token, from the choice's `weight_versions` spans."""
    versions = [-1] * count
    for span in choice.get("weight_versions") or []:
        for i in range(int(span["start"]), int(span["end"])):
            versions[i] = int(span["version"])
    if -1 in versions:
        raise ValueError(f"vLLM's weight_versions spans do not cover all {count} output tokens")
    return versions


def sglang_answer(completion: Completion) -> dict[str, Any]:
    """A completion as the driver reads SGLang's /generate answers (relax_hpc.rollout.engine_policy):
    `token_versions` carries each token's version; `weight_version` is the newest of them (an
    answer without tokens has none: -1, which no check reads)."""
    answer: dict[str, Any] = {
        "output_ids": completion.token_ids,
        "meta_info": {
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)
            ],
            "weight_version": str(max(completion.token_versions, default=-1)),
            "token_versions": completion.token_versions,
            "finish_reason": {"type": completion.finish_reason},
        },
    }
    if completion.routed_experts is not None:
        answer["meta_info"]["routed_experts"] = completion.routed_experts
    return answer


# What a vLLM engine cannot answer from a /generate batch (refused at submit too: JobConfig._vllm).
UNSUPPORTED = {
    "image_data": "media",
    "audio_data": "media",
    "video_data": "media",
}
# Requests of all engines in flight at once: vLLM's scheduler batches them, so they must all be
# there together; a driver sends at most a step's calls (prompts_per_step x group_size).
_SENDERS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="vllm-generate")


def _is_set(value: Any) -> bool:
    """A request field off its default (None or False); 0 is set (logprob_start_len=0)."""
    return value is not None and value is not False


def sample_groups(prompts: list[list[int]], params: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(first index, n) of each group: a run of consecutive prompts with the same ids and sampling
    whose seeds run on from the first's (a lone prompt, or one without a seed, is a group of 1)."""
    groups: list[tuple[int, int]] = []
    for i in range(len(prompts)):
        if groups and _continues(groups[-1], i, prompts, params):
            first, n = groups[-1]
            groups[-1] = (first, n + 1)
        else:
            groups.append((i, 1))
    return groups


def _continues(group: tuple[int, int], i: int, prompts: list[list[int]], params: list[dict[str, Any]]) -> bool:
    first, n = group
    a, b = params[first], params[i]
    seed, other = a.get("sampling_seed"), b.get("sampling_seed")
    same = {k: v for k, v in a.items() if k != "sampling_seed"} == {k: v for k, v in b.items() if k != "sampling_seed"}
    return same and prompts[i] == prompts[first] and seed is not None and other == int(seed) + n


def prometheus_counters(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each named counter's value in a Prometheus text exposition, summed over its label sets
    (0 where absent)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class VllmClient(EngineClient):
    """An EngineClient for a vLLM server: the version from /weight_info, SGLang-style /generate
    batches as concurrent /inference/v1/generate requests (see the module docstring)."""

    def weight_version(self) -> str:
        return str(self.call("GET", WEIGHT_INFO, timeout_s=5.0)["weight_version"])

    def generate(self, request: P.GenerateReqInput) -> Any:
        refused = [what for name, what in UNSUPPORTED.items() if _is_set(getattr(request, name))]
        if refused:
            raise ValueError(f"a vLLM engine does not serve {', '.join(refused)} (rollout.engine=vllm)")
        batch = isinstance(request.input_ids[0], list) if request.input_ids else False
        prompts: list[list[int]] = request.input_ids if batch else [request.input_ids]  # type: ignore[assignment, list-item]
        if request.logprob_start_len is not None:  # scoring (a teacher's): no new tokens
            starts = request.logprob_start_len
            starts = starts if isinstance(starts, list) else [starts] * len(prompts)
            futures = [_SENDERS.submit(self._score, ids, int(s)) for ids, s in zip(prompts, starts, strict=True)]
            answers = [f.result() for f in futures]
        else:
            sampling = request.sampling_params or {}
            params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
            adapter = request.lora_path
            groups = sample_groups(prompts, params)
            sent = [_SENDERS.submit(self._group, prompts[i], params[i], n, adapter) for i, n in groups]
            answers = [a for f in sent for a in f.result()]
        return answers if batch else answers[0]

    def _group(self, ids: list[int], sampling: dict[str, Any], n: int, adapter: str | None) -> list[dict[str, Any]]:
        seed = sampling.get("sampling_seed")
        request = generate_request(uuid.uuid4().hex, ids, sampling, None if seed is None else int(seed), adapter, n)
        # Routed experts come with every answer of a server started to return them (routing replay).
        return [sglang_answer(c) for c in parse_completions(self.call("POST", GENERATE, generate_body(request)), n)]

    def prefix_cache(self) -> tuple[float, float]:
        """The server's prefix-cache counters so far: (tokens hit, tokens queried)."""
        counters = prometheus_counters(self.text(METRICS), (PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES))
        return counters[PREFIX_CACHE_HITS], counters[PREFIX_CACHE_QUERIES]

    def _score(self, ids: list[int], start: int) -> dict[str, Any]:
        answer = self.call("POST", GENERATE, generate_body(scoring_request(uuid.uuid4().hex, ids)))
        return scored_answer(answer, ids, start)

    def load_from_disk(self, request: P.UpdateWeightFromDiskReqInput) -> None:
        """The file channel's folder, reloaded in place by vLLM's workers while generation is
        paused (abort with partial rollout: the driver continues what returns; keep otherwise).
        A delta folder cannot be: vLLM reloads whole checkpoints (weights.delta is refused)."""
        if request.load_format is not None:
            raise ValueError(f"a vLLM engine loads whole weight folders, not load_format {request.load_format}")
        self.call("POST", f"{PAUSE}?mode={'abort' if request.abort_all_requests else 'keep'}")
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": request.model_path}}
            self.call("POST", COLLECTIVE_RPC, rpc)
            if request.weight_version is not None:
                self.call("POST", UPDATE_WEIGHT_VERSION, {"new_version": request.weight_version})
        finally:
            self.call("POST", RESUME)

    def load_adapter(self, name: str, folder: str) -> None:
        """One of that name (loaded by a trainer before a restart) is replaced in place."""
        self.fetch(LOAD_LORA_ADAPTER, LoadLoRAAdapterRequest(name, folder, load_inplace=True))

    def unload_adapter(self, name: str) -> None:
        """vLLM forgets the name at once; requests in flight keep the adapter they resolved."""
        self.fetch(UNLOAD_LORA_ADAPTER, UnloadLoRAAdapterRequest(name))


def client_class(engine: str) -> type[EngineClient]:
    """The client that speaks the API of rollout.engine's kind (vLLM's, or SGLang's)."""
    return VllmClient if engine_kind(engine).api == "vllm" else EngineClient
