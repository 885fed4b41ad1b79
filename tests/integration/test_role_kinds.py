"""The supervisor treats each role as its kind's entry in ROLE_KINDS says (a role is named KIND or
KIND-N), not by its name: a fifth kind added to the table alone is restarted as often as its
entry allows, and then either left behind (a helper) or ends the run."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.launch.supervisor import EXIT_COMPLETED, EXIT_FAILED, ROLE_KINDS, RoleKind, Supervisor
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.integration


def run_with_a_failing_role(tmp_path: Path, kind: RoleKind, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[dict]]:
    monkeypatch.setitem(ROLE_KINDS, "fake", kind)
    cfg = load_config(None, ["launch.health.restart_backoff_s=0.05"])
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    end = f"JsonlWriter(RunPaths(Path({str(paths.root)!r})).train_metrics).log({{'event': 'end', 'completed': True}})"
    trainer = "import time; from pathlib import Path; from relax_hpc.paths import RunPaths; "
    trainer += "from relax_hpc.metrics.jsonl import JsonlWriter; "
    # It ends once the fake role's fate is recorded (an order of events, not a time), at most in 60 s.
    events, fate = str(paths.events_metrics), ('"abandon"', '"give_up"')
    trainer += f"deadline = time.time() + 60\nwhile time.time() < deadline and not any(f in open({events!r}).read() "
    trainer += f"for f in {fate!r}): time.sleep(0.1)\n{end}"
    commands = {"trainer": [sys.executable, "-c", trainer], "fake-0": [sys.executable, "-c", "raise SystemExit(3)"]}
    code = Supervisor(cfg, paths, lambda: commands, out=io.StringIO()).run()
    return code, [e for e in read_jsonl(paths.events_metrics) if e.get("role") == "fake-0"]


def test_a_helper_kind_is_restarted_as_its_entry_says_then_left_behind(tmp_path, monkeypatch):
    code, exits = run_with_a_failing_role(tmp_path, RoleKind(lambda cfg: 2, helper=True), monkeypatch)
    assert code == EXIT_COMPLETED
    assert [e["action"] for e in exits] == ["restart", "restart", "abandon"] and exits[-1]["exit"] == 3


def test_a_kind_that_is_no_helper_ends_the_run_once_its_restarts_are_spent(tmp_path, monkeypatch):
    code, exits = run_with_a_failing_role(tmp_path, RoleKind(lambda cfg: 1), monkeypatch)
    assert code == EXIT_FAILED
    assert [e["action"] for e in exits] == ["restart", "give_up"]
