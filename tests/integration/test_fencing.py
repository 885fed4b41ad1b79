"""Fencing with real processes: every role of a run whose launcher died lives on, stopped; a new
launcher starts the run again; the old roles, continued mid-run, write nothing and end."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from relax_hpc.fence import read_lease, refused_writes
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.status import collect
from tests.integration.conftest import Job, _descendants
from tests.integration.test_resume import COMMON, STEPS
from tests.runs import assert_nothing_lost_or_repeated, final_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def pids_in_run_dir(run_dir: Path) -> set[int]:
    """The processes that RUN_DIR's registry and heartbeats name."""
    records = [*run_dir.glob("registry/*/*.json"), *run_dir.glob("health/*.json")]
    return {json.loads(p.read_text())["pid"] for p in records}


def test_the_roles_of_a_superseded_generation_write_nothing_when_continued(tmp_path):
    run_dir = tmp_path / "run"
    old = Job(run_dir, *COMMON).start()
    old.wait_for_step(5, timeout_s=300)
    assert old.proc is not None
    roles = _descendants(old.proc.pid)  # engines, driver, torchrun and its ranks
    for pid in roles:
        os.kill(pid, signal.SIGSTOP)
    # The launcher is gone (its srun client killed, its node lost): its roles live on, stopped.
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    new = Job(run_dir, *COMMON).start()
    try:
        new.wait_for_step(10, timeout_s=300)
        for pid in roles:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while alive(roles) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(roles)
        assert not left, [" ".join(psutil.Process(p).cmdline()) for p in left]
        assert new.wait(timeout_s=400) == 0, new.text()[-3000:]
    finally:
        for pid in alive(roles):  # only on failure: the processes this test stopped
            os.kill(pid, signal.SIGKILL)
        if new.proc is not None and new.proc.poll() is None:
            new.kill_all()
    assert read_lease(run_dir)["generation"] == 2
    # Each old role said why it ended (the watcher, or a refused write first).
    for name in ("trainer", "driver", "engine-0", "engine-1"):
        assert "fenced:" in (run_dir / "logs" / "0" / f"{name}.log").read_text(), name
    assert not pids_in_run_dir(run_dir) & roles
    assert {r["pid"] for r in refused_writes(run_dir)} <= roles
    ends = [e for e in read_jsonl(run_dir / "metrics" / "events.jsonl") if e.get("event") == "end"]
    assert ends[-1]["refused_writes"] == len(refused_writes(run_dir))
    assert collect(run_dir)["fencing"] == {"generation": 2, "refused_writes": len(refused_writes(run_dir))}
    # Every step once in the record that survived, nothing lost or repeated, the last checkpoint
    # the final one (an old commit would have moved `latest` back).
    assert sorted(final_records(run_dir)) == list(range(1, STEPS + 1))
    assert all(len(records) == 1 for records in final_records(run_dir).values())
    assert_nothing_lost_or_repeated(run_dir, STEPS)
    assert (run_dir / "ckpt" / "latest").resolve().name == f"step-{STEPS:08d}"
