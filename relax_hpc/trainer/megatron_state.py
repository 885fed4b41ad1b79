"""The megatron backend's trainable state: the model wrapped in megatron's DistributedDataParallel,
its distributed optimizer (fp32 master weights and Adam moments sharded over data-parallel ranks),
and their checkpoints (megatron distributed checkpoints in the torch_dist format: DCP files).

Without Transformer Engine or apex, megatron-core 0.16.1 falls back to torch's Adam and to Python
loops for apex's multi-tensor kernels; the functions below put torch's fused and multi-tensor
kernels in their place, and work around what its checkpoint code gets wrong with torch's Adam
(see `load`). Tested on the CPU against megatron's own optimizer (tests/integration/
test_megatron_checkpoint.py) and on a GPU (tests/gpu/test_megatron_backend.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

from relax_hpc.config.schema import TrainerConfig

# The optimizer state in the model's parameter shapes, so a run may resume under other parallel
# sizes (megatron's default, fully_sharded_model_space, saves flattened ranges, which its own
# torch_dist writer refuses: every save failed).
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def trainable(
    module: GPTModel, cfg: TrainerConfig, dtype: torch.dtype, distributed_optimizer: bool
) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """(DistributedDataParallel, megatron optimizer) of a built GPTModel."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
    )
    model = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    # Sum (not average) per-token losses over micro-batches and data-parallel ranks: each loss is
    # already divided by the global mini-batch's counts.
    module.config.calculate_per_token_loss = True
    module.config.no_sync_func = model.no_sync
    module.config.finalize_model_grads_func = lambda models, num_tokens, **_: finalize_model_grads(models, None)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            clip_grad=cfg.max_grad_norm,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [model],
    )
    fuse_adam(optimizer)
    return model, optimizer


def _inner(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The megatron optimizers (each wrapping one torch optimizer) of a possibly chained one."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def torch_optimizers(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers megatron's (possibly chained) optimizer steps."""
    return [inner.optimizer for inner in _inner(optimizer)]


def _sharded_state(model: DistributedDataParallel, optimizer: MegatronOptimizer, loading: bool) -> dict[str, Any]:
    model_sd = model.module.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=SHARDING),
    }


def save(model: DistributedDataParallel, optimizer: MegatronOptimizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)  # megatron's save, unlike torch DCP's, needs it to exist
    dist_checkpointing.save(
        _sharded_state(model, optimizer, loading=False), str(folder), sharded_strategy=("torch_dist", 1)
    )


def load(model: DistributedDataParallel, optimizer: MegatronOptimizer, folder: Path) -> None:
    """Restore the model, the master weights, Adam's moments and its step count.

    megatron reads the optimizer's state into tensors that must exist; before the first step they
    do not (torch's Adam creates them lazily), so megatron's own dummy step (zero gradients) comes
    first, and the checkpoint overwrites what it did. Then megatron's load_state_dict gives torch's
    Adam the checkpoint's step as one tensor shared by every parameter and copies the loaded
    tensors over every key of each parameter's state: the fully_reshardable tensors have no
    'step' (KeyError), and a shared step would count once per parameter at the next step. So the
    step is taken out between the two and put back after, one tensor per parameter. Under no_grad:
    in fp32 the master weights are views of the model's parameters.
    """
    for inner in _inner(optimizer):
        if not inner.optimizer.state and hasattr(inner, "_init_optimizer_states_with_dummy_values"):
            inner._init_optimizer_states_with_dummy_values()  # the distributed optimizer's
    state = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True), str(folder))
    model.module.load_state_dict(state["model"])
    with _steps_set_aside(optimizer), torch.no_grad():
        optimizer.load_state_dict(state["optimizer"])


@contextlib.contextmanager
def _steps_set_aside(optimizer: MegatronOptimizer) -> Iterator[None]:
    kept: list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor]] = []

    def set_aside(torch_optimizer: torch.optim.Optimizer) -> None:
        for param, state in torch_optimizer.state.items():
            if "step" in state:
                kept.append((torch_optimizer, param, state.pop("step")))

    hooks = [inner.optimizer.register_load_state_dict_post_hook(set_aside) for inner in _inner(optimizer)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    for torch_optimizer, param, step in kept:
        torch_optimizer.state[param]["step"] = step.clone()


def fuse_adam(optimizer: MegatronOptimizer) -> None:
    """Without Transformer Engine or apex, megatron steps torch's Adam with its default multi-tensor
    (foreach) kernels, several passes over the fp32 master weights; torch's fused Adam does it in
    one. `fused` is read from the parameter groups at each step, before any state exists."""
    for inner in _inner(optimizer):
        if isinstance(inner.optimizer, torch.optim.Adam):
            for group in inner.optimizer.param_groups:
                group.update(fused=True, foreach=False)


def use_torch_multi_tensor_ops() -> None:
    """megatron's fallbacks for apex's multi-tensor kernels (no TE, no apex) loop in Python, and the
    gradient norm's reads every parameter's norm back to the host, one sync per tensor (hundreds
    per step): put torch's own multi-tensor kernels in their place, one launch for all tensors."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def foreach_l2_norm(
    chunk_size: int,
    noop_flag: torch.Tensor | None,
    tensor_lists: list[list[torch.Tensor]],
    per_tensor: bool,
    *args: Any,
) -> tuple[torch.Tensor, None]:
    """amp_C.multi_tensor_l2norm's contract: ([1] norm of all tensors of tensor_lists[0], None)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensor_lists[0]))).reshape(1), None


def foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor | None, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    src, dst = tensor_lists
    if src is dst:  # clipping scales the gradients in place
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))
