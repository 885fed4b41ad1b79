"""What `submit` refuses before a job is queued, and what --dry-run shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.models.qwen3_family import build_qwen3_omni, build_qwen3_vl
from tests.slurm.jobs import REPO, submit


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


def test_a_time_limit_that_cannot_fit_a_step_is_refused_before_anything_is_queued(slurm_cluster, tmp_path):
    """The issue's thrashing job: 2-minute allocations with the notice 60 s before the end."""
    out = submit(tmp_path / "run", "launch.slurm.time_min=2", "launch.slurm.signal_lead_s=60")
    assert out.returncode == 2 and out.stderr.startswith("error: launch.slurm.time_min=2 (120 s) cannot fit one step")
    assert "(estimated: RUN_DIR has no steps yet)" in out.stderr and "Raise time_min to at least 3" in out.stderr
    assert not (tmp_path / "run").exists()


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


@pytest.mark.parametrize(
    ("recipe", "build", "data", "backend"),
    [
        ("qwen3-vl-4b-grpo", build_qwen3_vl, "shapes/shapes.jsonl", "megatron"),
        ("qwen3-omni-grpo", build_qwen3_omni, "beeps/beeps.jsonl", "megatron"),
    ],
)
def test_the_multimodal_gpu_recipes_validate_and_lay_out_their_jobs(
    slurm_cluster, tmp_path, recipe, build, data, backend
):
    """The recipes as a user submits them, their model and data replaced by a tiny model of the
    same family and a shipped dataset, and their GPUs by the test cluster's 2 a node (Slurm
    itself judges the job): --dry-run checks every input (each picture and clip decoded, the
    megatron layout against the model) and shows the job: its backend, SGLang engines; and
    `sbatch --test-only` takes the recipe's batch script, its GPUs and CPUs scaled to the
    cluster's nodes."""
    model = build(tmp_path / "model")
    media = "data.media={image: images}" if "shapes" in data else "data.media={audio: audios}"
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / f"{recipe}.yaml"),
        f"run.dir={tmp_path / 'run'}",
        f"model.path={model}", f"data.path={REPO / 'assets' / data}", media, "--dry-run",
        "trainer.num_ranks=1", "launch.slurm.trainer.gpus_per_node=1", "rollout.num_engines=1",
        "launch.slurm.rollout.gpus_per_node=1", "rollout.sglang.tp_size=1", "trainer.megatron.expert_parallel=1",
    ]  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "relax_hpc.engines.sglang_engine" in out.stdout and "relax_hpc.trainer.main" in out.stdout
    assert yaml.safe_load(out.stdout.split("# submission file")[0])["trainer"]["backend"] == backend
    assert not (tmp_path / "run").exists()
    script = (REPO / "sbatch" / f"{recipe}.sbatch").read_text()
    scaled = re.sub(
        r"--cpus-per-task=\d+", "--cpus-per-task=4", re.sub(r"--gpus-per-node=\d+", "--gpus-per-node=2", script)
    )
    (tmp_path / "recipe.sbatch").write_text(scaled)
    tested = subprocess.run(["sbatch", "--test-only", str(tmp_path / "recipe.sbatch")], capture_output=True,
                            text=True, check=False, timeout=60, cwd=tmp_path)  # fmt: skip
    assert tested.returncode == 0 and "to start at" in tested.stderr, tested.stderr
