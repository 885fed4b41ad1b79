"""Telling a hung role from a busy one.

A dead role is the supervisor's to see (its process exits). A hung one keeps running and does
nothing, so every role says what it is doing:

- the trainer's rank 0 writes RUN_DIR/health/trainer.json at every phase change: the phase
  (`wait` for samples, `read`, `train`, `push`, `checkpoint`), since when, the step, and the
  median step time so far;
- the driver's event loop writes RUN_DIR/health/driver.json every few seconds (a loop blocked in
  synchronous code, or deadlocked, stops writing);
- engines answer /health, which the monitor asks in a thread of its own.

`HealthMonitor.findings()` turns these into causes (launch.health holds the limits); the
supervisor acts on them: a hung engine or driver is killed and restarted like a dead one, a hung
trainer is killed and the run restarted from its checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from relax_hpc.config.schema import HealthConfig
from relax_hpc.metrics.heartbeat import read_heartbeat
from relax_hpc.paths import RunPaths, SpoolDirs
from relax_hpc.protocol.client import EngineClient
from relax_hpc.protocol.registry import read_records

BUSY_PHASES = ("read", "train", "push", "checkpoint")


@dataclass(frozen=True)
class Finding:
    role: str
    cause: str


class HealthMonitor:
    """What the heartbeats and the engines' /health say about each role (findings())."""

    def __init__(self, paths: RunPaths, cfg: HealthConfig, started: Callable[[str], float]) -> None:
        """`started(role)`: when the role's current process started (a heartbeat older than
        that is its predecessor's)."""
        self.paths, self.cfg, self.started = paths, cfg, started
        self.api_key = paths.read_token()
        self._answered: dict[str, float] = {}  # engine id -> when /health last answered
        self._seen: dict[str, str] = {}  # engine id -> the instance the times above are for
        self._gone: dict[str, str] = {}  # engine id -> the instance of a killed process (its record stays)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_engines, name="health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def forget(self, engine_id: str) -> None:
        """The engine's process was killed: its record is stale until its successor registers."""
        if engine_id in self._seen:
            self._gone[engine_id] = self._seen.pop(engine_id)
        self._answered.pop(engine_id, None)

    def _probe_engines(self) -> None:
        while not self._stop.wait(2.0):
            for record in [r for folder in self.paths.registries for r in read_records(folder)]:
                if self._gone.get(record.engine_id) == record.instance:
                    continue
                if self._seen.get(record.engine_id) != record.instance:  # a new process: a new clock
                    self._seen[record.engine_id] = record.instance
                    self._answered[record.engine_id] = time.monotonic()
                if EngineClient(record.url, self.api_key, 2.0).healthy(2.0):
                    self._answered[record.engine_id] = time.monotonic()

    def findings(self, now: float | None = None) -> list[Finding]:
        now = time.time() if now is None else now
        out = []
        limit = self.cfg.engine_timeout_s
        for engine_id, answered in list(self._answered.items()):
            silent = time.monotonic() - answered
            if silent > limit and engine_id in self._seen:
                out.append(Finding(engine_id, f"its /health has not answered for {silent:.0f} s (hung)"))
        driver = read_heartbeat(self.paths.health("driver"))
        driver_since = max(driver["time"] if driver else 0.0, self.started("driver"))
        if now - driver_since > self.cfg.driver_timeout_s:
            out.append(Finding("driver", f"no heartbeat for {now - driver_since:.0f} s (hung)"))
        trainer = read_heartbeat(self.paths.health("trainer"))
        if trainer and trainer["time"] >= self.started("trainer"):
            lasted = now - float(trainer["since"])
            median = trainer.get("median_step_s")
            limit = max(self.cfg.step_timeout_s, self.cfg.step_factor * median if median else 0.0)
            phase = trainer.get("phase")
            if phase in BUSY_PHASES and lasted > limit:
                out.append(Finding("trainer", f"in its {phase} phase for {lasted:.0f} s (hung)"))
            elif phase == "wait" and now - self._oldest_ready(now) > limit and lasted > limit:
                out.append(Finding("trainer", f"waiting for {lasted:.0f} s with batches ready (hung)"))
        return out

    def _oldest_ready(self, now: float) -> float:
        """When the oldest batch waiting in the spool was published (now: none waits)."""
        times = [p.stat().st_mtime for p in SpoolDirs(self.paths.spool).ready.glob("b*.h5")]
        return min(times, default=now)
