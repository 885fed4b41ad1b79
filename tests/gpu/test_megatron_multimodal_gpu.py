"""tests/integration/test_megatron_multimodal.py's proofs on a GPU (the CUDA kernels: SDPA's packed
attention, megatron's fused layers, bf16): the shipped tiny Qwen2.5-VL, a tiny Qwen3-VL, the
shipped tiny Qwen2-Audio and a tiny Qwen3-Omni on the megatron backend against the torch backend,
the same batch of rows with 0, 1 and 2 pictures (clips; the Omni rows mix both).

- fp32 (TF32 off): per-token log-probabilities, one GRPO step's loss and gradient norm, and the
  weights after it agree as on the CPU, with GPU-sized tolerances (other kernels' summation orders);
- bf16: the same, within bf16's rounding (each side rounds differently; both keep fp32 master
  weights, so the step's weights differ by at most Adam's 2 lr and the roundings, bf16_step_bound);
- loading then exporting gives the HF tensors bit for bit in either dtype.
Each test prints one `MEASURED {...}` line (what BENCHMARKS.md quotes; tools/bench/multimodal_megatron_gpu.sh
collects them). Run on the GPU machine: `python -m pytest tests/gpu/test_megatron_multimodal_gpu.py -m gpu -s`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# dtype -> (log-prob max abs, loss and gradient norm rel, (abs, rel) of each weight after one lr
# step). fp32: as on the CPU but for the kernels' summation orders. bf16: products rounded to 8
# mantissa bits; the weights: see bf16_step_bound.
TOLERANCES = {"float32": (1e-4, 1e-3, (5e-5, 0.0)), "bfloat16": (0.25, 5e-2, None)}


def bf16_step_bound(source: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lr: float) -> torch.Tensor:
    """How far two bf16 exports of one Adam step from `source` may be apart, element by element.
    Both backends keep fp32 master weights and moments, so each moves a weight by at most lr
    (Adam's first step is lr * g / (|g| + eps)), the two in opposite directions where their
    gradients' signs differ. Megatron's master starts from the bf16 weight, the torch backend's
    from the fp32 source: at most half a bf16 spacing (2^-9 of it) apart. Each export rounds its
    master to the nearest bf16: half a spacing, at most 2^-8 of the value."""
    return 2 * lr + 2.0**-9 * source.abs() + 2.0**-8 * (a.abs() + b.abs())


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl", "qwen2-audio", "qwen3-omni"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.test_megatron_multimodal import model_folder

    return model_folder(request.param, tmp_path_factory)


def _backends(model: Path, dtype: str):
    from relax_hpc.trainer.megatron_backend import MegatronBackend
    from relax_hpc.trainer.torch_backend import TorchBackend
    from tests.integration.test_megatron_multimodal import MEGATRON, _config

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    reference = TorchBackend(_config(model, f"model.dtype={dtype}"), device)
    return reference, MegatronBackend(_config(model, f"model.dtype={dtype}", *MEGATRON), device)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_logprobs_and_step_are_the_torch_backends_on_cuda(model, dtype, megatron_world):
    from relax_hpc.trainer.batching import token_logprobs_and_entropy
    from tests.integration.test_megatron_multimodal import _batch, _hf_weights, _source

    logprob_atol, rel, weights = TOLERANCES[dtype]
    reference, megatron = _backends(model, dtype)
    batch = _batch(model)
    with torch.no_grad():
        expected = token_logprobs_and_entropy(reference.model, batch.to(torch.device("cuda", 0)))[0].float().cpu()
    got = megatron._frozen_logprobs(megatron.model, batch.to(torch.device("cuda", 0)))  # train_step's own move
    assert got is not None
    real = batch.attention_mask.bool()
    diff = (got.float().cpu()[real] - expected[real]).abs()

    batch.rollout_logprobs = expected * batch.loss_mask  # on-policy: ratios 1, as after sampling
    want, result = reference.train_step(batch, 0), megatron.train_step(batch, 0)
    after, torch_after = _hf_weights(megatron), _hf_weights(reference)
    weight_diff = max((after[n].float() - torch_after[n].float()).abs().max().item() for n in after)
    measured = {
        "model": model.name, "dtype": dtype, "logprob_max": diff.max().item(), "logprob_mean": diff.mean().item(),
        "loss": [want.loss, result.loss], "grad_norm": [want.grad_norm, result.grad_norm], "weight_max": weight_diff,
    }  # fmt: skip
    print("MEASURED " + json.dumps({"test": "multimodal_equality", **measured}), flush=True)
    assert diff.max() < logprob_atol
    assert result.loss == pytest.approx(want.loss, rel=rel, abs=1e-5)
    assert result.grad_norm == pytest.approx(want.grad_norm, rel=rel)
    assert after.keys() == torch_after.keys()
    source = _source(model)
    for name in after:
        a, b = after[name].float().cpu(), torch_after[name].float().cpu()
        if weights is None:
            bound = bf16_step_bound(source[name].float(), a, b, reference.cfg.lr)
            assert ((a - b).abs() <= bound).all(), (name, ((a - b).abs() - bound).max().item())
        else:
            assert torch.allclose(a, b, atol=weights[0], rtol=weights[1]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megatron_loads_and_exports_the_hf_weights_exactly_on_cuda(model, dtype, megatron_world):
    from relax_hpc.models.hf import torch_dtype
    from relax_hpc.trainer.megatron_backend import MegatronBackend
    from tests.integration.test_megatron_multimodal import MEGATRON, _config, _hf_weights, _source

    megatron = MegatronBackend(_config(model, f"model.dtype={dtype}", *MEGATRON), torch.device("cuda", 0))
    source = {n: t.to(torch_dtype(dtype)) for n, t in _source(model).items()}  # an Omni model's thinker
    exported = {n: t.cpu() for n, t in _hf_weights(megatron).items()}
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[n], source[n]) for n in source)
