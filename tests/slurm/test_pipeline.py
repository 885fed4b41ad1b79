"""Pipelines on a real Slurm cluster: configs/tiny-pipeline.yaml (sft -> rl -> export -> eval), each
stage its own job waiting for the one before it (afterok); submitting it again while it runs
keeps its jobs, and once it is done submits nothing; a stage that fails cancels the rest and is
reported in one line."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_hpc.metrics.jsonl import read_jsonl
from tests.slurm.jobs import REPO, sacct, slurm

pytestmark = [pytest.mark.slurm]

SLURM = {"launch.slurm.cpus_per_node": 2, "launch.slurm.time_min": 10}


def pipeline_file(tmp_path: Path, name: str, **changes: object) -> Path:
    tree = yaml.safe_load((REPO / "configs" / "tiny-pipeline.yaml").read_text())
    tree.update({"dir": str(tmp_path / name), "executor": "slurm", "overrides": SLURM, **changes})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def run_pipeline(path: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "relax_hpc.pipeline", "--config", str(path), *args]
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_tiny_pipeline_runs_as_jobs_chained_by_afterok_and_a_resubmission_skips_it(slurm_cluster, tmp_path):
    path = pipeline_file(tmp_path, "tiny")
    out = run_pipeline(path)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = [line.split("submitted job ")[1].split(",")[0] for line in out.stdout.splitlines() if "submitted" in line]
    assert len(jobs) == 4, out.stdout
    queued = slurm("squeue", "-h", "-j", ",".join(jobs[1:]), "-o", "%i %E").splitlines()
    dependencies = dict(line.split(" ", 1) for line in queued)
    assert dependencies[jobs[-1]] == f"afterok:{jobs[-2]}(unfulfilled)", queued  # eval waits for the export
    for before, job in itertools.pairwise(jobs):  # a stage already started shows no dependency
        assert dependencies.get(job, f"afterok:{before}").startswith(f"afterok:{before}"), queued

    waited = run_pipeline(path, "--wait")  # while its jobs are queued or running: keeps them
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert waited.stdout.count("; kept") + waited.stdout.count("finished; skipped") == 4, waited.stdout
    rows = [r for job in jobs for r in sacct(job, "JobID,JobName,State,Start,End") if r["JobID"] == job]
    assert [r["JobName"] for r in rows] == ["relax_hpc-sft", "relax_hpc-rl", "relax_hpc-halfway", "relax_hpc-eval"]
    assert {r["State"] for r in rows} == {"COMPLETED"}
    assert all(later["Start"] >= earlier["End"] for earlier, later in itertools.pairwise(rows)), rows
    records = read_jsonl(tmp_path / "tiny" / "eval" / "eval" / "results.jsonl")
    assert [r["model"] for r in records] == ["sft", "rl-step-2", "rl"]

    known = slurm("sacct", "-n", "-X", "-o", "JobID").split()
    again = run_pipeline(path)
    assert again.returncode == 0 and again.stdout.count("finished; skipped") == 4, again.stdout + again.stderr
    assert slurm("sacct", "-n", "-X", "-o", "JobID").split() == known  # no job submitted
    status = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(tmp_path / "tiny")], capture_output=True, text=True, check=True
    ).stdout
    for stage, job in zip(("sft", "rl", "halfway", "eval"), jobs, strict=True):
        row = next(line for line in status.splitlines() if line.startswith(f"  {stage} "))
        assert " done " in row and f"job {job}" in row, status


def test_a_failing_stage_cancels_the_rest_and_is_reported_in_one_line(slurm_cluster, tmp_path):
    failing = {"launch.slurm.setup": ["echo 'no licence on this node' >&2; exit 3"]}
    stages = [
        {"name": "bad", "config": "configs/tiny-eval.yaml", "overrides": failing},
        {"name": "after", "config": "configs/tiny-eval.yaml"},
    ]
    out = run_pipeline(pipeline_file(tmp_path, "failing", stages=stages), "--wait")
    assert out.returncode == 1, out.stdout + out.stderr
    bad, after = (line.split("submitted job ")[1].split(",")[0] for line in out.stdout.splitlines())
    assert out.stderr.strip() == (
        f"pipeline stopped: stage bad (eval) failed, job {bad} failed: the run never started; "
        "output: no licence on this node"
    )
    assert [r["State"] for r in sacct(after, "JobID,State") if r["JobID"] == after] == ["CANCELLED"]
