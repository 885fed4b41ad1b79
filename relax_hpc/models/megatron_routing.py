"""Rollout routing replay in megatron-core's MoE layers (relax_hpc/models/routing.py says why; this
is the same for the megatron backend's GPTModel).

megatron-core 0.16.1 has the mechanism: a model built with `moe_enable_routing_replay` gives each
`TopKRouter` a `RouterReplay`, whose REPLAY_FORWARD action takes the top-k indices it is given in
place of its own and computes the weights from the router's own logits at those experts (softmax
over the k chosen for top-k-then-softmax, the renormalised Qwen3-MoE form; the full softmax
gathered at them otherwise), so the router still gets its gradient. Its static helpers address
every router of the process (the reference's and the teacher's too), so the routers of one model
are set here one by one, by their global layer number (pipeline stages hold later layers).

A position the engine recorded nothing for (the last token of each sample, the packing filler)
is sent to experts 0..k-1: its output reaches no loss token (causal attention; nothing attends to
a sample's last token, or to the filler, which is a document of its own), and without a capacity
factor or a load-balancing loss no other token's routing depends on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from torch import nn


def routers(model: nn.Module) -> list[TopKRouter]:
    """This rank's MoE routers (its pipeline stage's layers), in layer order."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@contextmanager
def recording(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The experts this rank's routers dispatched each token to, one entry per forward: long
    [tokens, layers * top_k] in the spool's layout, each layer's k ascending."""
    calls: list[torch.Tensor] = []
    layers: list[torch.Tensor] = []
    found = routers(model)

    def record(router: TopKRouter, _: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        routing_map = out[1]  # bool [tokens, experts]
        layers.append(routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1))
        if router is found[-1]:
            calls.append(torch.cat(layers, dim=1))
            layers.clear()

    hooks = [r.register_forward_hook(record) for r in found]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


@contextmanager
def replaying(model: nn.Module, chosen: torch.Tensor) -> Iterator[None]:
    """The forward inside routes token t of the (packed) input through the experts chosen[t] holds
    for each MoE layer: long [tokens, layers * top_k] in the spool's layout, -1 where nothing was
    recorded (those positions go to experts 0..k-1)."""
    found = routers(model)
    if not found:
        raise ValueError("routing replay needs an MoE model (algo.off_policy.routing_replay)")
    if any(r.router_replay is None for r in found):
        raise ValueError("routing replay: the model was built without moe_enable_routing_replay")
    top_k = found[0].topk
    per_layer = chosen.reshape(chosen.shape[0], -1, top_k)
    if per_layer.shape[1] != found[0].config.num_layers:
        raise ValueError(
            f"routing replay: the batch holds choices for {per_layer.shape[1]} MoE layers of top-{top_k}; "
            f"the model has {found[0].config.num_layers}"
        )
    unrecorded = torch.arange(top_k, device=chosen.device).expand(chosen.shape[0], top_k)
    try:
        for router in found:
            forced = per_layer[:, router.layer_number - 1]  # megatron numbers layers from 1, globally
            recorded = (forced >= 0).all(-1, keepdim=True)
            replay = router.router_replay
            assert replay is not None, "checked above"
            replay.set_target_indices(torch.where(recorded, forced, unrecorded))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for router in found:
            assert router.router_replay is not None, "checked above"
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
