"""relax_hpc's side of vLLM 0.32's API against vLLM's own classes, routes and argument parser.

vLLM lives in an environment of its own (.venv-vllm: it pins transformers below the trainer's),
so tests/vllm_probe.py runs there, in a subprocess: it takes what relax_hpc sends (built here
by the same functions the engine wrapper, the weight channel and the driver's vLLM requests use)
through vLLM's classes and prints what vLLM made of it. Checked:

- /inference/v1/generate: relax_hpc's body validates as vLLM's GenerateRequest and every sampling
  setting lands in vLLM's SamplingParams with the value meant; an answer built by vLLM's
  GenerateTokensResponse parses into tokens, log-probabilities and per-token versions;
- the routes relax_hpc calls exist with those methods, their parameters where relax_hpc puts them
  (pause's mode in the query, the rest in the body), and pause's modes are vLLM's;
- the gloo transfer engine: vLLM's plugin loading registers it (twice is harmless), it is a
  complete WeightTransferEngine, and the channel's init and update payloads build its info classes;
- the wrapper's server arguments parse with api_server's own parser, each to the value meant;
- vLLM's API key guards only some prefixes, none of the RL routes: why vllm_auth exists.
"""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relax_hpc.config import load_config
from relax_hpc.engines.vllm_engine import MIDDLEWARE, MODULE, engine_python, server_args
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import vllm as V
from relax_hpc.weights.buckets import BucketPlan, pack, plan_buckets
from relax_hpc.weights.delta import diff
from relax_hpc.weights.vllm_channel import (
    GlooTransport,
    Payload,
    PushBytes,
    SparseNcclTransport,
    VllmTransfer,
    init_info,
    nccl_init_info,
    update_info,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"
SAMPLING = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": -1}
PLAN = BucketPlan(["a.weight", "b.bias"], ["float32", "bfloat16"], [[2, 3], [4]])
UNIQUE_ID = bytes(range(128))  # what torch.cuda.nccl.unique_id() returns: NCCL's 128 bytes


def _sparse_versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two versions of a small checkpoint, the second differing in two elements of two tensors,
    one of them only in its sign bit (+0.0 -> -0.0); the third tensor is unchanged."""
    g = torch.Generator().manual_seed(0)
    v1 = {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g).bfloat16(),
        "model.norm.weight": torch.tensor([1.0, 0.0, 2.0, 3.0]).bfloat16(),
        "lm_head.weight": torch.randn(8, 4, generator=g),
    }
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.embed_tokens.weight"][3, 1] += 1
    v2["model.norm.weight"][1] = -0.0
    return v1, v2


def _sparse_pushes() -> list[Payload]:
    """What the trainer's VllmTransfer (weights.delta over nccl: vLLM's sparse_nccl) puts on the
    wire for a group's whole first push of v1, then for v2."""
    transport = SparseNcclTransport(torch.device("cpu"), 1.0, UNIQUE_ID)
    transfer = VllmTransfer([], "key", transport, 64, 1.0, delta=True)
    plans = plan_buckets(((n, t.shape, t.dtype) for n, t in SPARSE_V1.items()), 64)
    payloads: list[Payload] = []
    for version in (SPARSE_V1, SPARSE_V2):
        base: dict[int, torch.Tensor] = {}
        for k, plan in enumerate(plans):
            payload = transfer.payload(k, plan, [version[n] for n in plan.names], PushBytes(), base)
            payloads += [] if payload is None else [payload]
        transfer.base = base
    transfer.close()
    return payloads


