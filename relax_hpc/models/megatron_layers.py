"""The modules of megatron's local layer spec that relax_hpc replaces when Transformer Engine is
not installed: `RMSNorm` and the core attention `SDPAttention` (which also applies RoPE).

megatron's own fallbacks for these were slow on an H200 (BENCHMARKS.md; with these modules a
Qwen3-0.6B step went from 0.316 s to 0.264 s): torch's RMSNorm backward reduces the weight gradient of the per-head q/k
norms (hundreds of thousands of rows of 128) slowly, the unfused RoPE takes six passes over q and
k plus a host sync per layer for packed rows, and the local attention materialises S x S scores.
Here each norm and each rotation is one torch.compile'd kernel forward and one backward (on
CUDA; the CPU, where models are built to test the weight mapping, runs the same functions
eagerly), and attention over packed documents is one fused call for the whole row.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from relax_hpc.models.compile import compiled_on_cuda

# Its keyword arguments differ between torch versions (below): called with the ones it has.
_varlen_attn: Callable[..., Any] | None
try:  # torch >= 2.10: flash attention over packed documents (cu_seqlens) in one call
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:
    _varlen_attn = None
_VARLEN_PARAMS = inspect.signature(_varlen_attn).parameters if _varlen_attn is not None else {}
# Causal masking is `is_causal` in torch 2.10 and `window_size=(-1, 0)` from 2.11 on.
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
# Grouped-query attention without repeating key/value heads, where the kernel takes it (2.13).
_VARLEN_GQA = {"enable_gqa": True} if "enable_gqa" in _VARLEN_PARAMS else {}


@compiled_on_cuda
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Qwen RMSNorm, rounding included: normalise in fp32, cast, then scale.
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm with megatron's norm constructor (config, hidden_size, eps) and a `weight`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__()
        if config.sequence_parallel:
            raise ValueError("RMSNorm: sequence parallelism needs Transformer Engine's norms")
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, head_dim / 2] of the rotation angles, in fp32. Computed
    for every element inside the rotation kernel (and all sizes dynamic), RoPE took 27 ms of a
    0.6B step on an H200; from this table (and static head sizes), 3.8. Made once per packed
    micro-batch and shared by its layers (`SDPAttention._rotate_packed`). `positions`: [tokens], or
    [tokens, head_dim / 2] where each frequency has its own position (multimodal RoPE)."""
    angle = (positions.float() if positions.dim() == 2 else positions.float()[:, None]) * inv_freq
    return angle.cos(), angle.sin()


def mrope_axes(section: tuple[int, ...], interleaved: bool = False) -> torch.Tensor:
    """Which position (0 temporal, 1 height, 2 width) each of the head_dim / 2 frequencies
    rotates by, the same in both halves of the rotate-half form (transformers'
    recomposition_frequencies): Qwen2.5-VL gives consecutive sections to each axis; Qwen3-VL
    (`interleaved`) gives frequency j to height when j % 3 == 1 and j < 3 * section[1], to width
    when j % 3 == 2 and j < 3 * section[2], else to time."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
    axes = torch.zeros(sum(section), dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


@compiled_on_cuda
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form (transformers' Qwen), products in fp32.
    x [tokens, ..., head_dim]; cos, sin [tokens, head_dim / 2]."""
    shape = (x.shape[0], *[1] * (x.dim() - 2), cos.shape[-1])
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its document, on the device (no host sync)."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return tokens - cu_seqlens[torch.searchsorted(cu_seqlens[1:], tokens, right=True)]


