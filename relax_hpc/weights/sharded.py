"""The sharded channel (weights.channel sharded): every trainer rank broadcasts its own share of
the buckets to the engines over a group of its own, so that no rank sends, and with megatron no
rank holds, the whole model.

The buckets are planned once, never across a pipeline stage, and each goes to the least loaded
rank of the stage that holds its tensors (relax_hpc.weights.buckets.assign). With FSDP2 every rank
holds each full tensor in turn (the all-gather the broadcast channel's push does too), so N ranks
send 1/N of the bytes each; with megatron every rank of a stage holds that stage's full tensors
after the tensor- and expert-parallel gathers (export_hf's "stage"), and no tensor crosses a
stage on its way to the engines.

The engines see SGLang's weight-update API unchanged: each trainer rank's group is an
/init_weights_update_group of its own (its group_name; the trainer rank is rank 0 of it, as rank 0
is of the broadcast channel's), and each bucket's /update_weights_from_distributed names the
group it arrives on (SGLang keeps a process group per name). Rank 0 alone speaks to the engines
during a push: pause and begin, every bucket's request, then end and continue, pipelined as the
broadcast channel's (relax_hpc.weights.sender). The groups are formed one rank after the other
(an engine's join blocks until its group is complete: two at once could leave one engine waiting
in the first group and another in the second). Then, per the engines' kind:
- concurrent (the built-in engine): each group's buckets go over a connection of their own per
  engine, which the engine serves on a thread of its own, receiving into a receiver of that group
  and taking its model lock only to copy; so the ranks' broadcasts run at the same time, each on
  its own link. The version rides on a bucket of rank 0's sent last, once every engine answered
  every other bucket: an engine reports the version only once it holds all of it.
- ordered (SGLang, whose weight updates take turns under one lock): one connection per engine
  carries every bucket's request in the plan's order, the version on the last; every rank
  broadcasts its own buckets in that order, so no engine waits in one group while another waits
  in a second. The ranks then share the engines' time, not their links: the busiest rank sends
  1/N of the bytes, but a push takes about as long as the broadcast channel's.

A push fails on every rank when it failed on any (each rank's outcome is gathered), and every rank
then drops its group; the next push forms new ones with the engines that answer. Rank 0 watches
the engines' health during a push (MemberWatch); another rank's broadcast ends with an error when
an engine dies, and a hung engine holds it for at most weights.timeout_s.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Collection, Iterator
from typing import Literal

import torch
import torch.distributed as dist

from relax_hpc import fence
from relax_hpc.protocol.client import EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, BufferRing, pack, plan_buckets, stream_buckets
from relax_hpc.weights.channel import FullParameters
from relax_hpc.weights.colocated import ColocatedChannel, ColocatedSender
from relax_hpc.weights.layout import EngineLayout, Spec
from relax_hpc.weights.sender import BroadcastChannel, WeightSender, WeightSyncError, same_engines

log = logging.getLogger("relax_hpc.weights")


def plan_shares(
    layout: EngineLayout, bucket_bytes: int, stages: tuple[int, dict[str, int]]
) -> tuple[list[BucketPlan], list[int]]:
    """Collective: the buckets and the rank that sends each (balance_shares). `stages` is the
    backend's weight_stages()."""
    stage, stage_of = stages
    rank_stages: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(rank_stages, stage)
    return balance_shares(layout.specs(), bucket_bytes, lambda name: stage_of.get(name, 0), rank_stages)


