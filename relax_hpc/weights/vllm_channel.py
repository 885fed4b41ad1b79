"""Trainer side of weight sync to vLLM engines, through vLLM's own weight-transfer API.

One push: POST /pause (mode `keep`: requests in flight freeze and go on with the new weights, each
token keeping the version that sampled it; `abort` for partial rollout), /start_weight_update,
then per bucket POST /update_weights to every engine (each then waits in the broadcast) while the
trainer broadcasts the bucket over the transfer group, /finish_weight_update with the new
version, /resume.

Colocated (launch.colocate), the engines sleep through each training step: before it,
/sleep?level=1&mode=wait (requests in flight finish; the weights go to host memory and the KV
cache is freed, on a GPU with --enable-sleep-mode; vLLM's CPU backend keeps both and pauses
scheduling only). The push after it wakes the weights (/wake_up?tags=weights), updates them
without /pause, then wakes the KV cache (/wake_up?tags=kv_cache), at which vLLM resumes
scheduling: never with the KV cache still freed. Level 1, not 2: a push that fails leaves the
engines their last weights (woken whole by the drop), never discarded memory. The transfer is
gloo even on GPUs: NCCL refuses two ranks on one device.

The group is formed once (`connect`: /init_weight_transfer_engine to every engine while the
trainer opens its end as rank 0) and reused by every push.

Two transports, one interface (`VllmTransport`), chosen by weights.backend:
- gloo (CPU): relax_hpc's own transfer engine in the engines (relax_hpc.weights.vllm_gloo,
  registered through vLLM's plugin entry point); each bucket travels as one flat tensor;
- nccl (GPU): vLLM's own `nccl` transfer engine. The trainer mints the NCCL unique id
  (relax_hpc.weights.nccl_lib) and sends it in the init info (vLLM's unique-id rendezvous, which needs no
  vLLM on the trainer's side), answers the workers' one-element warm-up all_reduce, and
  broadcasts each tensor of a bucket in the order the update info names them (`packed: false`,
  vLLM's one-by-one receive), on a stream of its own.

With weights.delta (`VllmTransfer`) a push after a group's first sends per bucket only what
changed since the previous one: over gloo the changed elements' indices and bits, which
relax_gloo patches into its copy of the bucket; over NCCL vLLM's own `sparse_nccl` engine
(`SparseNcclTransport`), which patches the model's tensors in place.

`VllmSender` keeps the group to the registry's live engines: formed again when one starts,
restarts or leaves, dropped when a push fails (the next push forms it with the engines that
answer), as relax_hpc.weights.sender does for SGLang's protocol. This imports no vLLM: it speaks
HTTP, gloo and NCCL only, so it runs in the trainer's environment.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from relax_hpc import fence
from relax_hpc.protocol import vllm as V
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights import nccl_lib
from relax_hpc.weights.buckets import DTYPES, BucketPlan, pack, plan_buckets
from relax_hpc.weights.channel import FullParameters, PhaseTimer
from relax_hpc.weights.delta import SparseDelta, diff, split
from relax_hpc.weights.group import Abandoned, SideGroup
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import TrustedRegistry, WeightSyncError, answering, free_port, is_loopback, same_engines

log = logging.getLogger("relax_hpc.weights")
Named = tuple[str, torch.Tensor | None]


def init_info(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group: str,
    timeout_s: float,
    keep_base: bool = False,
) -> dict[str, Any]:
    """The body's `init_info` of /init_weight_transfer_engine (vllm_gloo.GlooInitInfo's fields)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group,
        "timeout_s": timeout_s,
        "keep_base": keep_base,
    }


def nccl_init_info(unique_id: bytes, rank_offset: int, world_size: int) -> dict[str, Any]:
    """`init_info` for vLLM's own nccl engine (NCCLWeightTransferInitInfo): the unique-id
    rendezvous (standard base64, not URL-safe), one tensor per broadcast (`packed: false`)."""
    return {
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode(),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": False,
    }


def update_info(plan: BucketPlan) -> dict[str, Any]:
    """The body's `update_info` of /update_weights for one bucket: its tensors' names, dtypes and
    shapes, in the order they travel (vllm_gloo.GlooUpdateInfo and vLLM's
    NCCLWeightTransferUpdateInfo have these fields)."""
    return {"names": plan.names, "dtype_names": plan.dtypes, "shapes": plan.shapes}


