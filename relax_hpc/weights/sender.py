"""Trainer side of weight sync (rank 0 of the trainer is rank 0 of the group).

SGLang 0.5.23's sequence: pause_generation (in_place, so no completion mixes buckets of two
versions; abort with partial rollout: what is in flight returns, and the driver continues it),
begin_weight_update, then for each bucket POST /update_weights_from_distributed to
every engine (which then waits in the broadcast) and broadcast the flat bucket, end_weight_update,
continue_generation. `weight_version` goes with the last bucket only, so an engine reports the new
version only once it holds all of it.

A push is a pipeline, so that the link stays busy: every request of the sequence goes to an engine
over one keep-alive connection without waiting for the previous answer (the engine answers them in
order, so its receiving broadcasts keep the sender's order, and bucket k+1's request is already
there when bucket k arrives); bucket k+1 is packed on the GPU while bucket k is broadcast
(BucketPacker); NCCL broadcasts return to the host at once. The host waits only at the end, for
the answers.

The group is formed once and reused until the registry's set of engines changes (an engine
restarted or left); a failed transfer (an engine that died without leaving, say) drops the group,
and the next push forms a new one with the engines that answer /health.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from relax_hpc import fence
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable, RequestPipeline
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, plan_buckets
from relax_hpc.weights.channel import FullParameters, QuietHooks
from relax_hpc.weights.group import Abandoned, SideGroup
from relax_hpc.weights.layout import EngineLayout

log = logging.getLogger("relax_hpc.weights")


class WeightSyncError(RuntimeError):
    """A push did not reach every engine of the group."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def engine_key(records: list[EngineRecord]) -> list[tuple[str, str]]:
    """Which engine processes these are (a restarted engine is a new instance of its id)."""
    return sorted((r.engine_id, r.instance) for r in records)


def same_engines(some: list[EngineRecord], others: list[EngineRecord]) -> bool:
    """Whether two lists hold the same engine processes, in any order."""
    return engine_key(some) == engine_key(others)


def answering(
    records: list[EngineRecord], pool: ThreadPoolExecutor, client: Callable[[EngineRecord], EngineClient]
) -> list[EngineRecord]:
    """The engines of `records` that answer /health (asked all at once)."""
    alive = list(pool.map(lambda r: client(r).healthy(), records))
    return [r for r, ok in zip(records, alive, strict=True) if ok]


class TrustedRegistry:
    """The registry a sender last found with every engine answering /health. While it stays the
    same, a sender with a group takes its members as the engines without asking again: that spares
    a round trip on every push, and a vLLM server busy with a step's requests may answer /health
    late (every missed probe would form the group again). An engine that died since refuses the
    push's first request instead."""

    def __init__(self) -> None:
        self.key: list[tuple[str, str]] | None = None

    def trusts(self, records: list[EngineRecord]) -> bool:
        return self.key is not None and engine_key(records) == self.key

    def update(self, records: list[EngineRecord], answered: list[EngineRecord]) -> None:
        self.key = engine_key(records) if len(answered) == len(records) else None

    def forget(self) -> None:
        self.key = None


class MemberWatch:
    """During a push, asks every member's /health each second. A raw broadcast has no timeout of
    its own beyond the group's (weights.timeout_s): without this, a member that dies or hangs in the
    middle of a push holds the trainer for all of it. Two failed probes in a row mark the member
    failed; the sender then abandons the push (closing the pipelines unblocks their reads)."""

    def __init__(self, members: list[EngineRecord], api_key: str, on_failure: Callable[[], None]) -> None:
        self.failed: str | None = None
        self._members, self._api_key, self._on_failure = members, api_key, on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        misses = dict.fromkeys((m.engine_id for m in self._members), 0)
        while not self._stop.wait(1.0):
            for member in self._members:
                ok = EngineClient(member.url, self._api_key, 2.0).healthy(2.0)
                misses[member.engine_id] = 0 if ok else misses[member.engine_id] + 1
                if misses[member.engine_id] >= 2 and not self._stop.is_set():
                    self.failed = member.engine_id
                    self._on_failure()
                    return

    def stop(self) -> None:
        self._stop.set()


class WatchedWork:
    """A broadcast's Work whose wait gives up when a member failed during the push."""

    def __init__(self, work: dist.Work, group: SideGroup, watch: MemberWatch | None) -> None:
        self.work, self.group, self.watch = work, group, watch

    def wait(self) -> None:
        try:
            self.group.wait(self.work, lambda: self.watch is not None and self.watch.failed is not None)
        except Abandoned:
            failed = self.watch.failed if self.watch is not None else None
            raise EngineUnavailable(f"engine {failed} stopped answering during the push") from None


