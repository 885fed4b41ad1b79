"""megatron-core GPT models of HF Qwen2 / Qwen3 / Qwen3-MoE checkpoints.

`transformer_config` turns an HF config plus the job's parallelism into megatron's TransformerConfig,
`layer_spec` picks the layer implementation (Transformer Engine, or megatron's local modules with
relax_hpc's RMSNorm and core attention: relax_hpc/models/megatron_layers.py), `build_model` builds this
rank's GPTModel (its pipeline stage, its tensor/expert shards). Weights come from
`relax_hpc.models.hf_mapping.load_hf_weights`.

Architectures outside what the mapping reproduces exactly (sliding-window layers, RoPE scaling,
Qwen3 attention biases, MoE models with dense layers) are refused with the reason, never
approximated.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from relax_hpc.config.schema import MegatronConfig
from relax_hpc.models.megatron_layers import RMSNorm, SDPAttention

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Arch:
    """The facts of an HF config that the megatron model and the weight mapping depend on."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (megatron: query groups)
    head_dim: int
    ffn: int  # dense MLP intermediate size
    vocab: int
    tied: bool
    qkv_bias: bool  # Qwen2: q/k/v projections have biases, o_proj has none
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    num_experts: int  # 0: dense
    moe_ffn: int
    topk: int
    norm_topk: bool
    rope_theta: float
    norm_eps: float
    max_positions: int

    @property
    def moe(self) -> bool:
        return self.num_experts > 0


def arch_of(hf_config: Any) -> Arch:
    """Read and validate an HF config; raise ValueError for anything this module cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"megatron backend: unsupported architecture model_type={model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf_config.hidden_act != "silu":
        raise ValueError(f"megatron backend: hidden_act={hf_config.hidden_act!r} is not supported (SwiGLU/silu only)")
    _refuse_sliding_window(hf_config)
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        raise ValueError("megatron backend: attention_bias=True (biases on q/k/v/o) is not supported")
    heads = hf_config.num_attention_heads
    num_experts = _num_experts(hf_config)
    return Arch(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        num_experts=num_experts,
        moe_ffn=hf_config.moe_intermediate_size if num_experts else 0,
        topk=hf_config.num_experts_per_tok if num_experts else 0,
        norm_topk=bool(getattr(hf_config, "norm_topk_prob", False)),
        rope_theta=_rope_theta(hf_config),
        norm_eps=hf_config.rms_norm_eps,
        max_positions=hf_config.max_position_embeddings,
    )


def _refuse_sliding_window(hf_config: Any) -> None:
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("megatron backend: sliding-window attention layers are not supported")


def _num_experts(hf_config: Any) -> int:
    if hf_config.model_type != "qwen3_moe":
        return 0
    # megatron's MoE spec here makes every layer an MoE layer; a mixed model would load wrongly.
    if getattr(hf_config, "decoder_sparse_step", 1) != 1 or getattr(hf_config, "mlp_only_layers", None):
        raise ValueError(
            "megatron backend: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
            "is not supported; every layer must be an MoE layer"
        )
    return hf_config.num_experts


def _rope_theta(hf_config: Any) -> float:
    """RoPE base; transformers 5 keeps it in rope_parameters, older configs in rope_theta."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"megatron backend: RoPE scaling type {rope_type!r} is not implemented (default RoPE only)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("megatron backend: the HF config has no rope_theta")
    return float(theta)


def use_transformer_engine(attention: str) -> bool:
    """`te`: required; `auto`: when transformer_engine is importable; `sdpa`: never."""
    available = importlib.util.find_spec("transformer_engine") is not None
    if attention == "te" and not available:
        raise ValueError("megatron.attention=te but transformer_engine is not installed")
    return attention == "te" or (attention == "auto" and available)


def padded_vocab_size(vocab: int, tensor_parallel: int) -> int:
    """The embedding/output rows: the HF vocabulary, padded only as far as TP divisibility needs.
    Logits of the padded rows (zero weights) are not tokens: the backend drops them."""
    return math.ceil(vocab / tensor_parallel) * tensor_parallel


def transformer_config(hf_config: Any, par: MegatronConfig, params_dtype: torch.dtype) -> TransformerConfig:
    """megatron TransformerConfig of an HF Qwen2/Qwen3/Qwen3-MoE config under the job's parallelism."""
    arch = arch_of(hf_config)
    te = use_transformer_engine(par.attention)
    _check_parallel(arch, par, te)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden,
        num_attention_heads=arch.heads,
        num_query_groups=arch.groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        qk_layernorm=arch.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=par.tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_parallel,
        context_parallel_size=par.context_parallel,
        expert_model_parallel_size=par.expert_parallel,
        # megatron's torch norms (the non-TE path) refuse sequence parallelism.
        sequence_parallel=par.sequence_parallel and par.tensor_parallel > 1 and te,
        use_cpu_initialization=not torch.cuda.is_available(),
        # SwiGLU in one torch.compile'd kernel each way, keeping only its input for backward (on
        # GPUs; the CPU, which builds models only to test the mapping, runs the plain form).
        bias_activation_fusion=torch.cuda.is_available(),
        **_recompute(par),
        **_moe(arch, par, te),
    )