def balance_shares(
    specs: list[Spec],
    bucket_bytes: int,
    stage_of: Callable[[str], int],
    rank_stages: list[int],
    senders: Collection[int] | None = None,
) -> tuple[list[BucketPlan], list[int]]:
    """The buckets and the rank that sends each. Tensors, not buckets, are spread: the largest
    first, each to the least loaded rank of the stage that holds it, so a rank's bytes come
    within one tensor of its stage's share however few buckets the model makes (spreading whole
    buckets left 2 ranks at 0.55 of a 9-bucket model). Each rank's tensors are then bucketed in
    the stream's order, and the buckets ordered by where their last tensor streams past: the
    order in which they fill as every rank walks the stream, which is the order SGLang's engines
    take them in (ShardedChannel's ordered mode): a rank never waits to send a bucket the
    engines take after one that cannot be complete yet. `senders`: the ranks that may send (all
    by default)."""
    load = [0] * len(rank_stages)
    owner_of: dict[str, int] = {}
    for name, shape, dtype in sorted(specs, key=lambda s: -s[1].numel() * s[2].itemsize):
        holders = [r for r, s in enumerate(rank_stages) if s == stage_of(name) and (senders is None or r in senders)]
        if not holders:
            raise ValueError(f"no sending trainer rank holds {name} (pipeline stage {stage_of(name)})")
        owner_of[name] = min(holders, key=load.__getitem__)
        load[owner_of[name]] += torch.Size(shape).numel() * dtype.itemsize
    position = {spec[0]: i for i, spec in enumerate(specs)}
    planned: list[tuple[int, BucketPlan, int]] = []
    for rank in range(len(rank_stages)):
        mine = [spec for spec in specs if owner_of[spec[0]] == rank]
        planned += [(position[p.names[-1]], p, rank) for p in plan_buckets(mine, bucket_bytes)]
    planned.sort(key=lambda entry: entry[0])
    return [p for _, p, _ in planned], [rank for _, _, rank in planned]


def node_leaders(places: list[tuple[int, str]]) -> list[int]:
    """The first rank of each (pipeline stage, host) in `places` (every rank's): weights.senders
    node's senders, one per node and stage (a node's ranks of one stage hold the same tensors)."""
    return [r for r, place in enumerate(places) if places.index(place) == r]


def shares(buckets: list[BucketPlan], owner: list[int], world: int) -> list[int]:
    """The bytes each rank sends in a push."""
    out = [0] * world
    for plan, rank in zip(buckets, owner, strict=True):
        out[rank] += plan.nbytes
    return out


def finish_share(params: Iterator[object], error: str | None, version: int) -> str | None:
    """Collective, after a rank sent its share: the rest of the parameters gathered (every rank
    takes part in every gather, also after a failure), then every rank's error: why the push
    failed on any rank, or None."""
    for _ in params:
        pass
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    return f"weight sync of version {version} failed: {'; '.join(failed)}" if failed else None


