"""Vocabulary-parallel log-probabilities: equal to log_softmax on the full vocabulary, values and
gradients, on one rank and split over two gloo ranks."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.trainer.vocab_parallel import logprobs_and_entropy


def _reference(logits, targets):
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 10, generator=g) * 4, torch.tensor([0, 9, 4, 5, 2, 7])


def test_one_rank_equals_log_softmax_values_and_gradients():
    logits, targets = _data()
    mine, ref = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(mine, targets)
    ref_lp, ref_ent = _reference(ref, targets)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() - 0.7 * ent.sum()).backward()
    (ref_lp.sum() - 0.7 * ref_ent.sum()).backward()
    torch.testing.assert_close(mine.grad, ref.grad)  # the entropy's closed-form gradient


def test_temperature_and_padded_columns():
    """softmax(logits / T) over the real columns only: padding columns (any value) are no token,
    get no probability and no gradient."""
    logits, targets = _data()
    padded = torch.cat([logits, torch.full((6, 3), 50.0)], dim=1).requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(padded, targets, temperature=0.7, vocab_size=10)
    ref_lp, ref_ent = _reference(ref / 0.7, targets)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() + ent.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert padded.grad is not None and ref.grad is not None
    torch.testing.assert_close(padded.grad[:, :10], ref.grad)
    assert padded.grad[:, 10:].abs().max() == 0


def test_entropy_without_gradient_and_bf16_logits():
    """entropy_grad=False: the entropy is a constant of the graph; bf16 logits are read in fp32
    and their gradient comes back in bf16."""
    logits, targets = _data()
    mine = logits.bfloat16().requires_grad_(True)
    ref = logits.bfloat16().float().requires_grad_(True)
    lp, ent = logprobs_and_entropy(mine, targets, entropy_grad=False)
    assert lp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    ref_lp, ref_ent = _reference(ref, targets)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() + ent.sum()).backward()
    ref_lp.sum().backward()
    assert mine.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine.grad.float(), ref.grad, atol=1e-2, rtol=1e-2)


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, targets = _data()
    full = logits.clone().requires_grad_(True)
    lp_ref, ent_ref = _reference(full, targets)
    (lp_ref.sum() + 0.3 * ent_ref.sum()).backward()
    local = logits[:, rank * 5 : (rank + 1) * 5].clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(local, targets, vocab_start=rank * 5, group=dist.group.WORLD)
    (lp.sum() + 0.3 * ent.sum()).backward()
    out[rank] = (
        (lp - lp_ref).abs().max().item(),
        (ent - ent_ref).abs().max().item(),
        (local.grad - full.grad[:, rank * 5 : (rank + 1) * 5]).abs().max().item(),
    )
    dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_equal_the_full_vocabulary_values_and_gradients():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, out), nprocs=2)
    for rank in (0, 1):
        # The gradient through the all-reduced sums: each rank's columns get exactly the
        # full-vocabulary gradient (a missing all-reduce in backward would halve or drop it).
        assert max(out[rank]) < 1e-5, out[rank]
