"""What the engines call the trainer's parameters: the same names and tensors (the built-in engine
loads the policy as the trainer does), or the HF checkpoint's layout (an SGLang engine loads
weights named and shaped as in the model's checkpoint, which for some models differs from
transformers' in-memory layout: fused MoE experts, an Omni thinker's names).

A layout is worked out once, on meta tensors: every trainer parameter maps to one or more engine
tensors, so the bucket plan is fixed and each push converts tensor by tensor on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

Spec = tuple[str, torch.Size, torch.dtype]
Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class EngineLayout:
    """The engine-side (name, tensor) stream of a parameter stream."""

    def __init__(self, specs: Iterable[Spec], convert: Convert | None = None) -> None:
        self.convert = convert
        self.outputs: dict[str, list[Spec]] = {}
        for name, shape, dtype in specs:
            if convert is None:
                self.outputs[name] = [(name, torch.Size(shape), dtype)]
                continue
            meta = convert({name: torch.empty(shape, dtype=dtype, device="meta")})
            self.outputs[name] = [(n, t.shape, t.dtype) for n, t in meta.items()]

    def specs(self) -> list[Spec]:
        return [spec for outputs in self.outputs.values() for spec in outputs]

    def tensors(self, params: Iterable[tuple[str, torch.Tensor | None]]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The engine tensors of each parameter in turn (None stays None: a rank that only joins
        the gather)."""
        for name, tensor in params:
            if tensor is None or self.convert is None:
                yield from ((n, tensor) for n, _, _ in self.outputs[name])
                continue
            converted = self.convert({name: tensor})
            for n, _, _ in self.outputs[name]:
                yield n, converted[n]
