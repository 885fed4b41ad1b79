"""Colocated weight sync: engines and trainer ranks take turns on the same devices.

Each trainer rank serves the engines on its own device (engine-i belongs to rank i modulo the
ranks), so that a CUDA IPC handle names memory the engine can map. Around every training step:

    before: pause generation (in place: a running batch finishes), release the engines' memory
            (weights and KV cache: SGLang's /release_memory_occupation)
    train
    after:  resume the engines' memory, then, between begin and end of a weight update, one
            /update_weights_from_tensor per bucket, sent by reference (relax_hpc.weights.tensors),
            then continue generation

A bucket is packed into one flat tensor first: one IPC handle per bucket on a GPU (measured
faster than sharing each tensor where it lies, BENCHMARKS.md), and on the CPU the only memory
another process can open (torch places it in shared memory).

Every rank gathers the full parameters (FSDP's full_tensor, a collective), so every rank can
serve its engines. A bucket's buffer stays alive until its engine has answered: the engine has
copied the bytes by then. The version rides on the last bucket, as in the broadcast path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPacker, BucketPlan, unpack
from relax_hpc.weights.tensors import serialize

log = logging.getLogger("relax_hpc.weights")


def served_by(engine_id: str, rank: int, world: int) -> bool:
    """Whether trainer rank `rank` serves this engine (engine-i: rank i modulo world)."""
    index = int(engine_id.rsplit("-", 1)[1]) if engine_id.startswith("engine-") else 0
    return index % world == rank


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
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="colocated")
        self.released = False
        self.requests_s = 0.0  # of the last push: inside the update requests (HTTP and the engine)

    def engines(self) -> list[EngineRecord]:
        mine = [r for r in read_records(self.registry) if served_by(r.engine_id, self.rank, self.world)]
        return [r for r in mine if EngineClient(r.url, self.api_key, 5.0).healthy(5.0)]

    def _each(self, engines: list[EngineRecord], route: str, request: object) -> None:
        clients = [EngineClient(r.url, self.api_key, self.timeout_s) for r in engines]
        for future in [self._pool.submit(c.post, route, request) for c in clients]:
            future.result()

    def release(self) -> float:
        """Before a step: the engines stop and free their memory. Returns the seconds it took."""
        started = time.monotonic()
        engines = self.engines()
        self._each(engines, "/pause_generation", P.PauseGenerationReqInput(mode="in_place"))
        self._each(engines, "/release_memory_occupation", P.ReleaseMemoryOccupationReqInput())
        self.released = True
        return time.monotonic() - started

    def push(
        self, buckets: list[BucketPlan], params: Iterable[tuple[str, torch.Tensor | None]], version: int
    ) -> tuple[int, float, float]:
        """After a step: the engines take their memory back and the new weights. Collective over
        the ranks (params is every rank's full-parameter stream). Returns (engines updated,
        seconds of resume, seconds of the update)."""
        engines = self.engines()
        started = time.monotonic()
        self._each(engines, "/resume_memory_occupation", P.ResumeMemoryOccupationReqInput())
        resumed = time.monotonic()
        self._each(engines, "/begin_weight_update", P.BeginWeightUpdateReqInput())
        it = iter(params)
        packer: BucketPacker | None = None
        self.requests_s = 0.0
        for i, plan in enumerate(buckets):
            tensors = [_tensor(next(it)) for _ in plan.names]
            device = tensors[0].device
            if self.pack or device.type == "cpu":
                packer = packer or BucketPacker(device, max(b.nbytes for b in buckets))
                named = unpack(packer.pack(tensors), plan)
            else:
                named = [(name, t.contiguous()) for name, t in zip(plan.names, tensors, strict=True)]
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the bytes are there before the engine maps them
            last = i == len(buckets) - 1
            request = P.UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=serialize(named, self.tp_size),
                flush_cache=last,
                weight_version=str(version) if last else None,
            )
            sent = time.monotonic()
            self._each(engines, "/update_weights_from_tensor", request)
            self.requests_s += time.monotonic() - sent
            if packer is not None:
                packer.consumed(None)  # answered: the engines have copied it
        if packer is not None:
            packer.drain()
        self._each(engines, "/end_weight_update", P.EndWeightUpdateReqInput())
        self._each(engines, "/continue_generation", P.ContinueGenerationReqInput())
        self.released = False
        return len(engines), resumed - started, time.monotonic() - resumed


def _tensor(param: tuple[str, torch.Tensor | None]) -> torch.Tensor:
    name, tensor = param
    assert tensor is not None, f"colocated ranks hold every full tensor; {name} is None"
    return tensor
