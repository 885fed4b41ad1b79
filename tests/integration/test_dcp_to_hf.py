"""tools/dcp_to_hf.py on a torch-backend checkpoint: transformers loads the folder, and it
generates the same greedy tokens as the trained policy (which no longer equals the base model)."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_hpc.ckpt.manager import Checkpointer
from relax_hpc.config.load import load_config, to_yaml
from relax_hpc.engines.sampling import SamplingSpec, sample
from relax_hpc.inprocess import InProcessRun
from relax_hpc.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import dcp_to_hf  # noqa: E402  # tools/ is no package: importable only after the sys.path insert

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
    dcp_to_hf.convert(paths.root, out)
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
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        dcp_to_hf.convert(paths.root, tmp_path / "hf")
