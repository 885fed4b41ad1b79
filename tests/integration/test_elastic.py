"""Elastic rollout on one machine (the local executor's elastic engines; the Slurm jobs are in
tests/slurm/test_elastic.py): engines join a running training, get its weights, take work, and
leave again; a server already running elsewhere joins by URL; nothing is lost."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.protocol.registry import read_records
from tests.integration.conftest import REPO, Job
from tests.runs import assert_nothing_lost_or_repeated

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 1000  # never reached: the test stops the run once the elastic engines have come and gone
COMMON = (
    f"trainer.total_steps={STEPS}", "rollout.prompts_per_step=8", "rollout.eval_every=0", "ckpt.every_steps=5",
    "ckpt.keep_trained_batches=true", "rollout.num_engines=1",
)  # fmt: skip


def scale(run_dir: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args], cwd=REPO, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def states(run_dir: Path) -> dict[str, str]:
    return {row["id"]: row["state"] for row in json.loads(scale(run_dir, "list", "--json"))}


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engines_join_a_running_training_take_work_and_leave(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(run_dir, *COMMON).start()
    job.wait_for_step(3, timeout_s=300)
    # An elastic engine from this machine, and a server of its own added by URL.
    assert "1 engine(s)" in scale(run_dir, "out", "--engines", "1", "--id", "extra")
    assert "nothing to do" in scale(run_dir, "out", "--engines", "1", "--id", "extra")  # already satisfied
    port = free_port()
    external = subprocess.Popen(
        [sys.executable, "-m", "relax_hpc.engines.torch_engine", "--run-dir", str(run_dir), "--engine-id", "outside",
         "--model-path", str(REPO / "assets/tiny-qwen3-addition"), "--port", str(port), "--pool", "none"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: _answers(port), 120, "the external server")
        scale(run_dir, "out", "--url", f"http://127.0.0.1:{port}", "--id", "outside")
        wait_for(lambda: set(states(run_dir).values()) == {"active"}, 180, "both to hold the current weights")

        def engines_used() -> set[int]:
            return {r["engines"] for r in read_jsonl(run_dir / "metrics" / "rollout.jsonl") if "batch" in r}

        wait_for(lambda: 3 in engines_used(), 120, "the driver to use three engines")
        assert 1 in engines_used()  # it started with its own one
        scale(run_dir, "in", "--url", f"http://127.0.0.1:{port}", "--drain-timeout-s", "20")
        scale(run_dir, "in", "--engines", "1", "--drain-timeout-s", "20")
        assert states(run_dir) == {"extra": "cancelled", "outside": "cancelled"}
        registered = lambda: {r.engine_id for r in read_records(run_dir / "registry" / "engines")}  # noqa: E731
        wait_for(lambda: registered() == {"engine-0"}, 60, "the elastic engines to leave the registry")
        (run_dir / "control" / "stop").write_text("stop")  # the run's own engine trains on alone: enough
        assert job.wait(timeout_s=300) == 75, job.text()[-3000:]
    finally:
        external.terminate()
        external.wait(timeout=30)
    end = [r for r in read_jsonl(run_dir / "metrics" / "train.jsonl") if r.get("event") == "end"][-1]
    assert not end["completed"]
    assert_nothing_lost_or_repeated(run_dir, end["step"])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_the_runs_own_engines_cannot_be_drained(tmp_path):
    run_dir = tmp_path / "run"
    job = Job(run_dir, *COMMON, "trainer.total_steps=4").start()
    job.wait_for_step(1, timeout_s=300)
    out = subprocess.run(
        [sys.executable, "-m", "relax_hpc.scale", str(run_dir), "in", "--engines", "1"], cwd=REPO,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 1 and "the run's own engines (engine-N) are not drained" in out.stderr
    assert job.wait(timeout_s=300) == 0
