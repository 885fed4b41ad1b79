"""SGLang as a rollout engine: a small supervisor around `python -m sglang.launch_server`.

    python -m relax_hpc.engines.sglang_engine --run-dir RUN_DIR --engine-id engine-0 --host H --port P

The launcher runs this in an engine's place when `rollout.engine: sglang`. It builds launch_server's
arguments from the frozen config (rollout.sglang, model, run.seed), starts the server in a session
of its own with this process's stdout and stderr (the supervisor writes them to
RUN_DIR/logs/RESTART/engine-N.log), waits until GET /health answers, and then registers the server
in RUN_DIR/registry/engines the way the built-in torch engine registers itself: a new `instance`
per start, the weight version the server reports (kept current from GET /model_info), the record
removed on exit. The record's pid is this process: the server dies with it (a parent-death signal),
so killing the engine's recorded pid kills the server.

While the server runs this process watches it. A server that exits, or that does not answer /health
for `--unhealthy-after-s`, is killed with its whole process group and this process exits 1: the
supervisor then restarts the engine (up to rollout.max_engine_restarts) and the trainer pushes the
current weights to the new one. SIGTERM, SIGINT and SIGUSR1 are passed on to the server; once it has
exited, the record goes and this process exits 0.

The run token is the server's `--api-key`. It appears in no log line, error message or file that
this module writes (the command line is logged with the key replaced).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from relax_hpc import fence
from relax_hpc.config.load import read_frozen
from relax_hpc.config.schema import JobConfig
from relax_hpc.data.processor import video_spec
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.client import EngineClient, EngineRequestError, EngineUnavailable
from relax_hpc.protocol.registry import EngineRecord, remove_record, write_record

log = logging.getLogger("relax_hpc.sglang_engine")

POLL_S = 1.0  # between two looks at the server (process state, /health, /model_info)
HEALTH_TIMEOUT_S = 10.0  # one /health call; SGLang answers it at once unless it is stuck
STOP_GRACE_S = 30.0  # after a forwarded signal, before the server's process group is killed
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# SGLang starts every engine at weight version "default"; the driver compares versions as
# integers, and the built-in engine starts at "0" too: the trainer's first push moves it on.
INITIAL_WEIGHT_VERSION = "0"


class EngineFailed(RuntimeError):
    """The server did not start, exited, or stopped answering: the supervisor restarts the engine."""


def server_args(
    cfg: JobConfig, host: str, port: int, api_key: str, pool: str = "policy", device: str | None = None
) -> list[str]:
    """launch_server's command-line arguments for this run (rollout.sglang.extra_args last,
    verbatim); a judge engine serves reward.judge.model, a teacher engine algo.teacher.path (on
    algo.teacher.tp_size GPUs when set);
    `device` cuda:K: a colocated engine on GPU K of those it sees (its trainer rank's)."""
    sg = cfg.rollout.sglang
    model = cfg.served_model(pool)
    tp_size = (cfg.algo.teacher.tp_size if pool == "teacher" else None) or sg.tp_size
    argv = [
        "--model-path", str(model), "--host", host, "--port", str(port),
        "--tp-size", str(tp_size), "--mem-fraction-static", str(sg.mem_fraction_static),
        "--dtype", cfg.model.dtype, "--random-seed", str(cfg.run.seed),
        "--weight-version", INITIAL_WEIGHT_VERSION, "--api-key", api_key,
    ]  # fmt: skip
    if sg.context_length is not None:
        argv += ["--context-length", str(sg.context_length)]
    if device is not None:
        argv += ["--base-gpu-id", device.removeprefix("cuda:")]
    if cfg.launch.colocate and pool == "policy":
        argv.append("--enable-memory-saver")  # /release_memory_occupation frees nothing without it
    if cfg.algo.off_policy.routing_replay and pool == "policy":
        argv.append("--enable-return-routed-experts")  # without it the routing is silently absent
    if "video" in cfg.data.media and pool == "policy" and (video := video_spec(str(model))) is not None:
        # SGLang samples and sizes videos by its own constants unless told the model's: the same
        # rule then keeps every frame of the driver's canonical clips as they are (relax_hpc.data.video)
        argv += ["--mm-process-config", json.dumps({"video": video.sglang_config()})]
    if cfg.lora_adapters and cfg.trainer.lora is not None and pool == "policy":
        # The adapters come later (/load_lora_adapter, relax_hpc.weights.adapters): the server
        # reserves their rank and modules now. None at start: version 0 is the base model.
        lora = cfg.trainer.lora
        argv += ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.target_modules]
    return argv + list(sg.extra_args)


