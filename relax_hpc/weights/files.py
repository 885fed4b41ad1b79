"""The file channel (weights.channel file): each version's weights as safetensors in RUN_DIR, loaded
by every engine through /update_weights_from_disk. For engines that share no NCCL or gloo path
with the trainer: all they need is the run's filesystem.

A version is a folder RUN_DIR/weights/files/vN of bucket files bK.safetensors (plan_buckets'
buckets; the tensors by their engine names, what SGLang's disk loader reads). The buckets are
spread over the writing ranks by size, planned once, and each rank writes its own as the
parameters stream past (every rank of the torch backend holds each full tensor in turn, so no rank
ever holds more than its buckets; the megatron backend gives rank 0 alone the full tensors, and
rank 0 writes them all). The ranks write into a hidden .vN.partial folder that rank 0 renames
once every rank wrote its part: an engine never sees a half-written version.

weights.delta adds vN-delta: per bucket only what changed since the version the engines hold
(relax_hpc.weights.delta: sparse or dense, whichever is smaller; nothing for an unchanged bucket),
with DELTA.json naming that base version. Each rank keeps its buckets' bytes of the last version
written as the base (host memory: its share of the model). An engine holding the base loads the
delta, an engine holding anything else (started since, missed a version) the whole version; a
delta's load is refused by an engine that does not hold its base. Folders older than the oldest
version any live engine holds are deleted after each push.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from relax_hpc import fence
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.weights.buckets import DTYPES, BucketPlan, assign, pack, plan_buckets, unpack
from relax_hpc.weights.channel import FullParameters, QuietHooks
from relax_hpc.weights.delta import Patch, SparseDelta, diff, split
from relax_hpc.weights.layout import EngineLayout
from relax_hpc.weights.sender import WeightSyncError

log = logging.getLogger("relax_hpc.weights")

DELTA_FORMAT = "relax_delta"  # the load_format of a delta folder
_BASE_FILE = "DELTA.json"
_SPARSE_KEY = "relax_sparse"  # a sparse bucket file's metadata: its plan, as JSON


def version_folder(root: Path, version: int, delta: bool) -> Path:
    return root / (f"v{version}-delta" if delta else f"v{version}")


# -- the files ------------------------------------------------------------------------------------


def write_dense(path: Path, flat: torch.Tensor, plan: BucketPlan) -> int:
    """The bucket's tensors by name (own storage each: safetensors refuses shared ones)."""
    save_file({n: t.clone() for n, t in unpack(flat, plan)}, str(path))
    return flat.numel()


def write_sparse(path: Path, delta: SparseDelta, plan: BucketPlan) -> int:
    meta = json.dumps({"names": plan.names, "dtypes": plan.dtypes, "shapes": plan.shapes})
    save_file({"index": delta.index, "values": delta.values}, str(path), metadata={_SPARSE_KEY: meta})
    return delta.nbytes


