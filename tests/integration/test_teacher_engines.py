"""The distillation teacher served by engines (algo.teacher.num_engines): a real teacher engine
scores sequences as the trainer's own teacher would, and a run whose every process is killed
with SIGKILL reproduces the uninterrupted run bit for bit (the spool carries the teacher's
scores; a regenerated batch is scored alike)."""

import asyncio
import socket
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from relax_hpc.exchange.spool import SampleBatch, Spool, read_batch
from relax_hpc.models.hf import load_policy
from relax_hpc.protocol import requests as P
from relax_hpc.protocol.client import EngineClient, EngineRequestError
from relax_hpc.protocol.registry import read_records, write_record
from relax_hpc.rollout.teacher import TeacherScorer
from relax_hpc.status import engines as engines_status
from relax_hpc.trainer.batching import share_of, token_logprobs_and_entropy
from tests.integration.conftest import REPO, Engines, Job, make_run
from tests.integration.test_agentic import trained_batches
from tests.runs import assert_reproduces

pytestmark = [pytest.mark.integration]

CONFIG = REPO / "configs" / "tiny-distill-engines.yaml"
TEACHER = REPO / "assets" / "tiny-qwen3-addition-teacher"
SERVED = ("algo.advantage.estimator=distill", f"algo.teacher.path={TEACHER}", "algo.teacher.num_engines=1")


def addition_batch(tokenizer: PreTrainedTokenizerFast) -> SampleBatch:
    """Two groups of sums with right and wrong answers of different lengths."""
    prompts = [tokenizer(p)["input_ids"] for p in ("3+4=", "3+4=", "9+8=", "9+8=", "9+8=")]
    answers = [tokenizer(a)["input_ids"] + [tokenizer.eos_token_id] for a in ("7", "12", "17", "1", "7")]
    return SampleBatch.from_samples(
        seq=0,
        sequences=[p + a for p, a in zip(prompts, answers, strict=True)],
        prompt_lens=[len(p) for p in prompts],
        logprobs=[[-1.0] * len(a) for a in answers],
        rewards=[0.0] * 5,
        group_ids=[0, 0, 1, 1, 1],
        policy_version=[0] * 5,
        prompt_index=[0, 0, 1, 1, 1],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The SGLang kind runs relax_hpc's SGLang wrapper around tests/integration/fake_sglang_server.py
# (SGLang's own argument parser, the built-in engine's answers): SGLang cannot run here.
KINDS = {"torch": (), "sglang": ("rollout.engine=sglang", "rollout.sglang.module=tests.integration.fake_sglang_server")}


@pytest.mark.parametrize("kind", KINDS)
def test_a_teacher_engine_scores_as_the_trainers_teacher(tmp_path, kind):
    """The driver's scoring requests on a real engine, through the spool and the trainer's
    batching: the advantages' teacher term equals the in-trainer teacher's on the same tokens."""
    cfg, paths = make_run(tmp_path / "run", *SERVED, *KINDS[kind])
    engines = Engines(cfg, paths)
    engines.start("teacher-0")
    try:
        assert [r.engine_id for r in engines.wait_registered(1, folder=paths.teacher_engines)] == ["teacher-0"]
        assert read_records(paths.engines) == []  # not a rollout engine: never pushed to
        (record,) = read_records(paths.teacher_engines)
        assert [(e["id"], e["healthy"]) for e in engines_status(paths)] == [("teacher-0", True)]  # status lists it
        # A teacher engine that died and left its record: its requests go to the live one.
        write_record(paths.teacher_engines, replace(record, engine_id="dead", port=free_port(), instance="gone"))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cfg.model.path)
        batch = addition_batch(tokenizer)
        asyncio.run(TeacherScorer(cfg, paths, wait_s=30).score(batch))
        past = P.GenerateReqInput(input_ids=[5, 6], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=3)  # fmt: skip
        with pytest.raises(EngineRequestError, match="logprob_start_len 3 is past prompt 0's 2 tokens"):
            EngineClient(record.url, paths.read_token(), 10).generate(past)
    finally:
        engines.stop()
    stored = read_batch(Spool(paths.spool).publish(batch, writer="test"))
    assert stored.teacher_logprobs is not None and np.all(stored.teacher_logprobs[stored.loss_mask == 0] == 0)
    tb, _ = share_of(stored, list(range(stored.num_samples)), 0, 1, tokenizer.pad_token_id)
    assert tb.teacher_logprobs is not None
    with torch.no_grad():
        expected, _ = token_logprobs_and_entropy(load_policy(str(TEACHER), torch.float32).eval(), tb)
    mask = tb.loss_mask.bool()
    assert int(mask.sum()) == 12 and bool((tb.teacher_logprobs[mask] < 0).all())
    torch.testing.assert_close(tb.teacher_logprobs[mask], expected[mask], rtol=0, atol=1e-5)


STEPS = 6
OVERRIDES = (
    f"trainer.total_steps={STEPS}", "ckpt.every_steps=2", "rollout.prompts_per_step=8", "rollout.eval_every=0",
    "ckpt.keep_trained_batches=true", "rollout.num_engines=1",
)  # fmt: skip


@pytest.mark.slow
def test_distillation_with_teacher_engines_resumes_exactly_after_kill_9(tmp_path):
    """Every process killed (kill -9) past the first checkpoint, the teacher engine too, then
    started again: the run reproduces its uninterrupted twin bit for bit. That the served
    teacher trains what the trainer's own teacher trains: the test above for the scores, and
    tools/bench/distill_teacher.py over whole runs (equal to 1e-5 until sampling parts them)."""
    reference = tmp_path / "reference"
    assert Job(reference, *OVERRIDES, config=CONFIG).run(timeout_s=400) == 0
    resumed = tmp_path / "resumed"
    job = Job(resumed, *OVERRIDES, config=CONFIG).start()
    job.wait_for_step(3, timeout_s=300)  # past the checkpoint at step 2
    job.kill_all()
    assert Job(resumed, *OVERRIDES, config=CONFIG).run(timeout_s=400) == 0

    assert_reproduces(reference, resumed, STEPS)
    assert (resumed / "logs" / "1" / "teacher-0.log").is_file()
    for batch in trained_batches(resumed):  # every batch trained carried the teacher's scores
        assert batch.teacher_logprobs is not None
        assert bool((batch.teacher_logprobs[batch.loss_mask == 1] < 0).all())
