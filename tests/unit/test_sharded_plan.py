"""The sharded channel's plan (relax_hpc.weights.sharded.balance_shares): tensors spread over the
ranks of their stage so that each rank sends its share to within one tensor, buckets in the order
they fill as the ranks walk the stream; and the walk itself (buckets.stream_buckets)."""

import pytest
import torch

from relax_hpc.weights.buckets import stream_buckets
from relax_hpc.weights.sharded import balance_shares, node_leaders, shares


def _specs(sizes: list[int], dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(f"p{i}", torch.Size([n]), dtype) for i, n in enumerate(sizes)]


def _check_plan(specs, buckets, owner, stage_of, rank_stages):
    """Every tensor once; a bucket from one rank of its tensors' stage; buckets ordered by where
    their last tensor streams past, each bucket's tensors in stream order."""
    position = {name: i for i, (name, _, _) in enumerate(specs)}
    names = [n for plan in buckets for n in plan.names]
    assert sorted(names) == sorted(position)
    for plan, rank in zip(buckets, owner, strict=True):
        assert {rank_stages[rank]} == {stage_of(n) for n in plan.names}
        assert [position[n] for n in plan.names] == sorted(position[n] for n in plan.names)
    lasts = [position[plan.names[-1]] for plan in buckets]
    assert lasts == sorted(lasts)


def test_tensors_not_buckets_are_spread_so_each_rank_sends_its_share():
    # One bucket would hold everything: spreading buckets left one rank all of it; spreading
    # tensors, largest first, gives each rank 11 of the 22 units exactly.
    specs = _specs([6, 5, 4, 3, 2, 2])
    buckets, owner = balance_shares(specs, 2**20, lambda name: 0, [0, 0])
    _check_plan(specs, buckets, owner, lambda name: 0, [0, 0])
    assert shares(buckets, owner, 2) == [44, 44]  # fp32: 4 bytes a unit
    assert len(buckets) == 2  # each rank's tensors in one bucket of its own


def test_a_rank_comes_within_one_tensor_of_its_share_with_many_ranks_and_small_buckets():
    g = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 5000, (300,), generator=g)]
    specs = _specs(sizes, torch.bfloat16)
    for ranks in (2, 3, 4, 8):
        buckets, owner = balance_shares(specs, 4096, lambda name: 0, [0] * ranks)
        _check_plan(specs, buckets, owner, lambda name: 0, [0] * ranks)
        sent = shares(buckets, owner, ranks)
        total = sum(sizes) * 2
        assert sum(sent) == total and max(sent) <= total / ranks + 2 * max(sizes), ranks
        assert max(b.nbytes for b in buckets) <= 4096 or any(len(b.names) == 1 for b in buckets)


def test_each_stage_is_spread_over_its_own_ranks_only():
    specs = _specs([8, 1, 1, 1, 7, 3, 3, 2, 2])  # p0-p3 on stage 0, p4-p8 on stage 1
    stage_of = lambda name: 0 if int(name[1:]) < 4 else 1  # noqa: E731
    rank_stages = [0, 0, 1, 1]
    buckets, owner = balance_shares(specs, 2**20, stage_of, rank_stages)
    _check_plan(specs, buckets, owner, stage_of, rank_stages)
    # Largest first to the lighter rank: stage 0 8 | 1+1+1, stage 1 7+2 | 3+3+2 (units of 4 bytes).
    assert shares(buckets, owner, 4) == [32, 12, 36, 32]
    with pytest.raises(ValueError, match="no sending trainer rank holds p4"):
        balance_shares(specs, 2**20, stage_of, [0, 0])


def _stream(specs, held=lambda name: True):
    return ((name, torch.full(shape, float(i)) if held(name) else None) for i, (name, shape, _) in enumerate(specs))


def test_stream_buckets_gives_each_own_bucket_once_its_last_tensor_passed():
    specs = _specs([3, 1, 2, 5, 4, 1, 2])
    buckets, owner = balance_shares(specs, 12, lambda name: 0, [0, 0])
    assert len(set(owner)) == 2 and len(buckets) > 2
    seen = []
    for rank in (0, 1):
        mine = [owner[k] == rank for k in range(len(buckets))]
        for k, tensors in stream_buckets(buckets, _stream(specs), mine.__getitem__):
            assert mine[k]
            assert [int(t[0]) for t in tensors] == [int(n[1:]) for n in buckets[k].names]
            seen.append(k)
        # A relay (weights.relay) is told of the other rank's buckets too, tensorless, every
        # bucket once in the plan's order: the order in which every rank joins their broadcasts.
        told = list(stream_buckets(buckets, _stream(specs), mine.__getitem__, passes=lambda k: True))
        assert [k for k, _ in told] == list(range(len(buckets)))
        assert [bool(tensors) for _, tensors in told] == mine
    assert sorted(seen) == list(range(len(buckets)))


def test_stream_buckets_refuses_a_bucket_this_rank_cannot_fill():
    specs = _specs([3, 1, 2])
    buckets, _ = balance_shares(specs, 2**20, lambda name: 0, [0])
    with pytest.raises(RuntimeError, match="does not hold p1"):
        list(stream_buckets(buckets, _stream(specs, lambda name: name != "p1"), lambda k: True))
    with pytest.raises(RuntimeError, match="did not fill"):
        list(stream_buckets(buckets, _stream(specs[:2]), lambda k: True))


def test_one_sender_per_node_and_stage_sends_all_of_their_tensors():
    """weights.senders node: the first rank of each (stage, host) sends; the others relay."""
    places = [(0, "a"), (0, "a"), (1, "a"), (1, "a"), (0, "b"), (0, "b")]
    assert node_leaders(places) == [0, 2, 4]
    specs = _specs([8, 1, 1, 1, 7, 3, 3, 2, 2])
    stage_of = lambda name: 0 if int(name[1:]) < 4 else 1  # noqa: E731
    rank_stages = [stage for stage, _ in places]
    buckets, owner = balance_shares(specs, 2**20, stage_of, rank_stages, senders=[0, 2, 4])
    _check_plan(specs, buckets, owner, stage_of, rank_stages)
    assert set(owner) <= {0, 2, 4}
    sent = shares(buckets, owner, len(places))
    assert sent[2] == 17 * 4 and sent[0] + sent[4] == 11 * 4  # stage 1 has one sender, stage 0 two
