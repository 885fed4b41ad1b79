"""configs/tiny-pipeline.yaml with the local executor: sft -> rl -> export -> eval stage after stage;
the same pipeline again runs nothing; a stage added after them that fails stops the pipeline
with its cause in one line, and the stage after it never runs. Its rl stage exports its best
evaluated version (ckpt.export_version=best): the HF folder holds that checkpoint's weights. A run
made to unlearn shows that the export is the best version's even when it is not the last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from relax_hpc.ckpt.best import read_record
from relax_hpc.ckpt.export import torch_backend_tensors
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import run_summary
from relax_hpc.paths import CkptDirs, RunPaths
from relax_hpc.pipeline import render, status
from tests.integration.conftest import REPO, Job

pytestmark = [pytest.mark.integration]


def run_pipeline(path: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "relax_hpc.pipeline", "--config", str(path)]
    return subprocess.run(argv, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_tiny_pipeline_runs_stage_after_stage_then_runs_nothing_and_a_failing_stage_stops_it(tmp_path):
    tree = yaml.safe_load((REPO / "configs" / "tiny-pipeline.yaml").read_text())
    root = tmp_path / "pipeline"
    tree["dir"] = str(root)
    tree["stages"][1]["overrides"] |= {"rollout.eval_every": 2, "ckpt.export_version": "best"}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    out = run_pipeline(path)
    assert out.returncode == 0, out.stdout + out.stderr + (root / "logs" / "rl.log").read_text()[-3000:]
    names = ("sft", "rl", "halfway", "eval")
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.endswith(")") and "done" in line] == [
        f"stage {n} ({k})" for n, k in zip(names, ("sft", "rl", "export", "eval"), strict=True)
    ]
    records = read_jsonl(root / "eval" / "eval" / "results.jsonl")
    assert (root / "eval" / "plots" / "eval.png").read_bytes().startswith(b"\x89PNG")  # the three models' scores
    assert [(r["model"], r["model_path"]) for r in records] == [
        ("sft", str(root / "sft" / "hf")), ("rl-step-2", str(root / "halfway" / "hf")), ("rl", str(root / "rl" / "hf")),
    ]  # fmt: skip
    assert (root / "halfway" / "hf" / "model.safetensors").is_file()
    assert_exports_the_best(RunPaths(root / "rl"), steps=4)
    logs = sorted(str(p) for p in root.glob("*/logs/*"))

    again = run_pipeline(path)
    assert again.returncode == 0 and again.stdout.count("finished; skipped") == 4, again.stdout + again.stderr
    assert sorted(str(p) for p in root.glob("*/logs/*")) == logs  # no stage started

    tree["stages"] += [
        {"name": "bad", "export": "${stages.rl.run_dir}", "step": 3},  # rl checkpointed steps 2 and 4
        {"name": "after", "export": "${stages.rl.run_dir}"},
    ]
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    failed = run_pipeline(path)
    assert failed.returncode == 1 and failed.stdout.count("finished; skipped") == 4, failed.stdout + failed.stderr
    line = (
        "pipeline stopped at stage bad (export): exit 1: output: error: no complete checkpoint for step 3 in "
        f"{root / 'rl' / 'ckpt'}"
    )
    assert failed.stderr.strip() == line
    assert not (root / "after").exists()
    shown = render(status(root))
    states = {row.split()[0]: row.split()[2] for row in shown.splitlines()[1:-2]}
    assert states == {"sft": "done", "rl": "done", "halfway": "done", "eval": "done", "bad": "failed", "after": "not"}
    assert shown.splitlines()[-1] == line


def assert_exports_the_best(paths: RunPaths, steps: int) -> int:
    """Every evaluated version was checkpointed (eval_every 2: versions 2 and 4, besides the base
    model's 0), RUN_DIR/hf holds the best one's weights bit for bit, and EXPORT.json and the
    summary name it. The best is found here from eval.jsonl, not by the code under test: the
    highest greedy accuracy among the checkpointed versions, a tie going to the later one
    (docs/config.md, ckpt.export_version). Returns it."""
    scored = evaluations(paths)
    assert sorted(scored) == [0, 2, steps]
    best = max((2, steps), key=lambda v: (scored[v], v))
    assert (CkptDirs(paths.ckpt).step(best) / "trainer_state.json").is_file()
    record = read_record(paths.export)
    assert record is not None and (record["version"], record["value"]) == (best, scored[best]), record
    exported = load_file(paths.export / "model.safetensors")
    checkpoint = torch_backend_tensors(CkptDirs(paths.ckpt).step(best))
    assert exported.keys() <= checkpoint.keys()
    assert all(exported[k].equal(checkpoint[k]) for k in exported)
    assert f"HF model:   {paths.export} (version {best}: {record['why']})" in run_summary(paths, steps)
    return best


def evaluations(paths: RunPaths) -> dict[int, float]:
    """{version: greedy accuracy} as RUN_DIR/metrics/eval.jsonl records them (a later record of a
    version wins, as a resumed run's re-evaluation would)."""
    return {r["version"]: r["greedy_accuracy"] for r in read_jsonl(paths.eval_metrics) if "greedy_accuracy" in r}


# GRPO rewarded for wrong sums (tests/integration/anti_reward.py) from the teacher, which adds well,
# at a learning rate that unlearns in steps rather than at once.
UNLEARN = (
    "model.path=assets/tiny-qwen3-addition-teacher", "reward.name=tests.integration.anti_reward:reward",
    "trainer.total_steps=4", "trainer.lr=2e-4", "trainer.num_ranks=1", "rollout.num_engines=1",
    "rollout.prompts_per_step=8", "rollout.eval_every=2", "ckpt.every_steps=2", "ckpt.export_version=best",
)  # fmt: skip


def test_a_run_that_unlearns_exports_its_best_version_not_its_last(tmp_path):
    """The evaluations score the training sums by exact match (data.eval_path: the same rows with
    "eval": true, which the anti-reward scores so), so greedy accuracy falls as the run unlearns:
    version 2 is strictly better than version 4, the last, and RUN_DIR/hf holds version 2's
    weights, which differ from version 4's.

    Measured here (2 cores, 2026-12-05), greedy accuracy at versions 0/2/4 for run.seed 0, 1, 2, 3:
    0.95/0.63/0.33, 0.95/0.56/0.36, 0.95/0.68/0.49, 0.95/0.49/0.31: version 2 beats the last by
    0.18 to 0.30 (18 to 30 sums of 100); seed 0 gave the same figures twice. At lr 3e-4 the margin
    fell to 0.06 for one seed; at 3e-3 both versions score 0, a tie that makes the last the best.
    The run took 8-17 s alone, 21 s as a test on the loaded machine."""
    rows = (REPO / "assets" / "addition.jsonl").read_text().splitlines()
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps(json.loads(row) | {"eval": True}) + "\n" for row in rows))
    job = Job(tmp_path / "run", *UNLEARN, f"data.eval_path={eval_path}")
    assert job.run(timeout_s=300) == 0, job.text()[-3000:]
    paths = RunPaths(job.run_dir)
    scored = evaluations(paths)
    assert scored.get(2, 0.0) > scored.get(4, 1.0), scored  # else the best is the last: nothing to tell apart
    assert assert_exports_the_best(paths, steps=4) == 2
    exported = load_file(paths.export / "model.safetensors")
    last = torch_backend_tensors(CkptDirs(paths.ckpt).step(4))
    assert any(not exported[k].equal(last[k]) for k in exported)
