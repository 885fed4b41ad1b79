"""Pipeline files: what is refused (and how it is said), references resolved to paths, inputs a
pending stage will write checked against a stand-in, and --dry-run (which writes nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relax_hpc.config.load import ConfigError
from relax_hpc.pipeline import check, main, read_pipeline, resolve
from tests.integration.conftest import REPO

TINY = REPO / "configs" / "tiny-pipeline.yaml"


def tiny(tmp_path: Path, **changes: Any) -> dict[str, Any]:
    tree = yaml.safe_load(TINY.read_text())
    tree.update({"dir": str(tmp_path / "pipeline"), **changes})
    return tree


def write(tmp_path: Path, tree: dict[str, Any]) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def stages_of(tmp_path: Path, tree: dict[str, Any]) -> list:
    return resolve(read_pipeline(write(tmp_path, tree)), REPO)


SFT = {"name": "sft", "config": "configs/tiny-sft.yaml"}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"dir": "x", "stagez": []}, r"stagez: unknown key; did you mean 'stages'"),
        ({"dir": "x", "stages": [{**SFT, "overide": {}}]}, r"stages.0.overide: unknown key; did you mean 'overrides'"),
        ({"dir": "x", "stages": []}, "a pipeline needs at least one stage"),
        ({"dir": "x", "stages": [SFT, SFT]}, "stage names must differ: sft appears twice"),
        ({"dir": "x", "stages": [{"name": "a"}]}, "stage a needs exactly one of `config` .* and `export`"),
        ({"dir": "x", "stages": [{**SFT, "export": "runs/x"}]}, "stage sft needs exactly one of"),
        ({"dir": "x", "stages": [{**SFT, "overrides": {"run.dir": "y"}}]}, r"may not set run.dir \(a stage's RUN_DIR"),
        (
            {"dir": "x", "executor": "pbs", "stages": [SFT]},
            r"executor: Input should be 'local' or 'slurm'",
        ),
        (
            {"dir": "x", "stages": [{**SFT, "overrides": {"model.path": "${stages.rl.hf}"}}, {**SFT, "name": "rl"}]},
            r"stage sft: \$\{stages.rl.hf\} names a later stage \(or itself\)",
        ),
        ({"dir": "x", "stages": [{"name": "e", "export": "${stages.nowhere.run_dir}"}]}, r"names no stage"),
        (
            {"dir": "x", "stages": [SFT, {"name": "e", "export": "${stages.sft.weights}"}]},
            r"\$\{stages.sft.weights\}: a stage's outputs are run_dir, hf, ckpt",
        ),
        ({"dir": "x", "stages": [SFT, {"name": "e", "export": "${sft.run_dir}"}]}, r"\$\{sft.run_dir\} is not a ref"),
    ],
)
def test_a_bad_pipeline_file_is_refused_naming_what_to_fix(tmp_path, tree, message):
    with pytest.raises(ConfigError, match=message):
        read_pipeline(write(tmp_path, tree))


def test_a_stage_option_is_checked_as_submit_checks_it_and_named_by_its_stage(tmp_path):
    tree = tiny(tmp_path)
    tree["stages"][1]["overrides"]["trainer.lrr"] = 1e-3
    with pytest.raises(ConfigError, match=r"stage rl \(configs/tiny-grpo.yaml\): override trainer.lrr: unknown key "):
        stages_of(tmp_path, tree)
    tree = tiny(tmp_path)
    tree["stages"].append({"name": "again", "config": "configs/tiny-eval.yaml",
                           "overrides": {"eval.models": ["${stages.eval.hf}"]}})  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"stage again: \$\{stages.eval.hf\}: stage eval has no hf \(its outputs: run_dir\)"
    ):
        stages_of(tmp_path, tree)


def test_references_become_the_earlier_stages_paths(tmp_path):
    sft, rl, halfway, evaluation = stages_of(tmp_path, tiny(tmp_path))
    root = tmp_path / "pipeline"
    assert rl.cfg.model.path == str(root / "sft" / "hf") and rl.cfg.run.dir == str(root / "rl")
    assert (halfway.kind, halfway.source, halfway.step) == ("export", root / "rl", 2)
    assert [m.path for m in evaluation.cfg.eval.models] == [str(root / n / "hf") for n in ("sft", "halfway", "rl")]
    assert rl.outputs()["ckpt"] == root / "rl" / "ckpt" / "step-00000004"
    assert [s.cfg.launch.slurm.job_name for s in (sft, rl)] == ["relax_hpc-sft", "relax_hpc-rl"]


def test_inputs_that_pending_stages_write_pass_and_a_real_problem_is_refused_before_anything_runs(tmp_path):
    check(stages_of(tmp_path, tiny(tmp_path)))  # sft/hf, rl/hf, halfway/hf do not exist yet
    tree = tiny(tmp_path)
    tree["stages"][3]["overrides"]["eval.datasets"] = [str(tmp_path / "missing.jsonl")]
    with pytest.raises(ConfigError, match=r"stage eval: eval.datasets.0.path: .*missing.jsonl does not exist"):
        check(stages_of(tmp_path, tree))
    assert not (tmp_path / "pipeline").exists()


def test_the_dry_run_prints_every_stage_and_its_afterok_dependency_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["--config", str(write(tmp_path, tiny(tmp_path, executor="slurm"))), "--dry-run"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("# ---- stage")]
    assert headers == [f"# ---- stage {s}: to run" for s in ("sft (sft)", "rl (rl)", "halfway (export)", "eval (eval)")]
    dependencies = [line for line in out.splitlines() if "--dependency" in line]
    assert dependencies == [f"#SBATCH --dependency='afterok:<job of {s}>'" for s in ("sft", "rl", "halfway")]
    assert out.count("#SBATCH --kill-on-invalid-dep=yes") == 3
    assert f"  path: {tmp_path / 'pipeline' / 'sft' / 'hf'}" in out  # the rl stage's resolved model
    assert not (tmp_path / "pipeline").exists()