class ShardedChannel(BroadcastChannel):
    """The broadcast channel with every rank a sender (`senders` node: one per node and stage;
    `relay`: each sender's node's other ranks pass its broadcasts on): `sender` is this rank's
    (its group with the engines); rank 0's also decides the engines and sends them every request. `stages` is the
    backend's weight_stages(). `concurrent` (the built-in engine) sends each group's buckets over
    a connection of its own, so that an engine takes every rank's at the same time; otherwise
    (SGLang, whose weight updates take turns) one connection per engine carries them in order."""

    def __init__(
        self,
        sender: WeightSender,
        layout: EngineLayout,
        bucket_bytes: int,
        stages: tuple[int, dict[str, int]],
        catch_up: bool = False,
        concurrent: bool = True,
        relay: bool = False,
        senders: Literal["rank", "node"] = "rank",
    ) -> None:
        super().__init__(sender, layout, bucket_bytes, catch_up)
        assert not (concurrent and relay), "relayed broadcasts run through every rank: one at a time"
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        stage, stage_of = stages
        places: list[tuple[int, str]] = [(0, "")] * self.world  # every rank's (pipeline stage, host)
        dist.all_gather_object(places, (stage, socket.gethostname()))
        self.senders = node_leaders(places) if senders == "node" else list(range(self.world))
        # weights.relay: the ranks that pass a sender's broadcasts on, its node's other ranks (a
        # broadcast leaves the sender's node over its GPUs' links; other nodes' would add hops).
        self.relays = [
            [x for x in range(self.world) if places[x][1] == places[r][1] and x != r]
            if relay and r in self.senders
            else []
            for r in range(self.world)
        ]
        specs, rank_stages = layout.specs(), [p[0] for p in places]
        self.buckets, self.owner = balance_shares(
            specs, bucket_bytes, lambda name: stage_of.get(name, 0), rank_stages, self.senders
        )
        # The bucket the version rides on. Ordered: the plan's last, which every engine takes last.
        # Concurrent: rank 0's last, sent once all the others are in.
        self.concurrent = concurrent
        assert 0 in self.owner, "rank 0 holds stage 0 and takes its largest tensor"
        self.carrier = max(k for k, o in enumerate(self.owner) if o == 0) if concurrent else len(self.buckets) - 1
        self.group_names: dict[int, str] = {}  # each sender's group, by rank
        log.info("sharded weight channel: rank %d sends %d of %d buckets, %.1f MiB", self.rank,
                 self.owner.count(self.rank), len(self.buckets), self.shares()[self.rank] / 2**20)  # fmt: skip

    def shares(self) -> list[int]:
        """The bytes each rank sends in a push."""
        return shares(self.buckets, self.owner, self.world)

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = iter(self.layout.tensors(full_parameters()))
        engines: list[EngineRecord] = []
        error = None
        try:
            engines = self._agree_on_engines()
            if engines:
                self._send(params, version)
        except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
            error = f"rank {self.rank}: {e}"
        if failure := finish_share(params, error, version):
            assert self.sender is not None, "every rank sends"
            self.sender.drop_group()
            raise WeightSyncError(failure)
        return len(engines) if self.rank == 0 else 0

    def _agree_on_engines(self) -> list[EngineRecord]:
        """Rank 0's choice of engines, on every rank; the groups formed again when it changed."""
        assert self.sender is not None, "every rank sends"
        decision: list[tuple[list[EngineRecord], bool] | None] = [None]
        if self.rank == 0:
            engines = self.sender.engines_for_push()
            regroup = self.sender.group is None or not same_engines(engines, self.sender.members)
            decision = [(engines, regroup)]
        dist.broadcast_object_list(decision, src=0)
        assert decision[0] is not None, "rank 0 decided"
        engines, regroup = decision[0]
        if not engines:
            self.sender.drop_group()
        elif regroup:
            self._form_groups(engines)
        return engines

    def _form_groups(self, engines: list[EngineRecord]) -> None:
        """Every rank forms its group with `engines`, one rank after the other; with relays the
        other ranks join each as it forms (ranks 1 to world-1 of it, in rank order)."""
        assert self.sender is not None, "every rank sends"
        sender, error = self.sender, None
        sender.drop_group()
        for r in self.senders:
            request = [sender.group_request(engines, len(self.relays[r])) if r == self.rank else None]
            if self.relays[r]:
                dist.broadcast_object_list(request, src=r)
            try:
                if r == self.rank:
                    sender.form_group(engines, request[0])
                elif self.rank in self.relays[r] and request[0] is not None:
                    sender.join_relay(request[0], 1 + self.relays[r].index(self.rank))
            except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
                error = error or str(e)
            dist.barrier()
        name = self.sender.group.group_name if self.sender.group is not None else None
        formed: list[tuple[str | None, str | None]] = [(None, None)] * self.world
        dist.all_gather_object(formed, (name, error))
        problems = [f"rank {r}: {e}" for r, (_, e) in enumerate(formed) if e is not None]
        if problems:
            raise RuntimeError(f"forming the weight-sync groups failed: {'; '.join(problems)}")
        self.group_names = {r: n for r, (n, _) in enumerate(formed) if n is not None}

    def _begin(self) -> bool:
        """Rank 0 opens the push (pause and begin, answered; the lanes), and every rank learns
        whether it did: a rank that broadcast into its group while the engines had refused would
        wait there for weights.timeout_s. Rank 0 raises its error; the others return False."""
        assert self.sender is not None, "every rank sends"
        failure: Exception | None = None
        if self.rank == 0:
            try:
                self.sender.open_push()
                self.sender.await_begun()  # before any lane: an engine takes buckets only once begun
                if self.concurrent:
                    self.sender.open_lanes(list(self.group_names.values()))
            except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
                failure = e
        began = [failure is None]
        dist.broadcast_object_list(began, src=0)
        if failure is not None:
            raise failure
        return bool(began[0])

    def _send(self, params: Iterator[tuple[str, torch.Tensor | None]], version: int) -> None:
        """Rank 0 queues every request of the push; every rank broadcasts its own buckets in the
        plan's order. Ordered, the version rides on the plan's last bucket. Concurrent, each
        group's requests go over a connection of their own, and the version rides on rank 0's
        carrier, sent once every other bucket is in every engine."""
        assert self.sender is not None, "every rank sends"
        sender, rank = self.sender, self.rank
        if not self._begin():
            return  # rank 0 raised why
        if rank == 0:
            for k, plan in enumerate(self.buckets):
                if k != self.carrier or not self.concurrent:
                    version_ = str(version) if k == self.carrier else None
                    sender.request_bucket(plan, version_, self.group_names[self.owner[k]])
            self._broadcast_share(params, version)
            sender.end()
            return
        fence.check("weight push (sharded)")  # every rank that sends or relays, not only rank 0
        sender.watch()  # rank 0 watches as it opens the push; the others from here
        try:
            self._broadcast_share(params, version)
        finally:
            sender.stop_watch()

    def _broadcast_share(self, params: Iterator[tuple[str, torch.Tensor | None]], version: int) -> None:
        """This rank's buckets, each broadcast as it fills (relays: the others' passed on), and
        (concurrent) rank 0's carrier last."""
        assert self.sender is not None, "every rank sends"
        sender, rank = self.sender, self.rank
        carried: torch.Tensor | None = None
        packer: BucketPacker | None = None
        relays = self._relay_ring()
        mine, passes = lambda k: self.owner[k] == rank, lambda k: rank in self.relays[self.owner[k]]
        for k, tensors in stream_buckets(self.buckets, params, mine, passes):
            if not tensors:  # another rank's bucket: passed on (weights.relay)
                assert relays is not None, "only relays are given other ranks' buckets"
                buffer = relays.acquire(self.buckets[k].nbytes)
                relays.release(sender.relay_async(self.group_names[self.owner[k]], buffer))
                continue
            if self.concurrent and k == self.carrier:
                carried = pack(tensors)  # sent last, after the collectives every rank's iteration runs
                continue
            if packer is None:  # the buffers go where the parameters are
                largest = max(b.nbytes for b, o in zip(self.buckets, self.owner, strict=True) if o == rank)
                packer = BucketPacker(tensors[0].device, largest)
            packer.consumed(sender.broadcast(packer.pack(tensors)))
        for ring in (packer, relays):
            if ring is not None:
                ring.drain()
        if carried is not None:
            sender.wait_lanes()  # every other bucket is in every engine
            sender.request_bucket(self.buckets[self.carrier], str(version), self.group_names[0])
            sender.broadcast(carried).wait()
            sender.wait_lanes()  # the carrier's answer: the engines hold the version; end comes after

    def _relay_ring(self) -> BufferRing | None:
        """With relays, two buffers for the buckets this rank passes on, on the group's device."""
        assert self.sender is not None, "every rank sends"
        others = [b.nbytes for b, o in zip(self.buckets, self.owner, strict=True) if self.rank in self.relays[o]]
        if not others:
            return None
        on_gpu = self.sender.backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        return BufferRing(device, max(others))


