"""The health monitor's verdicts on heartbeats: a busy phase past its limit, a silent driver,
a trainer idle beside waiting batches; a role just started gets its grace, up to its start-up
limit."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from relax_hpc.config.schema import HealthConfig
from relax_hpc.exchange.spool import Spool
from relax_hpc.launch.commands import free_port
from relax_hpc.launch.health import HealthMonitor
from relax_hpc.metrics.heartbeat import Heartbeat, StepClock
from relax_hpc.paths import RunPaths
from relax_hpc.protocol.registry import EngineRecord, write_record
from tests.unit.test_spool import make_batch


def monitor(tmp_path, started: float, **limits) -> tuple[HealthMonitor, RunPaths]:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    cfg = HealthConfig(**{"step_timeout_s": 10.0, "step_factor": 5.0, "driver_timeout_s": 30.0, **limits})
    health = HealthMonitor(paths, cfg, lambda role: started)
    health.close()  # no engines to probe here
    return health, paths


def test_a_phase_is_hung_past_the_larger_of_the_limit_and_the_median_step_times_the_factor(tmp_path):
    now = time.time()
    health, paths = monitor(tmp_path, started=now - 1000)
    clock = StepClock(Heartbeat(paths, "trainer"))
    for step, seconds in enumerate([3.0, 4.0, 5.0]):
        clock.stepped(step + 1, seconds)
    clock.phase("train")  # median 4 s x 5 = 20 s > the 10 s limit
    assert all(f.role != "trainer" for f in health.findings(now + 15))
    (finding,) = [f for f in health.findings(now + 25) if f.role == "trainer"]
    assert finding.cause.startswith("in its train phase for 2")
    clock.phase("wait")  # waiting for samples is the driver's business: never hung by itself
    assert all(f.role != "trainer" for f in health.findings(now + 100))


def test_a_trainer_waiting_beside_ready_batches_is_hung(tmp_path):
    now = time.time()
    health, paths = monitor(tmp_path, started=now - 1000)
    StepClock(Heartbeat(paths, "trainer")).phase("wait")
    published = Spool(paths.spool).publish(make_batch(0), writer="test")
    os.utime(published, (now - 100, now - 100))
    (finding,) = [f for f in health.findings(now + 20) if f.role == "trainer"]
    assert "with batches ready" in finding.cause


def test_a_batch_claimed_while_the_monitor_looks_is_passed_over(tmp_path):
    """The trainer claims (renames) a ready batch between the monitor's listing of the folder and
    its stat of the file: the listing then names a file that is gone, here a dangling link. The
    monitor passes it over; it raised FileNotFoundError and ended the launcher (CI at 73a6c78)."""
    now = time.time()
    health, paths = monitor(tmp_path, started=now - 1000)
    StepClock(Heartbeat(paths, "trainer")).phase("wait")
    ready = Spool(paths.spool).publish(make_batch(0), writer="test").parent
    (ready / "b000000007.h5").symlink_to(ready / "claimed-meanwhile.h5")
    assert all(f.role != "trainer" for f in health.findings(now + 1))  # a fresh batch: not yet hung


def test_a_silent_driver_is_hung_but_a_new_one_has_its_grace(tmp_path):
    now = time.time()
    health, paths = monitor(tmp_path, started=now - 1000)
    Heartbeat(paths, "driver").beat(batch=3)
    assert all(f.role != "driver" for f in health.findings(now + 20))
    (finding,) = [f for f in health.findings(now + 40) if f.role == "driver"]
    assert finding.cause.startswith("no heartbeat for 4")
    fresh, _ = monitor(tmp_path / "again", started=now)  # just (re)started, no heartbeat yet
    assert all(f.role != "driver" for f in fresh.findings(now + 20))


def test_a_role_not_up_within_the_startup_limit_is_hung_and_a_predecessor_vouches_for_nothing(tmp_path):
    """A trainer without a heartbeat of its own, a driver without its first, an engine that has
    not registered since its start: hung after launch.health.startup_timeout_s. What the
    predecessors left (a heartbeat, a registry record) is neither a sign of life nor of a hang."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    Heartbeat(paths, "trainer").beat(phase="train", since=time.time(), step=4)
    old = EngineRecord("engine-0", "127.0.0.1", free_port(), os.getpid(), "old", "3")
    write_record(paths.engines, old)
    cfg = HealthConfig(startup_timeout_s=60.0, engine_timeout_s=0.01, driver_timeout_s=30.0)
    start = time.time() + 0.01
    health = HealthMonitor(paths, cfg, lambda role: start, engines=["engine-0"])
    health.close()
    health.probe_once()  # the old record: its /health fails, but it is not this process's
    time.sleep(0.05)
    assert health.findings(start + 40) == []  # the driver too: its start-up, not driver_timeout_s
    causes = {f.role: f.cause for f in health.findings(start + 61)}
    assert set(causes) == {"trainer", "driver", "engine-0"}
    assert all(c == "not up 61 s after its start (hung in its start-up)" for c in causes.values())
    time.sleep(0.02)  # so that the next beat and record are newer than `start`
    Heartbeat(paths, "trainer").beat(phase="wait", since=time.time(), step=4)
    write_record(paths.engines, EngineRecord(**{**asdict(old), "instance": "new"}))
    health.probe_once()
    time.sleep(0.05)
    causes = {f.role: f.cause for f in health.findings(start + 61)}
    assert set(causes) == {"engine-0", "driver"}  # the trainer is up
    assert "/health has not answered" in causes["engine-0"]  # the engine is up: its silence counts


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_args: object) -> None:
        pass


def test_only_engines_registered_since_their_start_and_answering_count_as_serving(tmp_path):
    """The progress line's "engines N/M": an engine that crash-loops runs without serving."""
    paths = RunPaths(tmp_path / "run")
    paths.create()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started = dict.fromkeys(["engine-0", "engine-1", "engine-2"], time.time() - 10)
    health = HealthMonitor(paths, HealthConfig(), lambda role: started[role], engines=list(started))
    health.close()
    write_record(paths.engines, EngineRecord("engine-0", "127.0.0.1", server.server_address[1], 1, "a", "0"))
    write_record(paths.engines, EngineRecord("engine-1", "127.0.0.1", free_port(), 2, "b", "0"))  # died
    health.probe_once()  # engine-2 has not registered (starting, or dying before it serves)
    assert health.serving() == {"engine-0"}
    started["engine-0"] = time.time() + 1  # restarted: its predecessor's record answers for nothing
    assert health.serving() == set()
    server.shutdown()
