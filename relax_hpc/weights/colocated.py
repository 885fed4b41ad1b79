"""Colocated weight sync: engines and trainer ranks take turns on the same devices.

Each trainer rank serves the engines on its own device (engine-i belongs to rank i modulo the
ranks), so that a CUDA IPC handle names memory the engine can map. Around every training step:

    before: pause generation (in place: a running batch finishes), release the engines' memory
            (weights and KV cache: SGLang's /release_memory_occupation)
    train
    after:  resume the engines' memory, then, between begin and end of a weight update, one
            /update_weights_from_tensor per bucket, sent by reference (relax_hpc.weights.tensors),
            then continue generation

A bucket is packed into one flat buffer and sent as SGLang's "flattened_bucket": one shared
tensor, so one IPC handle to open per bucket on a GPU (sharing each of a model's hundreds of
tensors where it lies costs more than the extra copy, BENCHMARKS.md), and on the CPU the only
memory another process can open (torch places it in shared memory).

The requests to an engine go over one keep-alive connection without waiting for each answer
(relax_hpc.protocol.client.RequestPipeline; an engine answers them in order): the next bucket is
packed while the engine copies the last one. Two bucket buffers take turns; a buffer is packed
again only once its engines have answered its update, which they do after their copy has
finished. The version rides on the last bucket, as in the broadcast path.

Every rank gathers the full parameters (a collective), so every rank can serve its engines.

With weights.channel sharded (relax_hpc.weights.channel.ShardedColocatedChannel, one node) a rank
instead hands only its own share of the buckets to every engine of the node, and no rank needs
the whole model (megatron: a stage's ranks hand over that stage's tensors): rank 0 opens the
push on every engine (open_push), each rank sends its buckets (send_share), and once all are
answered rank 0 reports the version and closes it (close_push). An engine on another GPU of the
node maps the handle of the sender's GPU (every role of a node sees the same GPUs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from relax_hpc import fence
from relax_hpc.protocol import requests as P
from relax_hpc.protocol import routes as R
from relax_hpc.protocol.client import EngineClient, RequestPipeline
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, plan_buckets, stream_buckets
from relax_hpc.weights.channel import FullParameters, PhaseTimer
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.tensors import FLATTENED_BUCKET, bucket_records, serialize, serialize_bucket


def served_by(engine_id: str, rank: int, world: int) -> bool:
    """Whether trainer rank `rank` serves this engine (engine-i: rank i modulo world)."""
    index = int(engine_id.rsplit("-", 1)[1]) if engine_id.startswith("engine-") else 0
    return index % world == rank


class _Answered:
    """A bucket buffer's fence: its engines have answered its update (their copy has finished)."""

    def __init__(self, pipes: list[RequestPipeline]) -> None:
        self._marks = [(pipe, pipe.sent) for pipe in pipes]

    def wait(self) -> None:
        for pipe, count in self._marks:
            pipe.wait_through(count)


