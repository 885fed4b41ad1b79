"""Sequence packing: the samples of a rank's batch, concatenated into micro-batches of at most a
token budget, without padding.

A micro-batch is one row of back-to-back documents: `input_ids` and `position_ids` (restarting at
0 for each document) of shape [1, T] and the cumulative lengths `cu_seqlens` that attention uses
to keep documents apart. Per-token outputs computed on the packed row go back to the padded
[n, width] layout of TrainBatch with `unpack`, so the objective sees the same tensors whatever the
packing (and gradients flow through the scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from relax_hpc.data.processor import concat_inputs
from relax_hpc.trainer.batching import TrainBatch


@dataclass(slots=True)
class Microbatch:
    rows: torch.Tensor  # long [k]: the batch rows packed here, in order
    input_ids: torch.Tensor  # long [1, T]
    position_ids: torch.Tensor  # long [1, T]
    targets: torch.Tensor  # long [T]
    cu_seqlens: torch.Tensor  # int32 [k + 1] (+1 when padding was appended)
    max_seqlen: int
    width: int  # of the padded layout the rows come from
    real_tokens: int  # the rows' tokens, before the padding document
    grid: torch.Tensor  # long [real_tokens]: each of them's position in the [k, width] layout
    routed: torch.Tensor | None = None  # long [T, layers * top_k]: the engine's experts (-1: none), replay only
    # A vision-language model's: multimodal RoPE positions (long [3, T]) and the processor tensors
    # of the packed rows' images, in token order (pixel_values, image_grid_thw).
    mrope: torch.Tensor | None = None
    media: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[T] values of the packed row -> [k, width], zero where a row has no token (no host sync)."""
        out = flat.new_zeros(len(self.rows) * self.width)
        return out.index_put((self.grid,), flat[: self.real_tokens]).view(len(self.rows), self.width)


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
    """`rows` of `batch` packed into one micro-batch (pack_all of one bin)."""
    return pack_all(batch, [rows], batch.attention_mask.sum(1).cpu().numpy(), pad_id, multiple)[0]


def pack_all(
    batch: TrainBatch,
    bins: list[list[int]],
    lengths: np.ndarray,
    pad_id: int,
    multiple: int = 1,
    mrope: torch.Tensor | None = None,
) -> list[Microbatch]:
    """Each bin's rows packed into one row, padded with a dummy document (no loss) to a multiple of
    `multiple` tokens (tensor parallelism with sequence parallelism needs it); an empty bin gives
    padding alone (a rank without samples still joins the collectives). `lengths`: every row's
    token count, on the host. The indices are worked out there and reach the device in one copy:
    per bin, syncs and launches would leave the GPU waiting between micro-batches. `mrope`: the
    batch's [3, n, width] multimodal RoPE positions, packed like the tokens (the padding document
    at 0); the batch's media go with their rows."""
    device, width = batch.input_ids.device, batch.input_ids.shape[1]
    filler = batch.input_ids.numel()  # the index of a pad token appended to the flattened batch
    plans = [_plan_bin(np.asarray(rows, dtype=np.int64), lengths, width, filler, multiple) for rows in bins]
    moved = _to_device(np.concatenate([np.concatenate(p.arrays) for p in plans]), device)
    ids = torch.cat([batch.input_ids.reshape(-1), batch.input_ids.new_full((1,), pad_id)])
    targets = torch.cat([batch.targets.reshape(-1), batch.targets.new_full((1,), pad_id)])
    routed = None
    if batch.routed is not None:
        choices = batch.routed.shape[-1]
        routed = torch.cat([batch.routed.reshape(-1, choices), batch.routed.new_full((1, choices), -1)])
    flat_mrope = None if mrope is None else torch.cat([mrope.reshape(3, -1), mrope.new_zeros(3, 1)], dim=1)
    out, at = [], 0
    for p, rows in zip(plans, bins, strict=True):
        idx, source, positions, grid, cu = moved[at : at + p.size].split([len(a) for a in p.arrays])
        at += p.size
        out.append(
            Microbatch(
                rows=idx,
                input_ids=ids[source].unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                targets=targets[source],
                cu_seqlens=cu.int(),
                max_seqlen=p.max_seqlen,
                width=width,
                real_tokens=p.real_tokens,
                grid=grid,
                routed=None if routed is None else routed[source],
                mrope=None if flat_mrope is None else flat_mrope[:, source],
                media=_media(batch, rows, device),
            )
        )
    return out


def _media(batch: TrainBatch, rows: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The processor tensors of `rows` (in order: their image tokens' order in the packed row)."""
    if not batch.media:
        return {}
    return {k: v.to(device) for k, v in concat_inputs([batch.media[r] for r in rows]).items()}


@dataclass(frozen=True, slots=True)
class _BinPlan:
    """A bin's host-side indices: rows, source (into the flattened batch + one pad token),
    positions within documents, grid (into [k, width]) and cu_seqlens, all int64."""

    arrays: tuple[np.ndarray, ...]
    max_seqlen: int
    real_tokens: int

    @property
    def size(self) -> int:
        return sum(len(a) for a in self.arrays)


def _plan_bin(rows: np.ndarray, lengths: np.ndarray, width: int, filler: int, multiple: int) -> _BinPlan:
    lens = lengths[rows].astype(np.int64)  # right-padded rows: the first `length` tokens
    total = int(lens.sum())
    pad = (-total) % multiple if total else multiple
    docs = np.concatenate([lens, [pad] if pad else []]).astype(np.int64)
    within = _positions_np(lens)
    row_of = np.repeat(np.arange(len(rows)), lens)
    source = np.concatenate([rows[row_of] * width + within, np.full(pad, filler)])
    cu = np.concatenate([[0], np.cumsum(docs)])
    grid = row_of * width + within
    arrays = (rows, source, _positions_np(docs), grid, cu)
    return _BinPlan(tuple(a.astype(np.int64) for a in arrays), int(docs.max()), total)


def _to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """One copy to the device, asynchronous from pinned memory on CUDA."""
    tensor = torch.from_numpy(host)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _positions_np(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each length n, back to back."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts
