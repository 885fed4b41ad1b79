"""Engine-to-engine catch-up (rollout.catch_up engine): a new or restarted built-in engine copies
the current weights from a healthy engine of the run (the seed) before it registers, instead of
waiting for the trainer's next push.

The seed serves its weights over HTTP (`SNAPSHOT`, relax_hpc's own route: SGLang and vLLM have no
such route, see docs/DESIGN.md), one bucket per request, each bucket a safetensors blob of its
tensors by name, stamped with the seed's weight version and its weight epoch: a counter the
engine advances under its model lock at every write into its weights. A bucket is read under
that lock too, so it is never torn; a copy is whole when every bucket carries the same epoch.
A push that lands on the seed between two buckets changes the epoch: the copy is thrown away
and taken again (the seed then holds the newer version). A seed whose weights are not one
version (an update in progress, or one abandoned half-way) refuses to serve (503).

The new engine stages the buckets in host memory and checks them whole (every parameter, the
shapes) before anything is written into its weights, as the file channel's load does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import BucketPlan, plan_buckets

log = logging.getLogger("relax_hpc.weights")

SNAPSHOT = "/relax/weights_snapshot"  # POST SnapshotReq -> one bucket (safetensors bytes)
_META = "relax_snapshot"  # the blob's metadata key: version, epoch, bucket count


@dataclass
class SnapshotReq:
    """POST /relax/weights_snapshot: bucket `bucket` of the seed's weights in buckets of at most
    `bucket_bytes` (the seed plans them from its own parameters, in their order). `inspect`: a
    read of what the engine holds, not a copy to load, so served in LoRA runs too (their weights
    hold a merged adapter, which a catching-up engine must not take for its base)."""

    bucket: int
    bucket_bytes: int
    inspect: bool = False


@dataclass(frozen=True, slots=True)
class Stamp:
    """What a bucket was read at: the seed's version, its weight epoch, its bucket count."""

    version: str
    epoch: int
    buckets: int


class SeedMoved(RuntimeError):
    """The seed's weights changed between two buckets of a copy: take it again."""


def plan_of(params: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[BucketPlan]:
    return plan_buckets(((n, p.shape, p.dtype) for n, p in params.items()), bucket_bytes)


# safetensors' dtype names (the format's spec) of the dtypes engines hold.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def encode(params: Mapping[str, torch.Tensor], plan: BucketPlan, stamp: Stamp) -> bytearray:
    """The bucket's tensors as one safetensors blob (8 bytes of header length, the JSON header:
    each tensor's dtype, shape and byte range, and the stamp as metadata; then the data), each
    tensor copied once, straight from the parameters (a device's too): safetensors' own `save`
    took 6 times as long on the CPU. Call under the seed's model lock: the bucket is one state."""
    ranges: dict[str, tuple[int, int]] = {}
    header: dict[str, object] = {}
    offset = 0
    for name in plan.names:
        t = params[name]
        ranges[name] = (offset, offset + t.numel() * t.element_size())
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": list(ranges[name])}
        offset = ranges[name][1]
    meta = json.dumps({"version": stamp.version, "epoch": stamp.epoch, "buckets": stamp.buckets})
    head = json.dumps({**header, "__metadata__": {_META: meta}}).encode()
    head += b" " * (-len(head) % 8)  # the spec's padding: the data starts 8-aligned
    blob = bytearray(8 + len(head) + offset)
    blob[:8], blob[8 : 8 + len(head)] = len(head).to_bytes(8, "little"), head
    if offset:
        data = torch.frombuffer(blob, dtype=torch.uint8, offset=8 + len(head))
        with torch.no_grad():
            for name, (start, end) in ranges.items():
                if end > start:
                    data[start:end].copy_(params[name].detach().contiguous().reshape(-1).view(torch.uint8))
    return blob


def decode(blob: bytearray) -> tuple[dict[str, torch.Tensor], Stamp]:
    """A bucket's tensors, views of `blob` (no copy), and its stamp. safetensors' layout: 8 bytes
    of header length, the JSON header (each tensor's dtype, shape, byte range; the metadata),
    then the data."""
    try:
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + size])
        meta = json.loads(header.pop("__metadata__")[_META])
        tensors = {name: _view(blob, 8 + size, info) for name, info in header.items()}
        return tensors, Stamp(str(meta["version"]), int(meta["epoch"]), int(meta["buckets"]))
    except (ValueError, KeyError, TypeError) as e:
        raise EngineUnavailable(f"a seed's bucket is not a snapshot blob: {e}") from None


