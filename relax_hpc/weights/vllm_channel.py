"""Trainer side of weight sync to vLLM engines, through vLLM's own weight-transfer API.

One push: POST /pause (mode `keep`: requests in flight freeze and go on with the new weights, each
token keeping the version that sampled it; `abort` for partial rollout), /start_weight_update,
then per bucket POST /update_weights to every engine (each then waits in the broadcast) while the
trainer broadcasts the flat bucket over the gloo side group, /finish_weight_update with the new
version, /resume. The engines receive with relax_hpc.weights.vllm_gloo (vLLM's
`WeightTransferEngine`, registered through its plugin entry point) and load each bucket with the
model's own load_weights.

The group is formed once (`connect`: /init_weight_transfer_engine to every engine while the
trainer hosts the rendezvous as rank 0) and reused by every push. `VllmSender` keeps it to the
registry's live engines: formed again when one starts, restarts or leaves, dropped when a push
fails (the next push forms it with the engines that answer), as relax_hpc.weights.sender does for
SGLang's protocol. This imports no vLLM: it speaks HTTP and gloo only, so it runs in the trainer's
environment.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from relax_hpc import fence
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPlan, pack, plan_buckets
from relax_hpc.weights.group import Abandoned, SideGroup
from relax_hpc.weights.sender import WeightSyncError, _is_loopback, answering, engine_key, free_port

log = logging.getLogger("relax_hpc.weights")
Named = tuple[str, torch.Tensor | None]


def init_info(
    master_address: str, master_port: int, rank_offset: int, world_size: int, group: str, timeout_s: float
) -> dict[str, Any]:
    """The body's `init_info` of /init_weight_transfer_engine (vllm_gloo.GlooInitInfo's fields)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group,
        "timeout_s": timeout_s,
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
                "POST",
                V.INIT_WEIGHT_TRANSFER,
                {"init_info": init_info(self.host, master_port, 1 + i, world, name, self.timeout_s)},
            )
        )
        self.group = SideGroup(self.host, master_port, 0, world, name, "gloo", self.timeout_s)
        _results(answers)

    def push(
        self,
        params: Iterable[Named],
        version: int,
        pause: V.PauseMode = "keep",
        plans: list[BucketPlan] | None = None,
    ) -> None:
        """Every engine holds `params` (HF names) as weight version `version` when this returns.
        With `plans` (the trainer's, fixed by its layout) the tensors are taken bucket by bucket,
        each packed before the next is read; without, they are all read first to plan them."""
        if self.group is None:
            raise RuntimeError("connect() the channel before pushing")
        fence.check("weight push (vllm)")  # a superseded trainer pushes nothing, as on the other channels
        stream = iter(params)
        if plans is None:
            named = [(n, _on_cpu(n, t)) for n, t in stream]
            plans = plan_buckets(((n, t.shape, t.dtype) for n, t in named), self.bucket_bytes)
            stream = iter(named)
        self._all("POST", f"{V.PAUSE}?mode={pause}")
        self._all("POST", V.START_WEIGHT_UPDATE)
        for plan in plans:
            flat = pack([_take(stream, name) for name in plan.names])
            answers = self._each(_poster(V.UPDATE_WEIGHTS, {"update_info": update_info(plan)}))
            # An engine that fails meanwhile fails its /update_weights: give up on the broadcast
            # then, rather than wait for its part for the group's whole timeout.
            self.group.wait(self.group.broadcast_async(flat), functools.partial(_failed, answers))
            _results(answers)
        self._all("POST", V.FINISH_WEIGHT_UPDATE, {"weight_version": str(version)})
        self._all("POST", V.RESUME)

    def resume(self) -> None:
        """After a failed push: let the engines that answer generate again (best effort, briefly)."""
        for client in self.clients:
            with contextlib.suppress(EngineUnavailable, EngineRequestError):
                client.call("POST", V.RESUME, timeout_s=5.0)

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


