"""The engine-side LoRA merge (relax_hpc.weights.lora): each version lands on the base weights."""

import torch

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
