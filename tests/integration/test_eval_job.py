"""Evaluation as a job (kind=eval) through submit: a run's checkpoint and an HF folder, each served
by an engine of its own, scored by the run's reward; an interrupted job resumed from its record
and a finished one left alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from relax_hpc.config.load import load_config
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.status import collect, render
from tests.integration.conftest import REPO
from tests.runs import train_and_checkpoint

pytestmark = [pytest.mark.integration]

PROBLEMS = 24
POLICY, TEACHER = REPO / "assets" / "tiny-qwen3-addition", REPO / "assets" / "tiny-qwen3-addition-teacher"


def submit(run_dir: Path, checkpoint: Path) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "relax_hpc.submit", "--config", str(REPO / "configs" / "tiny-eval.yaml"),
        f"run.dir={run_dir}", "eval.k=4", f"eval.datasets=[{{path: assets/addition.jsonl, limit: {PROBLEMS}}}]",
        f"eval.models=[{{checkpoint: {checkpoint}, name: policy}}, {{path: {TEACHER}, name: teacher}}]",
        "metrics.tensorboard=true",
    ]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 90) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def processes_of(run_dir: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


def greedy_accuracy(path: Path, problems: int = PROBLEMS, dataset: Path = REPO / "assets" / "addition.jsonl") -> float:
    """A model's greedy accuracy on the first `problems` prompts of `dataset`, computed here: HF
    weights, the engines' sampler, exact match."""
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    rows = [json.loads(line) for line in dataset.read_text().splitlines()][:problems]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    with torch.no_grad():
        out = sample(model, prompts, [spec] * len(prompts), [0] * len(prompts), tok.eos_token_id, tok.pad_token_id)
    answers = [tok.decode(o.output_ids, skip_special_tokens=True).strip() for o in out]
    return sum(a == r["answer"] for a, r in zip(answers, rows, strict=True)) / len(rows)


def test_an_eval_job_scores_two_models_resumes_after_an_interruption_and_then_does_nothing(tmp_path):
    rl = load_config(REPO / "configs" / "tiny-grpo.yaml", [f"run.dir={tmp_path / 'rl'}"], base_dir=REPO)
    train_and_checkpoint(rl, steps=0)  # the untrained policy as a run's checkpoint (torch DCP)
    checkpoint = tmp_path / "rl" / "ckpt" / "latest"
    run_dir = tmp_path / "eval"
    results = run_dir / "eval" / "results.jsonl"
    job = submit(run_dir, checkpoint)
    deadline = time.monotonic() + 60
    while not read_jsonl(results):  # the first model scored: interrupt the job while it moves on
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    code, out = finish(job)
    assert code == 75 and "interrupted" in out, out[-3000:]
    assert processes_of(run_dir) == [], out  # its engines ended with it
    facts = collect(run_dir)
    assert (facts["state"], facts["pairs_scored"], facts["pairs"]) == ("stopped (resumable)", 1, 2)
    first = read_jsonl(results)
    assert [r["model"] for r in first] == ["policy"]
    assert first[0]["greedy_accuracy"] == greedy_accuracy(POLICY)  # the checkpoint exported and served

    code, out = finish(submit(run_dir, checkpoint))
    assert code == 0, out[-3000:]
    assert "1 of 2 model x dataset pairs to score" in out
    records = read_jsonl(results)
    assert records[0] == first[0]  # resumed at the teacher: the policy was not scored again
    teacher = records[1]
    assert (teacher["model"], teacher["problems"], teacher["samples"]) == ("teacher", PROBLEMS, PROBLEMS * 5)
    assert teacher["greedy_accuracy"] == greedy_accuracy(TEACHER)
    for r in records:
        assert 0 <= r["mean_at_k"] <= r["pass_at_k"] <= 1
        assert r["pass_at"]["1"] == pytest.approx(r["mean_at_k"])  # exact-match rewards are 0 or 1
    table = (run_dir / "eval" / "table.md").read_text()
    assert f"| teacher | {teacher['greedy_accuracy']:.3f} | {teacher['mean_at_k']:.3f} |" in table
    assert (run_dir / "plots" / "eval.png").read_bytes().startswith(b"\x89PNG")

    code, out = finish(submit(run_dir, checkpoint))
    assert code == 0 and "already complete" in out and "| teacher |" in out, out[-3000:]
    assert read_jsonl(results) == records
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["0", "1"]  # no engine started
    assert "1 of 2 model x dataset pairs to score" in (run_dir / "logs" / "1" / "eval.log").read_text()
    shown = render(collect(run_dir))
    assert "state:       complete" in shown and "2/2 model x dataset pairs scored" in shown and table in shown
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()  # each model once, at its place in eval.models, across the three starts
    greedy = [(e.step, e.value) for e in accumulator.Scalars("eval/addition/greedy_accuracy")]
    assert greedy == [(0, pytest.approx(records[0]["greedy_accuracy"])), (1, pytest.approx(teacher["greedy_accuracy"]))]
