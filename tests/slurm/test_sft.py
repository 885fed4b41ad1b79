"""kind=sft on a real Slurm cluster through submitit: the pre-timeout notice checkpoints,
requeues and resumes the run exactly; the trainer is the job's only step (no engines, no driver),
and the run exports the model an RL run then names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_hpc.config import load_config
from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import Job
from tests.slurm.jobs import (
    REPO,
    describe,
    finished,
    job_id,
    job_state,
    last_step,
    sacct,
    slurm,
    train_events,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


CONFIG = REPO / "configs" / "tiny-sft.yaml"
SLURM = ("launch.executor=slurm", "launch.slurm.trainer.nodes=1", "launch.slurm.rollout.nodes=0",
         "launch.slurm.cpus_per_node=2", "launch.slurm.time_min=10")  # fmt: skip


def submit_sft(run_dir, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "relax_hpc.submit", "--config", str(CONFIG), f"run.dir={run_dir}", *SLURM, *args]
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_an_sft_job_requeued_by_the_notice_resumes_exactly_and_exports_its_model(slurm_cluster, tmp_path):
    common = ("trainer.total_steps=40", "ckpt.every_steps=1000", "sft.batch_size=8")
    reference = tmp_path / "reference"  # uninterrupted, on this machine
    assert Job(reference, *common, config=CONFIG).run(timeout_s=300) == 0
    run_dir = tmp_path / "requeued"
    out = submit_sft(run_dir, *common)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    wait_until(lambda: last_step(run_dir) >= 3, 300, "step 3")
    slurm("scancel", "--batch", "--signal=USR2", job)  # what --signal=B:USR2@N sends before the limit
    wait_until(lambda: finished(job), 400, "the job to finish", every=1)
    assert job_state(job) == "COMPLETED", describe(run_dir, job)
    starts, ends = train_events(run_dir, "start"), train_events(run_dir, "end")
    assert [s["slurm_restart_count"] for s in starts] == [0, 1]
    # Checkpointed at the notice (not at every_steps), resumed there: the data position came back.
    assert ends[0]["completed"] is False and 3 <= starts[1]["step"] == ends[0]["step"] < 40
    assert ends[-1]["completed"] is True
    steps = {r["JobName"] for r in sacct(job) if r["JobName"].startswith("relax_hpc:")}
    assert steps == {"relax_hpc:trainer"}, steps  # no engines, no driver
    rl = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"model.path={run_dir}"], base_dir=REPO)
    assert rl.model.path == str(run_dir / "hf") and (run_dir / "hf" / "model.safetensors").is_file()

    def losses(d):
        return [(r["step"], r["loss"]) for r in read_jsonl(d / "metrics" / "train.jsonl") if "loss" in r]

    assert losses(run_dir) == losses(reference)
