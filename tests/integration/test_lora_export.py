"""The HF export of a LoRA run (trainer.lora): its checkpoint holds only the adapters and the
modules trained whole (the shipped config's final norm); the export writes them as a PEFT adapter
folder that peft loads onto the base (ckpt.export_lora=adapter), or the base with them merged as
the engines merge them (merged). Both compute what the trained policy computes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from relax_hpc.ckpt.export import convert
from relax_hpc.config.load import load_config
from relax_hpc.inprocess import InProcessRun
from relax_hpc.metrics.summary import run_summary
from relax_hpc.paths import RunPaths
from relax_hpc.weights.lora import merge_all
from tests.runs import train_and_checkpoint

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[InProcessRun, RunPaths]:
    """Three GRPO steps with LoRA adapters (a high learning rate: the adapters move away from
    B = 0, where the policy is still the base), then a checkpoint."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config(REPO / "configs/tiny-grpo-lora.yaml", [f"run.dir={run_dir}", "trainer.lr=0.01"])
    return train_and_checkpoint(cfg)


@torch.no_grad()
def _logits(model: torch.nn.Module, run: InProcessRun) -> torch.Tensor:
    prompts = run.rounds.prompt_ids[:8]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # the same padding for every model
    return model.eval()(input_ids=ids).logits.float()


def test_the_adapter_folder_loads_with_peft_and_computes_the_policy(trained):
    run, paths = trained
    out = paths.export  # RUN_DIR/hf, as the run's own export (ckpt.export_lora=adapter) writes it
    done = subprocess.run(
        [sys.executable, "tools/dcp_to_hf.py", "--run-dir", str(paths.root), "--out", str(out), "--lora", "adapter"],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.path)
    untrained = _logits(base, run)
    peft_model = PeftModel.from_pretrained(base, str(out))
    policy = _logits(run.backend.model, run)
    assert not torch.allclose(policy, untrained, atol=1e-3)  # the adapters did train
    torch.testing.assert_close(_logits(peft_model, run), policy, rtol=0, atol=1e-5)
    summary = run_summary(paths, run.cfg.trainer.total_steps)  # the folder is named, no export hint
    assert f"HF model:   {out}" in summary and "dcp_to_hf" not in summary, summary


def test_the_merged_export_holds_what_the_engines_hold(trained, tmp_path):
    run, paths = trained
    out = tmp_path / "merged"
    convert(paths.root, out, lora_format="merged")
    exported = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(run.cfg.model.path).state_dict()
    engines = merge_all(base, dict(run.backend.full_parameters()))  # what a push makes of them
    weights = exported.state_dict()
    assert engines and all(torch.equal(weights[name], t) for name, t in engines.items())
    # The shipped config trains the final norm whole (trainer.lora.modules_to_save): exported as trained.
    assert not torch.equal(weights["model.norm.weight"], base["model.norm.weight"])
    torch.testing.assert_close(_logits(exported, run), _logits(run.backend.model, run), rtol=0, atol=1e-5)
