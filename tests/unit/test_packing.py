"""Sequence packing: bins within the budget, every row once, and unpack undoes pack."""

import torch

from relax_hpc.trainer import packing
from relax_hpc.trainer.batching import pad_samples


def _batch(lengths):
    seqs = [[10 + i] * n for i, n in enumerate(lengths)]
    masks = [[0] + [1] * (n - 1) for n in lengths]
    logps = [[-0.5] * n for n in lengths]
    return pad_samples(seqs, masks, logps, [0.0] * len(lengths), list(range(len(lengths))), pad_token_id=0)


def test_plan_fills_bins_within_budget_and_keeps_every_row_once():
    lengths = [7, 3, 9, 2, 5, 4, 8]
    bins = packing.plan(lengths, budget=10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 38 tokens need at least 4 bins of 10; first-fit decreasing finds 4
    assert all(b == sorted(b) for b in bins)


def test_plan_gives_an_overlong_row_its_own_bin_and_pads_the_count():
    bins = packing.plan([30, 2], budget=10, count=4)
    assert bins == [[0], [1], [], []]


def test_pack_then_unpack_restores_rows_and_separates_documents():
    batch = _batch([4, 6, 3])
    mb = packing.pack(batch, [0, 2], pad_id=0, multiple=4)
    assert mb.num_tokens == 8  # 4 + 3 tokens, padded to a multiple of 4
    assert mb.cu_seqlens.tolist() == [0, 4, 7, 8]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb.input_ids[0, :7].tolist() == [10] * 4 + [12] * 3
    assert mb.targets[:7].tolist() == batch.targets[0, :4].tolist() + batch.targets[2, :3].tolist()
    values = torch.arange(8, dtype=torch.float32, requires_grad=True)
    grid = mb.unpack(values)
    assert grid.shape == (2, batch.input_ids.shape[1])
    assert grid[0, :4].tolist() == [0, 1, 2, 3] and grid[0, 4:].abs().sum() == 0
    assert grid[1, :3].tolist() == [4, 5, 6] and grid[1, 3:].abs().sum() == 0
    grid.sum().backward()
    assert values.grad is not None
    assert values.grad.tolist() == [1.0] * 7 + [0.0]  # the padding document gets no gradient


def test_an_empty_microbatch_is_padding_alone():
    mb = packing.pack(_batch([4]), [], pad_id=0, multiple=2)
    assert mb.num_tokens == 2 and len(mb.rows) == 0
    assert mb.unpack(torch.ones(2)).shape == (0, 4)


def test_pack_all_equals_each_bin_concatenated_row_by_row():
    """Several bins at once (one of them empty) with expert choices: each micro-batch is its rows'
    tokens, targets and choices laid end to end, positions restarting per document, padded to the
    multiple with pad tokens and unrecorded choices; unpack puts every token back in its row."""
    lengths = [4, 6, 3, 1, 7, 2]
    batch = _batch(lengths)
    batch.routed = torch.arange(batch.input_ids.numel() * 2).reshape(*batch.input_ids.shape, 2)
    bins = [[0, 2, 5], [], [1, 3, 4]]
    mbs = packing.pack_all(batch, bins, batch.attention_mask.sum(1).numpy(), pad_id=0, multiple=4)
    for rows, mb in zip(bins, mbs, strict=True):
        real = sum(lengths[i] for i in rows)
        pad = (-real) % 4 if real else 4
        ids = [t for i in rows for t in batch.input_ids[i, : lengths[i]].tolist()] + [0] * pad
        targets = [t for i in rows for t in batch.targets[i, : lengths[i]].tolist()] + [0] * pad
        routed = [c for i in rows for c in batch.routed[i, : lengths[i]].tolist()] + [[-1, -1]] * pad
        docs = [lengths[i] for i in rows] + ([pad] if pad else [])
        assert mb.rows.tolist() == rows and mb.input_ids[0].tolist() == ids and mb.targets.tolist() == targets
        assert mb.routed is not None and mb.routed.tolist() == routed
        assert mb.position_ids[0].tolist() == [p for n in docs for p in range(n)]
        assert mb.cu_seqlens.tolist() == [sum(docs[:k]) for k in range(len(docs) + 1)]
        assert mb.max_seqlen == max(docs) and mb.real_tokens == real
        grid = mb.unpack(torch.arange(1, mb.num_tokens + 1, dtype=torch.float32))
        for k, i in enumerate(rows):
            start = sum(lengths[j] for j in rows[:k])
            assert grid[k].tolist() == [float(start + 1 + t) if t < lengths[i] else 0.0 for t in range(grid.shape[1])]
