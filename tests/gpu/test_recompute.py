"""Activation recompute on a GPU (trainer.megatron.recompute, trainer.gradient_checkpointing):
a step with each layer's activations recomputed in the backward pass takes the step the plain
one takes. Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_megatron_backend import _batch, _weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("option", ["trainer.megatron.recompute", "trainer.gradient_checkpointing"])
def test_recomputed_step_equals_the_plain_one(megatron_world, tmp_path, option):
    from relax_hpc.config.load import load_config
    from relax_hpc.trainer.build import build_backend

    backend = "megatron" if "megatron" in option else "torch"
    common = [f"run.dir={tmp_path}", "trainer.lr=3e-3", f"trainer.backend={backend}"]  # float32: close comparisons
    device = torch.device("cuda", 0)
    config = REPO / "configs/gpu-tiny-megatron.yaml"
    plain: Any = build_backend(load_config(config, common), device)  # the backend's own class: its model
    recomputed: Any = build_backend(load_config(config, [*common, f"{option}=true"]), device)
    if backend == "torch":
        assert recomputed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    else:
        assert recomputed.model.module.config.recompute_granularity == "full"
    expected, got = (b.train_step(_batch(0, 46), 0) for b in (plain, recomputed))
    assert got.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-6)
    reference = _weights(plain)
    for name, tensor in _weights(recomputed).items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-3, atol=1e-5)
