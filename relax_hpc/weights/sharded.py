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
during a push: pause and begin, every bucket's request in the plan's order, then end and continue,
pipelined as the broadcast channel's (relax_hpc.weights.sender). An engine takes the buckets one
at a time in that order, whichever rank sends each, and every rank broadcasts its own buckets in
the same order: no engine waits in one group while another engine waits in a second. The groups
are formed one rank after the other for the same reason (an engine's join blocks until its group
is complete).

A push fails on every rank when it failed on any (each rank's outcome is gathered), and every rank
then drops its group; the next push forms new ones with the engines that answer. Rank 0 watches
the engines' health during a push (MemberWatch); another rank's broadcast ends with an error when
an engine dies, and a hung engine holds it for at most weights.timeout_s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from relax_hpc.protocol.client import EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord
from relax_hpc.weights.buckets import BucketPacker, assign, plan_buckets
from relax_hpc.weights.channel import BroadcastChannel, FullParameters
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import WeightSender, WeightSyncError, engine_key

log = logging.getLogger("relax_hpc.weights")


class ShardedChannel(BroadcastChannel):
    """The broadcast channel with every rank a sender: `sender` is this rank's (its group with the
    engines); rank 0's also decides the engines and sends them every request. `stages` is the
    backend's weight_stages()."""

    def __init__(
        self,
        sender: WeightSender,
        layout: EngineLayout,
        bucket_bytes: int,
        stages: tuple[int, dict[str, int]],
        catch_up: bool = False,
    ) -> None:
        super().__init__(sender, layout, bucket_bytes, catch_up)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        stage, stage_of = stages
        rank_stages: list[int] = [0] * self.world
        dist.all_gather_object(rank_stages, stage)
        key = lambda name: stage_of.get(name, 0)  # noqa: E731
        self.buckets = plan_buckets(layout.specs(), bucket_bytes, key)
        holders = [[r for r, s in enumerate(rank_stages) if s == key(b.names[0])] for b in self.buckets]
        self.owner = assign(self.buckets, holders)
        self.group_names: list[str] = []  # each rank's group, by rank
        log.info("sharded weight channel: rank %d sends %d of %d buckets, %.1f MiB", self.rank,
                 self.owner.count(self.rank), len(self.buckets), self.shares()[self.rank] / 2**20)  # fmt: skip

    def shares(self) -> list[int]:
        """The bytes each rank sends in a push."""
        out = [0] * self.world
        for plan, owner in zip(self.buckets, self.owner, strict=True):
            out[owner] += plan.nbytes
        return out

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
        for _ in params:  # every rank gathers every parameter, also after a failure: keep the collectives matched
            pass
        errors: list[str | None] = [None] * self.world
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e is not None]
        if failed:
            assert self.sender is not None, "every rank sends"
            self.sender.drop_group()
            raise WeightSyncError(f"weight sync of version {version} failed: {'; '.join(failed)}")
        return len(engines) if self.rank == 0 else 0

    def _agree_on_engines(self) -> list[EngineRecord]:
        """Rank 0's choice of engines, on every rank; the groups formed again when it changed."""
        assert self.sender is not None, "every rank sends"
        decision: list[tuple[list[EngineRecord], bool] | None] = [None]
        if self.rank == 0:
            engines = self.sender.engines_for_push()
            regroup = self.sender.group is None or engine_key(engines) != engine_key(self.sender.members)
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
        """Every rank forms its group with `engines`, one rank after the other."""
        assert self.sender is not None, "every rank sends"
        error = None
        for r in range(self.world):
            if r == self.rank:
                try:
                    self.sender.form_group(engines)
                except (EngineUnavailable, EngineRequestError, RuntimeError) as e:
                    error = str(e)
            dist.barrier()
        name = self.sender.group.group_name if self.sender.group is not None else None
        formed: list[tuple[str | None, str | None]] = [(None, None)] * self.world
        dist.all_gather_object(formed, (name, error))
        problems = [f"rank {r}: {e}" for r, (_, e) in enumerate(formed) if e is not None]
        if problems:
            raise RuntimeError(f"forming the weight-sync groups failed: {'; '.join(problems)}")
        self.group_names = [str(n) for n, _ in formed]

    def _send(self, params: Iterator[tuple[str, torch.Tensor | None]], version: int) -> None:
        """Rank 0 queues every request of the push; every rank broadcasts its own buckets in the
        plan's order (each engine joins them in that order)."""
        assert self.sender is not None, "every rank sends"
        if self.rank == 0:
            self.sender.open_push()
            last = len(self.buckets) - 1
            for k, plan in enumerate(self.buckets):
                self.sender.request_bucket(plan, str(version) if k == last else None, self.group_names[self.owner[k]])
            self.sender.await_begun()
        packer: BucketPacker | None = None
        for k, plan in enumerate(self.buckets):
            tensors = [next(params)[1] for _ in plan.names]
            if self.owner[k] != self.rank:
                continue
            full = [t for t in tensors if t is not None]
            if len(full) != len(tensors):
                raise RuntimeError(f"rank {self.rank} sends bucket {k} but does not hold all of its tensors")
            if packer is None:  # the buffers go where the parameters are
                largest = max(b.nbytes for b, o in zip(self.buckets, self.owner, strict=True) if o == self.rank)
                packer = BucketPacker(full[0].device, largest)
            packer.consumed(self.sender.broadcast(packer.pack(full)))
        if packer is not None:
            packer.drain()
        if self.rank == 0:
            self.sender.end()
