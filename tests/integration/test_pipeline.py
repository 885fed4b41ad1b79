"""configs/tiny-pipeline.yaml with the local executor: sft -> rl -> export -> eval stage after stage;
the same pipeline again runs nothing; a stage added after them that fails stops the pipeline
with its cause in one line, and the stage after it never runs. Its rl stage exports its best
evaluated version (ckpt.export_version=best): the HF folder holds that checkpoint's weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from relax_hpc.ckpt.best import best_version, read_record
from relax_hpc.ckpt.export import torch_backend_tensors
from relax_hpc.metrics.jsonl import read_jsonl
from relax_hpc.metrics.summary import eval_scores, run_summary
from relax_hpc.paths import CkptDirs, RunPaths
from relax_hpc.pipeline import render, status
from tests.integration.conftest import REPO

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


def assert_exports_the_best(paths: RunPaths, steps: int) -> None:
    """Every evaluated version was checkpointed (eval_every 2: versions 2 and 4, besides the base
    model's 0), RUN_DIR/hf holds the best one's weights bit for bit, and EXPORT.json and the
    summary name it."""
    scored = eval_scores(paths, "greedy_accuracy")
    assert sorted(scored) == [0, 2, steps]
    best = best_version(scored, [2, steps])
    assert best is not None and (CkptDirs(paths.ckpt).step(best) / "trainer_state.json").is_file()
    record = read_record(paths.export)
    assert record is not None and (record["version"], record["value"]) == (best, scored[best]), record
    exported = load_file(paths.export / "model.safetensors")
    checkpoint = torch_backend_tensors(CkptDirs(paths.ckpt).step(best))
    assert exported.keys() <= checkpoint.keys()
    assert all(exported[k].equal(checkpoint[k]) for k in exported)
    assert f"HF model:   {paths.export} (version {best}: {record['why']})" in run_summary(paths, steps)
