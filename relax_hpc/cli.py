"""What every command-line entry point shares: a reader that closes the pipe early
(`python -m relax_hpc.status RUN_DIR | head`) ends the command quietly, as it ends `ls`, instead
of with a BrokenPipeError traceback; a full disk ends it in one line that names the file."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command that a closed pipe ended
EXIT_NO_SPACE = 75  # a write found no space: stopped, resumable (relax_hpc.launch.supervisor.EXIT_STOPPED)


def run(main: Callable[[], int | None]) -> None:
    """Run `main` and exit with its status (141 once its reader has gone)."""
    try:
        code = main()
        sys.stdout.flush()  # inside the try: what is still buffered meets the closed pipe here
    except BrokenPipeError:
        # Python flushes stdout once more at exit: point it somewhere that takes the bytes
        # (Python's documentation, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A full disk is the user's to fix, not a fault of the program: one line, and the status
        # of a stopped run, which the same command resumes once space is freed.
        print(f"error: {e.filename or 'a file'}: {e.strerror}; free space and run the same command", file=sys.stderr)
        code = EXIT_NO_SPACE
    sys.exit(code)