def redact(argv: list[str], secret: str) -> str:
    """The command line as a shell would read it, with the secret replaced wherever it occurs."""
    return shlex.join(arg.replace(secret, "***") for arg in argv)


def free_port(host: str) -> int:
    """A port the OS considers free on `host` now (SGLang binds it a moment later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_url(host: str, port: int) -> str:
    """Where this process reaches the server: loopback when it listens on every interface."""
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{local}]:{port}" if ":" in local else f"http://{local}:{port}"


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGKILL it when this wrapper dies, even by kill -9,
    so that no server outlives its engine's record (a restarted engine needs the port and GPUs)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_server(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    # Its own session: the supervisor's signals to this process's group do not reach the server
    # directly, so this process decides how it stops, and can kill every server subprocess at once.
    return subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509  # only prctl(PR_SET_PDEATHSIG), which must run in the child
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the server and every process of its group (SGLang's scheduler and detokenizer)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Wrapper:
    """Supervises one SGLang server; VllmWrapper (relax_hpc.engines.vllm_engine) a vLLM one."""

    KIND = "SGLang"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.paths = RunPaths(Path(args.run_dir))
        self.cfg = read_frozen(self.paths.config)
        self.api_key = self.paths.read_token()
        self.port = args.port or free_port(args.host)
        self.client = EngineClient(_local_url(args.host, self.port), self.api_key, HEALTH_TIMEOUT_S)
        self.instance = uuid.uuid4().hex
        self.stopping = threading.Event()  # set by a forwarded signal
        self.signum: int = signal.SIGTERM  # the signal to forward
        self.proc: subprocess.Popen | None = None
        self.record: EngineRecord | None = None

    def on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        log.info("%s: %s received; passing it on to the %s server", self.args.engine_id, name, self.KIND)
        self.signum = signum
        self.stopping.set()
        self._forward()

    def _forward(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited a moment ago
                os.killpg(self.proc.pid, self.signum)

    def command(self) -> list[str]:
        """The server's command line (the run token in it as the API key)."""
        argv = server_args(self.cfg, self.args.host, self.port, self.api_key, self.args.pool, self.args.device)
        return [sys.executable, "-m", self.cfg.rollout.sglang.module, *argv]

    def environment(self) -> dict[str, str] | None:
        """The server's environment; None: this process's."""
        return None

    @property
    def startup_timeout_s(self) -> float:
        return self.cfg.rollout.sglang.startup_timeout_s

    def prepare(self) -> None:
        """Once the server answers /health, before it is registered."""

    def run(self) -> int:
        command = self.command()
        log.info("%s: starting %s", self.args.engine_id, redact(command, self.api_key))
        try:
            self.proc = start_server(command, self.environment())
        except OSError as e:  # a missing or unrunnable interpreter: the reason, not a traceback
            log.error("%s: cannot start the %s server: %s: %s", self.args.engine_id, self.KIND, command[0], e.strerror)
            return 1
        log.info("%s: %s server pid %d", self.args.engine_id, self.KIND, self.proc.pid)
        if self.cfg.rollout.catch_up == "engine" and self.args.pool == "policy":  # built-in engine only
            log.info(
                "%s: rollout.catch_up=engine is built for the built-in engine only; this %s engine waits for "
                "the trainer's push (docs/DESIGN.md, engine-to-engine catch-up)",
                self.args.engine_id, self.KIND,
            )  # fmt: skip
        if self.stopping.is_set():  # the signal came while the server was being started
            self._forward()
        try:
            if self.wait_healthy():
                self.prepare()
                self.register()
                self.watch()
            return self.stop()
        except EngineFailed as e:
            log.error("%s: %s", self.args.engine_id, e)
            return 1
        finally:
            # Whatever ended it: no record without a server, and no server process left behind
            # (SGLang's scheduler and detokenizer, vLLM's engine core and workers, may outlive it).
            remove_record(self.paths.registry(self.args.pool), self.args.engine_id, self.instance)
            kill_group(self.proc)

    def wait_healthy(self) -> bool:
        """True once /health answers 200; False when a signal came first."""
        timeout_s = self.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        while not self.stopping.is_set():
            self._check_alive("before it answered /health")
            if self.client.healthy(HEALTH_TIMEOUT_S):
                return True
            if time.monotonic() > deadline:
                raise EngineFailed(
                    f"the {self.KIND} server did not answer /health within {timeout_s:.0f} s of its start "
                    f"(rollout.{self.KIND.lower()}.startup_timeout_s); its output is above in this log"
                )
            self.stopping.wait(POLL_S)
        return False

    def register(self) -> None:
        host = socket.gethostname() if self.args.host in ("0.0.0.0", "::") else self.args.host
        version = self._weight_version() or INITIAL_WEIGHT_VERSION
        self.record = EngineRecord(self.args.engine_id, host, self.port, os.getpid(), self.instance, version)
        write_record(self.paths.registry(self.args.pool), self.record)
        log.info(
            "%s: %s server ready on %s:%d (weight version %s)", self.args.engine_id, self.KIND, host, self.port, version
        )

    def watch(self) -> None:
        """Until a signal: keep the record's weight version current; raise when the server is gone."""
        limit = self.args.unhealthy_after_s
        probe_s = min(HEALTH_TIMEOUT_S, limit)  # a hung server must not stretch the limit by a probe
        answered = time.monotonic()
        while not self.stopping.wait(POLL_S):
            self._check_alive("while serving")
            if fence.superseded():  # run()'s finally ends the server, and its record goes
                raise EngineFailed("a newer generation of the run superseded this engine (fenced)")
            if self.client.healthy(probe_s):
                answered = time.monotonic()
                self._refresh_version()
            elif time.monotonic() - answered > limit:
                raise EngineFailed(
                    f"the {self.KIND} server has not answered /health for {limit:.0f} s (--unhealthy-after-s)"
                )

    def stop(self) -> int:
        """After a forwarded signal: give the server STOP_GRACE_S to exit (then run() kills it)."""
        assert self.proc is not None, "run() starts the server first"
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
            log.info("%s: the %s server exited with code %s", self.args.engine_id, self.KIND, self.proc.returncode)
        except subprocess.TimeoutExpired:
            log.warning(
                "%s: the %s server did not exit in %.0f s; killing it", self.args.engine_id, self.KIND, STOP_GRACE_S
            )
        return 0

    def kill_server(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)

    def _check_alive(self, when: str) -> None:
        assert self.proc is not None, "run() starts the server first"
        code = self.proc.poll()
        if code is not None and not self.stopping.is_set():
            raise EngineFailed(f"the {self.KIND} server exited with code {code} {when}")

    def _weight_version(self) -> str | None:
        try:
            return self.client.weight_version()
        except (EngineUnavailable, EngineRequestError, KeyError, TypeError):
            return None

    def _refresh_version(self) -> None:
        assert self.record is not None, "register() writes the record before watch() refreshes it"
        version = self._weight_version()
        if version is not None and version != self.record.weight_version:
            self.record = replace(self.record, weight_version=version)
            write_record(self.paths.registry(self.args.pool), self.record)


def main(wrapper_class: type[Wrapper] = Wrapper) -> None:
    kind = wrapper_class.KIND
    parser = argparse.ArgumentParser(
        prog=f"python -m relax_hpc.engines.{kind.lower()}_engine",
        description=f"relax_hpc's supervisor of one {kind} server (rollout.engine={kind.lower()})",
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument(
        "--pool",
        choices=("policy", "judge", "teacher"),
        default="policy",
        help="which registry in RUN_DIR it registers in",
    )
    parser.add_argument("--device", default=None, help="cuda:K: the server's first GPU (colocated engines)")
    parser.add_argument(
        "--unhealthy-after-s",
        type=float,
        default=60.0,
        help="a running server that does not answer /health this long counts as dead",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    wrapper = wrapper_class(args)
    fence.install(wrapper.paths.root, before_exit=wrapper.kill_server)
    for sig in FORWARDED:
        signal.signal(sig, wrapper.on_signal)
    sys.exit(wrapper.run())


if __name__ == "__main__":
    main()