class WeightSender:
    def __init__(
        self, registry: Path, api_key: str, backend: str, timeout_s: float, abort_in_flight: bool = False
    ) -> None:
        self.registry = registry
        # Partial rollout: generations in flight are aborted (the driver continues them with the
        # new weights); otherwise they are paused in place and finish with the new weights.
        self.pause_mode: Literal["abort", "in_place"] = "abort" if abort_in_flight else "in_place"
        self.api_key = api_key
        self.backend = backend
        self.timeout_s = timeout_s
        self.group: SideGroup | None = None
        self.members: list[EngineRecord] = []
        self.relayed: dict[str, SideGroup] = {}  # other ranks' groups this rank relays (weights.relay)
        self._pipelines: list[RequestPipeline] = []  # one per member, during a push
        # The sharded channel's concurrent push: by group name, one more connection per member.
        self._lanes: dict[str, list[RequestPipeline]] = {}
        self.trusted = TrustedRegistry()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weights")
        self._watch: MemberWatch | None = None

    def live_engines(self, records: list[EngineRecord] | None = None) -> list[EngineRecord]:
        """The engines of `records` (default: the registry's) that answer /health."""
        return answering(read_records(self.registry) if records is None else records, self._pool, self._client)

    def engine_set_changed(self) -> bool:
        """True when the engines that answer differ from the current group's members."""
        return not same_engines(self.live_engines(), self.members)

    def _client(self, record: EngineRecord) -> EngineClient:
        return EngineClient(record.url, self.api_key, self.timeout_s)

    def _fan_out(
        self, route: str, request: object, members: list[EngineRecord] | None = None, timeout_s: float | None = None
    ) -> list:
        members = self.members if members is None else members
        return [self._pool.submit(self._client(r).post, route, request, timeout_s) for r in members]

    def group_request(self, engines: list[EngineRecord], relays: int = 0) -> P.InitWeightsUpdateGroupReqInput:
        """A new group of this rank (rank 0 of it, hosting its store), `relays` more trainer ranks
        (ranks 1 to relays: they pass each broadcast on) and `engines` (the ranks after)."""
        master = "127.0.0.1" if relays == 0 and all(is_loopback(r.host) for r in engines) else socket.getfqdn()
        return P.InitWeightsUpdateGroupReqInput(
            master_address=master,
            master_port=free_port(master if is_loopback(master) else ""),
            rank_offset=relays + 1,
            world_size=relays + 1 + len(engines),
            group_name=f"relax-{uuid.uuid4().hex[:12]}",
            backend=self.backend,
        )

    def form_group(self, engines: list[EngineRecord], req: P.InitWeightsUpdateGroupReqInput | None = None) -> None:
        """Form the group `req` (default: a new one of this rank and `engines`), replacing the old
        one; its relays join it at the same time (join_relay)."""
        self.drop_own_group()
        req = req or self.group_request(engines)
        futures = [
            self._pool.submit(
                self._client(r).post,
                R.INIT_WEIGHTS_UPDATE_GROUP.path,
                P.InitWeightsUpdateGroupReqInput(**{**P.to_json(req), "rank_offset": req.rank_offset + i}),
            )
            for i, r in enumerate(engines)
        ]
        group = SideGroup(
            req.master_address, req.master_port, 0, req.world_size, req.group_name, self.backend, self.timeout_s
        )
        for f in futures:
            f.result()
        self.group, self.members = group, engines
        log.info("weight-sync group %s formed with %d engine(s)", req.group_name, len(engines))

    def join_relay(self, req: P.InitWeightsUpdateGroupReqInput, rank: int) -> None:
        """Join another trainer rank's group `req` at `rank` (1 to its relays), to pass its
        broadcasts on (relay_async)."""
        self.relayed[req.group_name] = SideGroup(
            req.master_address, req.master_port, rank, req.world_size, req.group_name, self.backend, self.timeout_s
        )

    def relay_async(self, group_name: str, buffer: torch.Tensor) -> WatchedWork:
        """Take part in the broadcast of another rank's bucket in its group (into `buffer`)."""
        group = self.relayed[group_name]
        return WatchedWork(group.broadcast_async(buffer), group, self._watch)

    def drop_group(self) -> None:
        """Leave this rank's group (drop_own_group) and the groups it relays."""
        self.drop_own_group()
        for relayed in self.relayed.values():
            relayed.close_soon()
        self.relayed = {}

    def drop_own_group(self) -> None:
        """Leave the group; engines that still answer are un-paused (a failed push may have left
        them between begin and end of an update). A member the watch found failed is not asked
        (it would hold each request for the whole timeout), and the group is let go in a thread of
        its own: a backend may wait for a collective the failed member never joins."""
        failed = self._watch.failed if self._watch is not None else None
        self.stop_watch()
        self._close_pipelines()
        if self.group is not None:
            answering = [m for m in self.members if m.engine_id != failed]
            for route, request in (  # destroy first: it frees a survivor still in the collective
                (R.DESTROY_WEIGHTS_UPDATE_GROUP.path, P.DestroyWeightsUpdateGroupReqInput(self.group.group_name)),
                (R.END_WEIGHT_UPDATE.path, P.EndWeightUpdateReqInput()),
                (R.CONTINUE_GENERATION.path, P.ContinueGenerationReqInput()),
            ):
                # Best effort, briefly: a survivor may still be in the abandoned collective.
                for f in self._fan_out(route, request, answering, timeout_s=5.0):
                    with contextlib.suppress(EngineUnavailable, EngineRequestError):
                        f.result()
            self.group.close_soon()
        self.group, self.members = None, []

    def begin(self) -> int:
        """Before a push: make sure the group holds the registry's engines, open a pipeline to each
        and queue pause + begin. Returns the engine count (0: nothing to send)."""
        engines = self.engines_for_push()
        if not engines:
            self.drop_group()
            return 0
        if self.group is None or not same_engines(engines, self.members):
            self.form_group(engines)
        self.open_push()
        return len(self.members)

    def engines_for_push(self) -> list[EngineRecord]:
        """The engines a push goes to: the group's members while the registry is trusted
        (TrustedRegistry), else the registry's engines that answer /health."""
        fence.check("weight push")
        records = read_records(self.registry)
        if self.group is not None and self.trusted.trusts(records):
            return self.members
        engines = self.live_engines(records)
        self.trusted.update(records, engines)
        return engines

    def open_push(self) -> None:
        """Open a pipeline to each member and queue pause + begin."""
        self._pipelines = list(
            self._pool.map(lambda r: RequestPipeline(r.url, self.api_key, self.timeout_s), self.members)
        )
        self._watch = MemberWatch(self.members, self.api_key, self._close_pipelines)
        self._queue(R.PAUSE_GENERATION.path, P.PauseGenerationReqInput(mode=self.pause_mode))
        self._queue(R.BEGIN_WEIGHT_UPDATE.path, P.BeginWeightUpdateReqInput())

    def watch(self) -> None:
        """A rank that sends (or relays) but does not open the push: watch the members too, so that
        its broadcasts give up seconds after an engine dies or hangs (its root may never send
        what this rank waits for), not after weights.timeout_s. end() or drop_group() stops it."""
        self._watch = MemberWatch(self.members, self.api_key, self._close_pipelines)

    def open_lanes(self, group_names: list[str]) -> None:
        """After open_push and await_begun: a connection per member for each group, over which
        request_bucket sends that group's buckets. The built-in engine serves each connection on a
        thread of its own, so the groups' buckets arrive at the same time (the sharded channel)."""
        self._lanes = {
            name: list(self._pool.map(lambda r: RequestPipeline(r.url, self.api_key, self.timeout_s), self.members))
            for name in group_names
        }

    def wait_lanes(self) -> None:
        """Every answer of every lane so far."""
        for lane in self._lanes.values():
            for pipeline in lane:
                pipeline.wait_answers()

    def request_bucket(self, plan: BucketPlan, version: str | None, group_name: str | None = None) -> None:
        """Queue a bucket's request; each engine enters its broadcast once done with the previous
        bucket of the connection. The bucket travels over this sender's group, or the one named
        (sharded channel: another trainer rank's), on that group's lane when lanes are open."""
        assert self.group is not None, "begin() forms the group before buckets are sent"
        name = group_name or self.group.group_name
        for pipeline in self._lanes.get(name, self._pipelines):
            pipeline.send(
                R.UPDATE_WEIGHTS_FROM_DISTRIBUTED.path,
                P.UpdateWeightsFromDistributedReqInput(
                    names=plan.names,
                    dtypes=plan.dtypes,
                    shapes=plan.shapes,
                    group_name=name,
                    flush_cache=version is not None,
                    weight_version=version,
                    load_format="flattened_bucket",
                ),
            )

    def await_begun(self) -> None:
        """After the first bucket's request: wait for pause + begin to be answered, so that an engine
        refusing them fails the push before a broadcast is queued that no engine would join (the
        engine is busy reading that request meanwhile: this costs about nothing)."""
        for pipeline in self._pipelines:
            pipeline.wait_through(2)  # open_push's pause and begin

    def broadcast(self, flat: torch.Tensor) -> WatchedWork:
        """Start the broadcast of a packed bucket (after its request_bucket)."""
        assert self.group is not None, "begin() forms the group before buckets are sent"
        return WatchedWork(self.group.broadcast_async(flat), self.group, self._watch)

    def end(self) -> None:
        """Queue end + continue, then wait for every answer of the push."""
        self._queue(R.END_WEIGHT_UPDATE.path, P.EndWeightUpdateReqInput())
        self._queue(R.CONTINUE_GENERATION.path, P.ContinueGenerationReqInput())
        for pipeline in self._pipelines:
            pipeline.wait_answers()
        self.stop_watch()
        self._close_pipelines()

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _queue(self, route: str, request: object) -> None:
        for pipeline in self._pipelines:
            pipeline.send(route, request)

    def _close_pipelines(self) -> None:
        for pipeline in [*self._pipelines, *(p for lane in self._lanes.values() for p in lane)]:
            with contextlib.suppress(OSError):
                pipeline.close()
        self._pipelines, self._lanes = [], {}


