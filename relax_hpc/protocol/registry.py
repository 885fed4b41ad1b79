"""RUN_DIR/registry/engines/ID.json: where each engine listens and which weights it holds.

An engine writes its record once it serves, rewrites it after each weight update and removes it
when it exits cleanly; a record whose process died stays until the launcher restarts that engine
(the new process overwrites it with a new `instance`). Readers treat every record as a hint and
confirm with the engine's /health.

RUN_DIR/weights/quarantine/ID.json: an engine process the trainer found holding other weights
than it pushed (relax_hpc.weights.verify); the driver sends it nothing until the marker is lifted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from relax_hpc import fence
from relax_hpc.paths import write_atomic

EVAL_ENGINE_PREFIX = "engine-eval-"  # rollout.eval_engines: registered beside the rollout engines


@dataclass(frozen=True, slots=True)
class EngineRecord:
    engine_id: str
    host: str
    port: int
    pid: int
    instance: str  # changes on every (re)start of the engine process
    weight_version: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def evaluates(self) -> bool:
        """An engine of rollout.eval_engines: it gets every push, and serves the evaluations only."""
        return self.engine_id.startswith(EVAL_ENGINE_PREFIX)


def write_record(folder: Path, record: EngineRecord) -> None:
    fence.check(f"registry write {folder.name}/{record.engine_id}", fresh=True)  # as Heartbeat.beat says why
    write_atomic(folder / f"{record.engine_id}.json", json.dumps(asdict(record)).encode())


def remove_record(folder: Path, engine_id: str, instance: str) -> None:
    path = folder / f"{engine_id}.json"
    try:
        if json.loads(path.read_text())["instance"] == instance:
            path.unlink()
    except (FileNotFoundError, ValueError, KeyError):
        pass


def read_records(folder: Path) -> list[EngineRecord]:
    """Every readable record, sorted by engine id; unreadable ones are skipped (a writer may be
    replacing them at this moment)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            records.append(EngineRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return records


# -- engines out of service: their weights differ from the trainer's (relax_hpc.weights.verify) --


@dataclass(frozen=True, slots=True)
class Quarantine:
    """RUN_DIR/weights/quarantine/ID.json: engine process `instance` of `engine_id` held other
    weights than the trainer pushed as `version` (`differ` of `checked` tensors, the first of them
    named), out of service since `since` (epoch seconds) until a push matches it whole. A
    restarted engine (another instance) is not held out."""

    engine_id: str
    instance: str
    version: str
    tensors: list[str]
    differ: int
    checked: int
    since: float


def write_quarantine(folder: Path, marker: Quarantine) -> None:
    fence.check(f"quarantine {marker.engine_id}")  # a superseded trainer takes no engine out of service
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"{marker.engine_id}.json", json.dumps(asdict(marker)).encode())


def lift_quarantine(folder: Path, engine_id: str) -> None:
    fence.check(f"quarantine lift {engine_id}")
    (folder / f"{engine_id}.json").unlink(missing_ok=True)


def read_quarantine(folder: Path) -> dict[str, Quarantine]:
    """The engines held out of service, by engine id (unreadable markers are skipped)."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            marker = Quarantine(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[marker.engine_id] = marker
    return out
