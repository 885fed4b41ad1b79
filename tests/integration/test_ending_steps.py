"""Ending a role on Slurm cancels its job step once per end of the role, and gives up on a step
Slurm never drops within the bound (two rounds and the wait for the role's own processes).

A step that no cancel removes (a process stuck in the kernel) cannot be made on demand, so
`squeue` and `scancel` are stand-ins here, first on PATH: squeue lists the role's steps whatever
was cancelled, scancel records its calls. Everything else is the launcher's own: its health
monitor finds the roles (plain `sleep`s, never up) hung in their start-up and kills them, the
engine is restarted, the trainer's end ends the run."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from relax_hpc import status
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.launch.causes import exit_cause
from relax_hpc.launch.steps import PROCESS_WAIT_S
from relax_hpc.launch.supervisor import EXIT_FAILED, Supervisor
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.integration

JOB, ROUND_S = "7", 0.5
STEPS = {"7.0": "relax_hpc:engine-0", "7.1": "relax_hpc:trainer"}


def stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f'#!/bin/sh\necho "$(date +%s.%N) {name} $*" >> {folder}/calls\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_a_step_slurm_never_drops_is_ended_once_per_role_end_and_given_up_within_the_bound(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "\\n".join(f"{step}|{name}" for step, name in STEPS.items())
    stand_in(bin_dir, "squeue", f'case "$*" in *" -s "*) printf "{listing}\\n";; *) echo {JOB};; esac')
    stand_in(bin_dir, "scancel", "")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = load_config(
        None,
        ["launch.health.startup_timeout_s=1", "launch.health.restart_backoff_s=0", "launch.health.trainer_restarts=0"],
    )
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    commands = {"engine-0": ["sleep", "600"], "trainer": ["sleep", "600"]}
    supervisor = Supervisor(cfg, paths, lambda: commands, out=io.StringIO(), slurm_job=JOB, step_round_s=ROUND_S)

    assert supervisor.run() == EXIT_FAILED

    cancels = [line.split()[2:] for line in (bin_dir / "calls").read_text().splitlines() if " scancel " in line]
    first_rounds = [args for args in cancels if not args[0].startswith("--signal")]
    ends = {name: sum(step in args for args in first_rounds) for step, name in STEPS.items()}
    # The engine: killed as hung, then ended at the run's end after its restart (not again
    # before its restart); the trainer: killed as hung, not again as the run ends.
    assert ends == {"relax_hpc:engine-0": 2, "relax_hpc:trainer": 1}, cancels
    assert len(cancels) == 2 * len(first_rounds)  # each end escalates once (--signal=KILL), then gives up
    events = read_jsonl(paths.events_metrics)
    given_up = [e for e in events if e["event"] == "step_not_ended"]
    assert [e["role"] for e in given_up] == ["engine-0", "trainer", "roles"], given_up
    for hung in (e for e in events if e["event"] == "role_hung"):
        (end,) = [e for e in given_up if e["role"] == hung["role"]]
        assert end["time"] - hung["time"] < 2 * ROUND_S + PROCESS_WAIT_S + 5  # the bound, with a margin
    # status names each exit's cause, not the role's last log line
    restarts = [line for line in status.render(status.collect(paths.root)).splitlines() if line.startswith("restart:")]
    assert restarts[0].startswith("restart:     engine-0: hung: not up"), restarts
    assert restarts[-1].startswith("restart:     trainer: hung: not up"), restarts
    assert restarts[-1].endswith("(restart_run)"), restarts


def test_an_exit_is_named_by_its_cause():
    assert exit_cause(-9) == "killed by SIGKILL"
    assert exit_cause(137) == "exit 137 (SIGKILL)"  # srun: 128 + the signal that ended a task
    assert exit_cause(76).startswith("fenced")
    assert exit_cause(3) == "exit 3"
    assert exit_cause(0, hung="no heartbeat for 130 s (hung)") == "hung: no heartbeat for 130 s (hung)"
