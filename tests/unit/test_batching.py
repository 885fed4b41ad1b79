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


def _spool_batch(seed: int) -> SampleBatch:
    """Samples of uneven prompt and completion lengths in groups of 3, with masked-out completion
    tokens, newer and older tokens, the engine's expert choices (some unrecorded) and teacher scores."""
    rng = np.random.default_rng(seed)
    n = 12
    prompts, completions = rng.integers(1, 6, n), rng.integers(0, 7, n)
    sequences = [rng.integers(1, 50, int(p + c)).tolist() for p, c in zip(prompts, completions, strict=True)]
    masks = [rng.integers(0, 2, int(c)).tolist() for c in completions]
    versions = [rng.integers(3, 6, int(c)).tolist() for c in completions]
    routed = [rng.integers(0, 8, (len(s), 4)) if i % 4 else None for i, s in enumerate(sequences)]
    batch = SampleBatch.from_samples(
        seq=0, sequences=sequences, prompt_lens=prompts.tolist(),
        logprobs=[(-rng.random(int(c))).tolist() for c in completions], rewards=rng.random(n).tolist(),
        group_ids=[i // 3 for i in range(n)], policy_version=[5] * n, prompt_index=list(range(n)),
        loss_masks=masks, token_versions=versions, routed=routed, baselines=[float(i) for i in range(n)],
    )  # fmt: skip
    batch.teacher_logprobs = -rng.random(len(batch.tokens)).astype(np.float32)
    return batch


def _share_one_sample_at_a_time(batch: SampleBatch, rows: list[int], pad: int, oldest: int) -> dict[str, list]:
    """The padded tensors of `rows`, written out per sample and per position: position t holds
    token t, and the target, loss mask, log-probability and teacher score of token t + 1."""
    width = max(int(batch.offsets[i + 1] - batch.offsets[i]) for i in rows)
    names = ("input_ids", "attention_mask", "targets", "loss_mask", "logps", "routed", "teacher")
    out: dict[str, list] = {k: [] for k in names}
    assert batch.routed_experts is not None and batch.token_versions is not None
    unrecorded = np.iinfo(batch.routed_experts.dtype).max
    for i in rows:
        start, n = int(batch.offsets[i]), int(batch.offsets[i + 1] - batch.offsets[i])

        def at(values, t, fill, start=start, n=n):
            return values[start + t] if t < n else fill

        fresh = [at(batch.loss_mask, t, 0) * (at(batch.token_versions, t, 0) >= oldest) for t in range(width + 1)]
        out["input_ids"].append([int(at(batch.tokens, t, pad)) for t in range(width)])
        out["attention_mask"].append([int(t < n) for t in range(width)])
        out["targets"].append([int(at(batch.tokens, t + 1, pad)) for t in range(width)])
        out["loss_mask"].append([float(fresh[t + 1]) if t + 1 < n else 0.0 for t in range(width)])
        out["logps"].append([float(at(batch.rollout_logprobs, t + 1, 0.0)) for t in range(width)])
        out["teacher"].append([float(at(batch.teacher_logprobs, t + 1, 0.0)) for t in range(width)])
        out["routed"].append(
            [[-1 if c == unrecorded else int(c) for c in at(batch.routed_experts, t, [-1] * 4)] for t in range(width)]
        )
    return out


def test_share_of_equals_the_tensors_built_one_sample_at_a_time():
    """The batched share (array indexing over the flat spool arrays) holds, for each rank's
    groups, what a per-sample, per-position construction gives: tokens, shifted targets, loss
    masks with stale tokens masked, log-probabilities, rewards, baselines, routing and teacher."""
    batch = _spool_batch(0)
    trained = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # sample 6 (group 2) was not trained
    for rank in (0, 1):
        tb, stats = share_of(batch, trained, rank, 2, pad_id=99, oldest_version=4)
        groups = [0, 1, 2, 3][rank::2]
        rows = [i for i in trained if batch.group_ids[i] in groups]
        expected = _share_one_sample_at_a_time(batch, rows, 99, oldest=4)
        assert tb.input_ids.tolist() == expected["input_ids"]
        assert tb.attention_mask.tolist() == expected["attention_mask"]
        assert tb.targets.tolist() == expected["targets"]
        assert tb.loss_mask.tolist() == expected["loss_mask"]
        assert tb.rollout_logprobs.tolist() == expected["logps"]
        assert tb.teacher_logprobs is not None and tb.teacher_logprobs.tolist() == expected["teacher"]
        assert tb.routed is not None and tb.routed.tolist() == expected["routed"]
        assert tb.rewards.tolist() == batch.rewards[rows].tolist()
        assert tb.group_ids.tolist() == batch.group_ids[rows].tolist()
        assert tb.baselines.tolist() == [float(i) for i in rows]
        assert batch.token_versions is not None
        stale = sum(
            int(m == 1 and v < 4)
            for i in rows
            for m, v in zip(batch.loss_mask[batch.offsets[i] : batch.offsets[i + 1]],
                            batch.token_versions[batch.offsets[i] : batch.offsets[i + 1]], strict=True)
        )  # fmt: skip
        assert stats["stale_tokens_masked"] == stale > 0
