"""One owner per run (launch.owner): the submission claim (an exclusive create, taken over once its
process is gone or it is stale) and the local launcher's flock, released whatever ends its holder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from relax_hpc.config.load import ConfigError
from relax_hpc.launch.owner import CLAIM_STALE_S, hold_local_launcher, take_claim
from relax_hpc.paths import RunPaths


def claimed_by(host: str, pid: int, age_s: float = 0.0) -> str:
    return json.dumps({"host": host, "pid": pid, "time": time.time() - age_s})


def test_a_claim_is_taken_once_and_again_only_when_its_holder_is_gone_or_it_is_stale(tmp_path):
    claim = tmp_path / "slurm" / "job_id.claim"
    assert take_claim(claim) and not take_claim(claim)  # this live process holds it
    gone = subprocess.Popen(["true"])
    gone.wait()
    claim.write_text(claimed_by(socket.gethostname(), gone.pid))  # a submission that died here
    assert take_claim(claim) and json.loads(claim.read_text())["pid"] == os.getpid()
    claim.write_text(claimed_by("login2", 1))  # another host's, fresh: its process is not ours to judge
    assert not take_claim(claim)
    claim.write_text(claimed_by("login2", 1, age_s=CLAIM_STALE_S + 1))
    assert take_claim(claim) and [p.name for p in claim.parent.iterdir()] == [claim.name]


def test_a_second_local_launcher_is_refused_until_the_first_lets_go(tmp_path):
    paths = RunPaths(tmp_path / "run")
    first = hold_local_launcher(paths)
    with pytest.raises(ConfigError, match=rf"is run by a live launcher \(pid {os.getpid()}\)"):
        hold_local_launcher(paths)  # another open file: its flock conflicts even in this process
    os.close(first)  # what the kernel does when the launcher ends, SIGKILL included
    os.close(hold_local_launcher(paths))
