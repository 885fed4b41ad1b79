"""The health monitor's verdicts on heartbeats: a busy phase past its limit, a silent driver,
a trainer idle beside waiting batches; a role just started gets its grace."""

from __future__ import annotations

import os
import time

from relax_hpc.config.schema import HealthConfig
from relax_hpc.exchange.spool import Spool
from relax_hpc.launch.health import HealthMonitor
from relax_hpc.metrics.heartbeat import Heartbeat, StepClock
from relax_hpc.paths import RunPaths
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


def test_a_silent_driver_is_hung_but_a_new_one_has_its_grace(tmp_path):
    now = time.time()
    health, paths = monitor(tmp_path, started=now - 1000)
    Heartbeat(paths, "driver").beat(batch=3)
    assert all(f.role != "driver" for f in health.findings(now + 20))
    (finding,) = [f for f in health.findings(now + 40) if f.role == "driver"]
    assert finding.cause.startswith("no heartbeat for 4")
    fresh, _ = monitor(tmp_path / "again", started=now)  # just (re)started, no heartbeat yet
    assert all(f.role != "driver" for f in fresh.findings(now + 20))
