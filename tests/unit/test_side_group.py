"""The trainer-to-engines side group (relax_hpc.weights.group), between two real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from relax_hpc.weights.sender import free_port

REPO = Path(__file__).resolve().parents[2]
# A member that drops the group (as a failed push or an engine's destroy does) and exits at once.
MEMBER = """
import sys, time, torch
from relax_hpc.weights.group import SideGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = SideGroup("127.0.0.1", port, rank, 2, "t", "gloo", 30)
group.broadcast(torch.ones(1000))
if rank == 0:
    group.close_soon()
else:
    time.sleep(2)
"""


def test_a_process_that_drops_its_group_and_exits_at_once_exits_cleanly():
    """Before close_soon waited at exit, the exit cut short the gloo group's teardown on its
    thread and the process aborted ("terminate called without an active exception", exit 134)
    in 4 runs of 5 here."""
    for _ in range(2):
        port = str(free_port("127.0.0.1"))
        peer = subprocess.Popen([sys.executable, "-c", MEMBER, "1", port], cwd=REPO, stderr=subprocess.DEVNULL)
        dropper = subprocess.run(
            [sys.executable, "-c", MEMBER, "0", port], check=False, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        peer.wait(timeout=60)
        assert dropper.returncode == 0, dropper.stderr[-2000:]
        assert "terminate called" not in dropper.stderr
