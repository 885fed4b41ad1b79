"""Warm starts for the `local` executor: roles forked from one process that imported them once
(the launcher's side; the server is relax_hpc.forkserver, an entry point).

Every role of a run on this machine (engines, driver, trainer) is `python -m relax_hpc.<role>`,
and each fresh interpreter spends seconds of CPU importing torch and transformers before it does
anything: on 2 cores, a third of a short run's CPU and most of its start-up (BENCHMARKS.md,
"Start-up"). The fork server is one interpreter, started with the roles' common environment,
that imports every role module of the run once and then forks a child per role start; the child
takes the role's environment, log and process title and runs the module as `python -m` would
(runpy, as `__main__`), sharing the imported code copy-on-write. Restarts after a crash are forks
too. This is the Android zygote's idea and what multiprocessing's forkserver does for functions;
the latter is not used because it runs functions, not programs, reports a live child as exited
(255) when the server dies, and starts its children as daemons.

The launcher's side (`ForkServer`) speaks JSON lines over the server's stdin and stdout: a start
request is answered with the child's pid, and every child's exit with its status and CPU time
(the server is the child's parent and reaps it: launch.cputime). `ForkedProcess` gives the
supervisor the part of `subprocess.Popen` it uses. If the server dies, its children keep running;
their exit status is then unknown, and `ForkedProcess` reports a child that has gone as killed
(-9). Only plain `python -m <role module>` commands on this machine are forked: commands in a
container, on a GPU slice or in another interpreter start as before (`forkable`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from relax_hpc.launch.cputime import tree_cpu_s
from relax_hpc.launch.gpus import NO_GPU

ROLE_MODULES = frozenset(
    {
        "relax_hpc.engines.torch_engine",
        "relax_hpc.engines.sglang_engine",
        "relax_hpc.engines.vllm_engine",
        "relax_hpc.rollout.driver",
        "relax_hpc.trainer.main",
        "relax_hpc.metrics.sinks",
    }
)
READY_TIMEOUT_S = 300.0  # the server's imports, on a loaded machine
KILLED = -signal.SIGKILL  # the status reported for a child whose real status died with the server


class ForkServerError(RuntimeError):
    """The server could not start a role (the caller starts it as a fresh process instead)."""


class StartAbandoned(Exception):
    """The caller gave up a start while the server was still importing; nothing was forked."""


def forkable(argv: Sequence[str], modules: Iterable[str] = ROLE_MODULES) -> tuple[list[str], dict[str, str]] | None:
    """What the fork server runs for `argv`: `<this python> -m <one of modules> ...`, with the
    environment it adds; the same for a role kept off the GPUs (`launch.gpus none -- ...`, which
    hides every GPU). None for any other command (a container, a GPU slice, another python)."""
    argv = list(argv)
    env: dict[str, str] = {}
    if argv[1:5] == ["-m", "relax_hpc.launch.gpus", NO_GPU, "--"] and argv[0] == sys.executable:
        argv, env = argv[5:], {"CUDA_VISIBLE_DEVICES": ""}
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in modules:
        return argv, env
    return None


class ForkedProcess:
    """A role forked by the server: the part of subprocess.Popen the supervisor uses."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid, self._server = pid, server
        self.returncode: int | None = None
        self._created = _create_time(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self.pid, self._created)
        return self.returncode

    @property
    def cpu_s(self) -> float | None:
        """Once it has exited: its CPU time, with every descendant it reaped (None: unknown, its
        status died with the server)."""
        return self._server.cpu_s.get(self.pid)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The launcher's handle on one fork server, which runs `modules` (imported once, in the
    environment `env`). It starts at the first `start`, and again at a start after its death; its
    log, forkserver.log, goes into the folder of the log of the role whose start started it."""

    def __init__(self, modules: Iterable[str], env: Mapping[str, str]) -> None:
        self.modules, self.env = sorted(set(modules)), dict(env)
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._ready = False  # the current server has imported its modules
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self.cpu_s: dict[int, float] = {}  # an exited child's CPU time, with all it reaped (wait4)
        self._reader: threading.Thread | None = None
        # One request at a time: the server reads its input by lines, so it never holds a
        # second request in its buffer while it waits on the pipe.
        self._lock = threading.Lock()

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, abandon: Callable[[], bool] | None = None
    ) -> ForkedProcess:
        """Fork `argv` (`forkable` with this server's modules) with `env`, its output appended to
        `log_path`. While the server is still importing, `abandon` is asked every 0.1 s whether
        to give the start up (StartAbandoned): a stop asked during a run's first seconds need
        not wait out the imports, and nothing is forked after it."""
        command = forkable(argv, self.modules)
        if command is None:
            raise ForkServerError(f"not a role the fork server runs: {shlex.join(argv)}")
        with self._lock:
            proc = self._running(log_path.parent / "forkserver.log")
            self._await_ready(abandon)
            request = {"argv": command[0], "env": {**env, **command[1]}, "log": str(log_path)}
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                reply = self._replies.get(timeout=READY_TIMEOUT_S)
            except (OSError, queue.Empty) as err:
                raise ForkServerError(f"the fork server did not answer: {err}") from err
            if "pid" not in reply:
                raise ForkServerError(reply.get("error", f"the fork server ended (see {self.log_path})"))
            return ForkedProcess(int(reply["pid"]), self)

    def _await_ready(self, abandon: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready:
            try:
                message = self._replies.get(timeout=0.1)
            except queue.Empty:
                if abandon is not None and abandon():
                    raise StartAbandoned("the start was given up while the fork server imported") from None
                if time.monotonic() > deadline:
                    late = f"the fork server did not import its modules in {READY_TIMEOUT_S:.0f} s"
                    raise ForkServerError(late) from None
                continue
            if not message.get("ready"):
                raise ForkServerError(f"the fork server ended before it was ready (see {self.log_path})")
            self._ready = True

    def exit_status(self, pid: int, created: float | None) -> int | None:
        """`pid`'s exit status once it has exited; None while it runs."""
        if pid in self._exits:
            return self._exits[pid]
        if self._proc is not None and self._proc.poll() is None:
            return None
        if self._reader is not None:
            self._reader.join(timeout=1.0)  # the exits the server said before it ended
        if pid in self._exits:
            return self._exits[pid]
        # The server died with the child's status: the child has exited once its process is gone.
        if created is not None and _create_time(pid) == created:
            return None
        return self._exits.setdefault(pid, KILLED)

    def own_cpu_s(self) -> float:
        """The server's own CPU time (its imports), not its children's: they are counted as roles."""
        return tree_cpu_s(self._proc.pid, own_only=True) if self._proc is not None else 0.0

    def close(self) -> None:
        """End the server (its children are the supervisor's to end; they are not touched). It
        holds nothing to save, and its interpreter's orderly exit, with torch loaded, takes over a
        second of a stop that a preempted job may not have: SIGKILL."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _running(self, log_path: Path) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._replies, self.log_path, self._ready = queue.Queue(), log_path, False
            with log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "relax_hpc.forkserver", *self.modules],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
                    start_new_session=True, text=True,
                )  # fmt: skip
            self._reader = threading.Thread(target=self._read, args=(self._proc, self._replies), daemon=True)
            self._reader.start()
        return self._proc

    def _read(self, proc: subprocess.Popen, replies: queue.Queue) -> None:
        """The server's messages: exits into the table, everything else to the waiting start."""
        assert proc.stdout is not None
        for line in proc.stdout:
            message = json.loads(line)
            if "exited" in message:
                self.cpu_s[int(message["exited"])] = float(message["cpu_s"])
                self._exits[int(message["exited"])] = int(message["code"])
            else:
                replies.put(message)
        replies.put({})  # the server ended: a start waiting for it fails at once


def _create_time(pid: int) -> float | None:
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    return None
