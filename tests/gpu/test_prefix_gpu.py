"""Shared-prefix packing on CUDA (SDPA with a boolean block mask): the log-probabilities and
gradients are the padded forward's, in fp32 to rounding and in bf16 to bf16's. Run on the GPU
machine: `python -m pytest tests/gpu -m gpu`."""

import pytest
import torch

from relax_hpc.models.hf import load_policy
from relax_hpc.trainer.batching import _packed, token_logprobs_and_entropy
from tests.unit.test_prefix import MODEL, ROWS, batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_packed_groups_on_cuda_are_the_padded_forward(dtype, atol):
    torch.backends.cuda.matmul.allow_tf32 = False
    model: torch.nn.Module = load_policy(str(MODEL), dtype)
    model.cuda()
    b = batch([s for s, _ in ROWS], [g for _, g in ROWS]).to(torch.device("cuda"))
    assert _packed(model, b) is not None
    weights = torch.randn(b.input_ids.shape, device="cuda")
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = token_logprobs_and_entropy(model, b, 1.0, share_prefix=share)
        ((logprobs + 0.1 * entropy) * b.loss_mask * weights).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        results.append((logprobs * b.loss_mask, grads))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=atol, rtol=0)
    cosine = torch.nn.functional.cosine_similarity(g0, g1, dim=0)
    assert cosine > (1 - 1e-6 if dtype == torch.float32 else 0.999), cosine
