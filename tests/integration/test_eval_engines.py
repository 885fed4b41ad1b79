"""rollout.eval_engines: the driver's evaluations on engines of their own, beside generation.

The engine-eval role gets every weight push like the rollout engines and no rollout request; the
driver evaluates on it as a task beside generation, records the same figures, and its final
evaluation of the held-out rows (data.eval_path) equals the exported model's greedy accuracy on
them computed here. (Whether an evaluation
overlaps a batch's generation depends on the load: CI at 351e498 saw none in a 6-step run, so
the overlap is not asserted.)"""

from __future__ import annotations

import pytest

from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import REPO, Job
from tests.integration.test_eval_job import greedy_accuracy

pytestmark = [pytest.mark.integration]

STEPS, EVERY = 6, 2


def test_evaluations_run_on_their_own_engine_beside_generation(tmp_path):
    # the evaluations score data.eval_path's rows, not the 100 training prompts
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join((REPO / "assets" / "addition.jsonl").read_text().splitlines(True)[::3]))
    job = Job(
        tmp_path / "run", f"trainer.total_steps={STEPS}", f"rollout.eval_every={EVERY}", "rollout.eval_engines=1",
        "rollout.prompts_per_step=8", f"data.eval_path={held_out}",
    )  # fmt: skip
    assert job.run(timeout_s=300) == 0, job.text()[-3000:]
    run = job.run_dir
    evals = read_jsonl(run / "metrics" / "eval.jsonl")
    assert [r["version"] // EVERY for r in evals] == list(range(STEPS // EVERY + 1)), evals  # one per eval point
    assert evals[-1]["version"] == STEPS and all(r["problems"] == 34 and r["dataset"] == "held-out" for r in evals)
    assert evals[-1]["greedy_accuracy"] == greedy_accuracy(run / "hf", 34, held_out)  # the same numbers
    batches = [r for r in read_jsonl(run / "metrics" / "rollout.jsonl") if "batch" in r]
    assert max(r["engines"] for r in batches) == 2  # of 3 engines: the evaluation one took no rollout request
    assert (run / "logs" / "0" / "engine-eval-0.log").is_file()