class ShardedColocatedChannel(ColocatedChannel):
    """launch.colocate with weights.channel sharded, on one node: every rank hands its own share
    of the buckets by reference to every engine (relax_hpc.weights.colocated), so no rank sends,
    and with megatron no rank holds, the whole model. Rank 0 opens the push on every engine and,
    once every rank's buckets are answered, reports the version and closes it. Before a step each
    rank releases its own engines, as the colocated channel's."""

    def __init__(
        self, sender: ColocatedSender, layout: EngineLayout, bucket_bytes: int, stages: tuple[int, dict[str, int]]
    ) -> None:
        super().__init__(sender, layout, bucket_bytes)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.buckets, self.owner = plan_shares(layout, bucket_bytes, stages)
        mine = shares(self.buckets, self.owner, self.world)[self.rank]
        log.info("sharded colocated weight channel: rank %d sends %d of %d buckets, %.1f MiB", self.rank,
                 self.owner.count(self.rank), len(self.buckets), mine / 2**20)  # fmt: skip

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = iter(self.layout.tensors(full_parameters()))
        sender, error = self.sender, None
        decision: list[list[EngineRecord] | None] = [None]
        # Each rank released its own engines before the step (before_step); rank 0 resumes them
        # all, so every release must be answered first (a step's collectives usually see to it).
        dist.barrier()
        try:
            if self.rank == 0:
                engines = sender.engines(everyone=True)
                self.resume_s = sender.open_push(engines)
                decision = [engines]
        except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
            error = f"rank 0: {e}"
        dist.broadcast_object_list(decision, src=0)
        engines = decision[0] or []
        started = time.monotonic()
        try:
            if engines:
                sender.send_share(engines, self.buckets, params, lambda k: self.owner[k] == self.rank)
        except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
            error = f"rank {self.rank}: {e}"
        if failure := finish_share(params, error, version):
            raise WeightSyncError(failure)
        if self.rank == 0 and engines:
            sender.close_push(engines, version)
        self.update_s = time.monotonic() - started
        return len(engines) if self.rank == 0 else 0
