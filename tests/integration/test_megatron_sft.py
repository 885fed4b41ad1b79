"""kind=sft on the megatron backend, on the CPU (megatron's GPU code redirected as in
test_megatron_checkpoint.py): the real MegatronBackend.sft_step, its examples packed into several
micro-batches, takes the torch backend's step on the same weights and batch: the same loss, NLL
statistics and gradient norm, and after one optimizer step each the same loss again, lower."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relax_hpc.config.load import load_config
from relax_hpc.data.sft import load_examples, prompt_response_example
from relax_hpc.models.tiny import build_char_tokenizer
from relax_hpc.trainer.backend import BackendConfig
from relax_hpc.trainer.megatron_backend import MegatronBackend
from relax_hpc.trainer.sft_loop import examples_batch
from relax_hpc.trainer.torch_backend import TorchBackend
from tests.integration.test_megatron_checkpoint import megatron_on_cpu

__all__ = ["megatron_on_cpu"]  # the fixture, requested by name
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form of tests/gpu/test_megatron_backend.py"),
]
REPO = Path(__file__).resolve().parents[2]
KEYS = {"prompt": "prompt", "response": "response", "messages": "messages"}
OVERRIDES = ["trainer.num_ranks=1", "model.dtype=float32"]


@pytest.fixture
def reference(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TorchBackend]:
    """The torch backend, built before megatron's CPU patches apply: a first transformers model
    loaded while torch.tensor is redirected keeps uninitialised RoPE frequencies."""
    started = not dist.is_initialized()  # another test of the session may have made the one-rank world
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cfg = load_config(REPO / "configs/tiny-sft.yaml", OVERRIDES, base_dir=REPO)
    backend = TorchBackend(BackendConfig.of(cfg), torch.device("cpu"))
    request.getfixturevalue("megatron_on_cpu")
    yield backend
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_megatron_sft_step_is_the_torch_backends(aggregation, reference):
    cfg = load_config(REPO / "configs/tiny-sft.yaml", [*OVERRIDES, "trainer.backend=megatron",
                      "trainer.megatron.attention=sdpa", "trainer.megatron.max_tokens_per_microbatch=24"],
                      base_dir=REPO)  # fmt: skip
    tok = build_char_tokenizer()
    examples = load_examples(REPO / "assets/addition-sft.jsonl", "prompt_response", KEYS, tok, 64)[::9]
    examples.append(prompt_response_example({"prompt": "9+9+9=", "response": "27"}, "prompt", "response", tok, "x"))
    batch = examples_batch(examples, list(range(len(examples))), tok.pad_token_id)
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1  # rows of several lengths: padding to skip
    megatron = MegatronBackend(BackendConfig.of(cfg), torch.device("cpu"))
    assert len(megatron._microbatches(batch)) > 2  # the global counts divide each micro-batch's loss

    losses = []
    for step in (0, 1):
        expected = reference.sft_step(batch, step, aggregation)
        got = megatron.sft_step(batch, step, aggregation)
        assert got.loss == pytest.approx(expected.loss, rel=1e-4)
        assert got.stats.sums["tokens"] == expected.stats.sums["tokens"] == float(batch.loss_mask.sum())
        assert got.stats.sums["nll"] == pytest.approx(expected.stats.sums["nll"], rel=1e-4)
        assert got.grad_norm == pytest.approx(expected.grad_norm, rel=1e-3)
        losses.append(got.loss)
    assert losses[1] < losses[0]  # the first step learned
