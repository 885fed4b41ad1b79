"""The megatron backend's GPU kernels compute what their plain forms compute: the torch.compile'd
log-probability and entropy passes against float64 log_softmax (values and gradients, with a
temperature and padded vocabulary columns), and the variable-length flash attention over packed
documents against one scaled_dot_product_attention call per document (GQA, uneven lengths).
Run on the GPU machine: `python -m pytest tests/gpu -m gpu`."""

import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("tokens", [1, 777, 4096])
def test_compiled_logprobs_equal_float64_log_softmax(tokens):
    from relax_hpc.trainer.vocab_parallel import logprobs_and_entropy

    vocab, padding, temperature = 50_000, 64, 0.8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    real = torch.randn(tokens, vocab, device="cuda", generator=g) * 4
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    padded = torch.cat([real, torch.full((tokens, padding), 30.0, device="cuda")], 1).bfloat16().requires_grad_(True)
    lp, ent = logprobs_and_entropy(padded, targets, temperature=temperature, vocab_size=vocab)
    (lp.sum() - 0.3 * ent.sum()).backward()
    assert padded.grad is not None
    ref_in = padded.detach()[:, :vocab].double().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, targets, temperature)
    (ref_lp.sum() - 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-4, rtol=1e-5)
    assert ref_in.grad is not None
    assert padded.grad.dtype == torch.bfloat16 and padded.grad[:, vocab:].abs().max() == 0
    # bf16 gradients: compare at bf16's resolution of the largest entry (the target's 1 - p).
    torch.testing.assert_close(padded.grad[:, :vocab].double(), ref_in.grad, atol=1e-2, rtol=1e-2)


def _attention(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from relax_hpc.models.megatron_layers import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_packed_attention_equals_one_call_per_document(mp, dtype, tolerance):
    """bf16: the variable-length flash call; fp32: the documents batched by length class."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from relax_hpc.models import megatron_layers

    assert megatron_layers._varlen_attn is not None, "this torch has no torch.nn.attention.varlen"
    attention = _attention(heads=16, groups=4, head_dim=128)
    lengths = [1, 37, 500, 1024, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, 16, 128, device="cuda", generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(total, 4, 128, device="cuda", generator=g, dtype=dtype, requires_grad=True) for _ in "kv")
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    grad = torch.randn(total, 16 * 128, device="cuda", generator=g, dtype=dtype)
    out = attention(q, k, v, None, packed_seq_params=params)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    rq, rk = attention._rotate(q, k, megatron_layers.document_positions(cu, total))
    kr, vr = rk.repeat_interleave(4, 1), v.repeat_interleave(4, 1)  # key/value heads to the query heads
    ref = torch.cat(
        [  # one call per document, [1, heads, len, d]
            F.scaled_dot_product_attention(
                rq[a:b].transpose(0, 1)[None],
                kr[a:b].transpose(0, 1)[None],
                vr[a:b].transpose(0, 1)[None],
                is_causal=True,
            )[0].transpose(0, 1)
            for a, b in itertools.pairwise(cu.tolist())
        ]
    ).reshape(total, -1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for mine, theirs in zip((out, *grads), (ref, *ref_grads), strict=True):
        err = ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()
        assert err < tolerance, err  # kernels with different tilings


def test_compiled_norm_and_rope_equal_their_eager_forms():
    from relax_hpc.models import megatron_layers as layers

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(3000, 16, 128, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = (1 + 0.1 * torch.randn(128, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    positions = torch.arange(3000, device="cuda") % 1100
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    cos, sin = layers.rope_table(positions, inv_freq)
    grad = torch.randn(3000, 16, 128, device="cuda", generator=g).bfloat16()
    for compiled, eager, args in (
        (layers._rms_norm, inspect.unwrap(layers._rms_norm), (w, 1e-6)),
        (layers._rope, inspect.unwrap(layers._rope), (cos, sin)),
    ):
        out = compiled(x, *args)
        ref = eager(x, *args)
        torch.testing.assert_close(out, ref)
        inputs = (x, w) if compiled is layers._rms_norm else (x,)
        for mine, theirs in zip(
            torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True
        ):
            err = ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item()
            assert err < 1e-2, err  # bf16 gradients, the weight's summed over 48,000 rows
