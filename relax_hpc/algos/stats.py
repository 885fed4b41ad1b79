"""Per-step statistics of the objective, in a form that sums over mini-batches and ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

Value = torch.Tensor | float


class Stats:
    """Token sums (the trainer divides them by the token count of everything it summed), and
    extrema over loss tokens. `tokens` counts the loss tokens the sums cover.

    Values stay 0-dim device tensors until they are read: reading `sums`, `maxes` or `mins` (or
    `resolve`) fetches them all in one transfer. A float per statistic cost a host sync each, about
    20 per micro-batch, and each one drained the GPU's queue (BENCHMARKS.md, "The GPU step's host
    work")."""

    def __init__(self) -> None:
        self._sums: dict[str, Value] = {}
        self._maxes: dict[str, Value] = {}
        self._mins: dict[str, Value] = {}

    @property
    def sums(self) -> dict[str, float]:
        return self.resolve()._sums  # type: ignore[return-value]  # floats once resolved

    @property
    def maxes(self) -> dict[str, float]:
        return self.resolve()._maxes  # type: ignore[return-value]

    @property
    def mins(self) -> dict[str, float]:
        return self.resolve()._mins  # type: ignore[return-value]

    def add_sum(self, name: str, value: Value) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + _detached(value)

    def mean_of(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        self.add_sum(name, (per_token.detach() * mask).sum())

    def range_of(self, name: str, per_token: torch.Tensor, mask: torch.Tensor) -> None:
        """Registers the name even without tokens (+-inf), so every rank reports the same names."""
        values, real = per_token.detach(), mask > 0
        if values.numel():
            high: Value = torch.where(real, values, -torch.inf).amax()
            low: Value = torch.where(real, values, torch.inf).amin()
        else:
            high, low = -float("inf"), float("inf")
        self._maxes[name] = _extremum(self._maxes.get(name), high, torch.maximum, max)
        self._mins[name] = _extremum(self._mins.get(name), low, torch.minimum, min)

    def add(self, other: Stats) -> None:
        for name, value in other._sums.items():
            self.add_sum(name, value)
        for name, value in other._maxes.items():
            self._maxes[name] = _extremum(self._maxes.get(name), value, torch.maximum, max)
        for name, value in other._mins.items():
            self._mins[name] = _extremum(self._mins.get(name), value, torch.minimum, min)

    def resolve(self) -> Stats:
        """Every value as a float, fetched in one transfer; returns self."""
        tables = (self._sums, self._maxes, self._mins)
        pending = [(table, name) for table in tables for name, v in table.items() if isinstance(v, torch.Tensor)]
        if pending:
            tensors = [table[name] for table, name in pending]
            device = tensors[0].device  # type: ignore[union-attr]
            values = torch.stack([torch.as_tensor(t, dtype=torch.float64, device=device) for t in tensors]).tolist()
            for (table, name), value in zip(pending, values, strict=True):
                table[name] = value
        return self

    def __getstate__(self) -> dict[str, dict[str, Value]]:  # gathered as objects: floats, no device tensors
        self.resolve()
        return self.__dict__


def _detached(value: Value) -> Value:
    return value.detach().reshape(()) if isinstance(value, torch.Tensor) else value


def _extremum(
    old: Value | None,
    new: Value,
    on_tensors: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    on_floats: Callable[[float, float], float],
) -> Value:
    if old is None:
        return _detached(new)
    if isinstance(old, float) and isinstance(new, float):
        return on_floats(old, new)
    device = old.device if isinstance(old, torch.Tensor) else new.device  # type: ignore[union-attr]
    return on_tensors(torch.as_tensor(old, device=device).float(), torch.as_tensor(new, device=device).float())
