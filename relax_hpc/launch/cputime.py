"""CPU time (user + system) of a run's processes, from the kernel's own counters, for the usage
record (metrics.accounting): not wall time x the threads a role was given, which on a shared
machine says nothing of what the run used.

A process that ended is counted by the process that reaps it: `wait4` returns the CPU time of the
process and of every descendant it reaped in turn (a trainer's ranks, a wrapper's server). The
launcher reaps its fresh role processes (`CountedPopen`), the fork server its forked ones
(launch.forkserver reports the time with the exit). A process still running is counted from
/proc: its own time and its reaped children's, and the same of each living descendant (a living
process's time is in no reaped child's count, so nothing is counted twice).
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
from typing import Any

import psutil


def rusage_cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def self_cpu_s() -> float:
    """This process's own CPU time (its children's are counted where they are reaped)."""
    return rusage_cpu_s(resource.getrusage(resource.RUSAGE_SELF))


def tree_cpu_s(pid: int, own_only: bool = False) -> float:
    """CPU time of the living process `pid`, the children it reaped and every living process
    below it (0 once it is gone). `own_only`: its own time alone (the fork server: its forked
    roles are counted as roles)."""
    try:
        top = psutil.Process(pid)
        processes = [top] if own_only else [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile: its parent counts it
            times = process.cpu_times()
            total += times.user + times.system
            if not own_only:
                total += times.children_user + times.children_system
    return total


class CountedPopen(subprocess.Popen):
    """subprocess.Popen that keeps its process's CPU time (`cpu_s`, with every descendant it
    reaped) when it reaps it, by `wait4` in place of `waitpid`, whichever call reaps it."""

    cpu_s: float | None = None  # once reaped

    def _wait4(self, pid: int, flags: int) -> tuple[int, int]:
        reaped, status, usage = os.wait4(pid, flags)
        if reaped == self.pid:
            self.cpu_s = rusage_cpu_s(usage)
        return reaped, status

    def _internal_poll(self, *args: Any, **kwargs: Any) -> int | None:  # poll()
        return super()._internal_poll(*args, **{**kwargs, "_waitpid": self._wait4})  # type: ignore[misc]

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:  # wait()
        try:
            return self._wait4(self.pid, wait_flags)
        except ChildProcessError:  # reaped elsewhere: Popen's own answer for that
            return super()._try_wait(wait_flags)  # type: ignore[misc]