def _view(blob: bytearray, base: int, info: dict) -> torch.Tensor:
    dtype = _DTYPES[info["dtype"]]
    start, end = info["data_offsets"]
    if end == start:  # frombuffer takes no empty range
        return torch.empty(info["shape"], dtype=dtype)
    flat = torch.frombuffer(blob, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start)
    return flat.view(info["shape"])


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """A finished copy: from which engine, which version, how many bytes, in how many tries."""

    seed: str
    version: str
    nbytes: int
    attempts: int


def copy_once(
    client: EngineClient, params: Mapping[str, torch.Tensor], bucket_bytes: int
) -> tuple[Stamp, list[tuple[str, torch.Tensor]]]:
    """Every bucket of one seed at one epoch, staged on the host and checked against `params`
    (names and shapes, every parameter once). Raises SeedMoved when the epoch changed. Two
    buckets are asked at a time: the seed serialises one while the other is on the wire."""
    first_tensors, first = decode(client.fetch(SNAPSHOT, SnapshotReq(0, bucket_bytes)))
    staged = list(first_tensors.items())
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="catch-up") as pool:
        fetched = pool.map(lambda k: client.fetch(SNAPSHOT, SnapshotReq(k, bucket_bytes)), range(1, first.buckets))
        for blob in fetched:
            tensors, stamp = decode(blob)
            if stamp != first:
                raise SeedMoved(f"the seed went from version {first.version} to {stamp.version} during the copy")
            staged.extend(tensors.items())
    _check_whole(params, staged)
    return first, staged


def _check_whole(params: Mapping[str, torch.Tensor], staged: list[tuple[str, torch.Tensor]]) -> None:
    names = [n for n, _ in staged]
    if sorted(names) != sorted(params):
        missing, extra = sorted(set(params) - set(names))[:5], sorted(set(names) - set(params))[:5]
        raise EngineRequestError(f"the seed's parameters differ: missing {missing}, extra {extra}")
    wrong = [n for n, t in staged if t.shape != params[n].shape or t.dtype != params[n].dtype]
    if wrong:
        raise EngineRequestError(f"the seed's shapes or dtypes differ for {wrong[:5]}")


def seeds(registry: Path, own_id: str, api_key: str) -> list[EngineRecord]:
    """The run's other engines that answer /health, highest weight version first. Left out: those
    at version 0 (the model's own weights, which the new engine loaded too: the engines of a run's
    first start would copy them from each other) and those whose version is not a number."""
    others = [r for r in read_records(registry) if r.engine_id != own_id and r.weight_version.isdigit()]
    others = [r for r in others if int(r.weight_version) > 0]
    alive = [r for r in others if EngineClient(r.url, api_key, 2.0).healthy()]
    return sorted(alive, key=lambda r: -int(r.weight_version))


def catch_up(
    registry: Path,
    own_id: str,
    api_key: str,
    params: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    timeout_s: float,
    tries: int = 5,
) -> tuple[CaughtUp | None, list[tuple[str, torch.Tensor]], str]:
    """Copy the weights of a healthy seed at the highest version: (what was copied, the
    staged tensors to write into `params`, "") or (None, [], why not). A seed that moves on or is
    busy updating is asked again (`tries` times, half a second apart); one that fails, or
    refuses, gives way to the next."""
    candidates = seeds(registry, own_id, api_key)
    if not candidates:
        return None, [], "no healthy engine past version 0 to copy from"
    why = ""
    for seed in candidates:
        client = EngineClient(seed.url, api_key, timeout_s)
        for attempt in range(1, tries + 1):
            try:
                stamp, staged = copy_once(client, params, bucket_bytes)
            except (SeedMoved, EngineUnavailable) as e:  # a push landed, or the seed is mid-update (503)
                why = f"{seed.engine_id}: {e}"
                log.info("catch-up from %s, try %d: %s", seed.engine_id, attempt, e)
                time.sleep(0.5)
                continue
            except EngineRequestError as e:  # refused (LoRA adapters, another model): the next seed
                why = f"{seed.engine_id}: {e}"
                break
            nbytes = sum(t.numel() * t.element_size() for _, t in staged)
            return CaughtUp(seed.engine_id, stamp.version, nbytes, attempt), staged, ""
    return None, [], why
