"""The tiny run on a real Slurm cluster: through submitit and through an sbatch recipe, as a
heterogeneous job, across a time limit, and interrupted every way Slurm interrupts jobs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from relax_hpc.exchange.spool import read_batch
from relax_hpc.launch.recover import recover
from relax_hpc.metrics.accounting import accounting
from relax_hpc.metrics.jsonl import JsonlWriter, read_jsonl
from relax_hpc.paths import RunPaths
from tests.integration.conftest import Job
from tests.runs import assert_nothing_lost_or_repeated, assert_reproduces
from tests.slurm.jobs import (
    CONFIG,
    REPO,
    TINY_SLURM,
    describe,
    env_with,
    finished,
    job_id,
    job_log,
    job_state,
    last_step,
    no_accounting,
    sacct,
    slurm,
    status,
    submit,
    train_events,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROLE_STEPS = {"relax_hpc:trainer", "relax_hpc:driver", "relax_hpc:engine-0", "relax_hpc:engine-1"}


def test_submitit_run_completes_with_roles_as_job_steps_and_its_pictures(slurm_cluster, tmp_path):
    """The tiny vision run through submitit (one job for both proofs: a job start costs more than
    its steps): roles as job steps on their own nodes, sacct's hours in the run's accounting, and
    the pictures seen alike by engines and trainer ranks on the cluster."""
    run_dir = tmp_path / "run"
    config = REPO / "configs" / "tiny-vision-grpo.yaml"
    out = submit(run_dir, "trainer.total_steps=4", "rollout.prompts_per_step=4", "--wait", config=config)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    assert f"submitted job {job}" in out.stdout and f"run dir: {run_dir}" in out.stdout
    assert job_state(job) == "COMPLETED", describe(run_dir, job)
    rows = sacct(job)
    assert {r["JobName"] for r in rows} >= ROLE_STEPS, rows
    engines = {r["NodeList"] for r in rows if r["JobName"].startswith("relax_hpc:engine")}
    trainer = {r["NodeList"] for r in rows if r["JobName"] == "relax_hpc:trainer"}
    assert len(engines) == len(trainer) == 1 and engines != trainer  # a node each
    assert train_events(run_dir, "end")[-1] == {**train_events(run_dir, "end")[-1], "step": 4, "completed": True}
    assert_accounting_matches_sacct(run_dir, job)
    steps = [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["media_mismatched_groups"] == 0 for r in steps)  # engines and trainer ranks agree on every picture
    assert (run_dir / "hf" / "preprocessor_config.json").is_file()  # the export carries the processor


def hours(rows: list[dict[str, str]], resource: str) -> float:
    """Elapsed x the resource's count in AllocTRES, summed, in hours: what sacct charged."""
    count = lambda r: float(dict(f.split("=") for f in r["AllocTRES"].split(",") if f).get(resource, 0))  # noqa: E731
    return sum(int(r["ElapsedRaw"]) * count(r) for r in rows) / 3600


