"""What every trainer backend shares: its result type, the objective's communicator, the
learning-rate schedule, and the choice of backend from the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from relax_hpc.algos.stats import Stats

if TYPE_CHECKING:
    from relax_hpc.config.schema import JobConfig


class NonFiniteLossError(RuntimeError):
    """The loss is NaN or infinite; the optimizer step is refused to keep the weights intact."""


@dataclass(slots=True)
class StepResult:
    stats: Stats  # summed over this rank's mini-batches and passes (empty on ranks that report none)
    loss: float  # the global loss, mean over the optimizer steps
    grad_norm: float  # of the last optimizer step
    lr: float


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
        return torch.cat([p[: int(s)] for p, s in zip(padded, sizes)]).to(t.device)


class WarmupSchedule:
    """Linear warm-up over `warmup` optimizer steps, then constant; drives any optimizer whose
    param_groups carry an `lr` (torch's and megatron's)."""

    def __init__(self, optimizer, peak_lr: float, warmup: int) -> None:
        self.optimizer, self.peak_lr, self.warmup = optimizer, peak_lr, warmup
        self.steps = 0
        self._apply()

    def _lr(self) -> float:
        return self.peak_lr * (min(1.0, (self.steps + 1) / self.warmup) if self.warmup else 1.0)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [self._lr()]

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        self._apply()


def make_backend(job: JobConfig, device: torch.device):
    """The configured backend (imported lazily: megatron-core is an optional dependency)."""
    if job.trainer.backend == "megatron":
        from relax_hpc.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(job, device)
    from relax_hpc.trainer.torch_backend import TorchBackend

    return TorchBackend(job, device)