def patches_info(patches: list[tuple[str, str, list[int], int]]) -> dict[str, Any]:
    """`update_info` for vLLM's sparse_nccl engine (SparseNCCLWeightTransferUpdateInfo): per patch
    (name, dtype, full shape, changed elements), whose int32 flat indices and then values travel."""
    names, dtypes, shapes, counts = (list(column) for column in zip(*patches, strict=True))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "num_updates_list": counts}


# An /update_weights body's `update_info` and the tensors broadcast after it, in order.
Payload = tuple[dict[str, Any], list[torch.Tensor]]


class VllmTransport(Protocol):
    """How buckets travel to the engines' workers: the init info vLLM's transfer engine `backend`
    takes, the trainer's end of the group (rank 0; engine i's worker is rank 1 + i), and what a
    bucket, whole or as a delta, puts on it. `takes_dense`: a delta may send a changed bucket
    whole where that is smaller (else every changed bucket goes sparse)."""

    backend: str
    takes_dense: bool

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]: ...

    def open(self, world_size: int, abandon: Callable[[], bool]) -> None:
        """The trainer's end of the group, while every engine joins (returns once all have; gives
        up, Abandoned, once `abandon()` says an engine's init failed)."""
        ...

    def whole(self, plan: BucketPlan, tensors: list[torch.Tensor], flat: torch.Tensor | None = None) -> Payload:
        """A bucket's tensors as they travel; `flat`: their bytes, where a delta's comparison has
        packed them already (a transport of flat buckets sends it instead of packing again)."""
        ...

    def delta(self, plan: BucketPlan, delta: SparseDelta) -> Payload:
        """A bucket's changed elements (weights.delta) as they travel."""
        ...

    def send(self, tensors: list[torch.Tensor], abandon: Callable[[], bool]) -> None:
        """Broadcast a payload's tensors in order; give up (Abandoned) once `abandon()` says so."""
        ...

    def close(self) -> None: ...


