"""Pipelines on a real Slurm cluster: configs/tiny-pipeline.yaml (sft -> rl -> export -> eval), each
stage its own job waiting for the one before it (afterok); the rl stage cancelled mid-training
stops the pipeline, and submitting it again resumes there (the finished stage skipped, the rl
run from the checkpoint its cancel wrote) and, once done, submits nothing; a stage that fails
cancels the rest and is reported in one line."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.pipeline import render, status
from tests.runs import assert_nothing_lost_or_repeated
from tests.slurm.jobs import REPO, last_step, sacct, slurm, train_events, wait_until

pytestmark = [pytest.mark.slurm]

SLURM = {"launch.slurm.cpus_per_node": 2, "launch.slurm.time_min": 10}
STAGES = ("sft", "rl", "halfway", "eval")
RL_STEPS = 12  # long enough to be cancelled mid-training (at step 3 or 4)


def pipeline_file(tmp_path: Path, name: str, rl_steps: int = 4, **changes: object) -> Path:
    tree = yaml.safe_load((REPO / "configs" / "tiny-pipeline.yaml").read_text())
    tree.update({"dir": str(tmp_path / name), "executor": "slurm", "overrides": SLURM, **changes})
    if "stages" not in changes:  # rl: what every step trained kept, every checkpoint kept (halfway exports step 2)
        rl = {"trainer.total_steps": rl_steps, "ckpt.keep_trained_batches": True, "ckpt.keep": rl_steps}
        tree["stages"][1]["overrides"] |= rl
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def run_pipeline(path: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "relax_hpc.pipeline", "--config", str(path), *args]
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)


def submitted(out: subprocess.CompletedProcess) -> dict[str, str]:
    """Stage -> the job this submission gave it."""
    lines = [line for line in out.stdout.splitlines() if "submitted job " in line]
    return {line.split()[1]: line.split("submitted job ")[1].split(",")[0] for line in lines}


def test_the_tiny_pipeline_chained_by_afterok_resumes_at_a_cancelled_stage_and_then_submits_nothing(
    slurm_cluster, tmp_path
):
    path, root = pipeline_file(tmp_path, "tiny", rl_steps=RL_STEPS), tmp_path / "tiny"
    out = run_pipeline(path)
    assert out.returncode == 0, out.stdout + out.stderr
    first = submitted(out)
    jobs = [first[stage] for stage in STAGES]
    queued = slurm("squeue", "-h", "-j", ",".join(jobs[1:]), "-o", "%i %E").splitlines()
    dependencies = dict(line.split(" ", 1) for line in queued)
    assert dependencies[jobs[-1]] == f"afterok:{jobs[-2]}(unfulfilled)", queued  # eval waits for the export
    for before, job in itertools.pairwise(jobs):  # a stage already started shows no dependency
        assert dependencies.get(job, f"afterok:{before}").startswith(f"afterok:{before}"), queued

    wait_until(lambda: last_step(root / "rl") >= 3, 300, "the rl stage's step 3")
    slurm("scancel", first["rl"])  # SIGTERM mid-training (a checkpoint first): the pipeline stops there
    stopped = wait_until(lambda: render(status(root)).splitlines()[-1].startswith("pipeline stopped"), 60, "a stop")
    assert stopped and render(status(root)).splitlines()[-1].startswith(
        f"pipeline stopped at stage rl (rl): job {first['rl']} cancelled: "
    )
    resumed = run_pipeline(path, "--wait")  # sft kept (or skipped, once done); rl on from there
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    again = submitted(resumed)
    assert sorted(again) == ["eval", "halfway", "rl"], resumed.stdout
    jobs = [first["sft"], *(again[stage] for stage in STAGES[1:])]
    rows = [r for job in jobs for r in sacct(job, "JobID,JobName,State,Start,End") if r["JobID"] == job]
    assert [r["JobName"] for r in rows] == [f"relax_hpc-{stage}" for stage in STAGES]
    assert {r["State"] for r in rows} == {"COMPLETED"}
    assert all(later["Start"] >= earlier["End"] for earlier, later in itertools.pairwise(rows)), rows
    old = [r["State"].split()[0] for s in STAGES[1:] for r in sacct(first[s], "JobID,State") if r["JobID"] == first[s]]
    assert old == ["CANCELLED"] * 3
    starts = train_events(root / "rl", "start")  # the rl run went on from where the cancel stopped it
    assert len(starts) == 2 and starts[1]["step"] == train_events(root / "rl", "end")[0]["step"] >= 3, starts
    assert_nothing_lost_or_repeated(root / "rl", RL_STEPS)
    records = read_jsonl(root / "eval" / "eval" / "results.jsonl")
    assert [r["model"] for r in records] == ["sft", "rl-step-2", "rl"]

    known = slurm("sacct", "-n", "-X", "-o", "JobID").split()
    out = run_pipeline(path)
    assert out.returncode == 0 and out.stdout.count("finished; skipped") == 4, out.stdout + out.stderr
    assert slurm("sacct", "-n", "-X", "-o", "JobID").split() == known  # no job submitted
    shown = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(root)], capture_output=True, text=True, check=True
    ).stdout
    for stage, job in zip(STAGES, jobs, strict=True):
        row = next(line for line in shown.splitlines() if line.startswith(f"  {stage} "))
        assert " done " in row and f"job {job}" in row, shown


def test_a_failing_stage_cancels_the_rest_and_is_reported_in_one_line(slurm_cluster, tmp_path):
    failing = {"launch.slurm.setup": ["echo 'no licence on this node' >&2; exit 3"]}
    stages = [
        {"name": "bad", "config": "configs/tiny-eval.yaml", "overrides": failing},
        {"name": "after", "config": "configs/tiny-eval.yaml"},
    ]
    out = run_pipeline(pipeline_file(tmp_path, "failing", stages=stages), "--wait")
    assert out.returncode == 1, out.stdout + out.stderr
    bad, after = submitted(out)["bad"], submitted(out)["after"]
    assert out.stderr.strip() == (
        f"pipeline stopped at stage bad (eval): job {bad} failed: the run never started; "
        "output: no licence on this node"
    )
    assert [r["State"] for r in sacct(after, "JobID,State") if r["JobID"] == after] == ["CANCELLED"]
