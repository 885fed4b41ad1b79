"""Where the time of a step goes: named phases timed on the host, summed per step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase since the last `take()`. Host time: on a GPU, work a phase only
    queued is counted by the phase that waits for it (the next host sync). `on_phase`, if given,
    hears each phase's name as it starts and "wait" as it ends (the trainer's heartbeat)."""

    def __init__(self, on_phase: Callable[[str], None] | None = None) -> None:
        self._seconds: dict[str, float] = {}
        self.on_phase = on_phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase(name)
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)
            if self.on_phase is not None:
                self.on_phase("wait")

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The phases' seconds so far, and start over."""
        out, self._seconds = self._seconds, {}
        return out


class PeakMemory:
    """The device's peak allocated memory over a phase, in GB (CUDA only: `on` is False elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on = device.type == "cuda"
        if self.on:
            torch.cuda.reset_peak_memory_stats(device)

    def take(self) -> float:
        """The peak since the last take (or the start), and start over."""
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return round(peak, 3)
