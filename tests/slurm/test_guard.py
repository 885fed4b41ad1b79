"""The no-progress guard inside a real job: an allocation that ends without a new step (here the
notice comes during start-up) counts, and after launch.slurm.max_idle_allocations of them the job
is not requeued again; the reason is in events.jsonl, the job's output and `submit --wait`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from tests.slurm.jobs import CONFIG, REPO, TINY_SLURM, job_id, job_log, job_state, slurm, wait_until

pytestmark = [pytest.mark.slow]


def test_a_job_that_makes_no_progress_stops_requeueing_and_says_why(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}", *TINY_SLURM,
            "trainer.total_steps=400", "launch.slurm.max_idle_allocations=1", "--wait"]  # fmt: skip
    waiting = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events = run_dir / "metrics" / "events.jsonl"
    wait_until(lambda: any(e.get("event") == "start" for e in read_jsonl(events)), 180, "the launcher's start")
    job = job_id(run_dir)
    slurm("scancel", "--batch", "--signal=USR2", job)  # the pre-timeout notice, before the first step
    _, err = waiting.communicate(timeout=300)
    why = "not requeued: 1 allocation(s) in a row ended without a new step (launch.slurm.max_idle_allocations=1)"
    assert waiting.returncode == 1 and why in err, err
    assert job_state(job).split()[0] not in ("PENDING", "RUNNING", "REQUEUED"), job_state(job)
    recorded = read_jsonl(events)
    assert [e["event"] for e in recorded if e["event"] in ("start", "end", "no_progress")] == [
        "start", "end", "no_progress"
    ]  # fmt: skip
    assert recorded[-1]["why"].startswith(why) and why in job_log(run_dir, job)
