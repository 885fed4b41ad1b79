"""megatron-core GPT models of HF Qwen2 / Qwen3 / Qwen3-MoE checkpoints, and of Qwen2.5-VL / Qwen3-VL and
Qwen2-Audio (their language model as GPT, their towers beside it: relax_hpc/models/megatron_multimodal.py).

`transformer_config` turns an HF config plus the job's parallelism into megatron's TransformerConfig,
`layer_spec` picks the layer implementation (Transformer Engine, or megatron's local modules with
relax_hpc's RMSNorm and core attention: relax_hpc/models/megatron_layers.py), `build_model` builds this
rank's GPTModel (its pipeline stage, its tensor/expert shards). Weights come from
`relax_hpc.models.hf_mapping.load_hf_weights`.

Architectures outside what the mapping reproduces exactly are refused with the reason, never
approximated (relax_hpc.models.arch, which submit also runs before anything is queued).
"""

from __future__ import annotations

from collections.abc import Sequence
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
from relax_hpc.models.arch import Arch, arch_of, megatron_problems, padded_vocab_size, use_transformer_engine
from relax_hpc.models.megatron_layers import RMSNorm, SDPAttention
from relax_hpc.models.megatron_multimodal import MultimodalGPTModel


def transformer_config(
    hf_config: Any, par: MegatronConfig, params_dtype: torch.dtype, routing_replay: bool = False
) -> TransformerConfig:
    """megatron TransformerConfig of an HF Qwen2/Qwen3/Qwen3-MoE config under the job's parallelism;
    `routing_replay`: the MoE routers can take given experts (relax_hpc/models/megatron_routing.py)."""
    arch = arch_of(hf_config)
    te = use_transformer_engine(par.attention, arch)
    problems = megatron_problems(arch, par, te)
    if problems:
        raise ValueError("; ".join(problems))
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
        **_moe(arch, par, te, routing_replay),
    )


def _recompute(par: MegatronConfig) -> dict:
    if not par.recompute:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _moe(arch: Arch, par: MegatronConfig, te: bool, routing_replay: bool) -> dict:
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
        "moe_enable_routing_replay": routing_replay,
    }


def layer_spec(hf_config: Any, par: MegatronConfig) -> ModuleSpec:
    """One transformer layer's spec: Transformer Engine's, or megatron's local modules with
    relax_hpc's norms and `SDPAttention` as core attention, which applies RoPE (megatron's local
    DotProductAttention materialises S x S scores; megatron_layers.py says what the others cost)."""
    arch = arch_of(hf_config)
    num_experts = arch.num_experts or None
    if use_transformer_engine(par.attention, arch):
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
    attention.core_attention = ModuleSpec(
        module=SDPAttention,
        params={
            "rotary_base": arch.rope_theta,
            "mrope_section": arch.mrope_section,
            "mrope_interleaved": arch.mrope_interleaved,
        },
    )
    if arch.qk_norm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def build_model(
    hf_config: Any,
    par: MegatronConfig,
    params_dtype: torch.dtype,
    pre_process: bool,
    post_process: bool,
    routing_replay: bool = False,
) -> GPTModel:
    """This rank's GPTModel (needs megatron's parallel_state initialised with par's sizes, and on
    GPUs its CUDA RNG tracker: model_parallel_cuda_manual_seed). Every parameter is params_dtype
    (megatron creates its torch norms in fp32) and on the current GPU (else the CPU)."""
    arch = arch_of(hf_config)
    config = transformer_config(hf_config, par, params_dtype, routing_replay)
    te = use_transformer_engine(par.attention, arch)
    if arch.moe:
        _define_router_gemm_fallback()
    layers = [layer_spec(hf_config, par)] * get_num_layers_to_build(config)
    final_norm = _te_norm() if te else RMSNorm
    media = {"hf_config": hf_config} if arch.encoders else {}
    model = (MultimodalGPTModel if arch.encoders else GPTModel)(
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
        **media,
    )
    # megatron allocates on the current GPU, except the MoE router (created on the CPU and moved
    # at its first forward): put every parameter on one device from the start.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return model.to(device=device, dtype=params_dtype)


class ValueHead(torch.nn.Module):
    """The critic's output layer in a GPTModel's output_layer slot: one value per token, called as
    megatron calls its output layer (the tied embedding weight it passes is not used). Its
    parameter keeps the name `weight`, which megatron's checkpoint code looks up there; it is
    replicated over tensor-parallel ranks, which all hold the full hidden states at the output."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # V = 0 at the start, as the torch backend's critic: no random initial baseline.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight), None


def as_value_model(model: GPTModel) -> GPTModel:
    """The critic: the model's transformer (and the weights it holds) with a ValueHead in place of
    the output layer on the last pipeline stage; its forward then gives [batch, tokens, 1]."""
    if model.post_process:
        device = next(model.parameters()).device
        model.output_layer = ValueHead(model.config.hidden_size, model.config.params_dtype, device)
    return model


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
