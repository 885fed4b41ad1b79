"""Per-step statistics of the objective, in a form that sums over mini-batches and ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Stats:
    """Token sums (the trainer divides them by the token count of everything it summed), and
    extrema over loss tokens. `tokens` counts the loss tokens the sums cover."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)

    def mean_of(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float((per_token.detach() * mask).sum())

    def range_of(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        """Registers the name even without tokens (+-inf), so every rank reports the same names."""
        values = per_token.detach()[mask > 0]
        high, low = (float(values.max()), float(values.min())) if values.numel() else (-float("inf"), float("inf"))
        self.maxes[name] = max(self.maxes.get(name, -float("inf")), high)
        self.mins[name] = min(self.mins.get(name, float("inf")), low)

    def add(self, other: Stats) -> None:
        for name, value in other.sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        for name, value in other.maxes.items():
            self.maxes[name] = max(self.maxes.get(name, -float("inf")), value)
        for name, value in other.mins.items():
            self.mins[name] = min(self.mins.get(name, float("inf")), value)