def push(
    sender: WeightSender | None,
    buckets: list[BucketPlan],
    full_parameters: Callable[[], Iterable[tuple[str, torch.Tensor | None]]],
    version: int,
) -> int:
    """Send every bucket; collective over trainer ranks (all gather full tensors, rank 0 sends).

    `sender` is None on ranks other than 0, whose tensors are ignored (they may be None). Rank 0's
    tensors may be freed or overwritten once the iterator moves on (on CUDA: by work queued after
    that on the current stream). Returns the number of engines updated (rank 0). Raises
    WeightSyncError on rank 0 if the transfer failed (the group is dropped first).
    """
    num_engines = 0
    params = iter(full_parameters())
    try:
        if sender is not None:
            num_engines = sender.begin()
        if sender is not None and num_engines:
            _send_buckets(sender, buckets, params, str(version))
            sender.end()
        else:
            for _ in params:  # the other ranks gather every parameter: keep the collectives matched
                pass
    except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
        for _ in params:
            pass
        if sender is not None:
            sender.drop_group()
        raise WeightSyncError(f"weight sync of version {version} failed: {e}") from e
    return num_engines


def _full_tensor(param: tuple[str, torch.Tensor | None]) -> torch.Tensor:
    name, tensor = param
    assert tensor is not None, f"rank 0 holds every full tensor; {name} is None"
    return tensor


