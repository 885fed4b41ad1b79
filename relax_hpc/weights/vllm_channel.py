"""Trainer side of weight sync to vLLM engines, through vLLM's own weight-transfer API.

One push: POST /pause (mode `keep`: requests in flight freeze and go on with the new weights, each
token keeping the version that sampled it; `abort` for partial rollout), /start_weight_update,
then per bucket POST /update_weights to every engine (each then waits in the broadcast) while the
trainer broadcasts the flat bucket over the gloo side group, /finish_weight_update with the new
version, /resume. The engines receive with relax_hpc.weights.vllm_gloo (vLLM's
`WeightTransferEngine`, registered through its plugin entry point) and load each bucket with the
model's own load_weights.

The group is formed once (`connect`: /init_weight_transfer_engine to every engine while the
trainer hosts the rendezvous as rank 0) and reused by every push. This imports no vLLM: it speaks
HTTP and gloo only, so it runs in the trainer's environment.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from relax_hpc import fence
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient
from relax_hpc.weights.buckets import BucketPlan, pack, plan_buckets
from relax_hpc.weights.group import SideGroup


def init_info(master_address: str, master_port: int, rank_offset: int, world_size: int, group: str) -> dict[str, Any]:
    """The body's `init_info` of /init_weight_transfer_engine (vllm_gloo.GlooInitInfo's fields)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group,
    }


def update_info(plan: BucketPlan) -> dict[str, Any]:
    """The body's `update_info` of /update_weights for one flat bucket (vllm_gloo.GlooUpdateInfo)."""
    return {"names": plan.names, "dtype_names": plan.dtypes, "shapes": plan.shapes}


class VllmGlooChannel:
    """Pushes the trainer's weights to a fixed set of vLLM engines (one worker each)."""

    def __init__(self, urls: list[str], api_key: str, host: str, bucket_bytes: int, timeout_s: float) -> None:
        self.clients = [EngineClient(url, api_key, timeout_s) for url in urls]
        self.host, self.bucket_bytes, self.timeout_s = host, bucket_bytes, timeout_s
        self.group: SideGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)))

    def connect(self, master_port: int) -> None:
        """Form the side group: trainer rank 0, engine i rank 1 + i."""
        name = f"relax-vllm-{uuid.uuid4().hex[:8]}"
        world = 1 + len(self.clients)
        answers = self._each(
            lambda i, c: c.call(
                "POST", V.INIT_WEIGHT_TRANSFER, {"init_info": init_info(self.host, master_port, 1 + i, world, name)}
            )
        )
        self.group = SideGroup(self.host, master_port, 0, world, name, "gloo", self.timeout_s)
        _results(answers)

    def push(self, params: Iterable[tuple[str, torch.Tensor]], version: int, pause: V.PauseMode = "keep") -> None:
        """Every engine holds `params` (HF names) as weight version `version` when this returns."""
        if self.group is None:
            raise RuntimeError("connect() the channel before pushing")
        fence.check("weight push (vllm)")  # a superseded trainer pushes nothing, as on the other channels
        named = [(n, t.detach().contiguous()) for n, t in params]
        plans = plan_buckets(((n, t.shape, t.dtype) for n, t in named), self.bucket_bytes)
        self._all("POST", f"{V.PAUSE}?mode={pause}")
        self._all("POST", V.START_WEIGHT_UPDATE)
        start = 0
        for plan in plans:
            tensors = [t for _, t in named[start : start + len(plan.names)]]
            start += len(plan.names)
            answers = self._each(_poster(V.UPDATE_WEIGHTS, {"update_info": update_info(plan)}))
            self.group.broadcast(pack(tensors))
            _results(answers)
        self._all("POST", V.FINISH_WEIGHT_UPDATE, {"weight_version": str(version)})
        self._all("POST", V.RESUME)

    def checksums(self) -> list[dict[str, str]]:
        """vLLM's weight checker: sha256 of every weight tensor as each engine holds it."""
        answers = _results(self._each(lambda _, c: c.call("POST", V.WEIGHT_CHECKER, {"action": "checksum"})))
        return [a["checksums"] for a in answers]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._pool.shutdown(wait=False)

    def _each(self, call: Callable[[int, EngineClient], Any]) -> list[Future[Any]]:
        return [self._pool.submit(call, i, c) for i, c in enumerate(self.clients)]

    def _all(self, method: str, route: str, body: Any = None) -> None:
        _results(self._each(lambda _, c: c.call(method, route, body)))


def _poster(route: str, body: Any) -> Callable[[int, EngineClient], Any]:
    return lambda _, client: client.call("POST", route, body)


def _results(futures: list[Future[Any]]) -> list[Any]:
    return [f.result() for f in futures]