def _check_parallel(arch: Arch, par: MegatronConfig, te: bool) -> None:
    tp = par.tensor_parallel
    if arch.heads % tp or arch.groups % tp:
        # A TP rank must hold whole query groups (q heads with their k/v head) for the mapping.
        raise ValueError(
            f"megatron backend: tensor_parallel={tp} must divide num_attention_heads={arch.heads} "
            f"and num_key_value_heads={arch.groups}"
        )
    if par.context_parallel > 1 and not te:
        raise ValueError("megatron backend: context_parallel > 1 needs Transformer Engine attention")
    if arch.moe and arch.num_experts % par.expert_parallel:
        raise ValueError(f"expert_parallel={par.expert_parallel} must divide num_experts={arch.num_experts}")
    if not arch.moe and par.expert_parallel > 1:
        raise ValueError("megatron backend: expert_parallel > 1 needs an MoE model")


def _recompute(par: MegatronConfig) -> dict:
    if not par.recompute:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _moe(arch: Arch, par: MegatronConfig, te: bool) -> dict:
    if not arch.moe:
        return {}
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn,
        "moe_router_topk": arch.topk,
        # Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob. megatron's
        # top-k-then-softmax is exactly the renormalised form; softmax-then-top-k the other.
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk,
        # HF's forward has no load-balancing term (output_router_logits is off by default).
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": te,
        # Data-parallel ranks' packed micro-batches differ in length: the allgather dispatcher
        # cannot take that, alltoall can. alltoall creates CUDA streams when built, so on a CPU
        # (where models are built only to test the weight mapping) allgather.
        "moe_token_dispatcher_type": "alltoall" if torch.cuda.is_available() else "allgather",
    }


def layer_spec(hf_config: Any, par: MegatronConfig) -> ModuleSpec:
    """One transformer layer's spec: Transformer Engine's, or megatron's local modules with
    relax_hpc's norms and `SDPAttention` as core attention, which applies RoPE (megatron's local
    DotProductAttention materialises S x S scores; megatron_layers.py says what the others cost)."""
    arch = arch_of(hf_config)
    num_experts = arch.num_experts or None
    if use_transformer_engine(par.attention):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=arch.moe, qk_layernorm=arch.qk_norm
        )
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    attention = layer.self_attention.submodules
    attention.core_attention = ModuleSpec(module=SDPAttention, params={"rotary_base": arch.rope_theta})
    if arch.qk_norm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def build_model(
    hf_config: Any, par: MegatronConfig, params_dtype: torch.dtype, pre_process: bool, post_process: bool
) -> GPTModel:
    """This rank's GPTModel (needs megatron's parallel_state initialised with par's sizes, and on
    GPUs its CUDA RNG tracker: model_parallel_cuda_manual_seed). Every parameter is params_dtype
    (megatron creates its torch norms in fp32) and on the current GPU (else the CPU)."""
    arch = arch_of(hf_config)
    config = transformer_config(hf_config, par, params_dtype)
    te = use_transformer_engine(par.attention)
    if arch.moe:
        _define_router_gemm_fallback()
    layers = [layer_spec(hf_config, par)] * get_num_layers_to_build(config)
    final_norm = _te_norm() if te else RMSNorm
    model = GPTModel(
        config=config,
        transformer_layer_spec=TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm),
        vocab_size=padded_vocab_size(arch.vocab, par.tensor_parallel),
        max_sequence_length=arch.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tied,
        # Transformer Engine's attention takes megatron's RoPE; the local SDPAttention applies its own.
        position_embedding_type="rope" if te else "none",
        rotary_base=arch.rope_theta,
    )
    # megatron allocates on the current GPU, except the MoE router (created on the CPU and moved
    # at its first forward): put every parameter on one device from the start.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return model.to(device=device, dtype=params_dtype)


def _define_router_gemm_fallback() -> None:
    """megatron-core 0.16.1's MoE router reads moe_utils.te_general_gemm, a name that module
    defines only when Transformer Engine imports: without TE every MoE forward raised NameError.
    None is the value megatron's own code takes as "no TE gemm" (it then uses torch matmuls)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _te_norm() -> type:
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


def packed_seq_params(doc_lengths: Sequence[int], device: torch.device | str) -> PackedSeqParams:
    """Packing metadata of one row holding documents back to back (input_ids [1, sum(lengths)]).
    max_seqlen is the longest document: megatron's RoPE then restarts positions at every document."""
    cu = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lengths, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(doc_lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
