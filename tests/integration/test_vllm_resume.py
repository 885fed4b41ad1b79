"""A resumed run on a real vLLM server reproduces the uninterrupted one (issue 25).

The embedded default, shortened and on-policy (each batch is sampled by the weights of the step
before, so a resumed run can match an uninterrupted one), on one vLLM engine (.venv-vllm): once to
step STEPS, and once stopped after step STOP_AT with a checkpoint (control/stop, as on Ctrl-C or a
time limit) and started again to STEPS. The restarted vLLM server is sampled from the
checkpoint's weights, pushed through vLLM's weight-transfer routes. The interrupted run pushes
deltas (weights.delta: after each group's whole first push, only the changed elements), the
reference whole versions. Every step's loss and reward
and every trained sample's tokens and reward are the reference's bit for bit (tests/runs.py's
assert_reproduces, as for the built-in engine in test_resume.py): vLLM's CPU build samples each
request with the driver's seed, and nothing the run needs is missing from the checkpoint.
tools/bench/vllm_resume.py runs the same with more steps and engines (BENCHMARKS.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.config import load_config
from relax_hpc.engines.vllm_engine import engine_python
from tests.integration.conftest import CONFIG, REPO, Job
from tests.runs import assert_reproduces

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS, STOP_AT = 4, 2


def test_a_run_stopped_and_resumed_on_vllm_reproduces_the_uninterrupted_one(tmp_path: Path) -> None:
    assert Path(engine_python(load_config(CONFIG, [], base_dir=REPO).rollout.vllm)).exists(), "bash tools/install.sh"
    rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
    data = tmp_path / "addition-9.jsonl"
    data.write_text("\n".join(rows[::12]) + "\n")
    overrides = (
        "rollout.engine=vllm", "rollout.vllm.max_model_len=64", "rollout.num_engines=1",
        "rollout.max_staleness=0", f"data.path={data}", "rollout.prompts_per_step=9",
        f"trainer.total_steps={STEPS}", f"ckpt.every_steps={STOP_AT}", "rollout.eval_every=0",
        "ckpt.keep_trained_batches=true",
        "model.dtype=bfloat16", "trainer.lr=1e-6",  # most steps change few bf16 elements: the deltas are small
    )  # fmt: skip
    reference = Job(tmp_path / "reference", *overrides).start()
    # The interrupted run pushes deltas (weights.delta), the reference whole versions.
    interrupted = Job(tmp_path / "resumed", *overrides, "weights.delta=true").start()  # side by side
    try:
        interrupted.wait_for_step(STOP_AT, timeout_s=400)
        (interrupted.run_dir / "control" / "stop").write_text("stop")
        assert interrupted.wait(timeout_s=120) == 75, interrupted.text()[-3000:]  # stopped, resumable
        stopped_at = max(s["step"] for s in interrupted.steps())
        assert stopped_at < STEPS, "the run ended before the stop took effect: nothing was resumed"
        assert interrupted.run(timeout_s=400) == 0, interrupted.text()[-3000:]
        assert reference.wait(timeout_s=400) == 0, reference.text()[-3000:]
    finally:
        for job in (reference, interrupted):
            if job.proc is not None and job.proc.poll() is None:
                job.kill_all()
    trainer_log = (interrupted.run_dir / "logs" / "1" / "trainer.log").read_text()
    assert f"resumed from step {stopped_at}" in trainer_log  # the second start began at the checkpoint
    assert_reproduces(reference.run_dir, interrupted.run_dir, STEPS)
    # Each step's push was a delta (a whole push, the version an attempt starts from, has share 1.0):
    # 2.5-3.9 % of the elements changed here. A step of a resumed attempt trained on a batch already
    # sampled, before its engine was up again, pushed to none and records no share.
    shares = [s["weights_changed_share"] for s in interrupted.steps() if "weights_changed_share" in s]
    assert len(shares) >= STEPS - 1 and all(0 < share < 0.1 for share in shares), shares
    assert all("weights_changed_share" not in s for s in reference.steps())