def _on_cpu(name: str, tensor: torch.Tensor | None) -> torch.Tensor:
    """gloo sends host memory: the tensor on the CPU (rank 0 holds every full tensor)."""
    assert tensor is not None, f"rank 0 holds every full tensor; {name} is None"
    return tensor.detach().to("cpu").contiguous()


def _take(stream: Iterator[Named], expected: str) -> torch.Tensor:
    name, tensor = next(stream)
    assert name == expected, f"the parameter stream gave {name} where the bucket plan has {expected}"
    return _on_cpu(name, tensor)


class VllmSender:
    """Rank 0's pushes to the registry's vLLM engines that answer /health, through one
    VllmGlooChannel, formed again when they change. `pause`: how a push pauses generation
    (abort with partial rollout: the driver continues what returns; keep otherwise)."""

    def __init__(self, registry: Path, api_key: str, timeout_s: float, bucket_bytes: int, pause: V.PauseMode) -> None:
        self.registry, self.api_key, self.timeout_s = registry, api_key, timeout_s
        self.bucket_bytes, self.pause = bucket_bytes, pause
        self.members: list[EngineRecord] = []
        self.channel: VllmGlooChannel | None = None
        self._trusted: list[tuple[str, str]] | None = None  # see engine_set_changed
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="vllm-health")

    def live_engines(self, records: list[EngineRecord]) -> list[EngineRecord]:
        client = lambda r: EngineClient(r.url, self.api_key, self.timeout_s)  # noqa: E731
        return answering(records, self._pool, client)

    def engine_set_changed(self) -> bool:
        """Whether the engines that answer differ from the group's members. A registry whose
        engines all answered when the group was formed is trusted while it stays the same: a
        vLLM server busy with a step's requests may answer /health late, and every probe that
        missed would form the group again (a dead engine fails the next push instead)."""
        records = read_records(self.registry)
        if self.channel is not None and engine_key(records) == self._trusted:
            return False
        return engine_key(self.live_engines(records)) != engine_key(self.members)

    def push(self, params: Iterator[Named], plans: list[BucketPlan], version: int) -> int:
        """The engines that answer take `version`; returns how many. Raises WeightSyncError when
        the transfer failed (the group is dropped first)."""
        try:
            records = read_records(self.registry)
            if self.channel is None or engine_key(records) != self._trusted:
                engines = self.live_engines(records)
                if self.channel is None or engine_key(engines) != engine_key(self.members):
                    self._form(engines)
                self._trusted = engine_key(records) if len(engines) == len(records) else None
            if self.channel is None:
                return 0
            self.channel.push(params, version, self.pause, plans)
        except (EngineUnavailable, EngineRequestError, Abandoned, RuntimeError) as e:
            self.drop()
            raise WeightSyncError(f"weight sync of version {version} to vLLM failed: {e}") from e
        return len(self.members)

    def _form(self, engines: list[EngineRecord]) -> None:
        self.drop()
        if not engines:
            return
        host = "127.0.0.1" if all(_is_loopback(r.host) for r in engines) else socket.getfqdn()
        channel = VllmGlooChannel([r.url for r in engines], self.api_key, host, self.bucket_bytes, self.timeout_s)
        try:
            channel.connect(free_port(host if _is_loopback(host) else ""))
        except BaseException:
            channel.close()
            raise
        self.channel, self.members = channel, engines
        log.info("vLLM weight-transfer group formed with %d engine(s)", len(engines))

    def drop(self) -> None:
        if self.channel is not None:
            self.channel.resume()
            self.channel.close()
        self.channel, self.members, self._trusted = None, [], None


def _poster(route: str, body: Any) -> Callable[[int, EngineClient], Any]:
    return lambda _, client: client.call("POST", route, body)


def _failed(futures: list[Future[Any]]) -> bool:
    return any(f.done() and f.exception() is not None for f in futures)


def _results(futures: list[Future[Any]]) -> list[Any]:
    return [f.result() for f in futures]
