"""The `torch` trainer backend: an HF transformers causal LM sharded with FSDP2 (fully_shard).

Works on CPU with gloo (the embedded default, tests) and on GPUs with nccl. Every rank's loss is
divided by the *global* number of completion tokens and multiplied by the world size, which
FSDP's gradient averaging divides out again (gloo has no pre-multiplied sum, so the divide factor
cannot simply be set to 1): the update is the token-mean over the whole batch, however sharded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from relax_hpc.algos.grpo import PolicyLossConfig, group_advantages, policy_loss
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.trainer.batching import TrainBatch, token_logprobs_and_entropy


class NonFiniteLossError(RuntimeError):
    """The loss is NaN or infinite; the optimizer step is refused to keep the weights intact."""


class TorchBackend:
    def __init__(
        self, model_path: str, dtype: str, cfg: TrainerConfig, device: torch.device, use_rollout_logprobs: bool
    ) -> None:
        self.cfg = cfg
        self.use_rollout_logprobs = use_rollout_logprobs
        self.device = device
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
        for layer in model.model.layers:
            fully_shard(layer)
        self.model = fully_shard(model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        loss = cfg.loss
        self.loss_cfg = PolicyLossConfig(loss.clip_low, loss.clip_high, loss.entropy_coef)

    def train_step(self, batch: TrainBatch, global_tokens: float, step: int) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (whole prompt groups)."""
        self.model.train()
        batch = batch.to(self.device)
        advantages = group_advantages(batch.rewards, batch.group_ids, self.cfg.loss.normalize_std)
        logprobs, entropy = token_logprobs_and_entropy(self.model, batch)
        old = batch.rollout_logprobs if self.use_rollout_logprobs else logprobs.detach()
        loss, metrics = policy_loss(logprobs, old, advantages, entropy, batch.loss_mask, global_tokens, self.loss_cfg)
        loss_value = loss.detach().clone()
        dist.all_reduce(loss_value)  # host sync: the whole batch's loss, to refuse a NaN step everywhere
        if not torch.isfinite(loss_value):
            raise NonFiniteLossError(f"step {step}: loss is {float(loss_value)}; refusing the optimizer step")
        self.optimizer.zero_grad(set_to_none=True)
        (loss * dist.get_world_size()).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        metrics.update(
            loss=float(loss_value),
            grad_norm=float(grad_norm),
            lr=self.scheduler.get_last_lr()[0],
            adv_abs_sum=float((advantages.abs() * (batch.loss_mask.sum(-1) > 0)).sum()),
        )
        return metrics

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter; a collective: every rank must iterate."""
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, full.detach()

    def parameter_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(name, p.shape, p.dtype) for name, p in self.model.named_parameters()]

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
