"""One launcher per run on the local executor: a second launcher on a RUN_DIR whose launcher is
alive is refused in one line naming it; a launcher whose run is taken over (its roles then exit
as fenced, 76) stops instead of restarting them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from relax_hpc.fence import EXIT_FENCED, Lease, read_lease
from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import CONFIG, REPO, Job
from tests.slurm.jobs import wait_until

pytestmark = [pytest.mark.integration]
ROLES = ("trainer", "driver", "engine-0", "engine-1")


def test_a_second_launcher_is_refused_and_a_superseded_one_stops(tmp_path):
    run_dir = tmp_path / "run"
    first = Job(run_dir, "trainer.total_steps=1000", "rollout.eval_every=0").start()
    assert first.proc is not None
    try:
        # Every role started (each holds its grant): the lease is the launcher's own from here on.
        wait_until(lambda: set(ROLES) <= set(read_lease(run_dir).get("roles", {})), 120, "every role's start",
                   explain=first.text)  # fmt: skip
        argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}"]
        second = subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stdout == "", second.stdout + second.stderr
        assert second.stderr == (
            f"error: run.dir {run_dir} is run by a live launcher (pid {first.proc.pid}); stop it first (Ctrl-C "
            f"there, or kill -INT {first.proc.pid}), then start this one\n"
        )
        Lease(run_dir).new_generation()  # what another launcher's start does: its roles exit 76
        assert first.wait(timeout_s=120) == EXIT_FENCED, first.text()[-3000:]
    finally:
        if first.proc.poll() is None:
            first.kill_all()
    new_owner = f"launcher pid {os.getpid()} on {socket.gethostname()}"  # this test, named by the lease
    assert f"superseded: {new_owner} took {run_dir} over; this launcher stops without restarting" in first.text()
    events = [e["event"] for e in read_jsonl(run_dir / "metrics" / "events.jsonl")]
    assert events.count("start") == 1 and not {"role_exit", "restart", "end"} & set(events), events