def _send_buckets(
    sender: WeightSender, buckets: list[BucketPlan], params: Iterator[tuple[str, torch.Tensor | None]], version: str
) -> None:
    """Request, pack and broadcast each bucket without waiting for any of them (see the module
    docstring); the version rides on the last bucket."""
    packer: BucketPacker | None = None
    for i, plan in enumerate(buckets):
        tensors = [_full_tensor(next(params)) for _ in plan.names]
        sender.request_bucket(plan, version if i == len(buckets) - 1 else None)
        if packer is None:  # the buffers go where the parameters are
            packer = BucketPacker(tensors[0].device, max(b.nbytes for b in buckets))
        flat = packer.pack(tensors)
        if i == 0:
            sender.await_begun()
        packer.consumed(sender.broadcast(flat))
    if packer is not None:
        packer.drain()


class BroadcastChannel(QuietHooks):
    """Rank 0 broadcasts the buckets to every engine (relax_hpc.weights.sender); every rank takes
    part in the parameters' gathers. `sender` is None on the other ranks. With `catch_up`, a new
    engine copies the weights from another engine at its start (relax_hpc.weights.catchup)."""

    def __init__(
        self, sender: WeightSender | None, layout: EngineLayout, bucket_bytes: int, catch_up: bool = False
    ) -> None:
        self.sender, self.layout, self.catch_up = sender, layout, catch_up
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)

    def push(self, full_parameters: FullParameters, version: int) -> int:
        return push(self.sender, self.buckets, lambda: self.layout.tensors(full_parameters()), version)

    def engines_changed(self, delivered: int) -> bool:
        """An engine started, restarted or left. With catch-up, only when an engine that answers
        holds another version: one that caught up holds `delivered` and needs no push (the group
        takes it in at the next push). Version 0 is the trainer's to push: an engine that did not
        catch up reports 0 too."""
        assert self.sender is not None, "rank 0 decides"
        if self.catch_up and delivered > 0:
            return any(r.weight_version != str(delivered) for r in self.sender.live_engines())
        return self.sender.engine_set_changed()
