"""HF <-> megatron mapping of Qwen2 / Qwen3 / Qwen3-MoE on one CPU rank (gloo): load then export
is exact, megatron names and shapes match a built GPTModel, hf_specs match transformers, the qkv
and SwiGLU layouts match hand-written examples; the model config refuses what it cannot
reproduce; SDPAttention (the non-TE core attention) equals a naive causal attention, packed and
unpacked. The helpers here (tiny configs, random HF folders) serve the parallel and GPU tests too."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from relax_hpc.config.schema import MegatronConfig
from relax_hpc.models.arch import arch_of
from relax_hpc.models.hf_export import export_hf
from relax_hpc.models.hf_loading import load_hf_weights
from relax_hpc.models.hf_mapping import (
    canonical_name,
    entry,
    hf_specs,
    hf_to_mcore,
    mcore_names,
    mcore_to_hf,
    rank_experts,
    stage_layers,
)
from relax_hpc.models.megatron import (
    SDPAttention,
    build_model,
    layer_spec,
    packed_seq_params,
    transformer_config,
)

SDPA = MegatronConfig(attention="sdpa")


def tiny_configs(num_layers: int = 2) -> dict:
    """Tiny models of every supported architecture, each with something to get wrong."""
    common: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {
        # q/k/v biases, untied, a vocabulary that TP=2 must pad
        "qwen2": Qwen2Config(
            vocab_size=67,
            intermediate_size=48,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            **common,
        ),
        # head_dim 16 != hidden / heads = 8, untied
        "qwen3": Qwen3Config(vocab_size=64, intermediate_size=48, head_dim=16, tie_word_embeddings=False, **common),
        "qwen3-tied": Qwen3Config(vocab_size=64, intermediate_size=48, head_dim=16, tie_word_embeddings=True, **common),
        "qwen3-moe": Qwen3MoeConfig(
            vocab_size=64,
            intermediate_size=64,
            moe_intermediate_size=16,
            head_dim=8,  # type: ignore[call-arg]  # kept as an attribute: transformers' typed __init__ omits it
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        ),
    }


def save_random_hf(config, folder: Path, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """An HF model whose every tensor (norms too) is random, saved as an HF folder; returns the
    checkpoint's tensors as safetensors holds them."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * scale + (1.0 if param.dim() == 1 else 0.0))
    model.save_pretrained(folder)
    return read_safetensors(folder)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world for megatron's process groups (this module's own; models are built on a
    GPU where there is one, and then compared on the CPU)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


@pytest.fixture
def mp(one_rank):
    """megatron's global parallel_state, torn down after each test."""
    parallel_state.initialize_model_parallel()
    if torch.cuda.is_available():  # on a GPU machine megatron initialises weights under its RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


CONFIGS = tiny_configs()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_load_then_export_reproduces_the_hf_checkpoint_exactly(kind, mp, tmp_path):
    config = CONFIGS[kind]
    hf = save_random_hf(config, tmp_path)
    model = build_model(config, SDPA, torch.float32, pre_process=True, post_process=True)
    load_hf_weights(model, tmp_path)
    exported = list(export_hf(model, config))
    assert [name for name, _ in exported] == [name for name, _, _ in hf_specs(config, torch.float32)]
    assert {name for name, _ in exported} == set(hf)
    for name, tensor in exported:
        assert tensor is not None  # rank 0 of a one-rank world
        assert tensor.dtype == torch.float32 and torch.equal(tensor.cpu(), hf[name]), name


