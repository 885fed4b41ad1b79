"""Elastic rollout: engines that join a running training from Slurm jobs of their own, or from
servers already running elsewhere, and leave again (python -m relax_hpc.scale).

Every scale operation has a record, RUN_DIR/scale/ops/ID.json: what was asked (a Slurm job of N
engines, or an external URL), the Slurm job id, and whether it was cancelled. Its state is worked
out when asked, from what the run shows, so it is never stale:

    pending          the job waits in the queue
    starting         the job runs; its engines have not registered yet
    syncing weights  registered, holding an older policy version than the trainer's
    active           registered, holding the trainer's current version (or newer)
    draining         asked to leave: no new requests; in-flight ones finish or are aborted
    cancelled        left on request
    failed           the job ended, or the server stopped answering, without being asked to

An elastic job runs its engines as processes of its one node (engine ids ID-0, ID-1, ...),
restarts one that dies, and leaves when its engines are drained, when the operation is cancelled
or when the training completes. It registers its engines in RUN_DIR/registry/engines like the
run's own: the driver sends them work from their first free slot, and the trainer's next push
re-forms the weight-sync group with them (a push never waits for an engine that does not answer
/health: those are left out of the group). When the main job is preempted or requeued, elastic
engines keep serving their last weights, idle, and the main job's next start finds them in the
registry (recovery removes only the records of its own engines) and pushes the current weights.
An elastic job that Slurm preempts is requeued like any relax_hpc job and rejoins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.launch.commands import engine_args, python
from relax_hpc.launch.gpus import NO_GPU, visible_gpu_count
from relax_hpc.launch.supervisor import child_env
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths, draining, write_atomic
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import EngineRecord, read_records, remove_record, write_record

State = Literal["pending", "starting", "syncing weights", "active", "draining", "cancelled", "failed"]
ENDED: tuple[State, ...] = ("cancelled", "failed")


@dataclass
class ScaleOp:
    id: str
    kind: Literal["slurm", "url"]
    engines: int = 0  # slurm: engines in the job
    url: str = ""  # url: the external server
    job_id: str = ""
    requested: float = field(default_factory=time.time)
    overrides: list[str] = field(default_factory=list)  # launch.slurm.* of the elastic job
    cancelled: bool = False

    def engine_ids(self) -> list[str]:
        return [f"{self.id}-{i}" for i in range(self.engines)] if self.kind == "slurm" else [self.id]


def ops_folder(paths: RunPaths) -> Path:
    return paths.scale / "ops"


def save_op(paths: RunPaths, op: ScaleOp) -> None:
    ops_folder(paths).mkdir(parents=True, exist_ok=True)
    write_atomic(ops_folder(paths) / f"{op.id}.json", json.dumps(asdict(op)).encode())


def load_ops(paths: RunPaths) -> list[ScaleOp]:
    folder = ops_folder(paths)
    if not folder.is_dir():
        return []
    return sorted((ScaleOp(**json.loads(p.read_text())) for p in folder.glob("*.json")), key=lambda o: o.requested)


def new_id(kind: str) -> str:
    return f"{'ext' if kind == 'url' else 'el'}{uuid.uuid4().hex[:6]}"


def trainer_version(paths: RunPaths) -> int:
    try:
        return int(paths.weights_version.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def op_state(paths: RunPaths, op: ScaleOp, queue: str | None) -> State:
    """The operation's state now; `queue`: its job's squeue state (None: not in the queue)."""
    ids = set(op.engine_ids())
    if op.cancelled:
        alive = [r for r in read_records(paths.engines) if r.engine_id in ids]
        return "draining" if alive and (op.kind == "url" or queue) else "cancelled"
    if ids & draining(paths):
        return "draining"
    if op.kind == "slurm":
        if queue is None:
            return "failed"
        if queue.startswith(("PENDING", "CONFIGURING")):
            return "pending"
    records = [r for r in read_records(paths.engines) if r.engine_id in ids]
    token = paths.read_token()
    live = [r for r in records if EngineClient(r.url, token, 2.0).healthy(2.0)]
    if not live:
        return "failed" if op.kind == "url" and records else "starting"
    versions = []
    for record in live:
        try:
            versions.append(int(EngineClient(record.url, token, 5.0).weight_version()))
        except (ValueError, RuntimeError):
            versions.append(-1)
    return "active" if min(versions) >= trainer_version(paths) and len(live) == len(ids) else "syncing weights"


def register_external(paths: RunPaths, op: ScaleOp) -> EngineRecord:
    """The record of a server that runs elsewhere (it writes none itself)."""
    from urllib.parse import urlsplit

    parts = urlsplit(op.url)
    version = EngineClient(op.url, paths.read_token(), 10.0).weight_version()
    record = EngineRecord(op.id, parts.hostname or "", parts.port or 80, 0, uuid.uuid4().hex, version)
    write_record(paths.engines, record)
    return record


# -- the elastic job ---------------------------------------------------------------------------


class ElasticEngines:
    """What submitit runs in an elastic job: the operation's engines on this node."""

    def __init__(self, run_dir: str, op_id: str) -> None:
        self.run_dir, self.op_id = run_dir, op_id
        self.stopping = False

    def __call__(self) -> str:
        paths = RunPaths(Path(self.run_dir))
        cfg = read_frozen(paths.config)
        op = next(o for o in load_ops(paths) if o.id == self.op_id)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        serve(cfg, paths, op, lambda: self.stopping)
        return f"elastic engines {op.id} left"

    def checkpoint(self) -> object:
        """submitit calls this on USR2 (time limit or preemption ahead): stop, then requeue."""
        import submitit

        self.stopping = True
        return submitit.helpers.DelayedSubmission(ElasticEngines(self.run_dir, self.op_id))