def _encoded(payload: Payload) -> dict[str, Any]:
    info, tensors = payload
    raw = [
        (str(t.dtype).removeprefix("torch."), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for t in tensors
    ]
    return {"info": info, "tensors": [(d, base64.b64encode(b).decode()) for d, b in raw]}


SPARSE_V1, SPARSE_V2 = _sparse_versions()
SPARSE_UPDATES = _sparse_pushes()
DELTA_PLAN = BucketPlan(["a.weight", "b.weight"], ["float32", "float32"], [[2, 3], [4]])
_changed = diff(pack([torch.zeros(2, 3), torch.zeros(4)]), pack([torch.zeros(2, 3), torch.eye(4)[0]]), DELTA_PLAN)[0]
assert _changed is not None, "one element of ten changed: sparse"
GLOO_DELTA = GlooTransport("127.0.0.1", 29511, 1.0, keep_base=True).delta(DELTA_PLAN, _changed)


@pytest.fixture(scope="module")
def cfg() -> Any:
    overrides = ["rollout.vllm.kv_cache_mib=32", "rollout.vllm.max_model_len=48", "rollout.engine=vllm"]
    overrides += ["trainer.lora.rank=4"]  # adapter sync: the server serves LoRA adapters
    return load_config(CONFIG, overrides, base_dir=REPO)


@pytest.fixture(scope="module")
def probed(cfg: Any) -> dict[str, Any]:
    python = engine_python(cfg.rollout.vllm)
    with_nccl = cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"backend": "nccl"})})
    with_sparse = cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"backend": "nccl", "delta": True})})
    replay = cfg.algo.off_policy.model_copy(update={"routing_replay": True})
    routed = cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"off_policy": replay})})
    assert Path(python).exists(), f"{python} is missing: bash tools/install.sh --vllm"
    sent = {
        "generate": V.generate_body(V.generate_request("req-1", [1, 2, 3], SAMPLING, seed=42, adapter="v3", n=4)),
        "score": V.generate_body(V.scoring_request("req-2", [5, 6, 7])),
        "load_lora": P.to_json(V.LoadLoRAAdapterRequest("v3", "/run/weights/lora/v3", load_inplace=True)),
        "unload_lora": P.to_json(V.UnloadLoRAAdapterRequest("v1")),
        "init_info": init_info("127.0.0.1", 29511, 1, 3, "g", 120.0),
        "update_info": update_info(PLAN),
        "nccl_init_info": nccl_init_info(UNIQUE_ID, 1, 3),
        "delta_init_info": init_info("127.0.0.1", 29511, 1, 3, "g", 120.0, keep_base=True),
        "delta_update_info": GLOO_DELTA[0],
        "sparse_model": {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in SPARSE_V1.items()},
        "sparse_updates": [_encoded(u) for u in SPARSE_UPDATES],
        "argv": server_args(cfg, "127.0.0.1", 8123),
        "argv_nccl": server_args(with_nccl, "127.0.0.1", 8123),
        "argv_sparse": server_args(with_sparse, "127.0.0.1", 8123),
        "argv_routed": server_args(routed, "127.0.0.1", 8123),
        "module": MODULE,
    }
    done = subprocess.run(
        [python, str(REPO / "tests" / "vllm_probe.py")],
        input=json.dumps(sent),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_generate_request_is_vllms_and_every_setting_lands(probed: dict[str, Any]) -> None:
    g = probed["generate"]
    assert (g["request_id"], g["token_ids"], g["output_mode"]) == ("req-1", [1, 2, 3], "tokens")
    assert g["model"] == "v3"  # the LoRA adapter the request names (adapter sync)
    assert g["sampling"] == {
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,  # relax_hpc's -1 (off) is vLLM's 0
        "seed": 42,
        "logprobs": 0,
        "detokenize": False,
        "stop_token_ids": [],
        "ignore_eos": False,
        "prompt_logprobs": None,
        "n": 4,  # a group of 4 samples in one request, seeded 42, 43, 44, 45 by vLLM
    }


def test_a_scoring_request_asks_for_the_prompts_own_logprobs_and_its_answer_parses(probed: dict[str, Any]) -> None:
    """A teacher's scoring: each prompt token's log-probability at temperature 1, untruncated."""
    s = probed["score"]
    assert s["token_ids"] == [5, 6, 7]
    assert {k: s["sampling"][k] for k in ("max_tokens", "prompt_logprobs", "temperature", "top_p", "top_k")} == {
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
    }
    answer = V.scored_answer(probed["scored"], [5, 6, 7], start=1)
    assert answer["meta_info"]["input_token_logprobs"] == [[None, 6, None], [-1.5, 7, None]]
    with pytest.raises(ValueError, match="lack the log-probability of token 8"):
        V.scored_answer(probed["scored"], [5, 6, 8], start=1)


def test_the_adapter_requests_are_vllms(probed: dict[str, Any]) -> None:
    assert probed["load_lora"] == {
        "lora_name": "v3",
        "lora_path": "/run/weights/lora/v3",
        "load_inplace": True,
        "is_3d_lora_weight": False,
    }
    assert probed["unload_lora"] == {"lora_name": "v1", "lora_int_id": None}


def test_vllms_answer_parses_into_tokens_logprobs_and_versions(probed: dict[str, Any]) -> None:
    completion = V.parse_completion(probed["answer"])
    routed = np.frombuffer(base64.b64decode(V.sglang_answer(completion)["meta_info"]["routed_experts"]), np.int32)
    assert routed.tolist() == [i % 8 for i in range(16)]  # SGLang's raw int32, as the driver reads it
    assert completion.token_ids == [3, 4, 5]
    assert completion.logprobs == [-0.75, -1.0, -1.25]
    assert completion.token_versions == [7, 7, 8]
    assert completion.finish_reason == "length"


def test_the_routes_relax_hpc_calls_exist_with_their_parameters(probed: dict[str, Any]) -> None:
    routes = probed["routes"]
    calls = {
        V.GENERATE: ("POST", [], ["request"]),
        V.PAUSE: ("POST", ["clear_cache", "mode"], []),
        V.RESUME: ("POST", [], []),
        V.ABORT: ("POST", [], []),
        V.INIT_WEIGHT_TRANSFER: ("POST", [], ["init_info"]),
        V.START_WEIGHT_UPDATE: ("POST", [], []),
        V.UPDATE_WEIGHTS: ("POST", [], ["update_info"]),
        V.FINISH_WEIGHT_UPDATE: ("POST", [], ["weight_version"]),
        V.WEIGHT_INFO: ("GET", [], []),
        V.WEIGHT_CHECKER: ("POST", [], ["action", "baseline"]),
        "/update_weight_version": ("POST", [], ["new_version"]),
    }
    for path, (method, query, body) in calls.items():
        assert path in routes, path
        assert method in routes[path]["methods"], (path, routes[path])
        assert routes[path]["query"] == query, (path, routes[path])
        assert routes[path]["body"] == body, (path, routes[path])
    assert set(probed["pause_modes"]) == {"abort", "wait", "keep"}


def test_the_gloo_engine_registers_through_the_plugin_and_takes_the_channels_payloads(
    probed: dict[str, Any],
) -> None:
    engine = probed["transfer_engine"]
    assert engine["is_engine"] and engine["abstract"] == []
    assert engine["init_info"] == init_info("127.0.0.1", 29511, 1, 3, "g", 120.0)
    assert engine["update_info"] == update_info(PLAN) | {"num_updates": None, "index_dtype": "int32"}
    delta = probed["delta_engine"]  # weights.delta: the engine keeps its copy; a bucket comes as a delta
    assert delta["init_info"] == init_info("127.0.0.1", 29511, 1, 3, "g", 120.0, keep_base=True)
    assert delta["update_info"] == update_info(DELTA_PLAN) | {"num_updates": 1, "index_dtype": "int32"}
    assert [t.tolist() for t in GLOO_DELTA[1]] == [[6], [0, 0, 128, 63]]  # flat index 6, the bytes of 1.0f


def test_a_delta_over_nccl_is_what_vllms_sparse_nccl_engine_receives_and_applies(probed: dict[str, Any]) -> None:
    """weights.delta with weights.backend nccl: engines serve vLLM's own sparse_nccl, whose
    receive_weights (run on the CPU by the probe, a stand-in handing it what the trainer
    broadcasts) takes the trainer's whole first push as patches of every index, then only the two
    changed elements, and vLLM's sparse loader leaves every tensor bit for bit the trainer's: the
    sign-only change included, the unchanged tensor not sent."""
    engine = probed["sparse_engine"]
    assert engine["class"] == "vllm.distributed.weight_transfer.sparse_nccl_engine.SparseNCCLWeightTransferEngine"
    assert engine["update_info"] == SPARSE_UPDATES[0][0]
    assert '"sparse_nccl"' in probed["server_args_sparse"]["weight_transfer_config"].replace("'", '"')
    assert len(SPARSE_UPDATES) == 3 + 2  # 64-byte buckets: one per tensor, the unchanged one not again
    whole, delta = SPARSE_UPDATES[:3], SPARSE_UPDATES[3:]
    assert [u[0]["num_updates_list"] for u in delta] == [[1], [1]]
    assert sum(u[0]["num_updates_list"][0] for u in whole) == sum(t.numel() for t in SPARSE_V1.values())
    raw = lambda t: base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode()  # noqa: E731
    after_whole, after_delta = probed["sparse_received"][2], probed["sparse_received"][4]
    assert after_whole == {n: raw(t) for n, t in SPARSE_V1.items()}
    assert after_delta == {n: raw(t) for n, t in SPARSE_V2.items()}
    assert after_delta["model.norm.weight"] != after_whole["model.norm.weight"]  # -0.0 landed


def test_the_nccl_route_builds_vllms_own_nccl_engine_from_the_channels_payloads(probed: dict[str, Any]) -> None:
    """weights.backend nccl: vLLM's own engine (no plugin), the unique-id rendezvous decoded to
    NCCL's 128 bytes, one tensor per broadcast, the same update info; and vLLM's communicator
    all_reduces one float32 zero after its init, which NcclTransport.open answers."""
    engine = probed["nccl_engine"]
    assert engine["class"] == "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine"
    assert engine["is_engine"] and engine["abstract"] == []
    assert engine["unique_id_bytes"] == 128
    info = engine["init_info"]
    assert {k: info[k] for k in nccl_init_info(UNIQUE_ID, 1, 3)} == nccl_init_info(UNIQUE_ID, 1, 3)
    assert info["master_address"] is None and info["packed"] is False
    assert engine["update_info"] == update_info(PLAN)
    assert "data = torch.zeros(1, device=device)" in probed["warm_up"] and "self.all_reduce(data)" in probed["warm_up"]
    assert '"nccl"' in probed["server_args_nccl"]["weight_transfer_config"].replace("'", '"')


def test_the_wrappers_arguments_parse_with_api_servers_parser(probed: dict[str, Any], cfg: Any) -> None:
    args = probed["server_args"]
    assert args["model"] == cfg.model.path and args["dtype"] == "float32" and args["seed"] == cfg.run.seed
    assert (args["kv_cache_memory_bytes"], args["max_model_len"]) == (32 * 2**20, 48)
    assert args["enable_scale_out"] is True and args["enforce_eager"] is True
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["middleware"] == [MIDDLEWARE]
    assert args["disable_uvicorn_access_log"] is True
    assert "relax_gloo" in args["weight_transfer_config"]
    # trainer.lora.rank 4 is served under vLLM's smallest rank that holds it
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 8, 2)
    assert args["enable_return_routed_experts"] is False
    assert probed["server_args_routed"]["enable_return_routed_experts"] is True  # routing replay
    assert probed["module_found"]


def test_vllms_own_key_leaves_the_rl_routes_open(probed: dict[str, Any]) -> None:
    guarded = tuple(probed["guarded_prefixes"])
    assert V.GENERATE.startswith(guarded)
    open_routes = [
        r for r in (V.PAUSE, V.INIT_WEIGHT_TRANSFER, V.UPDATE_WEIGHTS, V.WEIGHT_CHECKER) if not r.startswith(guarded)
    ]
    assert open_routes == [V.PAUSE, V.INIT_WEIGHT_TRANSFER, V.UPDATE_WEIGHTS, V.WEIGHT_CHECKER]
