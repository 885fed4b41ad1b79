"""The fork server itself (`python -m relax_hpc.forkserver MODULE...`): one interpreter that
imports the run's role modules once, then forks a child per role start and runs the role's module
in it as `python -m` would. The launcher's side, which starts this process and speaks to it in
JSON lines, is relax_hpc.launch.forkserver; read its docstring for the why.

An entry point, not part of launch/: it imports the roles (engines, the driver, the trainer), which
the launcher, itself a role, may not (tests/unit/test_layering.py). It imports them by the names
the launcher passes, so the layering test checks the names the launcher can pass instead
(relax_hpc.launch.forkserver.ROLE_MODULES, each a module of a role).

Protocol, one JSON object a line. In (stdin): a start request {"argv", "env", "log"}. Out (the
original stdout): {"ready": true} once imported; per request {"pid"} or {"error"}; per child exit
{"exited", "code", "cpu_s"} (the server is the children's parent and reaps them: launch.cputime).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import selectors
import shlex
import signal
import sys
from collections.abc import Sequence
from typing import Any

import setproctitle

from relax_hpc.launch.cputime import rusage_cpu_s


def main(modules: Sequence[str]) -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what an import prints goes to the server's log, not into the replies
    for name in modules:
        importlib.import_module(name)
        # Imported for its imports only: the child runs it afresh as __main__, as `python -m`
        # does, which never has the module under its own name before it runs.
        del sys.modules[name]
    # What the imports made stays out of every collection, in the server and in its children
    # (Python's advice for a pre-fork server): a child's collections neither scan it nor write to
    # its pages, which then stay shared.
    gc.freeze()
    print(json.dumps({"ready": True}), file=replies)
    request = _serve(replies)  # returns only in a forked child
    _run_role(request)


def _serve(replies: Any) -> dict[str, Any]:
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup fd is written
    signal.set_wakeup_fd(wakeup_w)
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == wakeup_r:
                os.read(wakeup_r, 4096)
                _report_exits(replies)
                continue
            line = sys.stdin.readline()
            if not line:  # the launcher closed its end: leave the children running
                sys.exit(0)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as err:
                print(json.dumps({"error": f"fork failed: {err}"}), file=replies)
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                for fd in (wakeup_r, wakeup_w, replies.fileno()):
                    os.close(fd)
                return request
            print(json.dumps({"pid": pid}), file=replies)


def _report_exits(replies: Any) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited = {"exited": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": rusage_cpu_s(usage)}
        print(json.dumps(exited), file=replies)


def _run_role(request: dict[str, Any]) -> None:
    """In the child: become the role's process, then run its module as `python -m` would."""
    os.setsid()  # as subprocess's start_new_session: Ctrl-C reaches the launcher alone
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    os.close(log)
    os.close(devnull)
    argv = request["argv"]
    # Before the environment changes: setproctitle makes room for a long title in the memory of
    # the environment the process started with.
    setproctitle.setproctitle(shlex.join(argv))
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
        sys.modules["numpy"].random.seed()
    sys.argv = [argv[2], *argv[3:]]
    # An exception or SystemExit leaves through the interpreter's own exit, as under `python -m`.
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
