"""The tiny run on a real Slurm cluster: through submitit and through an sbatch recipe, as a
heterogeneous job, across a time limit, and interrupted every way Slurm interrupts jobs."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tests.integration.conftest import Job
from tests.runs import assert_nothing_lost_or_repeated, final_records, trained_samples
from tests.slurm.jobs import (
    REPO,
    describe,
    env_with,
    job_id,
    job_state,
    last_step,
    sacct,
    slurm,
    submit,
    train_events,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROLE_STEPS = {"relax_hpc:trainer", "relax_hpc:driver", "relax_hpc:engine-0", "relax_hpc:engine-1"}


def test_submitit_run_completes_with_roles_as_job_steps(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    out = submit(run_dir, "trainer.total_steps=6", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    assert f"submitted job {job}" in out.stdout and f"run dir: {run_dir}" in out.stdout
    assert job_state(job) == "COMPLETED", describe(run_dir, job)
    rows = sacct(job)
    assert ROLE_STEPS <= {r["JobName"] for r in rows}, rows
    engines = {r["NodeList"] for r in rows if r["JobName"].startswith("relax_hpc:engine")}
    trainer = {r["NodeList"] for r in rows if r["JobName"] == "relax_hpc:trainer"}
    assert len(engines) == len(trainer) == 1 and engines != trainer  # a node each
    assert train_events(run_dir, "end")[-1] == {**train_events(run_dir, "end")[-1], "step": 6, "completed": True}


def test_sbatch_recipe_completes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "recipe"
    out = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--output={tmp_path}/%x-%j.out", "sbatch/tiny-cpu.sbatch",
         "trainer.total_steps=5", "rollout.prompts_per_step=8", "rollout.eval_every=0"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=env_with(RUN_DIR=str(run_dir), PYTHON=sys.executable),
    )  # fmt: skip
    job = out.stdout.strip().split(";")[0]
    log = next(tmp_path.glob("relax-tiny-*.out")).read_text()
    assert out.returncode == 0, out.stderr + log
    assert f"slurm job {job}, restart count 0" in log and "step 5/5" in log
    assert job_state(job) == "COMPLETED"
    assert ROLE_STEPS <= {r["JobName"] for r in sacct(job)}
    assert train_events(run_dir, "end")[-1]["completed"] is True


def test_heterogeneous_job_runs_each_role_in_its_component(slurm_cluster, tmp_path):
    run_dir = tmp_path / "het"
    out = submit(
        run_dir, "trainer.total_steps=4", "launch.slurm.heterogeneous=true",
        "launch.slurm.rollout.partition=high", "--wait",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    rows = sacct(job)
    components = {r["JobID"]: r for r in rows if r["JobID"] in (f"{job}+0", f"{job}+1")}
    assert components[f"{job}+0"]["Partition"] == "debug" and components[f"{job}+1"]["Partition"] == "high", rows
    assert components[f"{job}+0"]["NodeList"] != components[f"{job}+1"]["NodeList"]
    steps = {r["JobName"]: r["JobID"] for r in rows if r["JobName"].startswith("relax_hpc:")}
    assert steps["relax_hpc:trainer"].startswith(f"{job}+0.") and steps["relax_hpc:driver"].startswith(f"{job}+0.")
    assert steps["relax_hpc:engine-0"].startswith(f"{job}+1.") and steps["relax_hpc:engine-1"].startswith(f"{job}+1.")
    assert train_events(run_dir, "end")[-1]["completed"] is True


def test_time_limit_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """2-minute allocations, the notice 60 s before the end: the run needs at least two."""
    run_dir = tmp_path / "timelimit"
    out = submit(
        run_dir, "launch.slurm.time_min=2", "launch.slurm.signal_lead_s=60",
        "trainer.total_steps=40", "rollout.prompts_per_step=64", "--wait", timeout_s=900,
    )  # fmt: skip
    job = job_id(run_dir)
    assert out.returncode == 0, out.stdout + out.stderr + describe(run_dir, job)
    starts, ends = train_events(run_dir, "start"), train_events(run_dir, "end")
    assert len(starts) >= 2, describe(run_dir, job)
    assert [s["slurm_restart_count"] for s in starts] == list(range(len(starts)))
    assert {s["slurm_job_id"] for s in starts} == {job}
    # Each allocation stopped with a checkpoint at a step boundary; the next one began there.
    for stop, start in zip(ends, starts[1:]):
        assert stop["completed"] is False and start["step"] == stop["step"] > 0
    assert ends[-1]["completed"] is True and ends[-1]["step"] == 40
    assert "Requeued job" in describe(run_dir, job) or "timed-out" in describe(run_dir, job)
    assert_nothing_lost_or_repeated(run_dir, 40)


STEPS = 20
ON_POLICY = (f"trainer.total_steps={STEPS}", "ckpt.every_steps=3", "rollout.max_staleness=0")


def _preempt_by_partition(job: str, slurm_cluster) -> None:
    """A `high` job that needs every node: Slurm preempts ours (USR2 notice, then requeue)."""
    nodes = len(slurm_cluster.nodes)
    slurm("sbatch", "-p", "high", f"-N{nodes}", "--exclusive", "-o", "/dev/null", "--wrap", "sleep 3")


def _kill_without_checkpoint(job: str, _cluster) -> None:
    """Every process of the job SIGKILLed at once (a node crash), then the job requeued."""
    slurm("scancel", "--full", "--signal=KILL", job)
    wait_until(lambda: job_state(job) not in ("RUNNING", "COMPLETING"), 60, "the killed job to end")
    slurm("scontrol", "requeue", job)


INTERRUPTIONS = {
    "pre-timeout notice (USR2 to the batch shell)": lambda job, _c: slurm("scancel", "--batch", "--signal=USR2", job),
    "scontrol requeue (SIGTERM)": lambda job, _c: slurm("scontrol", "requeue", job),
    "partition preemption": _preempt_by_partition,
    "kill -9 of every process, then requeue": _kill_without_checkpoint,
}


def test_interrupted_every_way_reproduces_the_uninterrupted_run(slurm_cluster, tmp_path):
    rng = random.Random(7)
    reference = tmp_path / "reference"
    assert Job(reference, *ON_POLICY, "rollout.prompts_per_step=8", "rollout.eval_every=0").run(timeout_s=400) == 0

    run_dir = tmp_path / "interrupted"
    out = submit(run_dir, *ON_POLICY)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    target = 0
    for restart, (name, interrupt) in enumerate(INTERRUPTIONS.items()):
        target = wait_until(lambda: last_step(run_dir) > target and last_step(run_dir), 240, f"training before {name}", every=0.05)
        target += rng.randint(0, 1)
        wait_until(lambda: last_step(run_dir) >= target, 120, f"step {target}", every=0.05)
        interrupt(job, slurm_cluster)
        wait_until(lambda: len(train_events(run_dir, "start")) > restart + 1, 300, f"the start after {name}")
    wait_until(lambda: job_state(job) in ("COMPLETED", "FAILED", "CANCELLED"), 400, "the job to finish")
    assert job_state(job) == "COMPLETED", describe(run_dir, job)

    starts = train_events(run_dir, "start")
    assert [s["slurm_restart_count"] for s in starts] == list(range(len(INTERRUPTIONS) + 1))
    ref, got = final_records(reference), final_records(run_dir)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        # Every attempt at a step, also one an interruption threw away, computed the same loss.
        assert {r["loss"] for r in got[step]} == {ref[step][0]["loss"]}, step
        assert got[step][-1]["reward"] == ref[step][0]["reward"]
    assert trained_samples(run_dir) == trained_samples(reference)
    assert_nothing_lost_or_repeated(run_dir, STEPS)
