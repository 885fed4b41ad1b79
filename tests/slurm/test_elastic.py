"""Elastic rollout through Slurm jobs on the test cluster: an engine job joins a running
training, is requeued by Slurm (as a preemption would) and rejoins, then leaves by `scale in
--job`; and `submit --wait` through a requeue during start-up (a cancelled run's report, with and without
accounting: tests/slurm/test_runs.py, the time-limit test). Nothing is lost or trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from relax_hpc.launch.supervisor import EXIT_FAILED
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.protocol.registry import read_records
from tests.runs import assert_nothing_lost_or_repeated
from tests.slurm.jobs import CONFIG, REPO, TINY_SLURM, job_id, job_state, run_story, slurm, submit, wait_until

pytestmark = [pytest.mark.slow]
STEPS = 2000  # never reached: the test stops the run once the elastic job has come and gone


def scale(run_dir, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def state_of(run_dir, op_id: str) -> str:
    return {r["id"]: r["state"] for r in json.loads(scale(run_dir, "list", "--json"))}[op_id]


def test_an_elastic_engine_job_joins_is_requeued_rejoins_and_leaves(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    out = submit(run_dir, f"trainer.total_steps={STEPS}", "ckpt.every_steps=5", "ckpt.keep_trained_batches=true",
                 "rollout.num_engines=1")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    main = job_id(run_dir)
    wait_until(lambda: (run_dir / "metrics" / "train.jsonl").is_file() and any(
        "loss" in r for r in read_jsonl(run_dir / "metrics" / "train.jsonl")), 300, "the first step")  # fmt: skip
    said = scale(run_dir, "out", "--engines", "1", "--id", "el")
    elastic = said.split("job ")[1].split(";")[0]
    wait_until(lambda: state_of(run_dir, "el") == "active", 240, "the elastic engine to hold the current weights")
    wait_until(lambda: any(r.get("engines") == 2 for r in read_jsonl(run_dir / "metrics" / "rollout.jsonl")), 120,
               "the driver to use the elastic engine")  # fmt: skip
    slurm("scontrol", "requeue", elastic)  # what a preemption does to it
    wait_until(lambda: not any(r.engine_id == "el-0" for r in read_records(run_dir / "registry" / "engines")), 120,
               "the requeued engine to leave")  # fmt: skip
    wait_until(lambda: state_of(run_dir, "el") == "active", 300, "the elastic engine to rejoin")
    scale(run_dir, "in", "--job", elastic, "--drain-timeout-s", "30")
    wait_until(lambda: job_state(elastic).split()[0] in ("COMPLETED", "CANCELLED"), 120, "the elastic job to end")
    assert state_of(run_dir, "el") == "cancelled"
    # The run is far from its last step (no race with the elastic job's timing): stop it here.
    (run_dir / "control" / "stop").write_text("stop")
    wait_until(lambda: not job_state(main).startswith(("RUNNING", "PENDING", "COMPLETING")), 300, "the run to stop",
               explain=lambda: f"{job_state(main)}\n{run_story(run_dir)}")  # fmt: skip
    end = [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if r.get("event") == "end"][-1]
    assert not end["completed"] and end["step"] < STEPS
    assert_nothing_lost_or_repeated(run_dir, end["step"])


def test_submit_wait_follows_a_job_requeued_during_start_up_to_its_completion(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}", *TINY_SLURM,
            "trainer.total_steps=4", "--wait"]  # fmt: skip
    waiting = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until((run_dir / "slurm" / "job_id").is_file, 120, "the submission")
    job = job_id(run_dir)
    wait_until(lambda: job_state(job) == "RUNNING", 120, "the job to run")
    time.sleep(2)  # in its start-up
    slurm("scontrol", "requeue", job)
    out, err = waiting.communicate(timeout=600)
    assert waiting.returncode == 0, out + err
    assert f"job {job} completed: step 4" in out
    # The start the requeue cut stopped (75), it did not fail (1): Slurm's SIGTERM reached the trainer too.
    exits = [e["exit"] for e in read_jsonl(run_dir / "metrics" / "events.jsonl") if e.get("event") == "end"]
    assert exits[-1] == 0 and EXIT_FAILED not in exits, exits
