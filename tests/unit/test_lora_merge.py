"""The engine-side LoRA merge (relax_hpc.weights.lora): each version lands on the base weights."""

import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from relax_hpc.config.schema import LoraConfig
from relax_hpc.models.lora import add_adapters, read_adapter_folder, scaling, sync_name, write_adapter_folder
from relax_hpc.weights.lora import SCALING, AdapterMerger, merged

TINY = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-addition")


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.q_proj.lora_A.weight": torch.randn(2, 6, generator=g),
        "layer.q_proj.lora_B.weight": torch.randn(4, 2, generator=g),
        SCALING: torch.tensor([1.5]),
    }


def test_every_version_is_merged_onto_the_base_not_onto_the_previous_one():
    base = torch.randn(4, 6)
    params = {"layer.q_proj.weight": torch.nn.Parameter(base.clone()), "layer.k_proj.weight": torch.nn.Parameter(base)}
    merger = AdapterMerger(params, torch.device("cpu"))
    for version in (1, 2, 3):
        adapter = _adapter(version)
        merger.slots(list(adapter), ["float32"] * 3, [list(t.shape) for t in adapter.values()])
        for name, t in adapter.items():  # what the bucket receiver writes
            merger.adapter[name].copy_(t)
        merger.merge()
        a, b = adapter["layer.q_proj.lora_A.weight"], adapter["layer.q_proj.lora_B.weight"]
        assert torch.equal(params["layer.q_proj.weight"], merged(base, a, b, 1.5)), version  # as the trainer merges
        torch.testing.assert_close(params["layer.q_proj.weight"], base + 1.5 * b @ a)
    assert torch.equal(params["layer.k_proj.weight"], base)  # not a target: untouched


def test_adapter_folders_round_trip_and_the_base_comes_back(tmp_path):
    """Adapter sync: an engine reads the PEFT folder the trainer wrote to the same tensors and
    scaling, merges it onto the base, and a request without an adapter gets the base back."""
    cfg = LoraConfig(rank=2, alpha=3, target_modules=["q_proj"])
    adapter = _adapter(1) | {SCALING: scaling(cfg)}
    write_adapter_folder(tmp_path / "v1", cfg, "base-model", adapter)
    read = read_adapter_folder(tmp_path / "v1")
    assert read.keys() == adapter.keys() and all(torch.equal(read[k], adapter[k]) for k in adapter)
    base = torch.randn(4, 6)
    params = {"layer.q_proj.weight": torch.nn.Parameter(base.clone())}
    merger = AdapterMerger(params, torch.device("cpu"))
    merger.apply(read)
    a, b = adapter["layer.q_proj.lora_A.weight"], adapter["layer.q_proj.lora_B.weight"]
    assert torch.equal(params["layer.q_proj.weight"], merged(base, a, b, 1.5))
    merger.apply(None)
    assert torch.equal(params["layer.q_proj.weight"], base)


def test_a_module_trained_whole_travels_in_the_folder_and_is_restored_with_the_base(tmp_path):
    """trainer.lora.modules_to_save: the folder holds the module's weight (as PEFT writes it), the
    engine sets it with the merge and puts the base's back for a request without an adapter."""
    cfg = LoraConfig(rank=2, alpha=3, target_modules=["q_proj"], modules_to_save=["norm"])
    norm = torch.randn(6)
    write_adapter_folder(tmp_path / "v1", cfg, "base-model", _adapter(1) | {"norm.weight": norm})
    read = read_adapter_folder(tmp_path / "v1")
    assert torch.equal(read["norm.weight"], norm)
    base = torch.ones(6)
    params = {
        "layer.q_proj.weight": torch.nn.Parameter(torch.randn(4, 6)),
        "norm.weight": torch.nn.Parameter(base.clone()),
    }
    merger = AdapterMerger(params, torch.device("cpu"))
    merger.apply(read)
    assert torch.equal(params["norm.weight"], norm)
    merger.apply(None)
    assert torch.equal(params["norm.weight"], base)


def test_modules_to_save_train_beside_the_adapters_and_peft_loads_them_as_trained(tmp_path):
    """The final norm and the tied embedding train whole beside the adapters; their PEFT folder
    loads (peft.PeftModel) as exactly the trainer's policy, the tied output embedding included."""
    model = AutoModelForCausalLM.from_pretrained(TINY)
    cfg = LoraConfig(rank=2, target_modules=["q_proj"], modules_to_save=["model.norm", "embed_tokens"])
    add_adapters(model, cfg, TINY, seed=0)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= trained.keys()
    assert all(".lora_" in n for n in trained.keys() - {"model.norm.weight", "model.embed_tokens.weight"})
    assert model.lm_head.weight.requires_grad  # tied: the output embedding is the same tensor
    with torch.no_grad():
        for p in trained.values():
            p.add_(0.3 * torch.randn_like(p))
    adapter = {sync_name(n): p.detach().clone() for n, p in trained.items()} | {SCALING: scaling(cfg)}
    write_adapter_folder(tmp_path / "v1", cfg, TINY, adapter)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), str(tmp_path / "v1"))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert read_adapter_folder(tmp_path / "v1").keys() == adapter.keys()  # the engine's names: no lm_head


@pytest.mark.parametrize(
    "wrong, message",
    [("final_norm", "no module name of the model ends with 'final_norm'"), ("lm_head", "name the input one")],
)
def test_a_module_to_save_that_is_absent_or_a_tied_output_is_refused(wrong, message):
    model = AutoModelForCausalLM.from_pretrained(TINY)
    with pytest.raises(ValueError, match=re.escape(message)):
        add_adapters(model, LoraConfig(target_modules=["q_proj"], modules_to_save=[wrong]), TINY, seed=0)