class GlooTransport:
    """A gloo side group; a whole bucket travels as one flat tensor in host memory, a delta as its
    flat indices and their new bits as bytes (vllm_gloo patches the engine's copy of the
    bucket). `keep_base` (weights.delta): the engines keep each bucket's bytes to patch."""

    backend = V.GLOO_TRANSFER
    takes_dense = True

    def __init__(self, host: str, master_port: int, timeout_s: float, keep_base: bool = False) -> None:
        self.host, self.port, self.timeout_s, self.keep_base = host, master_port, timeout_s, keep_base
        self.name = f"relax-vllm-{uuid.uuid4().hex[:8]}"
        self.group: SideGroup | None = None

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return init_info(self.host, self.port, rank_offset, world_size, self.name, self.timeout_s, self.keep_base)

    def open(self, world_size: int, abandon: Callable[[], bool]) -> None:
        # The rendezvous ends at the group's timeout if an engine never joins.
        self.group = SideGroup(self.host, self.port, 0, world_size, self.name, "gloo", self.timeout_s)

    def whole(self, plan: BucketPlan, tensors: list[torch.Tensor], flat: torch.Tensor | None = None) -> Payload:
        return update_info(plan), [flat.to("cpu") if flat is not None else pack([t.to("cpu") for t in tensors])]

    def delta(self, plan: BucketPlan, delta: SparseDelta) -> Payload:
        sparse = {"num_updates": delta.index.numel(), "index_dtype": str(delta.index.dtype).removeprefix("torch.")}
        return {**update_info(plan), **sparse}, [delta.index, delta.values.view(torch.uint8)]  # gloo has no int16

    def send(self, tensors: list[torch.Tensor], abandon: Callable[[], bool]) -> None:
        assert self.group is not None, "open() the transport first"
        for tensor in tensors:
            self.group.wait(self.group.broadcast_async(tensor.to("cpu")), abandon)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class NcclTransport:
    """An NCCL communicator with vLLM's workers (relax_hpc.weights.nccl_lib, from a unique id this
    side mints); its broadcasts run on a stream of their own, which the host polls, so a worker
    that fails mid-push is given up on (`abandon`: the communicator is aborted, its collectives
    with it) instead of waited for. Built against vLLM 0.32's classes
    (tests/unit/test_vllm_contract.py) and NCCL on a GPU (tests/gpu/test_vllm_nccl.py); no vLLM
    CUDA build has reached a GPU machine of this project (docs/limitations.md)."""

    backend = V.NCCL_TRANSFER
    takes_dense = True

    def __init__(self, device: torch.device, timeout_s: float, unique_id: bytes | None = None) -> None:
        self.device, self.timeout_s = device, timeout_s
        self.unique_id = unique_id if unique_id is not None else nccl_lib.unique_id()
        self.comm: nccl_lib.Communicator | None = None
        self.stream: torch.cuda.Stream | None = None

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]:
        return nccl_init_info(self.unique_id, rank_offset, world_size)

    def open(self, world_size: int, abandon: Callable[[], bool]) -> None:
        """NCCL's init waits for every rank without a timeout, so it runs in a thread of its own:
        an engine whose init fails, or none joining within timeout_s, leaves that thread waiting
        (a daemon; the next connect mints a new id) instead of the trainer."""
        joined: dict[str, Any] = {}

        def init() -> None:
            try:
                with torch.cuda.device(self.device):
                    joined["comm"] = nccl_lib.Communicator(self.unique_id, world_size, 0)
            except nccl_lib.NcclError as e:
                joined["error"] = e

        thread = threading.Thread(target=init, name="vllm-nccl-init", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            if abandon() or time.monotonic() > deadline:
                raise Abandoned(f"vLLM NCCL weight transfer: not every engine joined within {self.timeout_s:.0f} s")
            thread.join(0.05)
        if "error" in joined:
            raise joined["error"]
        self.comm, self.stream = joined["comm"], torch.cuda.Stream(self.device)
        # vLLM's communicator all_reduces one float32 zero right after its init (PyNcclCommunicator):
        # every peer must do the same before any other collective.
        warm_up = torch.zeros(1, device=self.device)
        self._run(lambda comm, stream: comm.all_reduce(warm_up, stream), abandon)

    def whole(self, plan: BucketPlan, tensors: list[torch.Tensor], flat: torch.Tensor | None = None) -> Payload:
        return update_info(plan), tensors

    def delta(self, plan: BucketPlan, delta: SparseDelta) -> Payload:
        raise NotImplementedError("vLLM's nccl engine takes whole tensors: weights.delta uses sparse_nccl")

    def send(self, tensors: list[torch.Tensor], abandon: Callable[[], bool]) -> None:
        def broadcast(comm: nccl_lib.Communicator, stream: torch.cuda.Stream) -> None:
            for tensor in tensors:  # in the update info's order
                comm.broadcast(tensor.to(self.device).contiguous(), 0, stream)

        self._run(broadcast, abandon)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()  # collectives a failed push left pending end with it
        self.comm, self.stream = None, None

    def _run(
        self,
        enqueue: Callable[[nccl_lib.Communicator, torch.cuda.Stream], None],
        abandon: Callable[[], bool] | None,
    ) -> None:
        """Enqueue collectives on the transport's stream after the work queued so far, then poll
        until they have run (the tensors they read live until then)."""
        assert self.comm is not None and self.stream is not None, "open() the transport first"
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            enqueue(self.comm, self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        while not done.query():
            if abandon is not None and abandon():
                raise Abandoned("vLLM NCCL weight transfer: collective abandoned")
            time.sleep(0.001)


class SparseNcclTransport(NcclTransport):
    """vLLM's own `sparse_nccl` engine (weights.delta over NCCL): the same communicator as
    NcclTransport's, but every update is a list of checkpoint-coordinate patches, each tensor's
    int32 flat indices then its values, which vLLM applies in place through the model's loader
    (vllm/distributed/weight_transfer/sparse_nccl_engine.py). It takes nothing else, so a whole
    bucket (the first push to a group) travels as patches of every index: 3 times the bytes of
    bf16 values."""

    backend = V.SPARSE_NCCL_TRANSFER
    takes_dense = False

    def whole(self, plan: BucketPlan, tensors: list[torch.Tensor], flat: torch.Tensor | None = None) -> Payload:
        every = [
            (k, torch.arange(t.numel(), dtype=torch.int32, device=t.device), t.reshape(-1))
            for k, t in enumerate(tensors)
        ]
        return self._payload(plan, every)

    def delta(self, plan: BucketPlan, delta: SparseDelta) -> Payload:
        dtype, position = DTYPES[plan.dtypes[0]], {name: k for k, name in enumerate(plan.names)}
        changed = [(position[p.name], p.index.to(torch.int32), p.values.view(dtype)) for p in split(plan, delta)]
        return self._payload(plan, changed)

    @staticmethod
    def _payload(plan: BucketPlan, parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> Payload:
        info = patches_info([(plan.names[k], plan.dtypes[k], plan.shapes[k], index.numel()) for k, index, _ in parts])
        return info, [t for _, index, values in parts for t in (index, values)]


@dataclass
class PushBytes:
    """What the last push put on the transport, and with weights.delta how many of the model's
    elements had changed since the version the engines held (a whole push: all of them)."""

    sent: int = 0
    changed: int = 0
    elements: int = 0


class VllmTransfer:
    """Pushes the trainer's weights to a fixed set of vLLM engines (one worker each) over one
    transport. `delta` (weights.delta): after the first push, which is whole, each push sends per
    bucket only what changed since the last one (every engine of the group holds it: the group is
    formed anew, and so whole again, when an engine joins, restarts or a push fails); the last
    version's bytes of every bucket stay in host memory to compare with."""

    def __init__(
        self,
        urls: list[str],
        api_key: str,
        transport: VllmTransport,
        bucket_bytes: int,
        timeout_s: float,
        delta: bool = False,
    ) -> None:
        self.clients = [EngineClient(url, api_key, timeout_s) for url in urls]
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.delta = delta
        self.base: dict[int, torch.Tensor] = {}  # with delta: bucket -> its bytes as the engines hold them
        self.last = PushBytes()
        self.connected = False
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)))

    def connect(self) -> None:
        """Form the group: trainer rank 0, engine i rank 1 + i; the engines join while the trainer
        opens its end (each side's init returns once all have)."""
        world = 1 + len(self.clients)
        answers = self._each(
            lambda i, c: c.call("POST", V.INIT_WEIGHT_TRANSFER, {"init_info": self.transport.init_info(1 + i, world)})
        )
        self.transport.open(world, functools.partial(_failed, answers))
        _results(answers)
        self.connected = True

    def push(
        self,
        params: Iterable[Named],
        version: int,
        pause: V.PauseMode = "keep",
        plans: list[BucketPlan] | None = None,
        asleep: bool = False,
    ) -> None:
        """Every engine holds `params` (HF names) as weight version `version` when this returns.
        With `plans` (the trainer's, fixed by its layout) the tensors are taken bucket by bucket,
        each packed before the next is read; without, they are all read first to plan them.
        `asleep`: the engines sleep (colocated): wake the weights first, the KV cache last."""
        if not self.connected:
            raise RuntimeError("connect() the channel before pushing")
        fence.check("weight push (vllm)")  # a superseded trainer pushes nothing, as on the other channels
        stream = iter(params)
        if plans is None:
            named = [(n, _full(n, t)) for n, t in stream]
            plans = plan_buckets(((n, t.shape, t.dtype) for n, t in named), self.bucket_bytes)
            stream = iter(named)
        self._all("POST", f"{V.WAKE_UP}?tags=weights" if asleep else f"{V.PAUSE}?mode={pause}")
        _results(self._each(lambda _, c: _start_update(c)))
        pushed, base = PushBytes(), dict[int, torch.Tensor]()
        try:
            self._send_buckets(stream, plans, pushed, base)
            self._all("POST", V.FINISH_WEIGHT_UPDATE, {"weight_version": str(version)})
        except BaseException:
            self.base = {}  # the engines' versions (and on a GPU the copies, swapped in place) are unknown now
            raise
        self.base, self.last = base, pushed  # every engine holds this version now
        self._all("POST", f"{V.WAKE_UP}?tags=kv_cache" if asleep else V.RESUME)

    def _send_buckets(
        self, stream: Iterator[Named], plans: list[BucketPlan], pushed: PushBytes, base: dict[int, torch.Tensor]
    ) -> None:
        for k, plan in enumerate(plans):
            tensors = [_take(stream, name) for name in plan.names]
            payload = self.payload(k, plan, tensors, pushed, base)
            if payload is None:
                continue  # unchanged since the engines' version
            info, sent = payload
            answers = self._each(_poster(V.UPDATE_WEIGHTS, {"update_info": info}))
            # An engine that fails meanwhile fails its /update_weights: give up on the broadcast
            # then, rather than wait for its part for the group's whole timeout.
            self.transport.send(sent, functools.partial(_failed, answers))
            _results(answers)
            pushed.sent += sum(t.numel() * t.element_size() for t in sent)

    def payload(
        self, k: int, plan: BucketPlan, tensors: list[torch.Tensor], pushed: PushBytes, base: dict[int, torch.Tensor]
    ) -> Payload | None:
        """Bucket k as it travels: whole, or with `delta` what changed since self.base (None: nothing
        did). Counts its elements and changes into `pushed`, keeps its bytes in `base`."""
        elements = sum(math.prod(shape) for shape in plan.shapes)
        pushed.elements += elements
        if not self.delta:
            pushed.changed += elements
            return self.transport.whole(plan, tensors)
        flat = pack(tensors)
        old = self._swap(k, flat, base)
        if old is None:
            pushed.changed += elements
            return self.transport.whole(plan, tensors, flat)
        sparse, changed = diff(old, flat, plan, dense=self.transport.takes_dense)
        pushed.changed += changed
        if changed == 0:
            return None
        return self.transport.whole(plan, tensors, flat) if sparse is None else self.transport.delta(plan, sparse)

    def _swap(self, k: int, flat: torch.Tensor, base: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """Keep bucket k's new bytes in host memory (into `base`) and return its last version's,
        where `flat` is (None: none kept). On a GPU the comparison runs there: the old bytes come in
        and the new go out over the host link, into the same pinned buffer (in stream order, so the
        old are read first), instead of the host comparing them at one core's speed."""
        held = self.base.get(k)
        if flat.device.type == "cpu":
            base[k] = flat
            return held
        old = None if held is None else held.to(flat.device, non_blocking=True)
        base[k] = held if held is not None else torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        base[k].copy_(flat)
        return old

    def sleep(self) -> None:
        """Colocated, before a training step: every engine finishes its requests and sleeps."""
        self._all("POST", f"{V.SLEEP}?level=1&mode=wait")

    def resume(self) -> None:
        """Before the group is left (not after a failed push, which may have left the workers
        mid-update: VllmSender.push): let the engines that answer generate again (best effort,
        briefly); a sleeping engine wakes whole, with its last weights."""
        for client in self.clients:
            for route in (V.WAKE_UP, V.RESUME):
                with contextlib.suppress(EngineUnavailable, EngineRequestError):
                    client.call("POST", route, timeout_s=5.0)

    def checksums(self) -> list[dict[str, str]]:
        """vLLM's weight checker: sha256 of every weight tensor as each engine holds it."""
        answers = _results(self._each(lambda _, c: c.call("POST", V.WEIGHT_CHECKER, {"action": "checksum"})))
        return [a["checksums"] for a in answers]

    def close(self) -> None:
        self.transport.close()
        self.connected = False
        self._pool.shutdown(wait=False)

    def _each(self, call: Callable[[int, EngineClient], Any]) -> list[Future[Any]]:
        return [self._pool.submit(call, i, c) for i, c in enumerate(self.clients)]

    def _all(self, method: str, route: str, body: Any = None) -> None:
        _results(self._each(lambda _, c: c.call(method, route, body)))


def _full(name: str, tensor: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's full tensor, contiguous (the transport moves it where it travels from)."""
    assert tensor is not None, f"rank 0 holds every full tensor; {name} is None"
    return tensor.detach().contiguous()


def _take(stream: Iterator[Named], expected: str) -> torch.Tensor:
    name, tensor = next(stream)
    assert name == expected, f"the parameter stream gave {name} where the bucket plan has {expected}"
    return _full(name, tensor)


class VllmSender:
    """Rank 0's pushes to the registry's vLLM engines that answer /health, through one
    VllmTransfer, formed again when they change. `pause`: how a push pauses generation
    (abort with partial rollout: the driver continues what returns; keep otherwise). `backend`:
    weights.backend (protocol.vllm.transfer_backend: nccl, from the trainer's `device`, only when
    asked for). `colocated`: the engines sleep through each training step (`release`). `delta`:
    weights.delta (VllmTransfer)."""

    def __init__(
        self,
        registry: Path,
        api_key: str,
        timeout_s: float,
        bucket_bytes: int,
        pause: V.PauseMode,
        backend: str = "auto",
        device: torch.device | None = None,
        colocated: bool = False,
        delta: bool = False,
    ) -> None:
        self.registry, self.api_key, self.timeout_s = registry, api_key, timeout_s
        self.bucket_bytes, self.pause = bucket_bytes, pause
        self.backend, self.device, self.colocated, self.delta = backend, device, colocated, delta
        self.last = PushBytes()  # the last push's (VllmTransfer.last)
        self.asleep = False  # the group's engines sleep (released for a step, not yet pushed to)
        self.members: list[EngineRecord] = []
        self.channel: VllmTransfer | None = None
        self.trusted = TrustedRegistry()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="vllm-health")

    def live_engines(self, records: list[EngineRecord]) -> list[EngineRecord]:
        client = lambda r: EngineClient(r.url, self.api_key, self.timeout_s)  # noqa: E731
        return answering(records, self._pool, client)

    def engine_set_changed(self) -> bool:
        """Whether the engines that answer differ from the group's members (a trusted registry,
        TrustedRegistry, is taken as unchanged)."""
        records = read_records(self.registry)
        if self.channel is not None and self.trusted.trusts(records):
            return False
        return not same_engines(self.live_engines(records), self.members)

    def push(self, params: Iterator[Named], plans: list[BucketPlan], version: int) -> int:
        """The engines that answer take `version`; returns how many. Raises WeightSyncError when
        the transfer failed (the group is dropped first)."""
        try:
            records = read_records(self.registry)
            if self.channel is None or not self.trusted.trusts(records):
                engines = self.live_engines(records)
                if self.channel is None or not same_engines(engines, self.members):
                    self._form(engines)
                self.trusted.update(records, engines)
            if self.channel is None:
                return 0
            self.channel.push(params, version, self.pause, plans, asleep=self.asleep)
            self.asleep, self.last = False, self.channel.last
        except (EngineUnavailable, EngineRequestError, Abandoned, RuntimeError) as e:
            # The workers may be mid-update: vLLM's layerwise reload keeps a layer on the meta device
            # until it has all its tensors, and a request then kills the engine core. So the engines
            # stay paused (or asleep, colocated: the next push wakes them first); the next push
            # (whole: its group is new) finishes the reload and resumes them.
            self.drop(resume=False)
            raise WeightSyncError(f"weight sync of version {version} to vLLM failed: {e}") from e
        return len(self.members)

    def release(self) -> None:
        """Colocated, before a training step: the group's engines sleep (formed again by the push
        if they changed meanwhile: a restarted engine starts awake, and waking it is harmless).
        An engine that fails to answer (killed: the launcher restarts it) leaves the others awake
        for this step, and the next push forms the group again: the step is not lost for it."""
        if self.channel is None:
            return
        fence.check("engine release (vllm)")  # a superseded trainer must not stall its successor's engines
        try:
            self.channel.sleep()
            self.asleep = True
        except (EngineUnavailable, EngineRequestError) as e:
            log.warning("vLLM engines did not all go to sleep for the step (%s); they stay awake", e)
            self.drop()

    def _form(self, engines: list[EngineRecord]) -> None:
        self.drop()
        if not engines:
            return
        channel = VllmTransfer([r.url for r in engines], self.api_key, self._transport(engines), self.bucket_bytes,
                               self.timeout_s, self.delta)  # fmt: skip
        try:
            channel.connect()
        except BaseException:
            channel.close()
            raise
        self.channel, self.members = channel, engines
        log.info("vLLM weight-transfer group formed with %d engine(s)", len(engines))

    def _transport(self, engines: list[EngineRecord]) -> VllmTransport:
        backend = V.transfer_backend(self.backend, self.delta)
        if backend != V.GLOO_TRANSFER:
            assert self.device is not None and self.device.type == "cuda", "the nccl transfer runs from a GPU"
            return (SparseNcclTransport if backend == V.SPARSE_NCCL_TRANSFER else NcclTransport)(
                self.device, self.timeout_s
            )
        host = "127.0.0.1" if all(is_loopback(r.host) for r in engines) else socket.getfqdn()
        return GlooTransport(host, free_port(host if is_loopback(host) else ""), self.timeout_s, self.delta)

    def drop(self, resume: bool = True) -> None:
        """Leave the group; `resume`: let its engines generate again, woken whole if they sleep
        (VllmTransfer.resume). Without, they stay as they are, and `asleep` with them."""
        if self.channel is not None:
            if resume:
                self.channel.resume()
                self.asleep = False
            self.channel.close()
        self.channel, self.members = None, []
        self.trusted.forget()


def _start_update(client: EngineClient) -> None:
    """/start_weight_update. vLLM refuses it while an earlier update is unfinished: a push whose
    trainer gave up after the engine had taken every bucket but before /finish_weight_update (an
    answer that timed out on a loaded machine) left the worker mid-update, and every later push
    failed here, the engine paused for good. That update is finished first, under the version the
    engine reports (it stays paused; a layer the update left unloaded gets its old tensors back),
    then this push starts: whole, as every push to a group formed after a failure is, so it
    replaces every tensor before /resume lets the engine sample."""
    try:
        client.call("POST", V.START_WEIGHT_UPDATE)
        return
    except (EngineUnavailable, EngineRequestError) as e:
        if V.UPDATE_STILL_ACTIVE not in str(e):
            raise
    held = str(client.call("GET", V.WEIGHT_INFO)["weight_version"])
    log.warning("%s was left mid-update by a failed push: finishing it (version %s) before this push", client.url, held)
    client.call("POST", V.FINISH_WEIGHT_UPDATE, {"weight_version": held})
    client.call("POST", V.START_WEIGHT_UPDATE)


def _poster(route: str, body: Any) -> Callable[[int, EngineClient], Any]:
    return lambda _, client: client.call("POST", route, body)


def _failed(futures: list[Future[Any]]) -> bool:
    return any(f.done() and f.exception() is not None for f in futures)


def _results(futures: list[Future[Any]]) -> list[Any]:
    return [f.result() for f in futures]


class VllmChannel:
    """Rank 0 pushes to vLLM engines through vLLM's weight-transfer API (relax_hpc.weights.
    vllm_channel) in the HF checkpoint's layout, which vLLM's load_weights takes; every rank takes
    part in the parameters' gathers. `sender` is None on the other ranks. Colocated
    (VllmSender.colocated), rank 0 puts the engines to sleep before each step."""

    def __init__(self, sender: VllmSender | None, layout: EngineLayout, bucket_bytes: int) -> None:
        self.sender, self.layout = sender, layout
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = iter(self.layout.tensors(full_parameters()))
        try:
            return 0 if self.sender is None else self.sender.push(params, self.buckets, version)
        finally:
            for _ in params:  # every rank gathers every parameter, also after a failure: keep the collectives matched
                pass

    def engines_changed(self, delivered: int) -> bool:
        assert self.sender is not None, "rank 0 decides"
        return self.sender.engine_set_changed()

    def before_step(self, timer: PhaseTimer) -> None:
        if self.sender is not None and self.sender.colocated:
            with timer.phase("release"):  # the engines sleep through the step
                self.sender.release()

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """Colocated, the time the engines took to sleep; with weights.delta, the last push's bytes
        sent and the share of elements that changed."""
        if self.sender is None:
            return {}
        out = {"time_release": phases.get("release", 0.0)} if self.sender.colocated else {}
        last = self.sender.last
        if self.sender.delta and last.elements:
            out |= {
                "weights_sent_mb": round(last.sent / 2**20, 3),
                "weights_changed_share": last.changed / last.elements,
            }
        return out