def test_bf16_model_exports_the_bf16_checkpoint(mp, tmp_path):
    config = CONFIGS["qwen3-moe"]
    hf = save_random_hf(config, tmp_path)
    model = build_model(config, SDPA, torch.bfloat16, pre_process=True, post_process=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # megatron's torch norms too
    load_hf_weights(model, tmp_path)
    for name, tensor in export_hf(model, config):
        assert tensor is not None  # rank 0 of a one-rank world
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor.cpu(), hf[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_megatron_names_shapes_and_values_equal_the_built_model(kind, mp, tmp_path):
    config = CONFIGS[kind]
    hf = save_random_hf(config, tmp_path)
    model = build_model(config, SDPA, torch.float32, pre_process=True, post_process=True)
    params = dict(model.named_parameters())
    converted = hf_to_mcore(hf, config)
    assert {n: tuple(t.shape) for n, t in converted.items()} == {n: tuple(p.shape) for n, p in params.items()}
    assert sorted(mcore_names(config)) == sorted(params)
    load_hf_weights(model, tmp_path)
    for name, param in params.items():
        assert torch.equal(param.cpu(), converted[name]), name
    back = mcore_to_hf(converted, config)
    assert list(back) == [n for n, _, _ in hf_specs(config, torch.float32)]
    assert all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_hf_specs_equal_transformers_parameters_and_checkpoint(kind, tmp_path):
    config = CONFIGS[kind]
    specs = [(name, tuple(shape)) for name, shape, _ in hf_specs(config, torch.bfloat16)]
    assert {dtype for _, _, dtype in hf_specs(config, torch.bfloat16)} == {torch.bfloat16}
    hf = save_random_hf(config, tmp_path)
    assert dict(specs) == {name: tuple(t.shape) for name, t in hf.items()}  # the checkpoint format
    model_params = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    if "moe" not in kind:
        assert specs == model_params
        return
    # transformers fuses experts into 3-D parameters; checkpoints (and SGLang) name them one by one.
    fused = [n for n, _ in model_params if ".mlp.experts." in n]
    assert fused == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
    assert [s for s in specs if ".mlp.experts." not in s[0]] == [p for p in model_params if ".mlp.experts." not in p[0]]


def _state_with(config, **overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    state = {name: torch.zeros(shape) for name, shape, _ in hf_specs(config, torch.float32)}
    state.update({name.replace("__", "."): t for name, t in overrides.items()})
    return state


def _rows(values) -> torch.Tensor:
    """A [len(values), 8] tensor whose row i is values[i] throughout: rows are labelled."""
    return torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, 8).clone()


def test_qkv_interleave_matches_a_hand_written_example():
    # 4 query heads in 2 groups, head_dim 2: q rows 0..7, k rows 100..103, v rows 200..203.
    config = Qwen2Config(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    a = "model__layers__0__self_attn__"
    state = _state_with(
        config,
        **{a + "q_proj__weight": _rows(range(8)), a + "k_proj__weight": _rows(range(100, 104))},
        **{a + "v_proj__weight": _rows(range(200, 204)), a + "q_proj__bias": torch.arange(8.0)},
        **{a + "k_proj__bias": torch.arange(100.0, 104.0), a + "v_proj__bias": torch.arange(200.0, 204.0)},
    )
    mcore = hf_to_mcore(state, config)
    group0, group1 = [0, 1, 2, 3, 100, 101, 200, 201], [4, 5, 6, 7, 102, 103, 202, 203]
    assert mcore["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == group0 + group1
    assert mcore["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == group0 + group1
    assert torch.equal(mcore_to_hf(mcore, config)[a.replace("__", ".") + "k_proj.weight"], _rows(range(100, 104)))


def test_swiglu_fc1_and_vocab_layouts_per_tensor_parallel_rank():
    config = Qwen3Config(
        vocab_size=7,
        hidden_size=8,
        intermediate_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
    )
    gate, up = torch.arange(4.0)[:, None].expand(-1, 8), torch.arange(10.0, 14.0)[:, None].expand(-1, 8)
    embed = torch.arange(7.0)[:, None].expand(-1, 8)
    state = _state_with(
        config,
        model__layers__0__mlp__gate_proj__weight=gate,
        model__layers__0__mlp__up_proj__weight=up,
        model__embed_tokens__weight=embed,
    )
    tp1, tp2 = hf_to_mcore(state, config), hf_to_mcore(state, config, tp=2)
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert tp1[fc1][:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert tp2[fc1][:, 0].tolist() == [0, 1, 10, 11, 2, 3, 12, 13]  # rank 0: rows 0-3, rank 1: rows 4-7
    assert tp2["embedding.word_embeddings.weight"][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0]  # one zero pad row
    back = mcore_to_hf(tp2, config, tp=2)
    assert torch.equal(back["model.layers.0.mlp.up_proj.weight"], up) and torch.equal(
        back["model.embed_tokens.weight"], embed
    )


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_transformer_engine_names_round_trip(kind, tmp_path):
    # TE fuses the pre-attention / pre-MLP norms into the next linear and groups the experts.
    config = CONFIGS[kind]
    hf = save_random_hf(config, tmp_path)
    mcore = hf_to_mcore(hf, config, te=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in mcore
    if "moe" in kind:
        assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in mcore
    else:
        assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mcore
    back = mcore_to_hf(mcore, config)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


def test_stage_layers_and_rank_experts():
    par = MegatronConfig(attention="sdpa", pipeline_parallel=2)
    config = transformer_config(tiny_configs(num_layers=4)["qwen3"], par, torch.float32)
    assert [list(stage_layers(config, s)) for s in (0, 1)] == [[0, 1], [2, 3]]
    assert [list(rank_experts(8, 2, r)) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3-moe"])
def test_split_dims_are_the_ones_megatron_shards(kind, mp):
    config = CONFIGS[kind]
    model = build_model(config, SDPA, torch.float32, pre_process=True, post_process=True)
    arch = arch_of(config)
    for name, param in model.named_parameters():
        expected = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        assert entry(canonical_name(name, model), arch).split == expected, name


def test_config_carries_the_architecture(mp):
    qwen2 = transformer_config(CONFIGS["qwen2"], SDPA, torch.bfloat16)
    assert qwen2.add_qkv_bias and not qwen2.add_bias_linear and not qwen2.qk_layernorm
    assert qwen2.bf16 and qwen2.gated_linear_unit and qwen2.normalization == "RMSNorm"
    assert qwen2.hidden_dropout == qwen2.attention_dropout == 0.0 and qwen2.num_query_groups == 2
    qwen3 = transformer_config(CONFIGS["qwen3"], SDPA, torch.float32)
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias and qwen3.kv_channels == 16 and not qwen3.bf16
    moe = transformer_config(CONFIGS["qwen3-moe"], MegatronConfig(attention="sdpa", expert_parallel=2), torch.float32)
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (4, 2, 16)
    assert not moe.moe_router_pre_softmax and moe.moe_router_load_balancing_type == "none"
    assert moe.expert_model_parallel_size == 2 and not moe.moe_grouped_gemm
    par = MegatronConfig(
        attention="sdpa", tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True, recompute=True
    )
    sharded = transformer_config(CONFIGS["qwen3"], par, torch.bfloat16)
    assert (sharded.tensor_model_parallel_size, sharded.pipeline_model_parallel_size) == (2, 2)
    assert not sharded.sequence_parallel  # megatron's torch norms refuse it; TE would take it
    assert sharded.recompute_granularity == "full"
    model = build_model(CONFIGS["qwen2"], SDPA, torch.float32, pre_process=True, post_process=True)
    assert model.share_embeddings_and_output_weights is False
    assert all(isinstance(layer.self_attention.core_attention, SDPAttention) for layer in model.decoder.layers)
    # RoPE is the core attention's (megatron's own would rotate q and k a second time)
    assert not hasattr(model, "rotary_pos_emb")
    inv_freq = model.decoder.layers[0].self_attention.core_attention.inv_freq
    assert inv_freq[1].item() == pytest.approx(50000.0 ** (-2 / 8))  # rope_theta, head_dim 8


def test_unsupported_configs_are_refused_clearly():
    base: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    cases = {
        "unsupported architecture model_type='llama'": LlamaConfig(**base),
        "RoPE scaling type 'linear'": Qwen3Config(
            **base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
        ),
        "every layer must be an MoE layer": Qwen3MoeConfig(**base, num_experts=4, mlp_only_layers=[1]),
        "sliding-window": Qwen2Config(**base, use_sliding_window=True, sliding_window=8, max_window_layers=0),
        "attention_bias": Qwen3Config(**base, attention_bias=True),
    }
    for message, config in cases.items():
        with pytest.raises(ValueError, match=message):
            transformer_config(config, SDPA, torch.float32)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        transformer_config(CONFIGS["qwen3"], MegatronConfig(attention="sdpa", tensor_parallel=4), torch.float32)
    with pytest.raises(ValueError, match="transformer_engine is not installed"):
        layer_spec(CONFIGS["qwen3"], MegatronConfig(attention="te"))


# ---------------------------------------------------------------- SDPAttention on CPU


def _attention_module(heads: int = 4, groups: int = 2, head_dim: int = 8) -> SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[s, heads, d] x [s, groups, d] -> [s, heads * d], float64 loops: query head h uses kv head
    h // (heads / groups), as megatron groups them."""
    s, heads, d = q.shape
    per_group = heads // k.shape[1]
    out = torch.zeros(s, heads, d, dtype=torch.float64)
    for h in range(heads):
        for i in range(s):
            scores = torch.stack([q[i, h].double() @ k[j, h // per_group].double() for j in range(i + 1)]) / d**0.5
            out[i, h] = (torch.softmax(scores, 0)[:, None] * v[: i + 1, h // per_group].double()).sum(0)
    return out.reshape(s, heads * d)


def _hf_rope(q: torch.Tensor, k: torch.Tensor, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[s, heads, d] rotated by transformers' own Qwen3 rotary embedding at positions 0..s-1."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    d = q.shape[-1]
    rotary = Qwen3RotaryEmbedding(
        Qwen3Config(
            head_dim=d,
            num_attention_heads=q.shape[1],
            rope_parameters={"rope_type": "default", "rope_theta": theta},
        )
    )
    cos, sin = rotary(q, torch.arange(q.shape[0])[None])
    q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


def test_sdpa_attention_unpacked_equals_naive_causal_gqa_with_rope(mp):
    torch.manual_seed(0)
    attention = _attention_module()
    q, k, v = torch.randn(6, 2, 4, 8), torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8)  # [s, b, heads, d]
    out = attention(q, k, v, None)
    assert out.shape == (6, 2, 32)
    for b in range(2):
        expected = _naive_causal(*_hf_rope(q[:, b], k[:, b]), v[:, b])
        torch.testing.assert_close(out[:, b].double(), expected, atol=1e-5, rtol=1e-5)


def test_sdpa_attention_packed_documents_attend_only_within_themselves(mp):
    torch.manual_seed(1)
    attention = _attention_module()
    lengths = [3, 5, 2]
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)  # 'thd': [t, heads, d]
    out = attention(q, k, v, None, packed_seq_params=packed_seq_params(lengths, "cpu"))
    assert out.shape == (10, 32)
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        # RoPE positions restart at each document
        expected = _naive_causal(*_hf_rope(q[doc], k[doc]), v[doc])
        torch.testing.assert_close(out[doc].double(), expected, atol=1e-5, rtol=1e-5)
        start += n
    params = packed_seq_params(lengths, "cpu")
    assert params.cu_seqlens_q.tolist() == [0, 3, 5 + 3, 10] and params.max_seqlen_q == 5
    with pytest.raises(ValueError, match="do not cover"):
        attention(q, k, v, None, packed_seq_params=packed_seq_params([3, 5], "cpu"))


def test_packed_documents_of_many_lengths_equal_naive_attention_forward_and_backward(mp):
    """Documents of every length class (1 to 17 tokens, classes padded to their longest), in a
    shuffled order: the batched path's outputs and gradients are each document's naive causal
    attention's, and no output is shared between documents."""
    torch.manual_seed(2)
    attention = _attention_module()
    lengths = [4, 1, 17, 3, 2, 9, 5, 16, 1, 8]
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    grad = torch.randn(total, 32, dtype=torch.float64)
    out = attention(q, k, v, None, packed_seq_params=packed_seq_params(lengths, "cpu"))
    mine = torch.autograd.grad(out, (q, k, v), grad)
    expected, start = [], 0
    for n in lengths:
        doc = slice(start, start + n)
        expected.append(_naive_causal(*_hf_rope(q[doc], k[doc]), v[doc]))
        start += n
    reference = torch.cat(expected)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)  # RoPE rotates in fp32
    for g, r in zip(mine, torch.autograd.grad(reference, (q, k, v), grad), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)  # RoPE rotates in fp32


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_megatron_checkpoint_reads_back_as_the_hf_checkpoint(kind, mp, tmp_path, monkeypatch):
    """What tools/dcp_to_hf.py reads: megatron's own distributed checkpoint of the model (layers
    stacked, TE names, SwiGLU halves saved as separate shards) gives back the HF tensors."""
    from megatron.core import dist_checkpointing

    from relax_hpc.models.hf_checkpoint import megatron_checkpoint_to_hf

    if not torch.cuda.is_available():  # megatron's save syncs CUDA and reduces a flag there: on the CPU
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    config = CONFIGS[kind]
    hf = save_random_hf(config, tmp_path / "hf")
    model = build_model(config, SDPA, torch.float32, pre_process=True, post_process=True)
    load_hf_weights(model, tmp_path / "hf")
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"), sharded_strategy=("torch_dist", 1))
    converted = megatron_checkpoint_to_hf(tmp_path / "ckpt", config)
    assert set(converted) == set(hf)
    for name, tensor in converted.items():
        assert torch.equal(tensor, hf[name]), name
