"""An engine whose port is taken exits with a message that says what to change."""

import socket
import subprocess

import pytest

from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from tests.integration.conftest import make_run

pytestmark = pytest.mark.integration


def test_port_in_use_is_reported(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg, paths = make_run(tmp_path / "run", f"rollout.base_port={port}")
        result = subprocess.run(
            local_commands(cfg, paths)["engine-0"],
            check=False,
            env=child_env(cfg),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "rollout.base_port" in result.stderr