def read_folder(folder: Path) -> Iterator[tuple[dict[str, torch.Tensor], BucketPlan | None]]:
    """Each bucket file's tensors, and its plan when it is a sparse delta (None: tensors by name)."""
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = (f.metadata() or {}).get(_SPARSE_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  # safe_open is not a mapping
        yield tensors, None if meta is None else BucketPlan(**json.loads(meta))


def delta_base(folder: Path) -> str:
    """The version a delta folder applies to."""
    return str(json.loads((folder / _BASE_FILE).read_text())["base"])


@dataclass
class Loaded:
    """What a folder writes into the parameters: whole tensors, and sparse patches."""

    whole: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    patches: list[Patch] = field(default_factory=list)

    def apply(self, params: Mapping[str, torch.Tensor]) -> None:
        """Write it into `params` (call under the engine's model lock, without grad)."""
        if self.whole:
            device = next(iter(params.values())).device
            torch._foreach_copy_([params[n] for n, _ in self.whole], [t.to(device) for _, t in self.whole])
        for patch in self.patches:
            patch.apply(params[patch.name])


def load_folder(folder: Path, params: Mapping[str, torch.Tensor], delta: bool, held: str) -> Loaded:
    """What loading `folder` writes into `params`, read and checked whole before anything is
    written: a bad folder leaves the weights as they were. `held` is the version the parameters
    hold (a delta applies to its base only)."""
    if delta and delta_base(folder) != held:
        raise P.ProtocolError(f"{folder.name} applies to version {delta_base(folder)}; this engine holds {held}")
    if not delta and not any(folder.glob("*.safetensors")):
        raise P.ProtocolError(f"{folder} holds no safetensors file")
    out = Loaded()
    for tensors, plan in read_folder(folder):
        if plan is None:
            _check(params, [(n, t.shape) for n, t in tensors.items()])
            out.whole.extend(tensors.items())
            continue
        if not delta:
            raise P.ProtocolError(f"{folder} holds a sparse delta: load it with load_format {DELTA_FORMAT}")
        _check(params, [(n, torch.Size(s)) for n, s in zip(plan.names, plan.shapes, strict=True)])
        try:
            out.patches.extend(split(plan, SparseDelta(tensors["index"], tensors["values"])))
        except (KeyError, ValueError) as e:
            raise P.ProtocolError(f"{folder}: a bad sparse bucket: {e}") from None
    return out


def _check(params: Mapping[str, torch.Tensor], named: list[tuple[str, torch.Size]]) -> None:
    unknown = [n for n, _ in named if n not in params]
    if unknown:
        raise P.ProtocolError(f"unknown parameter names {unknown[:5]}")
    wrong = [n for n, shape in named if params[n].shape != shape]
    if wrong:
        raise P.ProtocolError(f"shapes differ from the engine's for {wrong[:5]}")


# -- the trainer's side -----------------------------------------------------------------------------


@dataclass
class _Decision:
    """What a push writes (rank 0 decides, every rank follows)."""

    whole: bool  # the version's full folder (some engine lacks the base)
    delta: bool  # the delta folder (some engine holds the base)
    base: str | None = None  # the version the delta applies to
    engines: list[tuple[EngineRecord, str]] = field(default_factory=list)  # rank 0: (engine, version it holds)


@dataclass
class _Written:
    """One rank's part of a push."""

    error: str | None = None
    nbytes: int = 0  # written to disk
    changed: int = 0  # elements that differ from the base (delta)
    elements: int = 0  # elements compared


class FileChannel(QuietHooks):
    """Every writing rank writes its buckets; rank 0 (whose `registry` is not None) renames the
    version into place, has each engine load it, and cleans up. See the module docstring."""

    def __init__(
        self,
        root: Path,
        layout: EngineLayout,
        bucket_bytes: int,
        writers: int,
        registry: Path | None,
        client: ClientSettings,
        delta: bool,
    ) -> None:
        self.root, self.layout, self.registry, self.client, self.use_delta = root, layout, registry, client, delta
        self.buckets = plan_buckets(layout.specs(), bucket_bytes)
        self.owner = assign(self.buckets, [range(writers)] * len(self.buckets))
        self.rank = dist.get_rank()
        self.base: dict[int, torch.Tensor] = {}  # my buckets' bytes of version base_version
        self.base_version: int | None = None
        self.last = _Written()  # all ranks' sum over the last push (rank 0)
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="weight-files")

    def push(self, full_parameters: FullParameters, version: int) -> int:
        decision = self._decide(version)
        params = self.layout.tensors(full_parameters())
        if not (decision.whole or decision.delta):
            for _ in params:  # every rank takes part in the gathers
                pass
            self.last = _Written()  # the step record reports nothing written
            return self._serve(decision, version)
        prepared = self._prepare(version, decision) if self.rank == 0 else None
        dist.barrier()  # the partial folders exist
        mine = self._write(params, version, decision)
        mine.error = mine.error or prepared  # every rank learns of rank 0's failure below
        everyone: list[_Written | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        errors = [w.error for w in everyone if w is not None and w.error]
        if errors:
            self.base, self.base_version = {}, None  # the ranks' bases may now differ: start whole
            raise WeightSyncError(f"writing version {version} failed: {errors[0]}")
        if self.use_delta:
            self.base_version = version
        self.last = _Written(
            None, *(sum(getattr(w, f) for w in everyone if w is not None) for f in ("nbytes", "changed", "elements"))
        )
        if self.rank != 0:
            return 0
        try:
            for delta in (False, True):
                if decision.delta if delta else decision.whole:
                    _publish(self.root, version, delta)
        except OSError as e:
            raise WeightSyncError(f"publishing version {version} failed: {e}") from e
        return self._serve(decision, version)

    def engines_changed(self, delivered: int) -> bool:
        """An engine (re)started or missed a push: it reports another version."""
        assert self.registry is not None, "rank 0 decides"
        return any(r.weight_version != str(delivered) for r in read_records(self.registry))

    def record(self, phases: dict[str, float], device: torch.device) -> dict[str, float]:
        """The last push's bytes on disk and, with weights.delta, the share of elements that changed."""
        out = {"weights_written_mb": round(self.last.nbytes / 2**20, 3)}
        if self.use_delta and self.last.elements:
            out["weights_changed_share"] = self.last.changed / self.last.elements
        return out

    # -- rank 0 ----------------------------------------------------------------------------------

    def _decide(self, version: int) -> _Decision:
        decision = [self._engines(version) if self.rank == 0 else None]
        dist.broadcast_object_list(decision, src=0)
        assert decision[0] is not None, "rank 0 broadcast it"
        return decision[0]

    def _engines(self, version: int) -> _Decision:
        fence.check("weight push (files)")
        assert self.registry is not None, "rank 0 serves the engines"
        records = read_records(self.registry)
        held = list(self._pool.map(self._held, records))
        engines = [(r, h) for r, h in zip(records, held, strict=True) if h is not None]
        base = str(self.base_version) if self.base_version is not None and self.base_version != version else None
        needs = [h for _, h in engines if h != str(version)]
        delta = any(h == base for h in needs)
        return _Decision(any(h != base for h in needs), delta, base if delta else None, engines)

    def _held(self, record: EngineRecord) -> str | None:
        """The version an engine holds (None: it does not answer within 5 s; a loaded machine
        answers slower than an idle one, and a hung engine costs the push that long)."""
        try:
            return self.client.speaks(record.url, self.client.api_key, 5.0).weight_version()
        except (EngineUnavailable, EngineRequestError, KeyError):
            return None

    def _prepare(self, version: int, decision: _Decision) -> str | None:
        """Make the empty partial folders of this push; returns what failed (a full disk, say)."""
        try:
            for delta in (False, True):
                partial = _partial(self.root, version, delta)
                shutil.rmtree(partial, ignore_errors=True)
                if delta and decision.delta:
                    partial.mkdir(parents=True)
                    (partial / _BASE_FILE).write_text(json.dumps({"base": decision.base}))
                elif not delta and decision.whole:
                    partial.mkdir(parents=True)
        except OSError as e:
            return f"rank 0 preparing {self.root}: {e}"
        return None

    def _serve(self, decision: _Decision, version: int) -> int:
        """Have each engine load what it lacks; delete what no engine needs. Returns how many hold
        `version` now (rank 0; 0 elsewhere)."""
        if self.rank != 0:
            return 0
        served = list(self._pool.map(lambda e: self._load(e[0], e[1], version, decision.base), decision.engines))
        held = [h for h in served if h is not None]
        if held and all(h.isdigit() for h in held):
            _clean(self.root, min(int(h) for h in held))
        return sum(h == str(version) for h in held)

    def _load(self, record: EngineRecord, held: str, version: int, base: str | None) -> str | None:
        """The version the engine holds after its load (None: it failed)."""
        if held == str(version):
            return held
        delta = held == base
        request = P.UpdateWeightFromDiskReqInput(
            model_path=str(version_folder(self.root, version, delta)),
            load_format=DELTA_FORMAT if delta else None,
            abort_all_requests=self.client.abort_in_flight,
            weight_version=str(version),
        )
        try:
            self.client.speaks(record.url, self.client.api_key, self.client.timeout_s).load_from_disk(request)
        except (EngineUnavailable, EngineRequestError) as e:
            log.warning("engine %s did not load version %d: %s", record.engine_id, version, e)
            return None
        return str(version)

    # -- every rank --------------------------------------------------------------------------------

    def _write(self, params: Iterator[tuple[str, torch.Tensor | None]], version: int, decision: _Decision) -> _Written:
        """Write my buckets as the parameters stream past (every rank iterates them all)."""
        out, error = _Written(), None
        for k, plan in enumerate(self.buckets):
            tensors = [t for _, t in (next(params) for _ in plan.names)]
            if self.owner[k] != self.rank or error is not None:
                continue
            try:
                self._write_bucket(k, plan, tensors, version, decision, out)
            except (OSError, RuntimeError, ValueError, AssertionError) as e:
                error = f"rank {self.rank}, bucket {k}: {type(e).__name__}: {e}"
        for _ in params:
            pass
        out.error = error
        return out

    def _write_bucket(
        self,
        k: int,
        plan: BucketPlan,
        tensors: list[torch.Tensor | None],
        version: int,
        decision: _Decision,
        out: _Written,
    ) -> None:
        assert all(t is not None for t in tensors), f"rank {self.rank} writes bucket {k}: it needs the full tensors"
        flat = pack([t.detach().cpu() for t in tensors if t is not None])
        name = f"b{k:05d}.safetensors"
        if decision.whole:
            out.nbytes += write_dense(_partial(self.root, version, False) / name, flat, plan)
        if decision.delta:
            sparse, changed = diff(self.base[k], flat, plan)
            out.changed, out.elements = out.changed + changed, out.elements + flat.numel() // plan_itemsize(plan)
            target = _partial(self.root, version, True) / name
            if changed and sparse is not None:
                out.nbytes += write_sparse(target, sparse, plan)
            elif changed:
                out.nbytes += write_dense(target, flat, plan)
        if self.use_delta:
            self.base[k] = flat


@dataclass(frozen=True)
class ClientSettings:
    api_key: str
    timeout_s: float  # of one engine's load
    abort_in_flight: bool = False  # partial rollout: the engines abort what is in flight
    speaks: type[EngineClient] = EngineClient  # the engines' API (relax_hpc.protocol.vllm.client_class)


def plan_itemsize(plan: BucketPlan) -> int:
    return DTYPES[plan.dtypes[0]].itemsize


def _partial(root: Path, version: int, delta: bool) -> Path:
    return root / f".{version_folder(root, version, delta).name}.partial"


def _publish(root: Path, version: int, delta: bool) -> None:
    """Rename the complete partial folder into place (replacing one a trainer before a restart wrote)."""
    # Fresh: the push decided under the lease seconds ago, and this replaces a version folder that
    # a newer generation may have written since.
    fence.check(f"weight files v{version}", fresh=True)
    final = version_folder(root, version, delta)
    shutil.rmtree(final, ignore_errors=True)
    _partial(root, version, delta).rename(final)


def _clean(root: Path, oldest_held: int) -> None:
    """Delete the folders of versions older than every live engine's (and what a trainer killed
    while writing them left); none yet where no engine needed a version written."""
    for folder in root.iterdir() if root.is_dir() else ():
        number = folder.name.removeprefix(".").removesuffix(".partial").removeprefix("v").removesuffix("-delta")
        if number.isdigit() and int(number) < oldest_held:
            shutil.rmtree(folder, ignore_errors=True)
