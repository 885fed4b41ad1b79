"""Trainer side of weight sync (rank 0 of the trainer is rank 0 of the group).

SGLang 0.5.23's sequence: pause_generation (in_place, so no completion mixes buckets of two
versions), begin_weight_update, then for each bucket POST /update_weights_from_distributed to
every engine (which then waits in the broadcast) and broadcast the flat bucket, end_weight_update,
continue_generation. `weight_version` goes with the last bucket only, so an engine reports the new
version only once it holds all of it.

The group is formed once and reused until the set of engines changes (an engine restarted or
died); a failed transfer drops the group, and the next push forms a new one with the engines that
answer /health.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from relax_hpc.rollout import protocol as P
from relax_hpc.rollout.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.rollout.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPlan, pack
from relax_hpc.weights.group import SideGroup

log = logging.getLogger("relax_hpc.weights")


class WeightSyncError(RuntimeError):
    """A push did not reach every engine of the group."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class WeightSender:
    def __init__(self, registry: Path, api_key: str, backend: str, timeout_s: float) -> None:
        self.registry = registry
        self.api_key = api_key
        self.backend = backend
        self.timeout_s = timeout_s
        self.group: SideGroup | None = None
        self.members: list[EngineRecord] = []
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weights")

    def live_engines(self) -> list[EngineRecord]:
        records = read_records(self.registry)
        alive = list(self._pool.map(lambda r: self._client(r).healthy(), records))
        return [r for r, ok in zip(records, alive) if ok]

    def engine_set_changed(self) -> bool:
        """True when the engines that answer differ from the current group's members."""
        key = lambda records: sorted((r.engine_id, r.instance) for r in records)
        return key(self.live_engines()) != key(self.members)

    def _client(self, record: EngineRecord) -> EngineClient:
        return EngineClient(record.url, self.api_key, self.timeout_s)

    def _fan_out(self, route: str, request: object, members: list[EngineRecord] | None = None) -> list:
        members = self.members if members is None else members
        return [self._pool.submit(self._client(r).post, route, request) for r in members]

    def _form_group(self, engines: list[EngineRecord]) -> None:
        self.drop_group()
        master = "127.0.0.1" if all(_is_loopback(r.host) for r in engines) else socket.getfqdn()
        req = P.InitWeightsUpdateGroupReqInput(
            master_address=master,
            master_port=free_port(master if _is_loopback(master) else ""),
            rank_offset=0,
            world_size=len(engines) + 1,
            group_name=f"relax-{uuid.uuid4().hex[:12]}",
            backend=self.backend,
        )
        futures = [
            self._pool.submit(
                self._client(r).post,
                "/init_weights_update_group",
                P.InitWeightsUpdateGroupReqInput(**{**P.to_json(req), "rank_offset": i + 1}),
            )
            for i, r in enumerate(engines)
        ]
        group = SideGroup(req.master_address, req.master_port, 0, req.world_size, req.group_name, self.backend, self.timeout_s)
        for f in futures:
            f.result()
        self.group, self.members = group, engines
        log.info("weight-sync group %s formed with %d engine(s)", req.group_name, len(engines))

    def drop_group(self) -> None:
        """Leave the group; engines that still answer are un-paused (a failed push may have left
        them between begin and end of an update)."""
        if self.group is not None:
            for route, request in (
                ("/end_weight_update", P.EndWeightUpdateReqInput()),
                ("/continue_generation", P.ContinueGenerationReqInput()),
                ("/destroy_weights_update_group", P.DestroyWeightsUpdateGroupReqInput(self.group.group_name)),
            ):
                for f in self._fan_out(route, request):
                    try:
                        f.result()
                    except (EngineUnavailable, EngineRequestError):
                        pass
            self.group.close()
        self.group, self.members = None, []

    def begin(self) -> int:
        """Before a push: make sure the group holds every live engine. Returns its engine count."""
        if self.group is None or self.engine_set_changed():
            engines = self.live_engines()
            if not engines:
                self.drop_group()
                return 0
            self._form_group(engines)
        for route, request in (
            ("/pause_generation", P.PauseGenerationReqInput(mode="in_place")),
            ("/begin_weight_update", P.BeginWeightUpdateReqInput()),
        ):
            for f in self._fan_out(route, request):
                f.result()
        return len(self.members)

    def send_bucket(self, plan: BucketPlan, tensors: list[torch.Tensor], version: str | None) -> None:
        assert self.group is not None, "begin() forms the group before buckets are sent"
        req = P.UpdateWeightsFromDistributedReqInput(
            names=plan.names,
            dtypes=plan.dtypes,
            shapes=plan.shapes,
            group_name=self.group.group_name,
            flush_cache=version is not None,
            weight_version=version,
            load_format="flattened_bucket",
        )
        futures = self._fan_out("/update_weights_from_distributed", req)
        self.group.broadcast(pack(tensors))
        for f in futures:
            f.result()

    def end(self) -> None:
        for route, request in (
            ("/end_weight_update", P.EndWeightUpdateReqInput()),
            ("/continue_generation", P.ContinueGenerationReqInput()),
        ):
            for f in self._fan_out(route, request):
                f.result()


def push(
    sender: WeightSender | None,
    buckets: list[BucketPlan],
    full_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    version: int,
) -> int:
    """Send every bucket; collective over trainer ranks (all gather full tensors, rank 0 sends).

    `sender` is None on ranks other than 0. Returns the number of engines updated (rank 0).
    Raises WeightSyncError on rank 0 if the transfer failed (the group is dropped first).
    """
    num_engines = 0
    params = iter(full_parameters())
    try:
        if sender is not None:
            num_engines = sender.begin()
        for i, plan in enumerate(buckets):
            tensors = [next(params)[1] for _ in plan.names]
            if sender is not None and num_engines:
                sender.send_bucket(plan, tensors, str(version) if i == len(buckets) - 1 else None)
        if sender is not None and num_engines:
            sender.end()
    except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
        for _ in params:  # the other ranks gather every parameter: keep the collectives matched
            pass
        if sender is not None:
            sender.drop_group()
        raise WeightSyncError(f"weight sync of version {version} failed: {e}") from e
    return num_engines
