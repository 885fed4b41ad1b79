"""The HF export (relax_hpc.ckpt.export, tools/dcp_to_hf.py) of a torch-backend checkpoint:
transformers loads the folder, and it generates the same greedy tokens as the trained policy
(which no longer equals the base model); the tool's files are readable like the rest of the
output, and its help names how it is run."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_hpc.ckpt.export import ExportError, convert
from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.inprocess import InProcessRun
from relax_hpc.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _greedy(model, run: InProcessRun) -> list[list[int]]:
    prompts = run.prompt_ids[:20]
    spec = SamplingSpec(max_new_tokens=4, temperature=0.0)
    tok = run.tokenizer
    return [
        c.output_ids
        for c in sample(model, prompts, [spec] * len(prompts), [0] * len(prompts), tok.eos_token_id, tok.pad_token_id)
    ]


def test_checkpoint_converts_to_a_folder_that_generates_like_the_policy(tmp_path):
    cfg = load_config(REPO / "configs/tiny-grpo.yaml", [f"run.dir={tmp_path / 'run'}", "trainer.lr=0.003"])
    paths = RunPaths(Path(cfg.run.dir))
    paths.create()
    paths.config.write_text(to_yaml(cfg))
    run = InProcessRun(cfg)
    for step in range(3):
        run.train(step, step)
    assert Checkpointer(paths.ckpt, keep=2).save(3, run.backend.save_checkpoint, {}, {"step": 3, "version": 3})

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
