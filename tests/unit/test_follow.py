"""`submit --wait` follows a job with squeue alone and reads how the run ended from RUN_DIR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax_hpc.launch.follow import follow
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.paths import RunPaths


def fake_slurm(tmp_path: Path, monkeypatch, states: list[str], sacct: str | None) -> Path:
    """squeue that shows `states` one per call (then nothing: the job left the queue), and a
    sacct that answers `sacct` or fails as on a cluster without accounting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "states").write_text("\n".join(states) + "\n")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\nhead -n1 {tmp_path}/states\nsed -i 1d {tmp_path}/states\n")
    answer = f"echo {sacct}" if sacct else "echo 'sacct: error: accounting storage is disabled' >&2; exit 1"
    (bin_dir / "sacct").write_text(f"#!/bin/sh\n{answer}\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def run_dir(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    return paths


def test_a_job_requeued_during_start_up_that_then_completes_is_a_success(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["PENDING", "RUNNING", "REQUEUED", "PENDING", "RUNNING", "COMPLETING"], None)
    paths = run_dir(tmp_path)
    JsonlWriter(paths.events_metrics).log({"event": "end", "exit": 75, "step": 0})  # the start the requeue cut
    JsonlWriter(paths.train_metrics).log({"event": "end", "step": 6, "completed": True})
    polls: list[float] = []
    result = follow("42", paths, poll_s=0.5, sleep=polls.append)
    assert result.code == 0 and result.message == "job 42 completed: step 6"
    assert len(polls) == 6  # it waited through every state, the requeue included


@pytest.mark.parametrize(
    ("sacct", "said"),
    [(None, "job 7 did not complete: the run stopped with a checkpoint (not requeued) at step 3 (exit 75)"),
     ("CANCELLED", ("job 7 did not complete: the run stopped with a checkpoint (not requeued) at step 3 (exit 75); "
                    "Slurm says CANCELLED"))],
)  # fmt: skip
def test_a_cancelled_job_ends_the_wait_at_once_with_or_without_accounting(tmp_path, monkeypatch, sacct, said):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING"], sacct)
    paths = run_dir(tmp_path)
    JsonlWriter(paths.events_metrics).log({"event": "end", "exit": 75, "step": 3})
    result = follow("7", paths, poll_s=0.5, sleep=lambda s: None)
    assert (result.code, result.message) == (1, said)


def test_a_job_that_never_started_says_so(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["PENDING", "CANCELLED"], None)
    result = follow("9", run_dir(tmp_path), poll_s=0.5, sleep=lambda s: None)
    assert (result.code, result.message) == (1, "job 9 did not complete: the run never started")
