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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[T] values of the packed row -> [k, width], zero where a row has no token."""
        out = flat.new_zeros(len(self.rows) * self.width)
        return out.index_put((self._grid_index(),), flat[: int(self.lengths.sum())]).view(len(self.rows), self.width)

    def _grid_index(self) -> torch.Tensor:
        device = self.lengths.device
        starts = torch.arange(len(self.rows), device=device) * self.width
        spans = [s + torch.arange(n, device=device) for s, n in zip(starts, self.lengths.tolist())]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=device)


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
    lengths = batch.attention_mask[rows].sum(1) if rows else torch.zeros(0, dtype=torch.long)
    idx = torch.tensor(rows, dtype=torch.long)
    ids = [batch.input_ids[i, :n] for i, n in zip(rows, lengths.tolist())]
    tgt = [batch.targets[i, :n] for i, n in zip(rows, lengths.tolist())]
    total = int(lengths.sum())
    pad = (-total) % multiple if total else multiple
    docs = lengths.tolist() + ([pad] if pad else [])
    device = batch.input_ids.device
    filler = torch.full((pad,), pad_id, dtype=torch.long, device=device)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return Microbatch(
        rows=idx.to(device),
        lengths=lengths.to(device),
        input_ids=torch.cat([*ids, filler]).unsqueeze(0),
        position_ids=torch.cat([torch.arange(n, device=device) for n in docs]).unsqueeze(0),
        targets=torch.cat([*tgt, filler]),
        cu_seqlens=cu,
        max_seqlen=max(docs),
        width=batch.input_ids.shape[1],
    )
