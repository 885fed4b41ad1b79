"""The engine-side LoRA merge (relax_hpc.weights.lora): each version lands on the base weights."""

import torch

from relax_hpc.config.schema import LoraConfig
from relax_hpc.models.lora import read_adapter_folder, scaling, write_adapter_folder
from relax_hpc.weights.lora import SCALING, AdapterMerger, merged


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
