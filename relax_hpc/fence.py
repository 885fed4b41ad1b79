"""Fencing: one writer per run, whatever state an older process is in.

The launcher owns RUN_DIR/fence/lease.json: the run's generation (advanced at every start of the
roles: each attempt inside an allocation, each requeue) and, per role, the serial number of the
process it started last (a role restarted alone, a hung engine replaced, gets a new one). Each
role process carries its own grant in its environment (RELAX_HPC_FENCE=ROLE:SERIAL) and is
current while the lease still names that serial for its role.

Every writing primitive (the checkpoint commit, spool publish and claim, JSONL metric appends,
registry writes, heartbeats, weight pushes) calls `check(what)` first. A process that is no
longer current records the refused write in RUN_DIR/fence/refused/ (one file each: it writes
nothing into the run's record, which the current generation owns and recovery rewrites) and
raises `Fenced`, a BaseException that no `except Exception` swallows; `install` makes an uncaught
`Fenced` end the process and starts a thread that ends it within a second of losing the lease,
whether or not it writes. A process without a grant (tests, `inprocess`, elastic engines, which
outlive the main job's generations by design) is never fenced.

The check reads a file of a few hundred bytes, at most once per `CACHE_S` (monotonic time, so a
process stopped with SIGSTOP and continued later reads it again before its next write); the
checkpoint commit reads it fresh. What a check cannot close is the write that follows the check
itself: a process stopped between the two completes that one write when it is continued, then
exits (docs/DESIGN.md, "Fencing").
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from relax_hpc.paths import write_atomic

ENV = "RELAX_HPC_FENCE"
EXIT_FENCED = 76  # a superseded process ended itself without writing
CACHE_S = 1.0  # how long a read of the lease counts as current on the hot paths
WATCH_S = 1.0  # how often the watcher thread reads the lease


class Fenced(BaseException):
    """A write refused: this process belongs to an older generation of the run."""


def lease_path(run_dir: Path) -> Path:
    return run_dir / "fence" / "lease.json"


def refused_dir(run_dir: Path) -> Path:
    return run_dir / "fence" / "refused"


def read_lease(run_dir: Path) -> dict[str, Any]:
    """The lease ({} before the launcher wrote one)."""
    try:
        lease: dict[str, Any] = json.loads(lease_path(run_dir).read_text())
        return lease
    except FileNotFoundError:
        return {}


def refused_writes(run_dir: Path) -> list[dict[str, Any]]:
    """Every write refused so far: what, by which role, process and generation."""
    folder = refused_dir(run_dir)
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written
    return out


class Lease:
    """The launcher's side: the only writer of lease.json."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.state = read_lease(run_dir) or {"generation": 0, "serial": 0, "roles": {}}
        self._wrote = False

    @property
    def generation(self) -> int:
        return int(self.state["generation"])

    def new_generation(self) -> int:
        """Supersede every process of the run (before recovery rewrites its record); the lease
        names this launcher as the run's owner."""
        self.state = {**self.state, "generation": self.generation + 1, "roles": {}, "owner": launcher_name()}
        self._write()
        return self.generation

    def superseded(self) -> str | None:
        """The launcher that has written the lease since this one last did (None: nobody; the
        run is still this launcher's). A launcher that sees one must start no role again."""
        try:
            on_disk = read_lease(self.run_dir)
        except (OSError, ValueError):  # a lease being replaced reads whole or not at all
            return None
        if not self._wrote or on_disk == self.state:
            return None
        return str(on_disk.get("owner", "another launcher"))

    def grant(self, role: str) -> dict[str, str]:
        """A new serial for `role` (superseding its previous process); the environment entry its
        process carries."""
        serial = int(self.state["serial"]) + 1
        self.state = {**self.state, "serial": serial, "roles": {**self.state["roles"], role: serial}}
        self._write()
        return {ENV: f"{role}:{serial}"}

    def _write(self) -> None:
        lease_path(self.run_dir).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(lease_path(self.run_dir), json.dumps(self.state).encode())
        self._wrote = True


