"""Environments, rewards and partial rollout through the whole system: engine processes, the
driver, trainer ranks; a reward service and a judge engine of their own."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.exchange.spool import read_batch
from relax_hpc.metrics.jsonl import read_jsonl
from tests.integration.conftest import REPO, Job
from tests.integration.test_resume import run_with_kills
from tests.runs import assert_nothing_lost_or_repeated

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SHORT = ("rollout.prompts_per_step=8", "rollout.eval_every=0", "ckpt.keep_trained_batches=true")


def trained_batches(run_dir):
    return [read_batch(p) for p in sorted((run_dir / "spool" / "claimed").glob("step-*/b*.h5"))]


def published_batches(run_dir):
    """Every batch the drivers published: trained, waiting, or set aside by a rollback."""
    spool = run_dir / "spool"
    return trained_batches(run_dir) + [
        read_batch(p) for d in ("ready", "orphaned") for p in sorted((spool / d).glob("b*.h5"))
    ]


@pytest.mark.learning
def test_the_calculator_task_learns_with_engines_and_trainer_ranks(tmp_path):
    """Against a learner at half speed (issue 46, item 5; BENCHMARKS.md, "Learning bars"): at 100
    steps no bar with a 0.05 margin parts the normal and half-rate learners, so the level stays
    0.6 (best 10-step mean from step 20 on, seeds 0-4: lr 5e-4 0.658-0.926, lr 2.5e-4 0.696-0.864)."""
    job = Job(
        tmp_path / "run",
        "trainer.total_steps=100",
        "rollout.eval_every=0",
        config=REPO / "configs/tiny-agentic-grpo.yaml",
    )
    rewards = [r["reward"] for r in job.run_until_learned(0.6, timeout_s=600)]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert first < 0.3 and last >= 0.6, (first, last)  # BENCHMARKS.md, "Tool use"
    rollout = [r for r in read_jsonl(tmp_path / "run" / "metrics" / "rollout.jsonl") if "batch" in r]
    assert rollout[-1]["env_tool_calls"] > rollout[0]["env_tool_calls"]  # it learned to use the tool
    assert 0 < rollout[-1]["masked_token_share"] < 1


class ExactMatchService(BaseHTTPRequestHandler):
    """A reward service: exact match; the first requests get 503 (the driver retries them)."""

    busy = 3
    requests = 0

    def do_POST(self) -> None:  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        cls.requests += 1
        answer: dict[str, object]
        if cls.busy > 0:
            cls.busy -= 1
            status, answer = 503, {"error": "busy"}
        else:
            status, answer = 200, {"reward": float(body["response"].strip() == body["answer"])}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


def test_a_reward_service_over_http_scores_every_sample_of_a_run(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), ExactMatchService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        job = Job(tmp_path / "run", "trainer.total_steps=3", *SHORT, "reward.name=remote", f"reward.remote.url={url}",
                  "reward.remote.backoff_s=0.05")  # fmt: skip
        assert job.run(timeout_s=400) == 0, job.text()[-3000:]
    finally:
        server.shutdown()
    batches = trained_batches(tmp_path / "run")
    samples = sum(b.num_samples for b in batches)
    assert samples == 3 * 8 * 16 and ExactMatchService.requests >= samples + 3  # each once, plus the retried
    tok = PreTrainedTokenizerFast.from_pretrained(REPO / "assets/tiny-qwen3-addition")
    rows = [json.loads(line) for line in (REPO / "assets/addition.jsonl").read_text().splitlines()]
    for b in batches:  # the service's verdicts are the rewards trained on
        for i in range(b.num_samples):
            completion = b.sample_tokens(i)[b.prompt_lens[i] :].tolist()
            text = tok.decode(completion, skip_special_tokens=True)
            assert b.rewards[i] == float(text.strip() == rows[b.prompt_index[i]]["answer"])


def test_a_judge_model_served_by_engines_of_its_own_scores_a_run(tmp_path):
    """The judge (the addition teacher) is asked "a+b=" and its verdict's first digit is the
    reward: every trained reward must be what the judge model says greedily, computed here."""
    teacher = REPO / "assets/tiny-qwen3-addition-teacher"
    judge = (
        "reward.name=judge", f"reward.judge.model={teacher}", "reward.judge.prompt_template='{prompt}'",
        "reward.judge.pattern=(\\d)", "reward.judge.max_new_tokens=3",
    )  # fmt: skip
    job = Job(tmp_path / "run", "trainer.total_steps=2", *SHORT, *judge)
    assert job.run(timeout_s=400) == 0, job.text()[-3000:]
    assert (tmp_path / "run" / "logs" / "0" / "judge-0.log").is_file()
    tok = PreTrainedTokenizerFast.from_pretrained(teacher)
    model = Qwen3ForCausalLM.from_pretrained(teacher).eval()
    rows = [json.loads(line) for line in (REPO / "assets/addition.jsonl").read_text().splitlines()]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    spec = SamplingSpec(max_new_tokens=3, temperature=0.0)
    with torch.no_grad():
        verdicts = sample(model, prompts, [spec] * len(prompts), [0] * len(prompts), tok.eos_token_id, tok.pad_token_id)
    first_digit = [
        float(next(c for c in tok.decode(v.output_ids, skip_special_tokens=True) if c.isdigit())) for v in verdicts
    ]
    for b in trained_batches(tmp_path / "run"):
        assert b.rewards.tolist() == [first_digit[int(i)] for i in b.prompt_index]


# A push aborts only generations in flight. A trainer step here takes about 3 times a batch's
# generation (1.3 s against 0.4 idle), so a driver held 2 batches ahead (the default staleness)
# waits for each version and starts its next batch just after the push: no abort (CI failed so).
# Allowed 12 batches ahead, it generates without pause until its lead is full, about 12 / (3 - 1)
# = 6 trainer steps, and every push in that time meets generations in flight.
PARTIAL = (
    "trainer.total_steps=10", "rollout.partial=true", "rollout.env.name=long_tail", "rollout.max_new_tokens=40",
    "rollout.env.settings={long_share: 0.25, long_tokens: 40}", "rollout.max_staleness=12", "ckpt.every_steps=3",
    *SHORT,
)  # fmt: skip


def test_partial_rollout_continues_across_weight_updates_and_resumes_losing_nothing(tmp_path):
    run_dir = tmp_path / "partial"
    run_with_kills(run_dir, 2, random.Random(5), *PARTIAL, steps=10)
    assert_nothing_lost_or_repeated(run_dir, 10)
    rollout = [r for r in read_jsonl(run_dir / "metrics" / "rollout.jsonl") if "batch" in r]
    assert max(r["continued_total"] for r in rollout) > 0  # generations were aborted and continued
    # Counted over every published batch, trained or waiting, not the trained ones only: which
    # batches the last start trains depends on where the kills fell against the checkpoints. CI
    # once saw no span among the trained ones (cause not found); a run here had 192 spans among
    # 1,280 trained samples and 194 among 1,280 waiting.
    spans = 0
    for b in published_batches(run_dir):
        for i in range(b.num_samples):
            versions = b.token_versions[b.offsets[i] : b.offsets[i + 1]]
            sampled = versions[versions >= 0]
            assert b.policy_version[i] == sampled.min() and b.newest_version[i] == sampled.max()
            spans += int(sampled.max() > sampled.min())
    assert spans > 0  # some completions were sampled by two policy versions, token by token
