"""Shared-prefix packing (relax_hpc.trainer.prefix): a group's prompt runs once, and the
log-probabilities, entropies and gradients are the padded forward's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_hpc.models.hf import load_policy
from relax_hpc.trainer.batching import TrainBatch, _packed, pad_samples, token_logprobs_and_entropy
from relax_hpc.trainer.prefix import pack_groups

MODEL = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-addition"


def batch(sequences: list[list[int]], groups: list[int], prompt: int = 3) -> TrainBatch:
    masks = [[0] * prompt + [1] * (len(s) - prompt) for s in sequences]
    logprobs = [[0.0] * len(s) for s in sequences]
    return pad_samples(sequences, masks, logprobs, [1.0] * len(sequences), groups, pad_token_id=0)


# Groups whose common prefix differs in length (3, 5 where the rows agree beyond the prompt, the
# whole of a row that another row continues), rows of different lengths, a group whose rows are
# identical, and a group whose rows are not contiguous.
ROWS = [
    ([5, 6, 7, 10, 11, 12], 0),
    ([5, 6, 7, 13, 14], 0),
    ([5, 6, 7, 10, 11, 20, 21, 22], 0),
    ([8, 9, 4, 30, 31], 1),
    ([8, 9, 4, 30, 31], 1),
    ([8, 9, 4, 30, 31, 32, 33], 2),
    ([8, 9, 4, 30, 31], 2),
    ([3, 3, 3, 40], 3),
    ([5, 6, 7, 10, 11, 25], 0),
]


def test_each_row_position_maps_to_its_token_in_the_packed_groups():
    b = batch([s for s, _ in ROWS], [g for _, g in ROWS])
    packed = pack_groups(b.input_ids, b.attention_mask, b.group_ids)
    real = b.attention_mask.bool()
    assert torch.equal(packed.rows(packed.input_ids)[real], b.input_ids[real])
    assert torch.equal(packed.rows(packed.position_ids)[real], torch.arange(b.input_ids.shape[1]).expand_as(real)[real])
    # group 0's rows share [5, 6, 7] (a row's 13 differs at the fourth), so its sequence is 3
    # tokens of prefix and 3 + 2 + 5 + 3 of remainders; group 1's rows are identical: 5 tokens
    sizes = (packed.input_ids != 0).sum(1).tolist()
    assert sizes == [3 + 3 + 2 + 5 + 3, 5, 5 + 2 + 0, 4]
    # a remainder sees the prefix and itself, never another row's remainder
    g0 = packed.mask[0, 0]
    first_rest, second_rest = packed.index[0, 3], packed.index[1, 3]
    assert g0[first_rest, :3].all() and not g0[second_rest, first_rest]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropies_and_gradients_are_the_padded_forwards(temperature):
    model = load_policy(str(MODEL), torch.float32)
    b = batch([s for s, _ in ROWS], [g for _, g in ROWS])
    assert _packed(model, b) is not None, "the batch is worth packing"
    weights = torch.randn(b.input_ids.shape)
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = token_logprobs_and_entropy(model, b, temperature, share_prefix=share)
        ((logprobs + 0.1 * entropy) * b.loss_mask * weights).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logprobs * b.loss_mask, entropy * b.loss_mask, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=2e-5, rtol=0)
    for a, c in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, c, atol=2e-5, rtol=1e-4)


def test_long_continuations_routed_batches_and_sliding_windows_stay_padded():
    model = load_policy(str(MODEL), torch.float32)
    # a 2-token prompt, 16 rows of 40 tokens: one 642-token sequence with a 642^2 mask costs
    # more than 16 rows of 42
    rows = [[5, 6, *torch.randint(2, 46, (40,)).tolist()] for _ in range(16)]
    assert _packed(model, batch(rows, [0] * 16, prompt=2)) is None
    short = batch([s for s, _ in ROWS], [g for _, g in ROWS])
    routed = TrainBatch(**{**{f: getattr(short, f) for f in short.__slots__}, "routed": torch.zeros(9, 8, 4)})
    assert _packed(model, routed) is None
    model.config.layer_types = ["sliding_attention", "full_attention"]  # the window lives in the model's own mask
    assert _packed(model, short) is None
