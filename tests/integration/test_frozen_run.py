"""A run that release 0.20.0 started and stopped (tests/data/run-0.20.0, made by
tools/freeze_run.py with that release's code: configs/tiny-grpo-lora.yaml with small adapters,
6 steps, stopped after its 4th as a preempted run is, a batch generated ahead still in its spool)
resumes with today's code to its end: its frozen config loads (with every weight channel's
options, as 0.20.0 froze them), its checkpoint, spool and metrics are read, and every step is
trained once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.integration.conftest import REPO, Job
from tests.runs import assert_nothing_lost_or_repeated

FROZEN = REPO / "tests" / "data" / "run-0.20.0"
TOTAL_STEPS = 6  # its trainer.total_steps


def test_a_run_stopped_by_0_20_0_resumes_to_its_end(tmp_path: Path) -> None:
    made = json.loads((FROZEN.parent / f"{FROZEN.name}.json").read_text())
    run_dir = tmp_path / "run"
    shutil.copytree(FROZEN, run_dir, symlinks=True)
    config = run_dir / "config.yaml"  # the paths it froze, as on the machine that ran it
    config.write_text(config.read_text().replace("{RUN_DIR}", str(run_dir)).replace("{REPO}", str(REPO)))
    before = [r["step"] for r in Job(run_dir, config=config).steps()]
    assert before == list(range(1, made["steps"] + 1)) and made["steps"] < TOTAL_STEPS

    job = Job(run_dir, config=config)  # what its user runs again: the frozen config
    assert job.run(timeout_s=300) == 0, job.text()[-3000:]
    assert "holds a run with a different config" not in job.text()
    assert [s["step"] for s in job.steps()] == list(range(1, TOTAL_STEPS + 1))
    assert_nothing_lost_or_repeated(run_dir, TOTAL_STEPS)
    resumed = f"resumed from step {made['steps']} "  # from its checkpoint, not from scratch
    assert any(resumed in log.read_text() for log in (run_dir / "logs").rglob("trainer.log"))
