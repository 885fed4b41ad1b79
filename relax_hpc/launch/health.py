"""Telling a hung role from a busy one.

A dead role is the supervisor's to see (its process exits). A hung one keeps running and does
nothing, so every role says what it is doing:

- the trainer's rank 0 writes RUN_DIR/health/trainer.json at every phase change: the phase
  (`wait` for samples, `read`, `train`, `push`, `checkpoint`), since when, the step, and the
  median step time so far;
- the driver's event loop writes RUN_DIR/health/driver.json every few seconds (a loop blocked in
  synchronous code, or deadlocked, stops writing);
- engines answer /health, which the monitor asks in a thread of its own.

Until a role's current process has said so once (its first heartbeat, its registry record), it
is starting: it gets launch.health.startup_timeout_s, and what its predecessor left says nothing.

`HealthMonitor.findings()` turns these into causes (launch.health holds the limits); the
supervisor acts on them: a hung engine or driver is killed and restarted like a dead one, a hung
trainer is killed and the run restarted from its checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
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

    def __init__(
        self, paths: RunPaths, cfg: HealthConfig, started: Callable[[str], float], engines: Iterable[str] = ()
    ) -> None:
        """`started(role)`: when the role's current process started (a heartbeat or an engine
        record older than that is its predecessor's); `engines`: the engine roles to watch."""
        self.paths, self.cfg, self.started, self.engines = paths, cfg, started, list(engines)
        self.api_key = paths.read_token()
        # engine id -> (its latest instance, when it was first seen): a record written before the
        # role's current start is its predecessor's, which a new process replaces once it serves.
        self._registered: dict[str, tuple[str, float]] = {}
        self._answered: dict[str, float] = {}  # engine id -> when /health last answered (monotonic)
        self._healthy: dict[str, bool] = {}  # engine id -> what its last /health probe said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe_engines, name="health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _probe_engines(self) -> None:
        while not self._stop.wait(2.0):
            self.probe_once()

    def probe_once(self) -> None:
        """Read the registry and ask each of the run's engines' /health once."""
        for record in [r for folder in self.paths.registries for r in read_records(folder)]:
            if record.engine_id not in self.engines:
                continue  # an elastic engine: its own job's, not this launcher's
            if self._registered.get(record.engine_id, ("", 0.0))[0] != record.instance:  # a new process: a new clock
                self._registered[record.engine_id] = (record.instance, time.time())
                self._answered[record.engine_id] = time.monotonic()
            self._healthy[record.engine_id] = EngineClient(record.url, self.api_key, 2.0).healthy(2.0)
            if self._healthy[record.engine_id]:
                self._answered[record.engine_id] = time.monotonic()

    def serving(self) -> set[str]:
        """The engines whose current process has registered and answered its last /health probe:
        an engine that crash-loops runs, but never serves."""
        return {
            engine_id
            for engine_id, (_, seen) in list(self._registered.items())
            if seen >= self.started(engine_id) and self._healthy.get(engine_id, False)
        }

    def findings(self, now: float | None = None) -> list[Finding]:
        now = time.time() if now is None else now
        out = [*self._engine_findings(now), *self._driver_findings(now)]
        trainer = read_heartbeat(self.paths.health("trainer"))
        if trainer is None or trainer["time"] < self.started("trainer"):
            out += self._never_started("trainer", now)
            return out
        lasted = now - float(trainer["since"])
        median = trainer.get("median_step_s")
        limit = max(self.cfg.step_timeout_s, self.cfg.step_factor * median if median else 0.0)
        phase = trainer.get("phase")
        if phase in BUSY_PHASES and lasted > limit:
            out.append(Finding("trainer", f"in its {phase} phase for {lasted:.0f} s (hung)"))
        elif phase == "wait" and now - self._oldest_ready(now) > limit and lasted > limit:
            out.append(Finding("trainer", f"waiting for {lasted:.0f} s with batches ready (hung)"))
        return out

    def _never_started(self, role: str, now: float) -> list[Finding]:
        """A role whose current process has not said it runs (no heartbeat, no engine record)
        within launch.health.startup_timeout_s of its start is hung like any other."""
        waited = now - self.started(role)
        if waited <= self.cfg.startup_timeout_s:
            return []
        return [Finding(role, f"not up {waited:.0f} s after its start (hung in its start-up)")]

    def _engine_findings(self, now: float) -> list[Finding]:
        out = []
        for engine_id in self.engines:
            registered = self._registered.get(engine_id)
            if registered is None or registered[1] < self.started(engine_id):
                out += self._never_started(engine_id, now)
                continue
            silent = time.monotonic() - self._answered[engine_id]
            if silent > self.cfg.engine_timeout_s:
                out.append(Finding(engine_id, f"its /health has not answered for {silent:.0f} s (hung)"))
        return out

    def _driver_findings(self, now: float) -> list[Finding]:
        driver = read_heartbeat(self.paths.health("driver"))
        if driver is None or driver["time"] < self.started("driver"):
            return self._never_started("driver", now)
        if now - driver["time"] > self.cfg.driver_timeout_s:
            return [Finding("driver", f"no heartbeat for {now - driver['time']:.0f} s (hung)")]
        return []

    def _oldest_ready(self, now: float) -> float:
        """When the oldest batch waiting in the spool was published (now: none waits). A batch
        the trainer claims between the listing and its stat is no longer waiting: passed over."""
        times = []
        for path in SpoolDirs(self.paths.spool).ready.glob("b*.h5"):
            with contextlib.suppress(FileNotFoundError):
                times.append(path.stat().st_mtime)
        return min(times, default=now)
