"""kind=sft on a real Slurm cluster through submitit: the trainer is the job's only step (no
engines, no driver), the run completes and exports the model an RL run then names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_hpc.config import load_config
from tests.slurm.jobs import REPO, describe, job_id, job_state, sacct, train_events

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_an_sft_run_is_one_trainer_step_and_exports_its_model(slurm_cluster, tmp_path):
    run_dir = tmp_path / "sft"
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / "tiny-sft.yaml"),
        f"run.dir={run_dir}", "launch.executor=slurm", "launch.slurm.trainer.nodes=1", "launch.slurm.rollout.nodes=0",
        "launch.slurm.cpus_per_node=2", "launch.slurm.time_min=10", "trainer.total_steps=8", "--wait",
    ]  # fmt: skip
    out = subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    job = job_id(run_dir)
    assert job_state(job) == "COMPLETED", describe(run_dir, job)
    steps = {r["JobName"] for r in sacct(job) if r["JobName"].startswith("relax_hpc:")}
    assert steps == {"relax_hpc:trainer"}, steps
    assert train_events(run_dir, "end")[-1]["completed"] is True
    rl = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"model.path={run_dir}"], base_dir=REPO)
    assert rl.model.path == str(run_dir / "hf") and (run_dir / "hf" / "model.safetensors").is_file()