def _length_classes(cu: torch.Tensor, total: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The packed documents of `cu` grouped by length class (lengths in (2^(k-1), 2^k]): for
    each class a [docs, longest] index of packed positions (past a document's end its last token
    again), and for every packed token its row in the classes' outputs laid end to end."""
    bounds = cu.tolist()  # one host sync per layer and micro-batch, not one per document
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"SDPAttention: cu_seqlens {bounds} do not cover the {total} packed tokens")
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    lengths = torch.tensor(bounds[1:], dtype=torch.long) - starts
    classes = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
    gather, rows, offset = [], torch.empty(total, dtype=torch.long), 0
    for c in torch.unique(classes[lengths > 0]).tolist():
        docs = torch.nonzero((classes == c) & (lengths > 0)).squeeze(1)
        longest = int(lengths[docs].max())
        steps = torch.arange(longest)
        gather.append(starts[docs, None] + torch.minimum(steps, lengths[docs, None] - 1))
        real = steps < lengths[docs, None]  # [docs, longest]: this class's outputs that are tokens
        rows[gather[-1][real]] = offset + torch.nonzero(real.flatten()).squeeze(1)
        offset += real.numel()
    return [g.to(cu.device) for g in gather], rows.to(cu.device)


class SDPAttention(MegatronModule):
    """Core attention with RoPE, with megatron DotProductAttention's constructor and forward
    signature (the model is built with position_embedding_type 'none', so megatron's attention
    hands over q and k unrotated, after the q/k norms).

    Attention is always causal (`attention_mask` is ignored, as TE's causal attention ignores it;
    a padded batch must be right-padded). Packed sequences (qkv_format 'thd', cu_seqlens) attend
    causally within each document, positions restarting at each: in bf16/fp16 on CUDA one
    variable-length flash call for the whole packed row (torch.nn.attention.varlen: no launch per
    document), otherwise one scaled_dot_product_attention call per document.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rotary_base: float = 10000.0,
        mrope_section: tuple[int, ...] = (),
        mrope_interleaved: bool = False,
    ):
        super().__init__(config=config)
        _refuse_unsupported_attention(config, attn_mask_type, attention_dropout)
        tp_size = (
            pg_collection.tp.size()
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        self.heads = divide(config.num_attention_heads, tp_size)
        self.groups = divide(config.num_query_groups, tp_size)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        dim = config.kv_channels  # transformers' inverse frequencies, computed as it does (fp32)
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.mrope_axes = mrope_axes(mrope_section, mrope_interleaved) if mrope_section else None
        self.rope_key = (rotary_base, dim, mrope_section, mrope_interleaved)  # layers alike share tables

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """[s, b, heads, d] (or 'thd' [t, heads, d]) -> [s, b, heads * d] (or [t, heads * d])."""
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if packed_seq_params is None:
            if self.mrope_axes is not None:
                raise ValueError("SDPAttention: multimodal RoPE runs on packed sequences (MropePackedSeqParams)")
            positions = torch.arange(query.shape[0], device=query.device)
            query, key = self._rotate(query, key, positions)
            return self._unpacked(query, key, value)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"SDPAttention: packed sequences must use qkv_format 'thd', got {packed_seq_params.qkv_format!r}"
            )
        cu = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if cu is None else cu
        query, key = self._rotate_packed(query, key, packed_seq_params, cu)
        if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn is not None:
            max_len = packed_seq_params.max_seqlen_q
            if max_len is None:
                raise ValueError("SDPAttention: packed sequences need max_seqlen_q (the longest document)")
            return self._varlen(query, key, value, cu, max_len)
        return self._per_document(query, key, value, cu)

    def _positions(self, params: PackedSeqParams, cu: torch.Tensor, total: int) -> torch.Tensor:
        """Each packed token's position inside its document: [total], or with multimodal RoPE
        [total, head_dim / 2] from the positions the packing metadata carries
        (relax_hpc/models/megatron_vision.py, MropePackedSeqParams)."""
        if self.mrope_axes is None:
            return document_positions(cu, total)
        positions = getattr(params, "mrope_positions", None)
        if positions is None or positions.shape != (3, total):
            raise ValueError(f"SDPAttention: multimodal RoPE needs mrope_positions [3, {total}] in packed_seq_params")
        if self.mrope_axes.device != positions.device:
            self.mrope_axes = self.mrope_axes.to(positions.device)
        return positions.index_select(0, self.mrope_axes).T  # [total, head_dim / 2]

    def _rotate_packed(
        self, query: torch.Tensor, key: torch.Tensor, params: PackedSeqParams, cu: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on a packed micro-batch, from cos/sin tables made once per micro-batch: every
        layer receives the same packing metadata, and remaking positions and tables per layer
        cost 28 x 6 launches of a 0.6B model's micro-batch (BENCHMARKS.md, the GPU step's host work)."""
        tables: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = params.__dict__.setdefault(
            "rope_tables", {}
        )
        if self.rope_key not in tables:
            self._move_inv_freq(query.device)
            tables[self.rope_key] = rope_table(self._positions(params, cu, query.shape[0]), self.inv_freq)
        cos, sin = tables[self.rope_key]
        return _rope(query, cos, sin), _rope(key, cos, sin)

    def _move_inv_freq(self, device: torch.device) -> None:
        if self.inv_freq.device != device:  # moved once (not a buffer: it stays fp32)
            self.inv_freq = self.inv_freq.to(device)

    def _rotate(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._move_inv_freq(query.device)
        cos, sin = rope_table(positions, self.inv_freq)
        return _rope(query, cos, sin), _rope(key, cos, sin)

    def _unpacked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        s, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        return self._sdpa(q, k, v).permute(2, 0, 1, 3).reshape(s, b, -1)

    def _repeat_kv(self, key: torch.Tensor, value: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key/value heads repeated to the query heads (query head h uses key/value head
        h // (heads / groups), megatron's grouping), for kernels without GQA."""
        if self.heads == self.groups:
            return key, value
        repeats = self.heads // self.groups
        return key.repeat_interleave(repeats, dim=dim), value.repeat_interleave(repeats, dim=dim)

    def _varlen(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int
    ) -> torch.Tensor:
        assert _varlen_attn is not None, "forward() takes this path only where torch has varlen_attn"
        if not _VARLEN_GQA:
            key, value = self._repeat_kv(key, value, dim=1)
        out = _varlen_attn(
            query, key, value, cu, cu, max_len, max_len, scale=self.softmax_scale, **_VARLEN_CAUSAL, **_VARLEN_GQA
        )
        return out.reshape(query.shape[0], -1)

    def _per_document(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention inside each packed document without a variable-length kernel (fp32,
        the CPU): the documents batched by length, one call per length class. A right-padded
        document attends causally to its own tokens alone (the padding comes after every real
        query), so padding changes no real output; a class pads to at most twice a document's
        length. One call per document took 2 x 1,024 launches forward and more backward for the
        embedded task's 1,024 short samples (BENCHMARKS.md)."""
        gather, scatter = _length_classes(cu, query.shape[0])
        parts = []
        for index in gather:  # [docs, longest]: packed positions, padding repeats the last token
            # [docs, heads, longest, d]: torch's flash and memory-efficient kernels take only 4-D
            # inputs (a 3-D call ran the math kernel: S x S scores per layer, 113 GiB at 8192 tokens).
            # index_select, not t[index]: its backward adds (index_add_), without the sort of index_put_.
            q, k, v = (t.index_select(0, index.flatten()).unflatten(0, index.shape) for t in (query, key, value))
            parts.append(self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2))
        return torch.cat([p.flatten(0, 1) for p in parts]).index_select(0, scatter).reshape(query.shape[0], -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = self._repeat_kv(k, v, dim=-3)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)


def _refuse_unsupported_attention(
    config: TransformerConfig, attn_mask_type: AttnMaskType, attention_dropout: float | None
) -> None:
    if (config.attention_dropout if attention_dropout is None else attention_dropout) != 0:
        raise ValueError("SDPAttention: attention dropout is not supported (Qwen models train without it)")
    if config.context_parallel_size != 1:
        raise ValueError("SDPAttention: context parallelism needs Transformer Engine attention")
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"SDPAttention: only causal attention is implemented, got {attn_mask_type}")
    if config.softmax_type != "vanilla" or config.window_size is not None or config.apply_query_key_layer_scaling:
        raise ValueError("SDPAttention: softmax offsets, sliding windows and query-key layer scaling are not supported")
