"""Sequence packing: the samples of a rank's batch, concatenated into micro-batches of at most a
token budget, without padding.

A micro-batch is one row of back-to-back documents: `input_ids` and `position_ids` (restarting at
0 for each document) of shape [1, T] and the cumulative lengths `cu_seqlens` that attention uses
to keep documents apart. Per-token outputs computed on the packed row go back to the padded
[n, width] layout of TrainBatch with `unpack`, so the objective sees the same tensors whatever the
packing (and gradients flow through the scatter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_hpc.trainer.batching import TrainBatch


@dataclass(slots=True)
class Microbatch:
    rows: torch.Tensor  # long [k]: the batch rows packed here, in order
    lengths: torch.Tensor  # long [k]
    input_ids: torch.Tensor  # long [1, T]
    position_ids: torch.Tensor  # long [1, T]
    targets: torch.Tensor  # long [T]
    cu_seqlens: torch.Tensor  # int32 [k + 1] (+1 when padding was appended)
    max_seqlen: int
    width: int  # of the padded layout the rows come from
    routed: torch.Tensor | None = None  # long [T, layers * top_k]: the engine's experts (-1: none), replay only

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[T] values of the packed row -> [k, width], zero where a row has no token."""
        out = flat.new_zeros(len(self.rows) * self.width)
        return out.index_put((self._grid_index(),), flat[: int(self.lengths.sum())]).view(len(self.rows), self.width)

    def _grid_index(self) -> torch.Tensor:
        """Position in the [k, width] grid of every packed token (vectorised: a GPU batch holds
        thousands of short samples)."""
        row = torch.repeat_interleave(torch.arange(len(self.lengths), device=self.lengths.device), self.lengths)
        return row * self.width + _positions(self.lengths)


def plan(lengths: list[int], budget: int, count: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: first-fit over the rows, longest first, into bins of at
    most `budget` tokens (a longer row gets a bin of its own), then at least `count` bins (empty
    ones appended; ranks equalise their micro-batch counts so their collectives match). Rows keep
    their order inside a bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if fit is None:
            bins.append([i])
            room.append(budget - lengths[i])
        else:
            bins[fit].append(i)
            room[fit] -= lengths[i]
    bins = [sorted(b) for b in bins]
    return bins + [[] for _ in range(count - len(bins))]


def pack(batch: TrainBatch, rows: list[int], pad_id: int, multiple: int = 1) -> Microbatch:
    """Pack `rows` of `batch` into one row, padded with a dummy document (no loss) to a multiple
    of `multiple` tokens (tensor parallelism with sequence parallelism needs it). An empty `rows`
    gives a micro-batch of padding alone: a rank without samples still joins the collectives."""
    device = batch.input_ids.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    lengths = batch.attention_mask[idx].sum(1)
    keep = batch.attention_mask[idx].bool()  # right-padded rows: the first `length` tokens
    total = int(lengths.sum())
    pad = (-total) % multiple if total else multiple
    docs = torch.cat([lengths, torch.tensor([pad] if pad else [], dtype=torch.long, device=device)])
    filler = torch.full((pad,), pad_id, dtype=torch.long, device=device)
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32, device=device)
    cu[1:] = docs.cumsum(0)
    routed = None
    if batch.routed is not None:
        unrecorded = torch.full((pad, batch.routed.shape[-1]), -1, dtype=torch.long, device=device)
        routed = torch.cat([batch.routed[idx][keep], unrecorded])
    return Microbatch(
        rows=idx,
        lengths=lengths,
        input_ids=torch.cat([batch.input_ids[idx][keep], filler]).unsqueeze(0),
        position_ids=_positions(docs).unsqueeze(0),
        targets=torch.cat([batch.targets[idx][keep], filler]),
        cu_seqlens=cu,
        max_seqlen=int(docs.max()),
        width=batch.input_ids.shape[1],
        routed=routed,
    )


def _positions(lengths: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each length n, back to back."""
    starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return torch.arange(int(lengths.sum()), device=lengths.device) - starts
