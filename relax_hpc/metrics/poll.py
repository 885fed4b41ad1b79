"""Polling a file system or a server for another process's progress, without torch (the driver imports it)."""

from __future__ import annotations

import time


class Poll:
    """How long a loop that waits on another process (the trainer for the spool, the driver for
    new weights) sleeps between looks: from 50 ms up by half each empty look, to at most a tenth
    of the loop's last cycle (between 10 ms and `highest`, 0.5 s by default). A colocated step of
    0.3 s then waits at most ~30 ms for its input; a step of a minute still looks only twice a
    second (the spool may live on NFS, and each engine answers an HTTP request per look)."""

    FIRST, LOWEST, HIGHEST = 0.05, 0.01, 0.5

    def __init__(self, highest: float = HIGHEST) -> None:
        self.highest = highest
        self.cap = highest
        self._next = min(self.FIRST, highest)
        self._cycle_started = time.monotonic()

    def interval(self) -> float:
        """The next sleep; the one after is longer."""
        wait, self._next = self._next, min(self._next * 1.5, self.cap)
        return wait

    def progressed(self) -> None:
        """A cycle ended (a step trained, a batch published): looks start short again."""
        now = time.monotonic()
        self.cap = min(self.highest, max(self.LOWEST, (now - self._cycle_started) / 10))
        self._next, self._cycle_started = min(self.FIRST, self.cap), now
