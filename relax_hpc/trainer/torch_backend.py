"""The `torch` trainer backend: HF transformers models sharded with FSDP2 (fully_shard).

Works on CPU with gloo (the embedded default, tests) and on GPUs with nccl. It owns the policy
and, as the objective needs them, a frozen reference (KL), a frozen teacher (distillation) and a
critic (GAE: the policy's transformer with a scalar head, its own AdamW). Every rank's loss is
divided by counts of the *global* mini-batch and multiplied by the world size, which FSDP's
gradient averaging divides out again (gloo has no pre-multiplied sum, so the divide factor cannot
simply be set to 1): the update is the configured aggregation over the whole mini-batch, however
sharded.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForTokenClassification

from relax_hpc.algos.aggregation import Normalizer, local_counts
from relax_hpc.algos.objective import Advantages, Objective
from relax_hpc.algos.sft import sft_loss
from relax_hpc.algos.stats import Stats
from relax_hpc.config.schema import Aggregation
from relax_hpc.metrics.timing import PhaseTimer
from relax_hpc.models import lora
from relax_hpc.models.hf import (
    checkpoint_layout,
    decoder_layers,
    encoders,
    is_encoder_parameter,
    load_policy,
    pad_token_id,
    torch_dtype,
)
from relax_hpc.trainer.backend import BackendConfig, DistComm, NonFiniteLossError, StepResult
from relax_hpc.trainer.batching import TrainBatch, token_logprobs_and_entropy
from relax_hpc.trainer.schedule import WarmupSchedule
from relax_hpc.weights.layout import Convert
from relax_hpc.weights.lora import SCALING

_Model = TypeVar("_Model", bound=torch.nn.Module)


def _sharded(model: _Model, device: torch.device, compute: torch.dtype | None = None) -> _Model:
    """FSDP2 units: each decoder layer, each encoder (a vision tower must be a unit of its own:
    generate calls it outside the root's forward), then the rest; on a mesh of `device`'s kind
    (FSDP2's default mesh is CUDA's wherever a GPU is visible, and would move a CPU model there).
    With `compute`, the sharded parameters (fp32: the optimizer's master weights) are gathered in
    that dtype for the forward and backward, and gradients are reduced in fp32."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    for encoder in encoders(model).values():
        fully_shard(encoder, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # in place: the class becomes a subclass of FSDPModule
    return model


def _frozen(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    hf_model = load_policy(path, dtype)
    model = _sharded(hf_model.to(device), device)  # type: ignore[arg-type]  # transformers types .to() as taking a model
    model.requires_grad_(False)
    return model.eval()


class TorchBackend:
    def __init__(self, config: BackendConfig, device: torch.device) -> None:
        cfg, algo = config.trainer, config.algo
        model_path = config.model.path
        self.cfg, self.algo, self.device = cfg, algo, device
        self.temperature = config.temperature
        self.objective = Objective(algo, DistComm())
        dtype = torch_dtype(config.model.dtype)
        # bf16 training keeps fp32 master weights and Adam moments, as megatron's mixed precision
        # does: a bf16 weight rounds away any update under half its spacing (2^-9 of the weight
        # or more, so every update at lr 1e-6), and bf16 moments make an update lr only to within
        # their rounding. LoRA trains fp32 adapters beside the frozen base, which stays in dtype.
        master = dtype if cfg.lora is not None else torch.float32
        self.compute = dtype if dtype != master else None  # what forward, backward and the engines use
        hf_model = load_policy(model_path, master)
        if cfg.lora is not None:  # the engines hold the base already: only the adapters are synced
            lora.add_adapters(hf_model, cfg.lora, model_path, config.seed)
        if cfg.gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.freeze_encoder:  # before sharding (FSDP keeps each unit's requires_grad) and after LoRA's adapters
            for encoder in encoders(hf_model).values():
                encoder.requires_grad_(False)
        self.synced = [
            n
            for n, p in hf_model.named_parameters()
            if (p.requires_grad if cfg.lora is not None else not (cfg.freeze_encoder and is_encoder_parameter(n)))
        ]
        # A LoRA checkpoint holds the adapters and their optimizer state, not the frozen base; loading
        # it sets the adapters alone (dcp.load has already refused a checkpoint that lacks one).
        self.state_options = StateDictOptions(ignore_frozen_params=cfg.lora is not None)
        self.load_options = StateDictOptions(ignore_frozen_params=cfg.lora is not None, strict=cfg.lora is None)
        self.model = _sharded(hf_model.to(device), device, self.compute)  # type: ignore[arg-type]  # transformers types .to() as taking a model
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr, betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )  # fmt: skip
        self.scheduler = WarmupSchedule(self.optimizer, cfg.lr, cfg.warmup_steps)
        self.timer = PhaseTimer()
        self.reference = _frozen(model_path, dtype, device) if self.objective.needs_reference else None
        self.teacher: torch.nn.Module | None = None
        if self.objective.needs_teacher and not algo.teacher.num_engines:  # else: the spool has its scores
            assert algo.teacher.path is not None, "the config refuses distill without algo.teacher.path"
            self.teacher = _frozen(algo.teacher.path, dtype, device)
        self.critic: torch.nn.Module | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if self.objective.needs_critic:
            critic = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=master)
            torch.nn.init.zeros_(critic.score.weight)  # start at V = 0: no random initial baseline
            self.critic = _sharded(critic.to(device), device, self.compute)
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=algo.critic.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
            )

    # -- who holds which samples: every rank its own share (FSDP) ------------------------------------

    @property
    def data_rank(self) -> int:
        return dist.get_rank()

    @property
    def data_world(self) -> int:
        return dist.get_world_size()

    reports = True  # every rank's statistics count

    @property
    def pad_token_id(self) -> int:
        return pad_token_id(self.model)

    # -- one rollout batch ----------------------------------------------------------------------

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        assert self.critic is not None, "gae builds the critic"
        out = self.critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return out.logits.squeeze(-1).float()

    @torch.no_grad()
    def _frozen_values(self, batch: TrainBatch) -> torch.Tensor | None:
        return None if self.critic is None else self._values(batch)

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module | None, batch: TrainBatch) -> torch.Tensor | None:
        return None if model is None else self._logprobs_and_entropy(model, batch)[0]

    def _logprobs_and_entropy(self, model: torch.nn.Module, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_and_entropy(model, batch, self.temperature, self.cfg.prefix_sharing)

    def _global_counts(self, parts: list[TrainBatch]) -> list[Normalizer]:
        counts = torch.tensor([local_counts(p.loss_mask) for p in parts], dtype=torch.float64)
        dist.all_reduce(counts)  # host sync: each mini-batch's loss divides by global counts
        return [Normalizer(float(tokens), float(seqs)) for tokens, seqs in counts.tolist()]

    def _minibatches(self, batch: TrainBatch) -> tuple[list[torch.Tensor], list[TrainBatch]]:
        """Row indices and tensors of each mini-batch. A rank with no group in a mini-batch still
        runs it (one row, no loss tokens): forward and backward are collectives under FSDP."""
        rows, parts = [], []
        for r in batch.minibatches(self.algo.minibatches):
            rows.append(r if len(r) else torch.zeros(1, dtype=torch.long))
            parts.append(batch.select(rows[-1]) if len(r) else batch.select(rows[-1]).without_loss())
        return rows, parts

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] + ([self.critic_optimizer] if self.critic_optimizer is not None else [])

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Advantages, then algo.epochs x algo.minibatches optimizer steps on this rank's share of
        the batch (whole prompt groups)."""
        self.model.train()
        batch = batch.to(self.device)
        objective, algo = self.objective, self.algo
        # The ratio's denominator: the rollout's log-probabilities, or the trainer's own before any
        # update (recomputed in a separate pass only when more than one optimizer step follows; with
        # one step it is the detached forward of that step).
        old: torch.Tensor | None
        if objective.old_is_rollout:
            old = batch.rollout_logprobs
        else:
            old = self._frozen_logprobs(self.model, batch) if algo.epochs * algo.minibatches > 1 else None
        ref = self._frozen_logprobs(self.reference, batch)
        teacher = self._frozen_logprobs(self.teacher, batch) if self.teacher is not None else batch.teacher_logprobs
        old_values = self._frozen_values(batch)
        advantages = None if old is None else self._advantages(batch, old, ref, teacher, old_values)
        rows, parts = self._minibatches(batch)
        norms = self._global_counts(parts)
        policy_learns = self.critic is None or step >= algo.critic.warmup_steps
        stats, losses, grad_norm = Stats(), [], 0.0
        self.timer.take()
        for _ in range(algo.epochs):
            for r, part, norm in zip(rows, parts, norms, strict=True):
                logprobs, entropy = self._logprobs_and_entropy(self.model, part)
                if advantages is None:
                    old = logprobs.detach()
                    advantages = self._advantages(batch, old, ref, teacher, old_values)
                assert old is not None, "the advantages come with the old log-probabilities they used"
                loss, part_stats = objective.policy_loss(
                    logprobs,
                    entropy,
                    old[r],
                    part.rollout_logprobs,
                    advantages.advantages[r],
                    part.loss_mask,
                    norm,
                    None if ref is None else ref[r],
                )
                stats.add(part_stats)
                losses.append(self._check_finite(loss, step))
                if policy_learns:
                    grad_norm = self._optimizer_step(loss, self.model, self.optimizer)
                    self.scheduler.step()
                if self.critic is not None:
                    assert self.critic_optimizer is not None and old_values is not None, "built with the critic"
                    assert advantages.returns is not None, "gae: the critic's targets"
                    critic_loss, critic_stats = objective.critic_loss(
                        self._values(part), old_values[r], advantages.returns[r], part.loss_mask, norm
                    )
                    stats.add(critic_stats)
                    self._optimizer_step(critic_loss, self.critic, self.critic_optimizer)
        optimizer_s = self.timer.take().get("optimizer", 0.0)
        return StepResult(stats, sum(losses) / len(losses), grad_norm, self.scheduler.get_last_lr()[0], optimizer_s)

    def sft_step(self, batch: TrainBatch, step: int, aggregation: Aggregation) -> StepResult:
        """Collective: one optimizer step on the response tokens' negative log-likelihood of this
        rank's share of a supervised batch (kind=sft; relax_hpc/algos/sft.py)."""
        self.model.train()
        batch = batch.to(self.device)
        norm = self._global_counts([batch])[0]
        self.timer.take()
        logprobs, _ = token_logprobs_and_entropy(self.model, batch)
        loss, stats = sft_loss(logprobs, batch.loss_mask, aggregation, norm)
        value = self._check_finite(loss, step)
        grad_norm = self._optimizer_step(loss, self.model, self.optimizer)
        self.scheduler.step()
        optimizer_s = self.timer.take().get("optimizer", 0.0)
        return StepResult(stats, value, grad_norm, self.scheduler.get_last_lr()[0], optimizer_s)

    def _advantages(
        self,
        batch: TrainBatch,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        teacher: torch.Tensor | None,
        values: torch.Tensor | None,
    ) -> Advantages:
        return self.objective.advantages(
            batch.rewards, batch.group_ids, batch.loss_mask, old, ref, teacher, values, batch.baselines
        )

    def _check_finite(self, loss: torch.Tensor, step: int) -> float:
        total = loss.detach().clone()
        dist.all_reduce(total)  # host sync: the whole mini-batch's loss, to refuse a NaN step everywhere
        if not torch.isfinite(total):
            raise NonFiniteLossError(f"step {step}: loss is {float(total)}; refusing the optimizer step")
        return float(total)

    def _optimizer_step(self, loss: torch.Tensor, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        optimizer.zero_grad(set_to_none=True)
        (loss * dist.get_world_size()).backward()
        with self.timer.phase("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
            return float(grad_norm)

    # -- weights and checkpoints ----------------------------------------------------------------

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter the engines get (a frozen encoder's stay as
        they loaded; with LoRA, the adapters by their sync names and the scaling,
        relax_hpc.weights.lora); a collective: every rank must iterate."""
        synced = set(self.synced)
        for name, param in self.model.named_parameters():
            if name in synced:
                full = param.full_tensor() if isinstance(param, DTensor) else param
                yield lora.sync_name(name), full.detach().to(self.compute or full.dtype)
        if self.cfg.lora is not None:
            yield SCALING, lora.scaling(self.cfg.lora)

    def weight_stages(self) -> tuple[int, dict[str, int]]:
        return 0, {}  # one stage: every rank holds each full tensor in turn (FSDP2's full_tensor)

    def checkpoint_layout(self) -> Convert:
        return functools.partial(checkpoint_layout, self.model)

    def parameter_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        synced = set(self.synced)
        params = self.model.named_parameters()
        specs = [(lora.sync_name(n), p.shape, self.compute or p.dtype) for n, p in params if n in synced]
        if self.cfg.lora is not None:
            specs.append((SCALING, torch.Size([1]), torch.float32))
        return specs

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.state_options)
        if self.cfg.lora is not None:  # a frozen tied lm_head survives ignore_frozen_params (named under the embedding)
            trained = set(self.synced)
            model_sd = {k: v for k, v in model_sd.items() if k in trained}
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            assert self.critic_optimizer is not None, "built with the critic"
            state["critic"], state["critic_optim"] = get_state_dict(self.critic, self.critic_optimizer)
        return state

    def save_checkpoint(self, folder: Path) -> None:
        dcp.save(self.state_dict(), checkpoint_id=str(folder))

    def load_checkpoint(self, folder: Path) -> None:
        state = self.state_dict()
        dcp.load(state, checkpoint_id=str(folder))
        self.load_state_dict(state)

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self.load_options,
        )
        if self.critic is not None:
            assert self.critic_optimizer is not None, "built with the critic"
            set_state_dict(
                self.critic,
                self.critic_optimizer,
                model_state_dict=state["critic"],
                optim_state_dict=state["critic_optim"],
            )
