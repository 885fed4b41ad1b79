"""An engine that dies mid-generation: its prompts are re-issued to another engine, and a killed
engine in a running job is restarted and copies the current weights from the other engine."""

import json
import os
import signal
import threading
import time

import pytest

from relax_hpc.config.load import read_frozen
from relax_hpc.envs.context import GenerateCall
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient
from relax_hpc.rollout.driver import Driver
from tests.integration.conftest import Job, make_run

pytestmark = pytest.mark.integration


def test_prompts_of_a_killed_engine_are_reissued(tmp_path, engines):
    cfg, paths = make_run(tmp_path / "run", "rollout.request_timeout_s=20")
    group = engines(cfg, paths, 2)
    records = {r.engine_id: r for r in group.wait_registered(2)}
    victim = records["engine-0"]
    # Hold engine-0's scheduler so the driver's request is in flight there when it dies.
    EngineClient(victim.url, paths.read_token(), 10).post(
        "/pause_generation", P.PauseGenerationReqInput(mode="in_place")
    )
    driver = Driver(read_frozen(paths.config), paths)
    driver.pool.refresh(force=True)
    policy = driver.policy
    victim_engine = next(e for e in policy.pool.engines if e.record.engine_id == "engine-0")
    calls = [
        GenerateCall(ids, {"max_new_tokens": 4, "sampling_seed": k}, session=f"episode-{k}")
        for k, ids in enumerate(driver.prompt_ids[:6])
    ]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=policy._run_chunk(victim_engine, calls)))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()  # waiting on the paused engine
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert policy.reissued == 6
    assert len(result["out"]) == 6 and all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in result["out"])
    # The sessions moved with their calls: engine-1 answered them, and holds them now.
    assert {policy.affinity.engine_of(c.session) for c in calls} == {records["engine-1"].instance}


def test_a_killed_engine_is_restarted_and_rejoins_weight_sync(tmp_path):
    job = Job(
        tmp_path / "run", "trainer.total_steps=400", "ckpt.every_steps=1000", "rollout.prompts_per_step=8"
    ).start()
    job.wait_for_step(6, timeout_s=240)
    record_path = job.run_dir / "registry" / "engines" / "engine-0.json"
    killed = json.loads(record_path.read_text())
    os.kill(killed["pid"], signal.SIGKILL)
    # The launcher restarts it; it copies the current weights from engine-1 (rollout.catch_up
    # engine), and the trainer's next push takes it into the group.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        record = json.loads(record_path.read_text()) if record_path.exists() else killed
        if record["instance"] != killed["instance"] and int(record["weight_version"]) > 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"restarted engine never received weights:\n{job.text()[-2000:]}")
    steps_at_rejoin = job.steps()[-1]["step"]
    trainer_log = job.run_dir / "logs" / "0" / "trainer.log"
    deadline = time.monotonic() + 120  # the trainer's next push takes the new engine into its group
    while trainer_log.read_text().count("formed with 2 engine(s)") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    (job.run_dir / "control" / "stop").write_text("stop")  # a clean stop, as on Ctrl-C
    assert job.wait(timeout_s=120) == 75, job.text()[-3000:]
    assert "engine-0 ended (killed by SIGKILL); restarting (1/5)" in job.text()
    assert not (job.run_dir / "control" / "stop").exists()  # served: a resubmission trains on
    assert int(record["weight_version"]) >= steps_at_rejoin - 1
    assert trainer_log.read_text().count("formed with 2 engine(s)") >= 2  # re-formed with the new engine
    caught = [e for e in read_jsonl(job.run_dir / "metrics" / "events.jsonl") if e["event"] == "catch_up"]
    restarted = [e for e in caught if e["engine"] == "engine-0"][-1]
    assert (restarted["outcome"], restarted["seed"]) == ("copied", "engine-1"), caught
    assert int(restarted["version"]) > 0 and restarted["bytes"] > 1e6
    assert [s["step"] for s in job.steps()] == list(range(1, job.steps()[-1]["step"] + 1))
    # Every push checked in the engines (weights.verify_every=1 in the tests' jobs), none differed,
    # and the last one reached the restarted engine's caught-up weights too.
    checks = [line for line in trainer_log.read_text().splitlines() if " verified on " in line]
    assert checks and all(": 0 differ; 24 tensors compared, 0 not checked" in line for line in checks), checks
    assert " verified on 2 engine(s)" in checks[-1]
    assert not [e for e in read_jsonl(job.run_dir / "metrics" / "events.jsonl") if e["event"] == "weights_mismatch"]
