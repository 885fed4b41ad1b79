"""How algorithm functions reach the rest of the batch when it is split over ranks."""

from __future__ import annotations

from typing import Protocol

import torch


class Comm(Protocol):
    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of `t` over every rank (same shape on every rank)."""
        ...

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The 1-D tensors of every rank concatenated (their lengths may differ)."""
        ...


class LocalComm:
    """One process holds the whole batch."""

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t


LOCAL = LocalComm()
