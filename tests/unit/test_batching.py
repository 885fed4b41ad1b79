"""Mini-batches of whole groups, and the no-loss rows a rank without a group trains."""

import numpy as np
import torch

from relax_hpc.exchange.spool import SampleBatch
from relax_hpc.trainer.batching import pad_samples, share_of


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


def test_teacher_logprobs_from_the_spool_align_with_the_targets_on_every_rank():
    """A batch scored by teacher engines: each rank's rows carry the teacher's log-probabilities
    where the loss mask has its tokens (position t scores token t + 1); a rank without a group
    gets zeros, which its no-loss row needs for the distill advantage."""
    batch = SampleBatch.from_samples(
        seq=0, sequences=[[5, 6, 7, 8], [5, 6, 9]], prompt_lens=[2, 2], logprobs=[[-0.1, -0.2], [-0.3]],
        rewards=[0.0, 1.0], group_ids=[0, 0], policy_version=[0, 0], prompt_index=[0, 0],
    )  # fmt: skip
    batch.teacher_logprobs = np.asarray([0, 0, -1.5, -2.5, 0, 0, -3.5], dtype=np.float32)
    tb, _ = share_of(batch, [0, 1], rank=0, world=2, pad_id=0)
    assert tb.teacher_logprobs is not None
    assert tb.teacher_logprobs.tolist() == [[0.0, -1.5, -2.5, 0.0], [0.0, -3.5, 0.0, 0.0]]
    assert (tb.teacher_logprobs != 0).tolist() == tb.loss_mask.bool().tolist()
    second = tb.select(torch.tensor([1])).teacher_logprobs
    assert second is not None and second.tolist() == [[0.0, -3.5, 0.0, 0.0]]
    idle, _ = share_of(batch, [0, 1], rank=1, world=2, pad_id=0)
    assert idle.teacher_logprobs is not None and not idle.teacher_logprobs.any() and not idle.loss_mask.any()