def _gpus(cfg: JobConfig, index: int, visible: int) -> str:
    per = cfg.rollout.kind.gpus_per_engine(cfg.rollout) or 1
    return f"{index * per}-{(index + 1) * per - 1}" if visible >= (index + 1) * per else NO_GPU


def serve(cfg: JobConfig, paths: RunPaths, op: ScaleOp, stopping: object) -> None:
    """Run the operation's engines until they are drained, the operation cancelled or the
    training complete; restart an engine that dies (rollout.max_engine_restarts)."""
    from relax_hpc.launch.commands import _on_gpus

    host = "0.0.0.0" if os.environ.get("SLURM_JOB_ID") else cfg.rollout.host
    visible = visible_gpu_count()
    argv = {
        engine_id: _on_gpus(
            _gpus(cfg, i, visible), [python(cfg), *engine_args(cfg, paths, 0, host, engine_id=engine_id)]
        )
        for i, engine_id in enumerate(op.engine_ids())
    }
    logs = paths.scale / "logs" / op.id
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    restarts = dict.fromkeys(argv, 0)
    env = child_env(cfg)

    def start(engine_id: str) -> None:
        with (logs / f"{engine_id}.log").open("ab") as out:
            procs[engine_id] = subprocess.Popen(argv[engine_id], stdout=out, stderr=subprocess.STDOUT, env=env)

    for engine_id in argv:
        start(engine_id)
    try:
        while procs and not stopping():  # type: ignore[operator]  # a callable
            time.sleep(1.0)
            if _training_over(paths) or _cancelled(paths, op.id):
                break
            for engine_id, proc in list(procs.items()):
                if paths.drain_marker(engine_id).exists() and _drained(paths, engine_id):
                    _stop(proc)
                    del procs[engine_id]
                elif proc.poll() is not None and restarts[engine_id] < cfg.rollout.max_engine_restarts:
                    restarts[engine_id] += 1
                    start(engine_id)
    finally:
        for proc in procs.values():
            _stop(proc)
        for engine_id in argv:
            for record in read_records(paths.engines):
                if record.engine_id == engine_id:
                    remove_record(paths.engines, engine_id, record.instance)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def _training_over(paths: RunPaths) -> bool:
    ends = [r for r in read_jsonl(paths.train_metrics) if r.get("event") == "end"]
    return bool(ends and ends[-1].get("completed"))


def _cancelled(paths: RunPaths, op_id: str) -> bool:
    return any(o.id == op_id and o.cancelled for o in load_ops(paths))


def _drained(paths: RunPaths, engine_id: str) -> bool:
    """The scale command has decided the engine may go (it writes `done` into the marker)."""
    return paths.drain_marker(engine_id).read_text().strip() == "done"


def in_flight(paths: RunPaths) -> dict[str, int]:
    """Requests in flight per engine, as the driver last said (its heartbeat)."""
    try:
        state = json.loads(paths.health("driver").read_text())
    except (OSError, ValueError):
        return {}
    load: dict[str, int] = state.get("load", {})
    return load