class ColocatedSender:
    """One trainer rank's side: its engines' memory turns and their weights."""

    def __init__(
        self,
        registry: Path,
        api_key: str,
        timeout_s: float,
        rank: int,
        world: int,
        tp_size: int = 1,
        pack: bool = True,
    ) -> None:
        """`pack` False (GPU only, for tools/bench/colocated_update.py): share each tensor where it lies."""
        self.registry, self.api_key, self.timeout_s = registry, api_key, timeout_s
        self.rank, self.world, self.tp_size, self.pack = rank, world, tp_size, pack
        self.released = False
        self._records: tuple[list[BucketPlan], list[list[SimpleNamespace]]] | None = None  # per plan list

    def engines(self, everyone: bool = False) -> list[EngineRecord]:
        """The engines this rank serves (engine-i: rank i modulo the ranks), or with `everyone`
        every engine (the sharded push: each rank hands its share to all of them)."""
        records = read_records(self.registry)
        mine = [r for r in records if everyone or served_by(r.engine_id, self.rank, self.world)]
        return [r for r in mine if EngineClient(r.url, self.api_key, 5.0).healthy(5.0)]

    def _open(self, engines: list[EngineRecord]) -> list[RequestPipeline]:
        return [RequestPipeline(r.url, self.api_key, self.timeout_s) for r in engines]

    def release(self) -> float:
        """Before a step: the engines stop and free their memory. Returns the seconds it took."""
        fence.check("engine release (colocated)")  # a superseded trainer must not stall its successor's engines
        started = time.monotonic()
        pipes = self._open(self.engines())
        try:
            _send(pipes, R.PAUSE_GENERATION.path, P.PauseGenerationReqInput(mode="in_place"))
            _send(pipes, R.RELEASE_MEMORY_OCCUPATION.path, P.ReleaseMemoryOccupationReqInput())
            _answered(pipes)
        finally:
            _close(pipes)
        self.released = True
        return time.monotonic() - started

    def push(
        self, buckets: list[BucketPlan], params: Iterable[tuple[str, torch.Tensor | None]], version: int
    ) -> tuple[int, float, float]:
        """After a step: the engines take their memory back and the new weights, over one
        connection per engine, pipelined. Collective over the ranks (params is every rank's
        full-parameter stream). Returns (engines updated, seconds of resume, of the update)."""
        fence.check("weight push (colocated)")
        engines = self.engines()
        pipes = self._open(engines)
        try:
            resume_s = _resume_and_begin(pipes)  # the begin rides ahead of the buckets, unanswered
            updating = time.monotonic()
            self._updates(pipes, buckets, iter(params), lambda _: True, version)
            _finish(pipes, None)
        finally:
            _close(pipes)
        self.released = False
        return len(engines), resume_s, time.monotonic() - updating

    # The sharded push (relax_hpc.weights.channel.ShardedColocatedChannel): one rank opens and
    # closes it on every engine, each rank sends its own buckets in between.

    def open_push(self, engines: list[EngineRecord]) -> float:
        """The engines take their memory back and begin a weight update, answered. Returns the
        seconds of the resume."""
        fence.check("weight push (colocated)")
        pipes = self._open(engines)
        try:
            resume_s = _resume_and_begin(pipes)
            _answered(pipes)  # the other ranks send only into an update that has begun
        finally:
            _close(pipes)
        return resume_s

    def send_share(
        self,
        engines: list[EngineRecord],
        buckets: list[BucketPlan],
        params: Iterable[tuple[str, torch.Tensor | None]],
        mine: Callable[[int], bool],
    ) -> None:
        """The buckets `mine` picks (by index) to every engine, answered; no version (close_push
        reports it once every rank's are in). Iterates all of `params`."""
        fence.check("weight push (colocated, sharded)")  # every sending rank, not only the one that opened
        pipes = self._open(engines)
        try:
            self._updates(pipes, buckets, iter(params), mine, None)
            _answered(pipes)
        finally:
            _close(pipes)
        self.released = False

    def close_push(self, engines: list[EngineRecord], version: int) -> None:
        """Every bucket is in: the engines report `version`, end the update and continue."""
        pipes = self._open(engines)
        try:
            _finish(pipes, version)
        finally:
            _close(pipes)

    def _updates(
        self,
        pipes: list[RequestPipeline],
        buckets: list[BucketPlan],
        params: Iterator[tuple[str, torch.Tensor | None]],
        mine: Callable[[int], bool],
        version: int | None,
    ) -> None:
        """One /update_weights_from_tensor per bucket of `mine`, sent without waiting for the last
        answer; the other buckets' parameters are passed over."""
        packer: BucketPacker | None = None
        if self._records is None or self._records[0] is not buckets:  # the same plans every push
            self._records = (buckets, [bucket_records(plan) for plan in buckets])
        sent = [i for i in range(len(buckets)) if mine(i)]
        for i, tensors in stream_buckets(buckets, params, mine):
            device = tensors[0].device
            # One pickling per engine: pickling a shared CPU storage takes a reference that its
            # receiver gives back, so a payload two engines open would be freed under the sender.
            payloads: Callable[[], list[str]]
            if self.pack or device.type == "cpu":
                packer = packer or BucketPacker(device, max(buckets[k].nbytes for k in sent))
                flat, records = packer.pack(tensors), self._records[1][i]  # waits for the buffer's last answers
                payloads, load_format = partial(serialize_bucket, flat, records, self.tp_size), FLATTENED_BUCKET
            else:  # the trainer's own tensors: unchanged until the push ends
                pairs = [(name, t.contiguous()) for name, t in zip(buckets[i].names, tensors, strict=True)]
                payloads, load_format = partial(serialize, pairs, self.tp_size), None
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the bytes are there before the engine maps them
            last = i == sent[-1]
            carries = version is not None and i == len(buckets) - 1
            for pipe in pipes:
                request = P.UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=payloads(),
                    load_format=load_format,
                    flush_cache=last,
                    weight_version=str(version) if carries else None,
                )
                pipe.send(R.UPDATE_WEIGHTS_FROM_TENSOR.path, request)
            if packer is not None:
                packer.consumed(_Answered(pipes))
        if packer is not None:
            packer.drain()


