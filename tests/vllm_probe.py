"""Run by tests/unit/test_vllm_contract.py with vLLM's own Python (.venv-vllm): reads what relax_hpc
sends (JSON on stdin), puts it through vLLM 0.32's own classes, parsers and routers, and prints
what vLLM made of it (JSON on stdout). Imports vLLM, so it never runs in the trainer's environment."""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import inspect
import json
import sys
import typing
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.rl.online.api_router import router as rl_router
from vllm.entrypoints.scale_out.token_in_token_out.api_router import router as tokens_router
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest, GenerateTokensResponse
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX
from vllm.plugins import load_general_plugins
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import PauseMode


def routes() -> dict[str, dict[str, Any]]:
    """Each route's methods and where its parameters come from (query or body), as FastAPI has them."""
    out = {}
    for route in [*rl_router.routes, *tokens_router.routes]:
        dependant = getattr(route, "dependant", None)
        out[route.path] = {
            "methods": sorted(route.methods),
            "query": sorted(p.name for p in dependant.query_params) if dependant else [],
            "body": sorted(p.name for p in dependant.body_params) if dependant else [],
        }
    return out


def generate(body: dict[str, Any]) -> dict[str, Any]:
    request = GenerateRequest.model_validate(body)
    params = request.sampling_params
    return {
        "request_id": request.request_id,
        "token_ids": request.token_ids,
        "output_mode": request.output_mode,
        "model": request.model,
        "sampling": {name: getattr(params, name) for name in body["sampling_params"]},
    }


def answer() -> dict[str, Any]:
    """An answer built with vLLM's response class: three tokens, the last by a newer version, and
    the routers' choices as vLLM's server encodes them (uint8 [2 prompt + 3 output - 1 positions,
    2 layers, top 2])."""
    import numpy as np
    from vllm.utils.serial_utils import numpy2base64

    routed = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2) % 8
    choice = {
        "routed_experts": numpy2base64(routed),
        "index": 0,
        "token_ids": [3, 4, 5],
        "finish_reason": "length",
        "logprobs": {"content": [{"token_id": t, "logprob": -0.25 * t} for t in (3, 4, 5)]},
        "weight_versions": [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}],
    }
    return GenerateTokensResponse(request_id="r", choices=[choice]).model_dump(mode="json")


def scored() -> dict[str, Any]:
    """A scoring answer built with vLLM's classes: prompt [5, 6, 7], each position's own token
    scored (prompt_logprobs=0), the first position unscored (None) as vLLM leaves it."""
    from vllm.logprobs import Logprob

    positions = [None, {6: Logprob(logprob=-0.5, rank=2)}, {7: Logprob(logprob=-1.5, rank=9)}]
    choice = {"index": 0, "token_ids": [9], "finish_reason": "length"}
    return GenerateTokensResponse(request_id="s", choices=[choice], prompt_logprobs=positions).model_dump(mode="json")


def transfer_engine(backend: str, init_info: dict[str, Any], update_info: dict[str, Any]) -> dict[str, Any]:
    """The engine class vLLM builds for `backend` and what its info classes make of the payloads."""
    load_general_plugins()  # what every vLLM process does at start: relax_hpc's entry point registers
    load_general_plugins()  # and again (vLLM may): registering must not fail the second time
    cls = WeightTransferEngineFactory._registry[backend]()
    info = cls.init_info_cls(**init_info)
    return {
        "class": f"{cls.__module__}.{cls.__name__}",
        "is_engine": issubclass(cls, WeightTransferEngine),
        "abstract": sorted(cls.__abstractmethods__),
        "init_info": dataclasses.asdict(info),
        "unique_id_bytes": len(getattr(info, "nccl_unique_id_bytes", b"") or b""),
        "update_info": dataclasses.asdict(cls.update_info_cls(**update_info)),
    }


