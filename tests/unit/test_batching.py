"""Mini-batches of whole groups, and the no-loss rows a rank without a group trains."""

import torch

from relax_hpc.trainer.batching import pad_samples


def batch_of(group_ids):
    n = len(group_ids)
    return pad_samples(
        [[5, 6, 7]] * n, [[0, 1, 1]] * n, [[0.0, -0.5, -0.25]] * n, [float(i) for i in range(n)], group_ids, 0
    )


def test_minibatches_hold_whole_groups_in_order():
    batch = batch_of([3, 3, 9, 9, 9, 1, 1, 4])  # groups of 2, 3, 2, 1 rows
    parts = batch.minibatches(2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3, 4], [5, 6, 7]]
    assert [batch.select(p).group_ids.tolist() for p in parts] == [[3, 3, 9, 9, 9], [1, 1, 4]]
    assert [p.tolist() for p in batch.minibatches(1)] == [list(range(8))]


def test_more_minibatches_than_groups_leaves_some_empty():
    parts = batch_of([0, 0, 1, 1]).minibatches(3)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], []]


def test_without_loss_keeps_the_rows_and_zeroes_the_mask():
    batch = batch_of([0, 0])
    empty = batch.without_loss()
    assert empty.loss_mask.sum() == 0 and batch.loss_mask.sum() == 4  # the original is untouched
    assert torch.equal(empty.input_ids, batch.input_ids) and empty.num_samples == 2
