"""The trainer backend interface (`Backend`), and what every backend shares: its result type and
the objective's communicator. Backends: `torch_backend` (HF models under FSDP2) and
`megatron_backend` (megatron-core); `build.build_backend` picks one from the config, and a backend
reads its settings from a `BackendConfig`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from relax_hpc.algos.stats import Stats
from relax_hpc.config.schema import Aggregation, AlgoConfig, JobConfig, ModelConfig, TrainerConfig
from relax_hpc.trainer.batching import TrainBatch
from relax_hpc.trainer.schedule import WarmupSchedule
from relax_hpc.weights.layout import Convert


class NonFiniteLossError(RuntimeError):
    """The loss is NaN or infinite; the optimizer step is refused to keep the weights intact."""


@dataclass(frozen=True)
class BackendConfig:
    """What a backend reads of the job. A backend is built from three sections (its own, the
    model and the objective's) and three single settings of others, so it receives this view rather
    than the whole JobConfig: what a backend depends on is this list, not every setting of a run."""

    model: ModelConfig
    trainer: TrainerConfig
    algo: AlgoConfig
    seed: int  # run.seed: LoRA's initial adapters, megatron's CUDA RNG tracker
    temperature: float  # rollout.temperature: log-probabilities are those of the sampling distribution
    colocate: bool  # launch.colocate: every rank serves its own engines the full weights (megatron)
    sharded: bool = False  # weights.channel sharded: every rank of a stage sends its share (megatron)

    @classmethod
    def of(cls, job: JobConfig) -> BackendConfig:
        sharded = job.weights.channel == "sharded"
        return cls(
            job.model, job.trainer, job.algo, job.run.seed, job.rollout.temperature, job.launch.colocate, sharded
        )


@dataclass(slots=True)
class StepResult:
    stats: Stats  # summed over this rank's mini-batches and passes (empty on ranks that report none)
    loss: float  # the global loss, mean over the optimizer steps
    grad_norm: float  # of the last optimizer step
    lr: float
    optimizer_s: float = 0.0  # of the step's time, in optimizer steps (gradient clipping included)


class DistComm:
    """relax_hpc.algos.comm.Comm over the ranks that hold different samples: the whole trainer
    for FSDP, the data-parallel group for megatron (tensor/pipeline peers hold the same samples)."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device  # where collectives run (nccl groups need CUDA tensors)

    def _on(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device is None else t.to(self.device)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = self._on(t.clone())
        dist.all_reduce(out, group=self.group)
        return out.to(t.device)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        sizes = [self._on(torch.zeros(1, dtype=torch.long)) for _ in range(world)]
        dist.all_gather(sizes, self._on(torch.tensor([t.numel()])), group=self.group)
        longest = max(int(s) for s in sizes)
        padded = [self._on(t.new_zeros(longest)) for _ in sizes]
        dist.all_gather(padded, self._on(torch.cat([t, t.new_zeros(longest - t.numel())])), group=self.group)
        return torch.cat([p[: int(s)] for p, s in zip(padded, sizes, strict=True)]).to(t.device)


class Backend(Protocol):
    """What the trainer's loop needs of a backend. One instance per rank; every method marked
    collective must run on all ranks in the same order."""

    scheduler: WarmupSchedule
    """The learning-rate schedule (its state is checkpointed beside the RNG states)."""

    @property
    def pad_token_id(self) -> int: ...

    @property
    def data_rank(self) -> int:
        """Which share of a batch this rank trains (ranks of one data-parallel replica share one)."""
        ...

    @property
    def data_world(self) -> int:
        """How many shares a batch is dealt into."""
        ...

    @property
    def reports(self) -> bool:
        """Whether this rank's statistics count (one rank per data-parallel replica)."""
        ...

    def train_step(self, batch: TrainBatch, step: int) -> StepResult:
        """Collective: advantages, then algo.epochs x algo.minibatches optimizer steps on this
        rank's share of a rollout batch."""
        ...

    def sft_step(self, batch: TrainBatch, step: int, aggregation: Aggregation) -> StepResult:
        """Collective: one optimizer step on the response tokens' negative log-likelihood of this
        rank's share of a supervised batch (kind=sft)."""
        ...

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose state this rank holds (launch.colocate_offload parks it)."""
        ...

    def parameter_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """(HF name, shape, dtype) of every parameter the engines hold, in full_parameters' order."""
        ...

    def full_parameters(self) -> Iterable[tuple[str, torch.Tensor | None]]:
        """Collective: (HF name, full tensor) in parameter_specs() order; every rank iterates, only
        rank 0's tensors are used (others may yield None), except with launch.colocate, where every
        rank pushes its own to the engines on its device and must yield them all, and with
        weights.channel sharded, where every rank of the stage that holds a tensor must yield it
        (weight_stages)."""
        ...

    def weight_stages(self) -> tuple[int, dict[str, int]]:
        """This rank's pipeline stage, and the stage whose ranks all hold each parameter's full
        tensor in full_parameters() under weights.channel sharded (names not listed: stage 0)."""
        ...

    def checkpoint_layout(self) -> Convert | None:
        """How full_parameters' tensors become the model's HF checkpoint layout, which SGLang
        loads (relax_hpc.weights.layout); None where they are in it already."""
        ...

    def save_checkpoint(self, folder: Path) -> None:
        """Collective: write the model and optimizer state (sharded as held) into `folder`."""
        ...

    def load_checkpoint(self, folder: Path) -> None:
        """Collective: restore what save_checkpoint wrote, under any layout the backend supports."""
        ...