def sparse_nccl_receive(model: dict[str, Any], updates: list[dict[str, Any]]) -> list[dict[str, str]]:
    """vLLM's own SparseNCCLWeightTransferEngine.receive_weights, run on the CPU: its communicator is
    played by a stand-in that hands out, in order, the tensors the trainer's SparseNcclTransport
    broadcasts (each receive's dtype and shape must be the sent tensor's), its model by a module
    whose load_weights is vLLM's default loader per checkpoint tensor. `model`: name -> [dtype,
    shape], all zeros at first. Returns each tensor's bytes (base64) after each update."""
    import torch
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    held = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (dtype, shape) in model.items()}

    class Model(torch.nn.Module):
        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
            for name, tensor in weights:
                default_weight_loader(held[name], tensor)
            return {name for name, _ in weights}

    class Wire:
        device = torch.device("cpu")

        def __init__(self, sent: list[torch.Tensor]) -> None:
            self.sent = sent

        def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
            expected = self.sent.pop(0)
            assert src == 0 and (tensor.dtype, tensor.shape) == (expected.dtype, expected.shape), (tensor, expected)
            tensor.copy_(expected)

    torch.cuda.current_stream = lambda device=None: None  # type: ignore[assignment,return-value]  # the stand-in needs no GPU stream
    engine = SparseNCCLWeightTransferEngine.__new__(SparseNCCLWeightTransferEngine)
    engine.model, out = Model(), []
    for update in updates:
        sent = [torch.frombuffer(bytearray(base64.b64decode(b)), dtype=getattr(torch, d)) for d, b in update["tensors"]]
        engine.model_update_group = Wire(sent)
        engine.receive_weights(engine.parse_update_info(update["info"]))
        assert not engine.model_update_group.sent, "tensors left unreceived"
        out.append({n: base64.b64encode(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).decode()
                    for n, t in held.items()})  # fmt: skip
    return out


def warm_up_source() -> str:
    """What vLLM's communicator runs right after its NCCL init (both rendezvous modes)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return inspect.getsource(PyNcclCommunicator._init_comm)


def server_args(argv: list[str]) -> dict[str, Any]:
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    keys = (
        "model",
        "dtype",
        "seed",
        "max_model_len",
        "kv_cache_memory_bytes",
        "enable_scale_out",
        "logprobs_mode",
        "middleware",
        "disable_uvicorn_access_log",
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "enable_return_routed_experts",
    )
    out = {k: getattr(ns, k) for k in keys}
    out |= {"enforce_eager": ns.enforce_eager, "weight_transfer_config": str(ns.weight_transfer_config)}
    return out


def main() -> None:
    sent = json.load(sys.stdin)
    print(
        json.dumps(
            {
                "routes": routes(),
                "pause_modes": list(typing.get_args(PauseMode)),
                "guarded_prefixes": list(GUARDED_PREFIX),
                "generate": generate(sent["generate"]),
                "load_lora": LoadLoRAAdapterRequest.model_validate(sent["load_lora"]).model_dump(),
                "unload_lora": UnloadLoRAAdapterRequest.model_validate(sent["unload_lora"]).model_dump(),
                "answer": answer(),
                "score": generate(sent["score"]),
                "scored": scored(),
                "transfer_engine": transfer_engine("relax_gloo", sent["init_info"], sent["update_info"]),
                "nccl_engine": transfer_engine("nccl", sent["nccl_init_info"], sent["update_info"]),
                "delta_engine": transfer_engine("relax_gloo", sent["delta_init_info"], sent["delta_update_info"]),
                "sparse_engine": transfer_engine(
                    "sparse_nccl", sent["nccl_init_info"], sent["sparse_updates"][0]["info"]
                ),
                "sparse_received": sparse_nccl_receive(sent["sparse_model"], sent["sparse_updates"]),
                "warm_up": warm_up_source(),
                "server_args": server_args(sent["argv"]),
                "server_args_nccl": server_args(sent["argv_nccl"]),
                "server_args_sparse": server_args(sent["argv_sparse"]),
                "server_args_routed": server_args(sent["argv_routed"]),
                "module_found": importlib.util.find_spec(sent["module"]) is not None,
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