def _resume_and_begin(pipes: list[RequestPipeline]) -> float:
    """The engines take their memory back (answered: the buckets need it) and are asked to begin
    a weight update (not waited for). Returns the seconds of the resume."""
    started = time.monotonic()
    _send(pipes, R.RESUME_MEMORY_OCCUPATION.path, P.ResumeMemoryOccupationReqInput())
    _answered(pipes)
    resume_s = time.monotonic() - started
    _send(pipes, R.BEGIN_WEIGHT_UPDATE.path, P.BeginWeightUpdateReqInput())
    return resume_s


def _finish(pipes: list[RequestPipeline], version: int | None) -> None:
    """End the weight update (reporting `version` from now on, where the buckets did not carry
    it) and continue generation, answered."""
    if version is not None:
        _send(pipes, R.UPDATE_WEIGHT_VERSION.path, P.UpdateWeightVersionReqInput(str(version), False))
    _send(pipes, R.END_WEIGHT_UPDATE.path, P.EndWeightUpdateReqInput())
    _send(pipes, R.CONTINUE_GENERATION.path, P.ContinueGenerationReqInput())
    _answered(pipes)


def _send(pipes: list[RequestPipeline], route: str, request: object) -> None:
    for pipe in pipes:
        pipe.send(route, request)


def _answered(pipes: list[RequestPipeline]) -> None:
    """Every request sent so far is answered (raises the first failure)."""
    for pipe in pipes:
        pipe.wait_answers()


def _close(pipes: list[RequestPipeline]) -> None:
    for pipe in pipes:
        pipe.close()


class ColocatedChannel:
    """Every rank serves the engines on its device by reference (relax_hpc.weights.colocated);
    the engines release their memory before each step and take it back with the push."""

    def __init__(self, sender: ColocatedSender, layout: EngineLayout, bucket_bytes: int) -> None:
        self.sender, self.layout = sender, layout
        self.buckets: list[BucketPlan] = plan_buckets(layout.specs(), bucket_bytes)
        self.resume_s = self.update_s = 0.0  # the last push's parts

    def push(self, full_parameters: FullParameters, version: int) -> int:
        params = self.layout.tensors(full_parameters())
        mine, self.resume_s, self.update_s = self.sender.push(self.buckets, params, version)
        everyone: list[int] = [0] * self.sender.world
        dist.all_gather_object(everyone, mine)
        return sum(everyone)

    def engines_changed(self, delivered: int) -> bool:
        """An engine (re)started since the last push: it reports another version."""
        return any(int(r.weight_version) != delivered for r in read_records(self.sender.registry))

    def before_step(self, timer: PhaseTimer) -> None:
        with timer.phase("release"):  # the engines free the device for the step
            self.sender.release()

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """The push is the engines' memory coming back, then the update by reference; and what
        the trainer still holds on the device while the engines generate (mem_held_gb)."""
        out = {"time_resume": self.resume_s, "time_update": self.update_s, "time_release": phases.get("release", 0.0)}
        if device.type == "cuda":
            out["mem_held_gb"] = round(torch.cuda.memory_allocated(device) / 2**30, 3)
        return out
