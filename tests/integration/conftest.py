"""Real processes for integration tests: engines, torchrun ranks, whole jobs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from relax_hpc.config import load_config
from relax_hpc.launch.commands import local_commands
from relax_hpc.launch.forkserver import ForkedProcess, ForkServer
from relax_hpc.launch.supervisor import child_env
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import EngineRecord, read_records
from relax_hpc.submit import freeze

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-grpo.yaml"


def wait_wrapper_record(folder: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> EngineRecord:
    """The first engine record in `folder`, written by an engine wrapper `proc` (output in `log`):
    failing at once, with the log's tail, when the wrapper exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_records(folder)
        if records:
            return records[0]
        tail = log.read_text(errors="replace")[-4000:]
        assert proc.poll() is None, f"wrapper exited ({proc.returncode}):\n{tail}"
        time.sleep(0.2)
    raise AssertionError(f"no engine record within {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")


def make_run(run_dir: Path, *overrides: str) -> tuple:
    cfg = load_config(CONFIG, [f"run.dir={run_dir}", *overrides], base_dir=REPO)
    paths = RunPaths(run_dir)
    freeze(cfg, paths)
    return cfg, paths


class Engines:
    """Engine processes started from the launcher's own command lines; forked by `forks` (the
    local executor's fork server) when given, as the launcher starts them."""

    def __init__(self, cfg, paths: RunPaths, forks: ForkServer | None = None) -> None:
        self.cfg, self.paths, self.forks = cfg, paths, forks
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}

    def start(self, engine_id: str) -> None:
        argv = local_commands(self.cfg, self.paths)[engine_id]
        log_path = self.paths.root / f"{engine_id}.log"
        if self.forks is not None:
            self.procs[engine_id] = self.forks.start(argv, child_env(self.cfg), log_path)
            return
        with log_path.open("ab") as log:
            env = child_env(self.cfg)
            self.procs[engine_id] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_registered(self, count: int, timeout_s: float = 120.0, folder: Path | None = None) -> list:
        """The records of `count` engines in `folder` (default: the rollout engines' registry)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = read_records(folder or self.paths.engines)
            if len(records) >= count:
                return records
            dead = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"engines exited: {dead}"
            time.sleep(0.2)
        raise TimeoutError(f"{count} engines did not register within {timeout_s}s")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def engine_forks():
    """One fork server of the built-in engine for the worker's tests (each engine a fork, as the
    local executor starts them: a fresh interpreter would spend seconds importing torch)."""
    cfg = load_config(CONFIG, [], base_dir=REPO)
    forks = ForkServer(["relax_hpc.engines.torch_engine"], child_env(cfg))
    yield forks
    forks.close()


@pytest.fixture
def engines(engine_forks):
    started: list[Engines] = []

    def factory(cfg, paths, count: int) -> Engines:
        group = Engines(cfg, paths, engine_forks)
        started.append(group)
        for i in range(count):
            group.start(f"engine-{i}")
        group.wait_registered(count)
        return group

    yield factory
    for group in started:
        group.stop()


class Job:
    """`python -m relax_hpc.submit` as a user runs it, in the background."""

    def __init__(self, run_dir: Path, *overrides: str, config: Path = CONFIG) -> None:
        self.run_dir = run_dir
        # An RL job checks every push's weights in the engines (default: every 10th); sft and eval
        # jobs push none, and refuse the weights section.
        kind = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("kind=")), None)
        pushes = (kind or yaml.safe_load(config.read_text()).get("kind", "rl")) == "rl"
        self.argv = [
            sys.executable,
            "-m",
            "relax_hpc.submit",
            "--config",
            str(config),
            f"run.dir={run_dir}",
            *(["weights.verify_every=1"] if pushes else []),
            *overrides,
        ]
        self.output = run_dir.parent / f"{run_dir.name}-submit.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Job:
        out = self.output.open("ab")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None, "start() the job first"
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"job did not finish in {timeout_s}s; output:\n{self.text()[-3000:]}") from None

    def run(self, timeout_s: float) -> int:
        return self.start().wait(timeout_s)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def steps(self) -> list[dict]:
        return [r for r in read_jsonl(self.run_dir / "metrics" / "train.jsonl") if "step" in r and "loss" in r]

    def wait_for_step(self, step: int, timeout_s: float) -> None:
        assert self.proc is not None, "start() the job first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self.steps()
            if done and done[-1]["step"] >= step:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"job exited ({self.proc.returncode}) before step {step}:\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError(f"step {step} not reached in {timeout_s}s")

    def run_until_learned(self, level: float, timeout_s: float, min_steps: int = 20) -> list[dict]:
        """Run; once the last 10 steps' mean reward reaches `level` (from step `min_steps` on), ask
        the run to stop (RUN_DIR/control/stop) and return the steps up to then: a learning test
        has its answer, and the rest of the run would be CI time. A run that ends first (its
        total_steps) returns all of its steps."""
        self.start()
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            steps = self.steps()
            if len(steps) >= min_steps and sum(s["reward"] for s in steps[-10:]) / 10 >= level:
                (self.run_dir / "control").mkdir(exist_ok=True)
                (self.run_dir / "control" / "stop").write_text("learned")
                assert self.wait(timeout_s=120) in (0, 75), self.text()[-3000:]  # 75: stopped, resumable
                return steps
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"job did not finish in {timeout_s}s; output:\n{self.text()[-3000:]}")
            time.sleep(0.5)
        assert self.proc.returncode == 0, self.text()[-3000:]
        return self.steps()

    def kill_all(self) -> None:
        """kill -9 the launcher and every role it started (their sessions: recorded PIDs only)."""
        assert self.proc is not None, "start() the job first"
        pids = {self.proc.pid}
        for path in (self.run_dir / "registry" / "engines").glob("*.json"):
            pids.add(json.loads(path.read_text())["pid"])
        pids |= _descendants(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        time.sleep(0.5)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out
