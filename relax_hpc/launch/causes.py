"""Why a role's process ended, in words: what the launcher says and `status` shows for every
role exit (RUN_DIR/metrics/events.jsonl `role_exit`), instead of the role's last log line."""

from __future__ import annotations

import errno
import os
import signal

from relax_hpc.fence import EXIT_FENCED

SIGNALLED = 128  # srun (and a shell) exit 128 + N for a task that signal N ended


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_cause(code: int | None, hung: str | None = None) -> str:
    """hung (with the health monitor's finding), fenced, a signal, or the exit code."""
    if hung:
        return f"hung: {hung}"
    if code is None:
        return "not started"
    if code == EXIT_FENCED:
        return f"fenced (exit {code}: superseded by a newer start of the run)"
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    if SIGNALLED < code < SIGNALLED + 65:
        return f"exit {code} ({_signal_name(code - SIGNALLED)})"
    return f"exit {code}"


# The OS's words for a write that found no space (a full filesystem, a full quota), as Python's
# OSError and HDF5's errors print them.
NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def no_space(log_tail: str) -> str | None:
    """The last line of a role's log that says a write found no space (None: none says so)."""
    return next((line.strip() for line in reversed(log_tail.splitlines()) if any(w in line for w in NO_SPACE)), None)
