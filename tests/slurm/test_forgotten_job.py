"""`status` without accounting, once Slurm has forgotten the run's job (MinJobAge): a scancel
leaves the launcher time to record its end, which status then shows; a launcher SIGKILLed (as a
node's loss, the OOM killer or KillWait's end do) leaves a start without an end, which status
shows ended, with when and how it was last seen, not "running" with an ETA, and whose hours the
usage lines name as not counted. On a cluster of its own (forgetful_cluster), up in about a
second; the run never gets past its start-up, which is all this needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from relax_hpc.metrics.jsonl import read_jsonl
from tests.slurm.jobs import job_id, run_story, slurm, status, submit, wait_until


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "metrics" / "events.jsonl") if e.get("event") == kind]


def forgotten(job: str, env: dict[str, str]) -> bool:
    """Slurm's controller no longer knows the job (and there is no accounting to ask)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env, check=False)
    return out.returncode != 0 and "Invalid job id" in out.stderr


def started(run_dir: Path, starts: int) -> bool:
    return len(events(run_dir, "start")) >= starts and (run_dir / "health" / "launcher.json").is_file()


def test_a_run_whose_job_slurm_forgot_shows_its_end_or_when_it_was_last_seen(forgetful_cluster, tmp_path):
    env, run_dir = forgetful_cluster, tmp_path / "run"
    story = lambda: run_story(run_dir)  # noqa: E731
    out = submit(run_dir, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    first = job_id(run_dir)
    wait_until(lambda: started(run_dir, 1), 120, "the launcher's start", explain=story)
    slurm("scancel", first, env=env)  # SIGTERM: the launcher records its end before Slurm's SIGKILL
    wait_until(lambda: not slurm("squeue", "-h", "-j", first, env=env).strip(), 60, "the cancelled job's end")
    assert events(run_dir, "end")[-1]["time"] > events(run_dir, "start")[-1]["time"], story()

    out = submit(run_dir, env=env)  # the same command resumes
    assert out.returncode == 0, out.stdout + out.stderr
    second = job_id(run_dir)
    wait_until(lambda: started(run_dir, 2), 120, "the second start", explain=story)
    # The launcher (the batch shell) SIGKILLed, as by the OOM killer: no time to record anything.
    # (scancel --signal=KILL cancels the job as a plain scancel does: SIGTERM first.)
    os.kill(json.loads((run_dir / "health" / "launcher.json").read_text())["pid"], signal.SIGKILL)
    wait_until(lambda: forgotten(second, env) and forgotten(first, env), 60, "Slurm to forget both jobs")
    text = status(run_dir, env)
    said = f"state:       ended without its end record (Slurm no longer knows job {second}): last seen "
    assert said in text and "the launcher's heartbeat (pid " in text and "nothing said why (killed)" in text, text
    assert "ETA" not in text and f"slurm:       job {second}: unknown to Slurm" in text, text
    assert f"usage:       not counted above: job {second} (restart 0), whose launcher was killed" in text, text
