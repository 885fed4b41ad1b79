"""The `megatron` trainer backend: megatron-core GPTModel on GPUs.

Tensor, pipeline, context and expert parallelism and the distributed optimizer come from
trainer.megatron; weights load from and export to the HF folder's names and layout
(relax_hpc/models/hf_mapping.py), so the engines, the spool and the objective are the same as
with the torch backend. What differs is how a rank's share of the batch is computed:

- samples are packed into micro-batches of at most max_tokens_per_microbatch tokens (no padding;
  attention keeps documents apart), and megatron's pipeline schedule runs them;
- the loss of each micro-batch is the objective on its rows, divided by counts of the whole
  global mini-batch, so the gradients summed over micro-batches and data-parallel ranks
  (calculate_per_token_loss: megatron sums instead of averaging) are the configured aggregation
  over the mini-batch, however sharded;
- log-probabilities come from vocabulary-parallel logits (relax_hpc/trainer/vocab_parallel.py);
- kind=sft's step (sft_step) is the same packed forward and backward with the SFT loss
  (relax_hpc/algos/sft.py) in the objective's place, at temperature 1 (the data's distribution);
- with algo.off_policy.routing_replay, every forward of an MoE model routes each token through the
  experts the engine chose for it (relax_hpc/models/megatron_routing.py);
- a vision-language model (Qwen2.5-VL, Qwen3-VL: relax_hpc/models/megatron_vision.py) gets each
  micro-batch's images and the multimodal RoPE positions transformers computes for the batch; an
  audio-language model (Qwen2-Audio: relax_hpc/models/megatron_audio.py) its clips' features;
- gae's critic is the policy's GPTModel with a scalar head in place of its output layer
  (relax_hpc/models/megatron.py, ValueHead), loaded from model.path, with its own megatron
  optimizer; its value loss is summed over micro-batches like the policy loss;
- checkpoints are megatron's distributed checkpoints in the torch_dist format (PyTorch DCP files),
  which reshard on load, so a run may resume with other parallel sizes (megatron_state.py); the
  critic and its optimizer are a second one in the folder's `critic/`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from transformers import AutoConfig, PretrainedConfig

from relax_hpc.algos.aggregation import Normalizer, local_counts
from relax_hpc.algos.objective import Advantages, Objective
from relax_hpc.algos.sft import sft_loss
from relax_hpc.algos.stats import Stats
from relax_hpc.config.schema import Aggregation, MegatronConfig
from relax_hpc.data.processor import concat_inputs
from relax_hpc.metrics.timing import PhaseTimer
from relax_hpc.models.arch import arch_of
from relax_hpc.models.hf import torch_dtype
from relax_hpc.models.hf_export import Holders, export_hf, hf_stages
from relax_hpc.models.hf_loading import load_hf_weights
from relax_hpc.models.hf_mapping import hf_specs
from relax_hpc.models.megatron import as_value_model, build_model
from relax_hpc.models.megatron_multimodal import MultimodalGPTModel
from relax_hpc.models.megatron_routing import replaying
from relax_hpc.models.megatron_vision import MropePackedSeqParams, mrope_positions, rope_index_model
from relax_hpc.trainer import megatron_state, packing
from relax_hpc.trainer.backend import BackendConfig, DistComm, NonFiniteLossError, StepResult
from relax_hpc.trainer.batching import TrainBatch
from relax_hpc.trainer.schedule import WarmupSchedule
from relax_hpc.trainer.vocab_parallel import logprobs_and_entropy

CRITIC = "critic"  # the critic's checkpoint: a folder inside the policy's
# What a micro-batch's loss function returns to megatron's schedule: the loss, a token count
# (unused: the loss is already divided by the global batch's counts), and the loss to report.
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _loss_output(loss: torch.Tensor) -> LossOutput:
    return loss, torch.ones((), dtype=torch.int, device=loss.device), {"loss": loss.detach()}


def _pad_token_id(hf_config: PretrainedConfig) -> int:
    """The pad token (a multimodal config keeps it in its text config), 0 where none."""
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(hf_config.get_text_config(), "pad_token_id", None)
    return pad if pad is not None else 0


def init_parallel(par: MegatronConfig, seed: int) -> None:
    """megatron's process groups over the trainer's default group, and its CUDA RNG tracker."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_parallel,
        context_parallel_size=par.context_parallel,
        expert_model_parallel_size=par.expert_parallel,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _build(config: BackendConfig, hf_config: PretrainedConfig, path: str, trainable: bool) -> torch.nn.Module:
    model = build_model(
        hf_config,
        config.trainer.megatron,
        torch_dtype(config.model.dtype),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        routing_replay=config.algo.off_policy.routing_replay,
    ).cuda()
    load_hf_weights(model, path)
    model.config.variable_seq_lengths = True  # packed micro-batches differ in length
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    elif config.trainer.freeze_encoder and isinstance(model, MultimodalGPTModel):
        for tower in model.towers():
            tower.requires_grad_(False)  # before DDP and the optimizer: neither takes it
    return model


