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

from relax_hpc.config import load_config
from relax_hpc.engines.vllm_engine import MIDDLEWARE, MODULE, engine_python, server_args
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import vllm as V
from relax_hpc.weights.buckets import BucketPlan
from relax_hpc.weights.vllm_channel import init_info, nccl_init_info, update_info

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"
SAMPLING = {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9, "top_k": -1}
PLAN = BucketPlan(["a.weight", "b.bias"], ["float32", "bfloat16"], [[2, 3], [4]])
UNIQUE_ID = bytes(range(128))  # what torch.cuda.nccl.unique_id() returns: NCCL's 128 bytes


@pytest.fixture(scope="module")
def cfg() -> Any:
    overrides = ["rollout.vllm.kv_cache_mib=32", "rollout.vllm.max_model_len=48", "rollout.engine=vllm"]
    overrides += ["trainer.lora.rank=4"]  # adapter sync: the server serves LoRA adapters
    return load_config(CONFIG, overrides, base_dir=REPO)


@pytest.fixture(scope="module")
def probed(cfg: Any) -> dict[str, Any]:
    python = engine_python(cfg.rollout.vllm)
    with_nccl = cfg.model_copy(update={"weights": cfg.weights.model_copy(update={"backend": "nccl"})})
    replay = cfg.algo.off_policy.model_copy(update={"routing_replay": True})
    routed = cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"off_policy": replay})})
    assert Path(python).exists(), f"{python} is missing: bash tools/install.sh --vllm"
    sent = {
        "generate": V.generate_body(V.generate_request("req-1", [1, 2, 3], SAMPLING, seed=42, adapter="v3")),
        "score": V.generate_body(V.scoring_request("req-2", [5, 6, 7])),
        "load_lora": P.to_json(V.LoadLoRAAdapterRequest("v3", "/run/weights/lora/v3", load_inplace=True)),
        "unload_lora": P.to_json(V.UnloadLoRAAdapterRequest("v1")),
        "init_info": init_info("127.0.0.1", 29511, 1, 3, "g", 120.0),
        "update_info": update_info(PLAN),
        "nccl_init_info": nccl_init_info(UNIQUE_ID, 1, 3),
        "argv": server_args(cfg, "127.0.0.1", 8123),
        "argv_nccl": server_args(with_nccl, "127.0.0.1", 8123),
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
    assert engine["update_info"] == update_info(PLAN)


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
