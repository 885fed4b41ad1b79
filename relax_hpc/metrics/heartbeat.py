"""Heartbeats: each role's RUN_DIR/health/ROLE.json says what it is doing and since when, so
that the launcher (relax_hpc.launch.health) can tell a hung role from a busy one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from relax_hpc import fence
from relax_hpc.paths import RunPaths


class Heartbeat:
    """A role's RUN_DIR/health/NAME.json: what it does, since when (written atomically)."""

    def __init__(self, paths: RunPaths, role: str) -> None:
        self.path = paths.health(role)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self, **state: Any) -> None:
        # Renamed into place (a reader never sees half a file) but not fsynced: a heartbeat is
        # news, not a record, and the trainer writes several per step.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        # host and pid: `status` on the same host tells at once whether the writer is gone
        tmp.write_text(json.dumps({"time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **state}))
        try:
            # An old process's beat would hide a hung new one. The lease is read afresh, just
            # before the rename: a process stopped (SIGSTOP, a frozen node) and continued after
            # its successor started must not pass on a reading from before its stop.
            fence.check(f"heartbeat {self.path.name}", fresh=True)
        except fence.Fenced:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path)


class Beating:
    """A heartbeat written every `every_s` from a thread of its own, until close(): the launcher's,
    whose own loop may wait out a role's end or a restart's back-off. A run none of whose
    heartbeats beats any more has ended, whatever its record says (`status`)."""

    def __init__(self, paths: RunPaths, role: str, every_s: float, **state: Any) -> None:
        self.heartbeat, self.every_s, self.state = Heartbeat(paths, role), every_s, state
        self._stop = threading.Event()
        threading.Thread(target=self._beat, name=f"{role}-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            with contextlib.suppress(OSError):  # a full or unreachable disk: the next beat tries again
                self.heartbeat.beat(**self.state)
            if self._stop.wait(self.every_s):
                return

    def close(self) -> None:
        self._stop.set()


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(path.read_text())
        return state
    except (OSError, ValueError):
        return None


class StepClock:
    """The trainer's phases, for its heartbeat: the median step time so far sets how long a busy
    phase may take before it counts as hung."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.steps: list[float] = []
        self.step = 0

    def phase(self, name: str) -> None:
        median = statistics.median(self.steps[-50:]) if self.steps else None
        self.heartbeat.beat(phase=name, since=time.time(), step=self.step, median_step_s=median)

    def stepped(self, step: int, seconds: float) -> None:
        self.step = step
        self.steps.append(seconds)
