"""The learning-rate schedule of every backend."""

from __future__ import annotations

from typing import Any, Protocol


class _HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


class WarmupSchedule:
    """Linear warm-up over `warmup` optimizer steps, then constant; drives any optimizer whose
    param_groups carry an `lr` (torch's and megatron's)."""

    def __init__(self, optimizer: _HasParamGroups, peak_lr: float, warmup: int) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Checkpoints of relax_hpc 0.1 hold a torch LambdaLR's state: its last_epoch counts the
        # same optimizer steps.
        self.steps = state["steps"] if "steps" in state else state["last_epoch"]
        self._apply()