def assert_accounting_matches_sacct(run_dir, job: str) -> None:
    """The run's hours per role are sacct's, step by step; `status` and the summary show them."""
    rows = sacct(job, "JobID,JobName,ElapsedRaw,AllocTRES")
    usage = accounting(RunPaths(run_dir))
    assert usage["source"] == "sacct" and set(usage["roles"]) == {"trainer", "driver", "engine"}, usage
    for kind in usage["roles"]:
        steps = [r for r in rows if r["JobName"].startswith(f"relax_hpc:{kind}")]
        assert usage["roles"][kind]["cpu_h"] == pytest.approx(hours(steps, "cpu"), rel=1e-6), (kind, rows)
        assert usage["roles"][kind]["cpu_h"] > 0 and usage["roles"][kind]["gpu_h"] == 0.0
    allocations = [r for r in rows if r["JobID"] == job]
    assert usage["total"]["cpu_h"] == pytest.approx(hours(allocations, "cpu"), rel=1e-6) and usage["total"]["cpu_h"] > 0
    samples = sum(r["samples"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if "loss" in r)
    assert usage["samples_per_cpu_h"] == pytest.approx(samples / usage["total"]["cpu_h"])
    out = subprocess.run([sys.executable, "-m", "relax_hpc.status", str(run_dir)], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout  # fmt: skip
    assert f"usage:       trainer 0.000 GPU-h, {usage['roles']['trainer']['cpu_h']:.3f} CPU-h" in out, out
    assert f"(sacct); {samples} samples, {usage['samples_per_cpu_h']:.0f} per CPU-hour" in out, out


def test_sbatch_recipe_requeues_itself_and_completes(slurm_cluster, tmp_path):
    """The recipe's own launcher: the pre-timeout notice mid-run, then a resumed run to the end."""
    run_dir = tmp_path / "recipe"
    # Roles failed twice on n1 by its fault (the launcher's own records): the requeue leaves n1 out.
    events = JsonlWriter(run_dir / "metrics" / "events.jsonl")
    for _ in range(2):
        events.log({"event": "role_exit", "role": "engine-0", "exit": 1, "restarts": 0, "action": "restart",
                    "nodes": ["n1"], "last_line": "", "hung": None,
                    "node_fault": {"node": "n1", "cause": "NODE_FAIL"}})  # fmt: skip
    job = slurm(
        "sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", "sbatch/tiny-cpu.sbatch",
        "trainer.total_steps=8", "rollout.prompts_per_step=8", "rollout.eval_every=0", "ckpt.keep_trained_batches=true",
        cwd=REPO, env=env_with(RUN_DIR=str(run_dir), PYTHON=sys.executable),
    ).strip()  # fmt: skip
    wait_until(lambda: last_step(run_dir) >= 2, 300, "step 2")
    slurm("scancel", "--batch", "--signal=USR2", job)  # what --signal=B:USR2@60 sends
    output = lambda: "\n".join(p.read_text(errors="replace") for p in tmp_path.glob("relax-tiny-*.out"))  # noqa: E731
    story = lambda: slurm("scontrol", "-o", "show", "job", job) + output()[-3000:]  # noqa: E731
    wait_until(lambda: finished(job), 400, "the job to finish", every=1, explain=story)
    log = output()
    assert job_state(job) == "COMPLETED", log[-3000:]
    for line in (
        f"slurm job {job}, restart count 0",
        "USR2 (time limit or preemption ahead)",
        f"requeued job {job}",
        f"bad node(s) n1 excluded from job {job}'s next start",
        f"slurm job {job}, restart count 1",
        "step 8/8",
    ):
        assert line in log, line
    assert {r["JobName"] for r in sacct(job)} >= ROLE_STEPS
    # The launcher requeued its job held until its exclude list was set: the second start avoided n1.
    second = [r["NodeList"] for r in sacct(job, "JobID,NodeList") if r["JobID"] == job][-1]
    assert "n1" not in slurm("scontrol", "show", "hostnames", second).split(), second
    assert "ExcNodeList=n1" in slurm("scontrol", "-o", "show", "job", job).split()
    starts, ends = train_events(run_dir, "start"), train_events(run_dir, "end")
    assert [s["slurm_restart_count"] for s in starts] == [0, 1]
    assert ends[0]["completed"] is False and starts[1]["step"] == ends[0]["step"] >= 2
    assert ends[-1]["completed"] is True
    assert_nothing_lost_or_repeated(run_dir, 8)


def test_heterogeneous_job_runs_each_role_in_its_component(slurm_cluster, tmp_path):
    """The trainer and driver in component 0, the engines in component 1: the rollout engines and
    a distillation teacher's engine (algo.teacher.num_engines), each a job step of its own."""
    run_dir = tmp_path / "het"
    teacher = REPO / "assets" / "tiny-qwen3-addition-teacher"
    out = submit(
        run_dir, "trainer.total_steps=4", "launch.slurm.heterogeneous=true",
        "launch.slurm.rollout.partition=high", "algo.advantage.estimator=distill", f"algo.teacher.path={teacher}",
        "algo.teacher.num_engines=1", "ckpt.keep_trained_batches=true", "--wait",
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
    assert steps["relax_hpc:teacher-0"].startswith(f"{job}+1.")
    assert train_events(run_dir, "end")[-1]["completed"] is True
    trained = [read_batch(p) for p in (run_dir / "spool" / "claimed").glob("step-*/b*.h5")]
    assert trained and all(b.teacher_logprobs is not None for b in trained)


def test_time_limit_checkpoints_requeues_and_resumes_then_a_cancel_is_reported(slurm_cluster, tmp_path):
    """2-minute allocations with the notice 30 s before the end: Slurm checks limits about every
    30 s, so the notice comes 60-90 s after the start, and the run (longer than that) must be
    stopped, requeued and resumed by its own launcher. `submit --wait`, on a client without
    accounting, follows the requeue; after a scancel of the resumed run it ends soon and says
    that the job was cancelled and how far the run got, and `status` says so too, with
    accounting and without (one job for both: a start costs more than its steps)."""
    run_dir = tmp_path / "timelimit"
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}", *TINY_SLURM,
        "launch.slurm.time_min=2", "launch.slurm.signal_lead_s=30",
        "trainer.total_steps=1000", "rollout.prompts_per_step=64", "ckpt.keep_trained_batches=true",
        "metrics.clearml.enabled=true", "metrics.clearml.offline=true", "metrics.tensorboard=true", "--wait",
    ]  # fmt: skip
    env = no_accounting(tmp_path)
    waiting = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until((run_dir / "slurm" / "job_id").is_file, 120, "the submission")
        job = job_id(run_dir)
        resumed = wait_until(lambda: train_events(run_dir, "start")[1:], 400, "the start after the time limit")[0]
        wait_until(lambda: last_step(run_dir) >= resumed["step"] + 2, 120, "steps after the restart")
        assert waiting.poll() is None, "submit --wait ended at the requeue"
        slurm("scancel", job)  # SIGTERM: the trainer checkpoints before Slurm kills it
        cancelled = time.monotonic()
        _, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert time.monotonic() - cancelled < 60, "submit --wait outlived the cancelled job"
    assert waiting.returncode == 1, err
    said = f"job {job} did not complete (cancelled: Slurm says CANCELLED): the run trained to step "
    assert said in err and "checkpoint at step " in err and "never started" not in err, err
    # The cluster's KillWait is 5 s: under load the step under way and the stop's checkpoint may
    # not both fit in it (CI at c471bd7), and Slurm's SIGKILL then leaves ckpt/.step-N.tmp, which
    # no start reads: recover() below rolls back to the last complete checkpoint.
    wait_until(lambda: finished(job), 60, "the end")
    cut = bool(list(run_dir.glob("ckpt/.step-*")))
    for client in (env, None):  # without accounting (the controller's record), with it (sacct)
        text = status(run_dir, client)
        assert "state:       running" not in text and f"slurm:       job {job}: CANCELLED" in text, text

    starts, ends = train_events(run_dir, "start"), train_events(run_dir, "end")
    assert [s["slurm_restart_count"] for s in starts] == [0, 1] and {s["slurm_job_id"] for s in starts} == {job}
    # The first allocation stopped with a checkpoint at a step boundary; the second began there.
    assert ends[0]["completed"] is False and starts[1]["step"] == ends[0]["step"] > 0
    log = job_log(run_dir, job)
    assert "this job is timed-out" in log and f"Requeued job {job}" in log, describe(run_dir, job)
    # One copy of each message: submitit's warnings once (they went to stdout and stderr, both
    # into this file), and the launcher's own lines once.
    assert log.count("Caught signal SIGUSR2") == 1 and log.count("asking the trainer to checkpoint") == 2, log
    # ClearML: the requeued allocation reopened the run's task (offline session), not a second one.
    clearml = run_dir / "clearml"
    task_id = (clearml / "task_id.offline").read_text().strip()
    assert [p.name for p in (clearml / "offline").iterdir() if p.is_dir()] == [task_id]
    events = [e for line in (clearml / "offline" / task_id / "metrics.jsonl").read_text().splitlines()
              for e in json.loads(line)]  # fmt: skip
    steps = {e["iter"] for e in events if e.get("variant") == "reward" and e.get("metric") == "train"}
    assert {starts[1]["step"], starts[1]["step"] + 1} <= steps and min(steps) == 1
    recovery = recover(RunPaths(run_dir))  # what the next start would do after the cancel
    assert recovery.step >= starts[1]["step"]
    # After a cut checkpoint the batches past the rollback wait for the next start to make them again.
    assert_nothing_lost_or_repeated(run_dir, recovery.step, regenerated=not cut)


STEPS = 12
# Trained batches are kept (ckpt.keep_trained_batches): the checks read what every step trained.
ON_POLICY = (
    f"trainer.total_steps={STEPS}", "ckpt.every_steps=3", "rollout.max_staleness=0", "ckpt.keep_trained_batches=true"
)  # fmt: skip


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
        target = wait_until(
            lambda target=target: last_step(run_dir) > target and last_step(run_dir),
            240,
            f"training before {name}",
            every=0.05,
        )
        target += rng.randint(0, 1)
        wait_until(lambda target=target: last_step(run_dir) >= target, 120, f"step {target}", every=0.05)
        interrupt(job, slurm_cluster)
        wait_until(
            lambda restart=restart: len(train_events(run_dir, "start")) > restart + 1, 300, f"the start after {name}"
        )
    wait_until(lambda: finished(job), 400, "the job to finish")
    assert job_state(job) == "COMPLETED", describe(run_dir, job)

    starts = train_events(run_dir, "start")
    assert [s["slurm_restart_count"] for s in starts] == list(range(len(INTERRUPTIONS) + 1))
    # Only the preemption is recorded as one: the no-progress guard passes that allocation over.
    preempted = {e["slurm_restart_count"] for e in read_jsonl(run_dir / "metrics" / "events.jsonl")
                 if e["event"] == "preempted"}  # fmt: skip
    assert preempted == {list(INTERRUPTIONS).index("partition preemption")}, preempted
    assert_reproduces(reference, run_dir, STEPS)
    assert_nothing_lost_or_repeated(run_dir, STEPS)
