"""Routing replay in megatron-core's MoE layers, on the CPU: a tiny Qwen3-MoE GPTModel routes each
token through exactly the experts it is given (its routers' routing maps say so), replaying its
own choices changes nothing, other experts change the logits, positions without a choice change
no other position, and afterwards the routers decide again. Packing carries the choices along;
the config refuses what the replay cannot take."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from megatron.core import parallel_state

from relax_hpc.config import ConfigError, load_config
from relax_hpc.config.schema import MegatronConfig
from relax_hpc.models.megatron import build_model
from relax_hpc.models.megatron_routing import recording, replaying
from relax_hpc.trainer import packing
from relax_hpc.trainer.batching import pad_samples
from tests.unit.test_hf_mapping import one_rank, tiny_configs  # noqa: F401  # one_rank: a fixture

TOKENS = 11


@pytest.fixture
def moe(one_rank, monkeypatch) -> Iterator[torch.nn.Module]:  # noqa: F811
    # megatron's router moves its weight "to the GPU" at its first forward: here that is the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    parallel_state.initialize_model_parallel()
    config = tiny_configs()["qwen3-moe"]  # 2 layers, 4 experts, top-2
    torch.manual_seed(0)
    model = build_model(config, MegatronConfig(attention="sdpa"), torch.float32, True, True, routing_replay=True)
    yield model.eval()
    parallel_state.destroy_model_parallel()


def run(model: torch.nn.Module, ids: torch.Tensor, chosen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, vocab], each token's experts [T, layers * top_k] as the routers dispatched them)."""
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad(), recording(model) as calls:
        if chosen is None:
            logits = model(ids, positions, None)
        else:
            with replaying(model, chosen):
                logits = model(ids, positions, None)
    assert len(calls) == 1
    return logits[0], calls[0]


def test_the_routers_take_the_given_experts(moe):
    ids = torch.randint(64, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    free_logits, own = run(moe, ids, None)
    same_logits, same = run(moe, ids, own)
    assert torch.equal(same, own)
    torch.testing.assert_close(same_logits, free_logits, rtol=1e-6, atol=1e-6)

    other = (own + 1) % 4  # experts 1, 2, 3, 0 in place of 0, 1, 2, 3: still two distinct per token
    other_logits, taken = run(moe, ids, other)
    assert torch.equal(taken, other.reshape(TOKENS, 2, 2).sort(-1).values.reshape(TOKENS, 4))
    assert (other_logits - free_logits).abs().max() > 1e-3

    unrecorded = other.clone()
    unrecorded[-1] = -1  # a sample's last token: the engine recorded nothing for it
    last_logits, taken = run(moe, ids, unrecorded)
    assert taken[-1].tolist() == [0, 1, 0, 1]  # experts 0..k-1 in each layer
    # Causal: no other position sees it (up to the rounding of experts' matmuls over other token sets).
    torch.testing.assert_close(last_logits[:-1], other_logits[:-1], rtol=1e-5, atol=1e-6)

    after_logits, after = run(moe, ids, None)  # the replay ended with its context
    assert torch.equal(after, own) and torch.equal(after_logits, free_logits)


def test_a_batch_for_another_model_is_refused(moe):
    too_many = torch.zeros(TOKENS, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="for 3 MoE layers of top-2; the model has 2"), replaying(moe, too_many):
        pass


def test_packing_carries_each_tokens_experts():
    lengths = [4, 6, 3]
    batch = pad_samples([[5] * n for n in lengths], [[0] + [1] * (n - 1) for n in lengths],
                        [[0.0] * n for n in lengths], [0.0] * 3, [0, 1, 2], 0)  # fmt: skip
    batch.routed = torch.full((3, 6, 4), -1, dtype=torch.long)
    for row, n in enumerate(lengths):
        batch.routed[row, : n - 1] = torch.arange(n - 1)[:, None] * 10 + row
    mb = packing.pack(batch, [0, 2], pad_id=0, multiple=4)
    assert mb.routed is not None and mb.routed.shape == (8, 4)
    assert mb.routed[:, 0].tolist() == [0, 10, 20, -1, 2, 12, -1, -1]  # row 0, row 2, the filler


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("trainer.megatron.recompute=true", "recompute=false"),
        ("trainer.megatron.context_parallel=2", "context_parallel=1"),
        ("trainer.megatron.tensor_parallel=2", "sequence_parallel=false"),
    ],
)
def test_the_config_refuses_what_megatron_replay_cannot_take(override, fix):
    base = ["trainer.backend=megatron", "trainer.num_ranks=2", "algo.off_policy.routing_replay=true"]
    with pytest.raises(ConfigError, match=fix):
        load_config(None, [*base, override])
    load_config(None, [*base, override.replace("=true", "=false").replace("=2", "=1")])
