"""MoE routing: which experts each token's router chose, recorded where the engine samples and
replayed where the trainer recomputes (rollout routing replay).

An engine and a trainer compute the router's logits with different kernels, batch shapes and
precision; near a tie the top-k differs, and the trainer then scores a token through other
experts than the ones that sampled it: the importance ratio of that token measures routing, not
policy. Replaying the engine's choices in the training forward removes that part of the
mismatch. The gradient still flows through the chosen experts' router probabilities (the scores
are the softmax of the trainer's own logits at the replayed experts).

Works on the HF MoE layers whose router returns (logits, top-k scores, top-k indices), as
transformers 5's Qwen3-MoE and Qwen3-Omni thinker routers do (`*TopKRouter`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

COMPUTE = -1  # a position without a replayed choice: the router decides (the last token, pads)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def shape(model: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, experts per token), or None for a dense model."""
    found = routers(model)
    top_k: int = getattr(found[0], "top_k", 0) if found else 0
    return (len(found), top_k) if found else None


@contextmanager
def recording(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Every forward's top-k indices per router: calls[forward][layer] = [tokens, top_k]."""
    calls: list[list[torch.Tensor]] = []
    found = routers(model)

    def wrap(layer: int, forward: Any) -> Any:
        def recorded(hidden: torch.Tensor) -> Any:
            logits, scores, indices = forward(hidden)
            if layer == 0:
                calls.append([])
            calls[-1].append(indices.detach().to("cpu", torch.int32))
            return logits, scores, indices

        return recorded

    originals = [r.forward for r in found]
    try:
        for layer, router in enumerate(found):
            router.forward = wrap(layer, router.forward)
        yield calls
    finally:
        for router, original in zip(found, originals, strict=True):
            router.forward = original


@contextmanager
def replaying(model: nn.Module, chosen: torch.Tensor) -> Iterator[None]:
    """The forward inside uses `chosen` [batch, tokens, layers, top_k] where it is not COMPUTE:
    each router's scores become its own softmax probabilities at those experts (renormalised
    where the router normalises its top-k)."""
    found = routers(model)
    flat = chosen.reshape(-1, chosen.shape[-2], chosen.shape[-1])  # [batch*tokens, layers, top_k]

    def wrap(layer: int, router: nn.Module, forward: Any) -> Any:
        def replayed(hidden: torch.Tensor) -> Any:
            logits, scores, indices = forward(hidden)
            forced = flat[:, layer].to(indices.device, indices.dtype)
            use = (forced >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(use, forced, indices)
            probs = F.softmax(logits, dtype=torch.float, dim=-1)
            picked = probs.gather(-1, indices)
            if getattr(router, "norm_topk_prob", False):
                picked = picked / picked.sum(dim=-1, keepdim=True)
            return logits, picked.to(scores.dtype), indices

        return replayed

    originals = [r.forward for r in found]
    try:
        for layer, router in enumerate(found):
            router.forward = wrap(layer, router, router.forward)
        yield
    finally:
        for router, original in zip(found, originals, strict=True):
            router.forward = original