def launcher_name() -> str:
    """Who a launcher is, in words: its Slurm job, else its process."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"job {job}" if job else f"launcher pid {os.getpid()} on {socket.gethostname()}"


@dataclass
class Fence:
    """A role process's side: is its grant still the lease's?"""

    run_dir: Path
    role: str
    serial: int
    _read_at: float = field(default=-float("inf"), repr=False)
    _current: bool = field(default=True, repr=False)
    _refused: int = field(default=0, repr=False)

    def current(self, fresh: bool = False) -> bool:
        if fresh or time.monotonic() - self._read_at > CACHE_S:
            try:
                roles = read_lease(self.run_dir).get("roles", {})
            except (OSError, ValueError):  # a lease being replaced reads whole or not at all
                return self._current
            self._current = roles.get(self.role) == self.serial
            self._read_at = time.monotonic()
        return self._current

    def check(self, what: str, fresh: bool = False) -> None:
        """Before a write: raise Fenced (after recording the refusal) if superseded."""
        if self.current(fresh):
            return
        self._record(what)
        raise Fenced(f"{self.role} (serial {self.serial}) is superseded: {what} refused")

    def _record(self, what: str) -> None:
        self._refused += 1
        host, pid = socket.gethostname(), os.getpid()
        record = {"time": time.time(), "what": what, "role": self.role, "serial": self.serial, "host": host, "pid": pid}
        folder = refused_dir(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{self.role}-{self.serial}-{host}-{pid}-{self._refused}.json"
        # O_EXCL and a name of its own: nobody else ever writes or rewrites this file.
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        _say(f"fenced: {what} refused; {self.role} serial {self.serial} is superseded")


@dataclass
class _Process:
    """This process's fence, and what must end with it (a server process of its own)."""

    fence: Fence | None = None
    before_exit: Callable[[], None] | None = None


_process = _Process()


def from_env(run_dir: Path) -> Fence | None:
    """This process's fence, from the grant the launcher put in its environment (None: none)."""
    grant = os.environ.get(ENV)
    if not grant:
        return None
    role, _, serial = grant.rpartition(":")
    if not role or not serial.isdigit():
        raise ValueError(f"{ENV}={grant!r}: expected ROLE:SERIAL")
    return Fence(run_dir, role, int(serial))


def configure(fence: Fence | None) -> None:
    """Make `fence` the one every writing primitive of this process checks."""
    _process.fence = fence


def check(what: str, fresh: bool = False) -> None:
    """Before a write to RUN_DIR or a weight push: raise Fenced if this process is superseded."""
    if _process.fence is not None:
        _process.fence.check(what, fresh)


def superseded() -> bool:
    """Whether this process lost its lease (an engine then refuses requests)."""
    return _process.fence is not None and not _process.fence.current()


def install(run_dir: Path, before_exit: Callable[[], None] | None = None) -> None:
    """At a role's start: take its grant from the environment, refuse to start when it is already
    superseded, end the process on an uncaught Fenced and within WATCH_S of losing the lease.
    `before_exit`: what must end with it (a server process of its own)."""
    fence = from_env(run_dir)
    configure(fence)
    if fence is None:
        return
    if not fence.current(fresh=True):
        _exit(f"{fence.role} serial {fence.serial} is superseded before its start")
    sys.excepthook = _exit_on_fenced(sys.excepthook)
    threading.excepthook = _thread_exit_on_fenced(threading.excepthook)
    _process.before_exit = before_exit
    threading.Thread(target=_watch, args=(fence,), name="fence", daemon=True).start()


def _watch(fence: Fence) -> None:
    while fence.current(fresh=True):
        time.sleep(WATCH_S)
    _exit(f"{fence.role} serial {fence.serial} is superseded")


def _exit(why: str) -> None:
    if _process.before_exit is not None:
        _process.before_exit()
    _say(f"fenced: {why}; exiting without writing")
    os._exit(EXIT_FENCED)


def _say(line: str) -> None:
    """To stderr, never blocking nor raising: a superseded process's reader may be gone (the srun
    client of a job step that a restart replaced) and its pipe full or closed."""
    with contextlib.suppress(OSError):
        os.set_blocking(2, False)
        os.write(2, f"{line}\n".encode())


def _exit_on_fenced(previous: Any) -> Any:
    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if isinstance(value, Fenced):
            _exit(str(value))
        previous(kind, value, tb)

    return hook


def _thread_exit_on_fenced(previous: Any) -> Any:
    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, Fenced):
            _exit(str(args.exc_value))
        previous(args)

    return hook
