"""What `submit` refuses before a job is queued, and what --dry-run shows."""

from __future__ import annotations

import os
import sys

from tests.slurm.jobs import submit


def test_dry_run_shows_the_submission_file_and_every_job_step(slurm_cluster, tmp_path):
    out = submit(
        tmp_path / "run", "launch.slurm.heterogeneous=true", "launch.slurm.rollout.partition=high", "--dry-run"
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for line in (
        "#SBATCH --signal=B:USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH hetjob",
        "#SBATCH --partition=high",
        "exec ",
    ):
        assert line in text, line
    assert text.count("srun --overlap") == 4 and "--het-group=1" in text
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_slurm_refusal_is_shown_with_what_to_change(slurm_cluster, tmp_path):
    out = submit(tmp_path / "run", "launch.slurm.trainer.nodes=9", "trainer.num_ranks=9")
    assert out.returncode == 2
    assert "Slurm refuses this job: allocation failure: Requested node configuration is not available" in out.stderr
    assert "change launch.slurm" in out.stderr
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_missing_container_image(slurm_cluster, tmp_path):
    out = submit(tmp_path / "run", f"launch.container={tmp_path / 'nope.sif'}")
    assert out.returncode == 2 and "nope.sif does not exist" in out.stderr


def test_node_local_run_dir_for_a_multi_node_run(slurm_cluster):
    out = submit(__import__("pathlib").Path(f"/dev/shm/relax-test-{os.getpid()}"))
    assert out.returncode == 2 and "is on tmpfs" in out.stderr and "shared filesystem" in out.stderr


def test_slurm_tools_missing_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # python is called by its full path
    out = submit(tmp_path / "run")
    assert out.returncode == 2 and "needs Slurm's `sbatch` on PATH" in out.stderr, out.stderr
    assert sys.executable
