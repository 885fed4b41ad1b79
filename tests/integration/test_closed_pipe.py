"""A command whose reader has gone (`python -m relax_hpc.status RUN_DIR | head`) ends quietly:
no BrokenPipeError traceback, the shell's status for a command a closed pipe ended (141)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax_hpc.cli import EXIT_BROKEN_PIPE
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.integration


def test_a_command_whose_reader_closed_the_pipe_ends_quietly(tmp_path):
    """status; every entry point that prints goes through relax_hpc.cli.run the same way."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text(to_yaml(load_config(None)))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        argv = [sys.executable, "-m", "relax_hpc.status", str(paths.root)]
        out = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (EXIT_BROKEN_PIPE, ""), out.stderr