class MegatronBackend:
    def __init__(self, config: BackendConfig, device: torch.device) -> None:
        cfg, algo, par = config.trainer, config.algo, config.trainer.megatron
        if not parallel_state.model_parallel_is_initialized():
            init_parallel(par, config.seed)
        megatron_state.use_torch_multi_tensor_ops()
        self.cfg, self.algo, self.par, self.device = cfg, algo, par, device
        # Who gets the full tensors: every rank of a stage sends its share (sharded, colocated or
        # not), every rank serves its own engines (colocated), or rank 0 sends them all.
        self.weights_to: Holders = "stage" if config.sharded else "every_rank" if config.colocate else "rank0"
        self.temperature = config.temperature
        self.hf_config = AutoConfig.from_pretrained(config.model.path)
        self.dtype = torch_dtype(config.model.dtype)
        self.pad_token_id = _pad_token_id(self.hf_config)
        # A vision-language model: the weightless HF model whose RoPE index gives the positions.
        self.arch = arch_of(self.hf_config)
        self.rope_index = rope_index_model(self.hf_config) if self.arch.vision else None
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.objective = Objective(algo, DistComm(self.dp_group, device))

        module = _build(config, self.hf_config, config.model.path, trainable=True)
        self.model, self.optimizer = megatron_state.trainable(module, cfg, self.dtype, par.distributed_optimizer)
        self.scheduler = WarmupSchedule(self.optimizer, cfg.lr, cfg.warmup_steps)
        self.timer = PhaseTimer()
        self.reference = (
            _build(config, self.hf_config, config.model.path, False) if self.objective.needs_reference else None
        )
        self.teacher: torch.nn.Module | None = None
        if self.objective.needs_teacher and not algo.teacher.num_engines:  # else: the spool has its scores
            assert algo.teacher.path is not None, "the config refuses distill without algo.teacher.path"
            self.teacher = _build(config, self.hf_config, algo.teacher.path, False)
        self.critic: DistributedDataParallel | None = None
        self.critic_optimizer: MegatronOptimizer | None = None
        if self.objective.needs_critic:
            self.critic, self.critic_optimizer = self._build_critic(config)

    def _build_critic(self, config: BackendConfig) -> tuple[DistributedDataParallel, MegatronOptimizer]:
        if self.arch.tied and self.par.pipeline_parallel > 1:
            # megatron would tie the value head to the first stage's embedding (its gradients, its
            # checkpoint entry) as it ties the output layer.
            raise ValueError(
                "algo.advantage.estimator=gae with trainer.backend=megatron: a model with tied embeddings "
                "needs trainer.megatron.pipeline_parallel=1"
            )
        module = as_value_model(_build(config, self.hf_config, config.model.path, trainable=True))
        critic_cfg = self.cfg.model_copy(update={"lr": config.algo.critic.lr})
        return megatron_state.trainable(module, critic_cfg, self.dtype, self.par.distributed_optimizer)

    # -- who holds which samples ------------------------------------------------------------------

    @property
    def data_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def data_world(self) -> int:
        return parallel_state.get_data_parallel_world_size()

    @property
    def reports(self) -> bool:
        """One rank per data-parallel replica reports statistics: the last pipeline stage computes
        the loss, and its tensor-parallel peers compute the same values."""
        return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0

    # -- micro-batches ------------------------------------------------------------------------------

    def _microbatches(self, batch: TrainBatch) -> list[packing.Microbatch]:
        """This rank's rows packed by token budget; every data-parallel rank runs the same number
        of micro-batches (some padding only), so per-micro-batch collectives stay matched."""
        lengths = batch.attention_mask.sum(1).cpu().numpy()  # the step's one host sync for packing
        bins = packing.plan(lengths.tolist(), self.par.max_tokens_per_microbatch)
        count = torch.tensor([len(bins)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dp_group)
        bins += [[] for _ in range(int(count) - len(bins))]
        multiple = self.tp_size * (2 * self.par.context_parallel if self.par.context_parallel > 1 else 1)
        return packing.pack_all(batch, bins, lengths, self.pad_token_id, multiple, self._mrope(batch))

    def _mrope(self, batch: TrainBatch) -> torch.Tensor | None:
        """A vision-language model's [3, n, width] multimodal RoPE positions of the batch (images
        or not: text rows get theirs too), as the HF model computes them; None for a text model.
        An Omni model's audio items take positions by their clips' lengths (the feature masks)."""
        if self.rope_index is None:
            return None
        # On the CPU: transformers' rope index is per-sample Python over small tensors (on the GPU
        # each of its steps would sync), and its inputs must share one device (a batch on the CPU
        # with grids on the GPU failed on the H200). Only the result travels.
        keys = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "feature_attention_mask")
        layout = [{k: m[k].cpu() for k in keys if k in m} for m in batch.media]
        cpu = (batch.input_ids.cpu(), batch.attention_mask.cpu())
        return mrope_positions(self.rope_index, *cpu, concat_inputs(layout)).to(self.device)

    def _forward(self, model: torch.nn.Module, mb: packing.Microbatch) -> torch.Tensor:
        """The model's output on a packed micro-batch; through the engine's experts where the
        batch carries them (routing replay)."""
        cu = mb.cu_seqlens
        longest = mb.max_seqlen
        params = MropePackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
            mrope_positions=mb.mrope,  # a vision-language model's multimodal RoPE (None: a text model's)
        )  # fmt: skip
        with nullcontext() if mb.routed is None else replaying(model, mb.routed):
            return model(mb.input_ids, mb.position_ids, None, packed_seq_params=params, **mb.media)

    def _token_logprobs(
        self, logits: torch.Tensor, mb: packing.Microbatch, entropy_grad: bool, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row [k, width] log-probabilities and entropies of a micro-batch's targets."""
        logits = logits.reshape(mb.num_tokens, -1)
        lp, ent = logprobs_and_entropy(
            logits,
            mb.targets,
            vocab_start=parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1],
            group=self.tp_group if self.tp_size > 1 else None,
            entropy_grad=entropy_grad,
            temperature=temperature,
            vocab_size=self.arch.vocab,  # columns padded for tensor parallelism are no token
        )
        return mb.unpack(lp), mb.unpack(ent)

    def _run(
        self, model: torch.nn.Module, mbs: list[packing.Microbatch], loss_fn: Callable[..., Any], forward_only: bool
    ) -> list[Any]:
        """megatron's schedule (pipelined when pp > 1) over the micro-batches; `loss_fn(mb,
        logits)` runs on the last stage and returns (loss, stats-or-output)."""
        data = iter(mbs)

        def step(_: object, chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
            mb = next(data)
            return self._forward(chunk, mb), functools.partial(loss_fn, mb)

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data,
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module | None, batch: TrainBatch) -> torch.Tensor | None:
        """[n, width] log-probabilities under `model` on the last pipeline stage (None elsewhere)."""
        if model is None:
            return None
        mbs = self._microbatches(batch)

        def keep(mb: packing.Microbatch, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            lp, _ = self._token_logprobs(logits, mb, entropy_grad=False, temperature=self.temperature)
            return torch.zeros((), device=self.device), {"rows": mb.rows, "logprobs": lp}

        outputs = self._run(model, mbs, keep, forward_only=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        out = torch.zeros_like(batch.loss_mask)
        for o in outputs:
            out[o["rows"]] = o["logprobs"]
        return out

    def _accumulate(
        self, model: DistributedDataParallel, optimizer: MegatronOptimizer, part: TrainBatch,
        loss_fn: Callable[[packing.Microbatch, torch.Tensor], LossOutput],
    ) -> torch.Tensor:  # fmt: skip
        """Forward and backward of `part` over its micro-batches, the gradients summed into fresh
        buffers; returns the summed loss (on the last stage; 0 elsewhere)."""
        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = self._run(model, self._microbatches(part), loss_fn, forward_only=False)
        return sum((o["loss"] for o in outputs), torch.zeros((), device=self.device))

    @torch.no_grad()
    def _frozen_values(self, batch: TrainBatch) -> torch.Tensor | None:
        """[n, width] values of the critic before this batch's updates, on the last pipeline stage
        (None elsewhere and without a critic)."""
        if self.critic is None:
            return None

        def keep(mb: packing.Microbatch, out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return torch.zeros((), device=self.device), {"rows": mb.rows, "values": self._token_values(out, mb)}

        outputs = self._run(self.critic, self._microbatches(batch), keep, forward_only=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        out = torch.zeros_like(batch.loss_mask)
        for o in outputs:
            out[o["rows"]] = o["values"]
        return out

    def _token_values(self, out: torch.Tensor, mb: packing.Microbatch) -> torch.Tensor:
        """The critic's [1, T, 1] output on a packed micro-batch as [k, width] float values."""
        return mb.unpack(out.reshape(mb.num_tokens).float())

    # -- one rollout batch --------------------------------------------------------------------------

    def _old_needed_for_advantages(self) -> bool:
        kl = self.algo.kl
        return self.objective.needs_teacher or (self.objective.needs_reference and kl.placement == "reward")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return megatron_state.torch_optimizers(self.optimizer)

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Advantages, then algo.epochs x algo.minibatches optimizer steps on this rank's share."""
        self.model.train()
        self.timer.take()
        batch = batch.to(self.device)
        objective, algo = self.objective, self.algo
        passes = algo.epochs * algo.minibatches
        old: torch.Tensor | None
        if objective.old_is_rollout:
            old = batch.rollout_logprobs
        elif passes > 1 or self._old_needed_for_advantages():
            old = self._frozen_logprobs(self.model, batch)
        else:
            old = None  # the detached forward of the one optimizer step
        ref = self._frozen_logprobs(self.reference, batch)
        teacher = self._frozen_logprobs(self.teacher, batch) if self.teacher is not None else batch.teacher_logprobs
        old_values = self._frozen_values(batch)
        advantages = None
        if parallel_state.is_pipeline_last_stage():
            base = batch.rollout_logprobs if old is None else old
            advantages = objective.advantages(
                batch.rewards, batch.group_ids, batch.loss_mask, base, ref, teacher, old_values, batch.baselines
            )
        rows = list(batch.minibatches(algo.minibatches))
        norms = self._global_counts(batch, rows)
        policy_learns = self.critic is None or step >= algo.critic.warmup_steps
        stats, losses, grad_norm = Stats(), [], 0.0
        for _ in range(algo.epochs):
            for r, norm in zip(rows, norms, strict=True):
                part = batch.select(r) if len(r) else batch.select(torch.zeros(1, dtype=torch.long)).without_loss()
                index = r.to(self.device) if len(r) else torch.zeros(1, dtype=torch.long, device=self.device)
                loss, part_stats = self._minibatch(part, index, old, advantages, ref, norm)
                stats.add(part_stats)
                losses.append(self._check_finite(loss, step))
                if policy_learns:
                    grad_norm = self._optimizer_step(self.optimizer)
                    self.scheduler.step()
                if self.critic is not None:
                    stats.add(self._critic_minibatch(part, index, old_values, advantages, norm))
        return StepResult(
            stats if self.reports else Stats(),
            sum(losses) / len(losses),
            grad_norm,
            self.scheduler.get_last_lr()[0],
            self.timer.take().get("optimizer", 0.0),
        )

    def sft_step(self, batch: TrainBatch, step: int, aggregation: Aggregation) -> StepResult:
        """Collective: one optimizer step on the response tokens' negative log-likelihood of this
        rank's share of a supervised batch (kind=sft; relax_hpc/algos/sft.py)."""
        self.model.train()
        self.timer.take()
        batch = batch.to(self.device)
        norm = self._global_counts(batch, [torch.arange(len(batch.loss_mask))])[0]
        stats = Stats()

        def loss_fn(mb: packing.Microbatch, logits: torch.Tensor) -> LossOutput:
            lp, _ = self._token_logprobs(logits, mb, entropy_grad=False, temperature=1.0)
            loss, s = sft_loss(lp, batch.loss_mask[mb.rows], aggregation, norm)
            stats.add(s)
            return _loss_output(loss)

        value = self._check_finite(self._accumulate(self.model, self.optimizer, batch, loss_fn), step)
        grad_norm = self._optimizer_step(self.optimizer)
        self.scheduler.step()
        return StepResult(
            stats if self.reports else Stats(),
            value,
            grad_norm,
            self.scheduler.get_last_lr()[0],
            self.timer.take().get("optimizer", 0.0),
        )

    def _global_counts(self, batch: TrainBatch, rows: list[torch.Tensor]) -> list[Normalizer]:
        counts = torch.tensor(
            [local_counts(batch.loss_mask[r]) if len(r) else (0.0, 0.0) for r in rows], dtype=torch.float64
        ).to(self.device)
        dist.all_reduce(counts, group=self.dp_group)
        return [Normalizer(float(tokens), float(seqs)) for tokens, seqs in counts.tolist()]

    def _minibatch(
        self,
        part: TrainBatch,
        index: torch.Tensor,
        old: torch.Tensor | None,
        advantages: Advantages | None,
        ref: torch.Tensor | None,
        norm: Normalizer,
    ) -> tuple[torch.Tensor, Stats]:
        """Forward and backward of one mini-batch; its loss and the objective's statistics."""
        stats = Stats()
        entropy_grad = self.algo.policy_loss.entropy_coef > 0

        def pick(t: torch.Tensor, mb: packing.Microbatch) -> torch.Tensor:
            return t[index][mb.rows]

        def loss_fn(mb: packing.Microbatch, logits: torch.Tensor) -> LossOutput:
            assert advantages is not None, "the loss runs on the last pipeline stage, which has the advantages"
            lp, ent = self._token_logprobs(logits, mb, entropy_grad, self.temperature)
            mask = part.loss_mask[mb.rows]
            loss, s = self.objective.policy_loss(
                lp,
                ent,
                lp.detach() if old is None else pick(old, mb),
                part.rollout_logprobs[mb.rows],
                pick(advantages.advantages, mb),
                mask,
                norm,
                None if ref is None else pick(ref, mb),
            )
            stats.add(s)
            return _loss_output(loss)

        return self._accumulate(self.model, self.optimizer, part, loss_fn), stats

    def _check_finite(self, loss: torch.Tensor, step: int) -> float:
        total = loss.detach().float() * float(self.reports)
        dist.all_reduce(total)  # host sync: the whole mini-batch's loss, to refuse a NaN step everywhere
        if not torch.isfinite(total):
            raise NonFiniteLossError(f"step {step}: loss is {float(total)}; refusing the optimizer step")
        return float(total)

    def _critic_minibatch(
        self,
        part: TrainBatch,
        index: torch.Tensor,
        old_values: torch.Tensor | None,
        advantages: Advantages | None,
        norm: Normalizer,
    ) -> Stats:
        """One optimizer step of the critic on a mini-batch (PPO's clipped value loss against the
        GAE returns); its statistics."""
        assert self.critic is not None and self.critic_optimizer is not None, "built with the critic"
        stats = Stats()

        def loss_fn(mb: packing.Microbatch, out: torch.Tensor) -> LossOutput:
            assert old_values is not None and advantages is not None, "the last pipeline stage has both"
            assert advantages.returns is not None, "gae: the critic's targets"
            rows = index[mb.rows]
            loss, s = self.objective.critic_loss(
                self._token_values(out, mb), old_values[rows], advantages.returns[rows], part.loss_mask[mb.rows], norm
            )
            stats.add(s)
            return _loss_output(loss)

        self._accumulate(self.critic, self.critic_optimizer, part, loss_fn)
        self._optimizer_step(self.critic_optimizer)
        return stats

    def _optimizer_step(self, optimizer: MegatronOptimizer) -> float:
        with self.timer.phase("optimizer"):
            _, grad_norm, _ = optimizer.step()
            return float(grad_norm or 0.0)

    # -- weights and checkpoints --------------------------------------------------------------------

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(HF name, full tensor) in parameter_specs() order: on every rank when the run is
        colocated (each rank pushes to the engines on its own device), on every rank of the
        owning stage with the sharded channel, else on global rank 0 alone (None elsewhere: rank 0
        broadcasts to the engines). A collective: every rank must iterate."""
        exported = export_hf(self.model.module, self.hf_config, to=self.weights_to)
        return ((name, tensor) for name, tensor in exported if not self._frozen(name))

    def weight_stages(self) -> tuple[int, dict[str, int]]:
        return parallel_state.get_pipeline_model_parallel_rank(), hf_stages(self.model.module, self.hf_config)

    def checkpoint_layout(self) -> None:
        return None  # relax_hpc.models.hf_mapping names and shapes them as the HF checkpoint does

    def parameter_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [spec for spec in hf_specs(self.hf_config, self.dtype) if not self._frozen(spec[0])]

    def _frozen(self, hf_name: str) -> bool:
        """A tensor of a tower under trainer.freeze_encoder: the engines keep theirs."""
        return self.cfg.freeze_encoder and hf_name.startswith(self.arch.hf_tower_prefixes)

    def save_checkpoint(self, folder: Path) -> None:
        megatron_state.save(self.model, self.optimizer, folder)
        if self.critic is not None:
            assert self.critic_optimizer is not None, "built with the critic"
            megatron_state.save(self.critic, self.critic_optimizer, folder / CRITIC)

    def load_checkpoint(self, folder: Path) -> None:
        megatron_state.load(self.model, self.optimizer, folder)
        if self.critic is not None:
            assert self.critic_optimizer is not None, "built with the critic"
            megatron_state.load(self.critic, self.critic_optimizer, folder / CRITIC)
