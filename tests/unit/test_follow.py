"""`submit --wait` follows a job with squeue alone and reads how the run ended from RUN_DIR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax_hpc.launch.follow import follow
from relax_hpc.metrics.jsonl import JsonlWriter
from relax_hpc.paths import RunPaths


def fake_slurm(tmp_path: Path, monkeypatch, states: list[str], sacct: str | None, ended: str = "") -> Path:
    """squeue that shows `states` one per call (then nothing: the job left the queue; a state
    `timeout` is a controller too busy to answer, `forgotten` one that no longer knows the job)
    and, asked with --states=all, the controller's record of the ended job (`ended`); a sacct
    that answers `sacct` or fails as on a cluster without accounting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "states").write_text("\n".join(states) + "\n")
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\ncase "$*" in *--states=all*) echo {ended}; exit 0;; esac\n'
        f"state=$(head -n1 {tmp_path}/states); sed -i 1d {tmp_path}/states\n"
        'case "$state" in\n'
        "  timeout) echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1;;\n"
        "  forgotten) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1;;\n"
        'esac\necho "$state"\n'
    )
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\n")
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
    ("sacct", "ended"), [(None, "CANCELLED"), ("CANCELLED", "")]
)  # the controller's record without accounting; sacct with it
def test_a_cancelled_job_ends_the_wait_at_once_and_says_cancelled_with_or_without_accounting(
    tmp_path, monkeypatch, sacct, ended
):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING"], sacct, ended)
    paths = run_dir(tmp_path)
    events, train = JsonlWriter(paths.events_metrics), JsonlWriter(paths.train_metrics)
    events.log({"event": "start", "step": 0})
    for step in (1, 2, 3, 4):
        train.log({"step": step, "loss": 0.1})
    events.log({"event": "end", "exit": 75, "step": 3})
    result = follow("7", paths, poll_s=0.5, sleep=lambda s: None)
    assert result.code == 1 and result.message == (
        "job 7 did not complete (cancelled: Slurm says CANCELLED): the run trained to step 4, checkpoint at step 0; "
        "the launcher stopped with a checkpoint (exit 75)"
    )


def test_a_run_killed_with_its_job_says_how_far_it_got_not_that_it_never_started(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING"], None, "TIMEOUT")
    paths = run_dir(tmp_path)
    JsonlWriter(paths.events_metrics).log({"event": "start", "step": 0})
    JsonlWriter(paths.train_metrics).log({"step": 1, "loss": 0.1})
    result = follow("8", paths, poll_s=0.5, sleep=lambda s: None)
    assert result.message == (
        "job 8 did not complete (timed out: Slurm says TIMEOUT): the run trained to step 1, checkpoint at step 0; "
        "the launcher was ended without a word (killed)"
    )


def test_the_no_progress_guard_s_reason_ends_the_wait_message(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING"], None, "FAILED")
    paths = run_dir(tmp_path)
    events = JsonlWriter(paths.events_metrics)
    events.log({"event": "start", "step": 0})
    events.log({"event": "end", "exit": 75, "step": 0})
    events.log({"event": "no_progress", "why": "not requeued: 3 allocation(s) in a row ended without a new step"})
    result = follow("5", paths, poll_s=0.5, sleep=lambda s: None)
    assert result.message == (
        "job 5 did not complete (failed: Slurm says FAILED): the run started 1 time(s) and trained no step; "
        "the launcher stopped with a checkpoint (exit 75); "
        "not requeued: 3 allocation(s) in a row ended without a new step"
    )


def test_a_job_that_never_started_says_so(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["PENDING", "CANCELLED"], None, "CANCELLED")
    result = follow("9", run_dir(tmp_path), poll_s=0.5, sleep=lambda s: None)
    assert (result.code, result.message) == (
        1,
        "job 9 did not complete (cancelled: Slurm says CANCELLED): the run never started",
    )


def test_an_eval_job_that_scored_everything_is_a_success(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING"], "COMPLETED")
    paths = run_dir(tmp_path)
    JsonlWriter(paths.eval_results).log({"model": "m", "dataset": "d", "greedy_accuracy": 0.5})
    JsonlWriter(paths.events_metrics).log({"event": "end", "exit": 1})
    assert follow("7", paths, poll_s=0, sleep=lambda _: None).code == 1  # a failed start: no success
    JsonlWriter(paths.events_metrics).log({"event": "end", "exit": 0})
    result = follow("7", paths, poll_s=0, sleep=lambda _: None)
    assert result.code == 0 and result.message == f"job 7 completed: every model x dataset scored ({paths.eval_table})"


def test_a_controller_too_busy_to_answer_does_not_end_the_wait_but_a_forgotten_job_does(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["RUNNING", "timeout", "timeout", "RUNNING", "forgotten", "RUNNING"], None)
    paths = run_dir(tmp_path)
    JsonlWriter(paths.train_metrics).log({"event": "end", "step": 6, "completed": True})
    polls: list[float] = []
    assert follow("3", paths, poll_s=1, sleep=polls.append).code == 0
    assert len(polls) == 4  # through both timeouts, up to the job the controller no longer knows


def test_a_controller_that_never_answers_ends_the_wait_after_its_patience(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, ["timeout"] * 5 + ["RUNNING"], None)
    polls: list[float] = []
    result = follow("4", run_dir(tmp_path), poll_s=1, sleep=polls.append, unanswered_polls=3)
    assert result.code == 1 and len(polls) == 2
