"""LoRA weight sync: only the adapters travel, and the engine merges them into its base weights.

A LoRA push (trainer.lora) sends, through the same buckets as a full one, every adapter's A and B
(named `<module>.lora_A.weight`, `<module>.lora_B.weight`, as in a PEFT adapter file without its
`base_model.model.` prefix), one float32 tensor `lora_scaling` (alpha / rank) and the weights of
the modules trained whole (trainer.lora.modules_to_save) under their own names, which the engine
receives into its parameters as a full push's (and a PEFT file holds them so too). The engine keeps
a copy of each target module's base weight, taken before its first merge, and sets the weight to
`merged(base, A, B, scaling)` after the last bucket of a version: every version is merged onto
the base, never onto the previous version, so the engine's weights are exactly the trainer's
merged weights (the same function computes both), whatever versions it missed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from relax_hpc.weights.buckets import DTYPES

SCALING = "lora_scaling"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter_tensor(name: str) -> bool:
    return name == SCALING or name.endswith((_A, _B))


def merged(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The effective weight of a target module: base + scaling x B A, in the base's dtype; one
    fused op (no weight-sized temporaries), written into `out` when given."""
    return torch.addmm(base, b.to(base.dtype), a.to(base.dtype), alpha=scaling, out=out)


def replaced_weight(name: str) -> str | None:
    """The model weight an adapter tensor sets: a target's weight for its A, the tensor's own
    name for a module trained whole (trainer.lora.modules_to_save); None for B and the scaling."""
    if name.endswith(_A):
        return f"{name[: -len(_A)]}.weight"
    return None if is_adapter_tensor(name) else name


def merge_all(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], out: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The weight of every module `adapter` (sync names, SCALING included) sets, keyed by its
    name (into `out`'s tensors when given): a target's merged weight, a module's trained whole as
    trained."""
    scaling = float(adapter[SCALING])  # one number per version (a host sync on a GPU, once)
    weights = {}
    for name, tensor in adapter.items():
        weight = replaced_weight(name)
        if weight is None:
            continue
        target = None if out is None else out[weight]
        if name.endswith(_A):
            weights[weight] = merged(base[weight], tensor, adapter[name[: -len(_A)] + _B], scaling, target)
        else:
            weights[weight] = tensor if target is None else target.copy_(tensor)
    return weights


class AdapterMerger:
    """Engine side: buffers the received adapter tensors and merges them into the parameters."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter], device: torch.device) -> None:
        self.params, self.device = params, device
        self.adapter: dict[str, torch.Tensor] = {}  # where the receiver writes A, B and the scaling
        self.base: dict[str, torch.Tensor] = {}  # base weights of the modules merged so far

    def slots(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        """Allocate (once) the buffers a bucket's adapter tensors are received into."""
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if is_adapter_tensor(name) and name not in self.adapter:
                self.adapter[name] = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)

    @torch.no_grad()
    def merge(self) -> None:
        """After a version's last bucket: every target weight becomes base + scaling x B A (and
        a module trained whole, when the adapter holds it, its trained weight)."""
        for name in self.adapter:
            weight = replaced_weight(name)
            if weight is not None:
                self.base.setdefault(weight, self.params[weight].detach().clone())
        merge_all(self.base, self.adapter, out=self.params)

    @torch.no_grad()
    def apply(self, adapter: dict[str, torch.Tensor] | None) -> None:
        """Adapter sync (relax_hpc.weights.adapters): the weights become `adapter` (sync names,
        SCALING included) merged onto the base; None: the base itself."""
        self.adapter.clear()
        if adapter is None:
            for name, base in self.base.items():
                self.params[name].copy_(base)
            return
        self.adapter.update({name: t.to(self.device) for name, t in adapter.items()})
        self.merge()
