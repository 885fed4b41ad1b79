"""Where a role's start-up went: one record per process in RUN_DIR/metrics/startup.jsonl.

A role makes a StartupClock first thing in its main(), marks the end of each phase of its
initialisation (model load, process group, engine registration, weight-sync group...) and
finishes at its first piece of real work (the trainer's first step, an engine's first batch, the
driver's first published batch). Each phase has its wall and CPU seconds; `import` is everything
before main(): the interpreter's start and the role's imports. tools/bench/startup.py reads these.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from relax_hpc.metrics.jsonl import JsonlWriter


def process_age() -> float:
    """Seconds since this process was created (0.0 where /proc does not say): its start in clock
    ticks since boot against CLOCK_BOOTTIME, the clock the kernel counts it on."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5), after pid and comm
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupClock:
    def __init__(self) -> None:
        age = process_age()
        self.started = time.time() - age
        self._wall, self._cpu = time.monotonic(), time.process_time()
        self.phases: dict[str, dict[str, float]] = {"import": {"wall": round(age, 4), "cpu": round(self._cpu, 4)}}
        self.finished = False

    def mark(self, phase: str) -> None:
        """The end of `phase` (since the previous mark); a phase already marked keeps its first
        time (a loop may pass the same point again)."""
        if phase in self.phases or self.finished:
            return
        now, cpu = time.monotonic(), time.process_time()
        self.phases[phase] = {"wall": round(now - self._wall, 4), "cpu": round(cpu - self._cpu, 4)}
        self._wall, self._cpu = now, cpu

    def finish(self, metrics: Path, role: str, phase: str) -> None:
        """Mark the last phase and append the record to `metrics`/startup.jsonl (once)."""
        if self.finished:
            return
        self.mark(phase)
        self.finished = True
        record = {
            "role": role,
            "pid": os.getpid(),
            "started": round(self.started, 4),
            "phases": self.phases,
            "wall": round(sum(p["wall"] for p in self.phases.values()), 4),
            "cpu": round(time.process_time(), 4),
        }
        writer = JsonlWriter(metrics / "startup.jsonl")
        writer.log(record)
        writer.close()
