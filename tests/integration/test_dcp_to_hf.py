"""The HF export (relax_hpc.ckpt.export, tools/dcp_to_hf.py) of a torch-backend checkpoint:
transformers loads the folder, and it generates the same greedy tokens as the trained policy
(which no longer equals the base model); the tool's files are readable like the rest of the
output, and its help names how it is run."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relax_hpc.ckpt.export import ExportError, convert
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.inprocess import InProcessRun
from relax_hpc.models.hf import load_policy
from relax_hpc.paths import RunPaths
from relax_hpc.weights.layout import EngineLayout
from tests.models.qwen3_family import build_qwen3_omni
from tests.runs import train_and_checkpoint

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _greedy(model, run: InProcessRun) -> list[list[int]]:
    prompts = run.rounds.prompt_ids[:20]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    tok = run.tokenizer
    return [
        c.output_ids
        for c in sample(model, prompts, [spec] * len(prompts), [0] * len(prompts), tok.eos_token_id, tok.pad_token_id)
    ]


def test_checkpoint_converts_to_a_folder_that_generates_like_the_policy(tmp_path):
    cfg = load_config(REPO / "configs/tiny-grpo.yaml", [f"run.dir={tmp_path / 'run'}", "trainer.lr=0.003"])
    run, paths = train_and_checkpoint(cfg)

    out = tmp_path / "hf"
    umask = os.umask(0o022)
    try:
        done = subprocess.run(
            [sys.executable, "tools/dcp_to_hf.py", "--run-dir", str(paths.root), "--out", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.umask(umask)
    assert "step-00000003 ->" in done.stdout
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = {name: t.clone() for name, t in run.backend.full_parameters()}
    for name, param in converted.named_parameters():
        assert torch.equal(param, trained[name]), name
    base = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    assert any(not torch.equal(p, trained[n]) for n, p in base.named_parameters())  # it did train
    run.backend.model.eval()
    assert _greedy(converted, run) == _greedy(run.backend.model, run)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()


def test_a_run_without_a_checkpoint_is_refused(tmp_path):
    cfg = load_config(REPO / "configs/tiny-grpo.yaml", [f"run.dir={tmp_path / 'run'}"])
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    with pytest.raises(ExportError, match="no complete checkpoint"):
        convert(paths.root, tmp_path / "hf")
    help_text = subprocess.run(
        [sys.executable, "tools/dcp_to_hf.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert help_text.startswith("usage: python tools/dcp_to_hf.py")


def test_a_trained_omni_thinker_exports_as_the_full_omni_folder_sglang_serves(tmp_path):
    """Qwen3-Omni trains its thinker; the export is the full model's folder (its config.json,
    the thinker's tensors named thinker.*), which the thinker class loads back exactly, and
    whose tensor names are the ones weight sync sends to SGLang engines."""
    model = build_qwen3_omni(tmp_path / "omni")
    overrides = [
        f"run.dir={tmp_path / 'run'}", f"model.path={model}", "data.path=assets/shapes/shapes.jsonl",
        "data.media={image: images}", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.lr=0.01",
    ]  # fmt: skip
    cfg = load_config(REPO / "configs/tiny-vision-grpo.yaml", overrides, base_dir=REPO)
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    run = InProcessRun(cfg)
    run.train(0, 0)
    assert Checkpointer(paths.ckpt, keep=2).save(1, run.backend.save_checkpoint, {}, {"step": 1, "version": 1})
    out = tmp_path / "hf"
    convert(paths.root, out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_omni_moe"
    saved = load_file(out / "model.safetensors")
    assert all(name.startswith("thinker.") for name in saved)
    trained = {name: t.clone() for name, t in run.backend.full_parameters()}
    # Weight sync to SGLang sends the same names and tensors as the export holds.
    layout = EngineLayout(run.backend.parameter_specs(), run.backend.checkpoint_layout())
    sent = dict(layout.tensors(run.backend.full_parameters()))
    assert sent.keys() == saved.keys()
    assert all(tensor is not None and torch.equal(saved[name], tensor) for name, tensor in sent.items())
    back = load_policy(str(out), torch.float32)
    for name, param in back.named_parameters():
        assert torch.equal(param, trained[name]), name
