"""The SGLang engine wrapper (relax_hpc.engines.sglang_engine) around a stand-in server.

SGLang cannot run here, so rollout.sglang.module points to tests/integration/fake_sglang_server.py:
it parses the wrapper's launch_server arguments with SGLang's own parser and serves the built-in
engine's HTTP API. The wrapper is started with the launcher's own command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.supervisor import child_env
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineRequestError
from relax_hpc.protocol.registry import EngineRecord, read_records
from tests.integration.conftest import REPO, Job, make_run, wait_wrapper_record
from tests.integration.fake_sglang_server import NEVER_HEALTHY

pytestmark = pytest.mark.integration

SGLANG = ["rollout.engine=sglang", "rollout.sglang.module=tests.integration.fake_sglang_server"]


class Wrapper:
    """One engine's wrapper process, its output in RUN_DIR/logs/0/engine-0.log as under the supervisor."""

    def __init__(self, run_dir: Path, *overrides: str, env: dict[str, str] | None = None, extra: tuple = ()) -> None:
        self.cfg, self.paths = make_run(run_dir, *SGLANG, *overrides)
        self.log = self.paths.logs(0) / "engine-0.log"
        self.log.parent.mkdir(parents=True)
        argv = [*local_commands(self.cfg, self.paths)["engine-0"], *extra]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**child_env(self.cfg), **(env or {})},
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def server_pid(self) -> int:
        match = re.search(r"SGLang server pid (\d+)", self.text())
        assert match is not None, self.text()[-3000:]
        return int(match[1])

    def wait_registered(self, timeout_s: float = 120.0) -> EngineRecord:
        return wait_wrapper_record(self.paths.engines, self.proc, self.log, timeout_s)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"wrapper still running after {timeout_s} s:\n{self.text()[-3000:]}") from None

    def kill(self) -> None:
        for pid in (self.proc.pid, *re.findall(r"SGLang server pid (\d+)", self.text())):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def wrappers():
    started: list[Wrapper] = []

    def start(run_dir: Path, *overrides: str, **kwargs) -> Wrapper:
        started.append(Wrapper(run_dir, *overrides, **kwargs))
        return started[-1]

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.kill()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_serves_with_the_run_token_and_stops_on_sigterm(tmp_path, wrappers):
    w = wrappers(tmp_path / "run")
    record = w.wait_registered()
    assert record.pid == w.proc.pid and record.port > 0 and record.weight_version == "0"
    token = w.paths.read_token()
    prompt = [3, 4, 5]
    sampling = {"max_new_tokens": 3, "sampling_seed": 1}
    outputs = EngineClient(record.url, token, 30).generate(
        P.GenerateReqInput(input_ids=[prompt, prompt], sampling_params=sampling, return_logprob=True)
    )
    assert len(outputs) == 2 and outputs[0]["meta_info"]["weight_version"] == "0"
    with pytest.raises(EngineRequestError, match="401"):  # the server got the run token as its key
        EngineClient(record.url, "not-the-token", 30).generate(P.GenerateReqInput(input_ids=prompt))
    server = w.server_pid()
    w.proc.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    assert read_records(w.paths.engines) == [] and _gone(server)
    assert "--api-key '***'" in w.text()
    # The key is in RUN_DIR/token and nowhere else there: not in the log, the config or the registry.
    holders = [p for p in w.paths.root.rglob("*") if p.is_file() and token in p.read_text(errors="replace")]
    assert holders == [w.paths.token]


def test_a_killed_server_takes_its_record_and_the_wrapper_down(tmp_path, wrappers):
    w = wrappers(tmp_path / "run")
    w.wait_registered()
    os.kill(w.server_pid(), signal.SIGKILL)
    assert w.wait(30) == 1
    assert read_records(w.paths.engines) == []
    assert "the SGLang server exited with code -9 while serving" in w.text()


def test_a_server_that_stops_answering_is_killed(tmp_path, wrappers):
    w = wrappers(tmp_path / "run", extra=("--unhealthy-after-s", "2"))
    w.wait_registered()
    server = w.server_pid()
    os.kill(server, signal.SIGSTOP)  # alive, but answers nothing
    assert w.wait(30) == 1
    assert read_records(w.paths.engines) == [] and _gone(server)
    assert "has not answered /health for 2 s" in w.text()


def test_a_server_that_never_answers_fails_after_the_startup_timeout(tmp_path, wrappers):
    w = wrappers(tmp_path / "run", "rollout.sglang.startup_timeout_s=2", env={NEVER_HEALTHY: "1"})
    started = time.monotonic()
    assert w.wait(30) == 1
    assert time.monotonic() - started < 15
    assert "did not answer /health within 2 s of its start (rollout.sglang.startup_timeout_s)" in w.text()
    assert read_records(w.paths.engines) == [] and _gone(w.server_pid())


@pytest.mark.slow  # a whole job and two server starts: 40 s on 2 idle cores, 80 s on busy ones
def test_the_supervisor_restarts_a_crashed_sglang_engine(tmp_path):
    """A whole job on the wrapper: its server is killed, the launcher restarts the engine, and the
    trainer pushes the current weights to the new server; a clean stop takes every server down."""
    job = Job(
        tmp_path / "run", *SGLANG, "rollout.num_engines=1", "trainer.total_steps=400", "ckpt.every_steps=1000",
        "rollout.prompts_per_step=8",
    ).start()  # fmt: skip
    job.wait_for_step(3, timeout_s=240)
    log = job.run_dir / "logs" / "0" / "engine-0.log"

    def servers() -> list[int]:
        return [int(pid) for pid in re.findall(r"SGLang server pid (\d+)", log.read_text())]

    record_path = job.run_dir / "registry" / "engines" / "engine-0.json"
    killed = EngineRecord(**json.loads(record_path.read_text()))
    os.kill(servers()[0], signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        record = EngineRecord(**json.loads(record_path.read_text())) if record_path.exists() else killed
        if record.instance != killed.instance and int(record.weight_version) > 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the restarted engine never received weights:\n{job.text()[-2000:]}")
    (job.run_dir / "control" / "stop").write_text("stop")
    assert job.wait(timeout_s=120) == 75, job.text()[-3000:]
    assert "engine-0 ended (exit 1); restarting (1/5)" in job.text()
    assert "the SGLang server exited with code -9 while serving" in log.read_text()
    time.sleep(1.0)  # the supervisor's SIGTERM reached the wrappers; give them a moment to clean up
    assert not record_path.exists() and len(servers()) == 2 and all(_gone(pid) for pid in servers())
