"""HF <-> megatron-core weights of Qwen2 / Qwen3 / Qwen3-MoE, Qwen2.5-VL / Qwen3-VL and Qwen2-Audio
(the language model under the checkpoint's prefix, Arch.hf_prefix): names, layouts, shards. Beside it, by
concern: hf_loading (an HF safetensors folder into a rank's shards), hf_export (the full HF
tensors gathered from the shards) and hf_checkpoint (a megatron distributed checkpoint to HF).

Terms used here:
- canonical name: a parameter's name in an unsharded megatron GPTModel, with the global layer
  index and the global expert index (`decoder.layers.7.mlp.experts.local_experts.33.linear_fc1.weight`).
  A rank's own names carry its stage-local layer index and rank-local expert index;
  `canonical_name` translates them (megatron's layer_number and the MoE layer's
  local_expert_indices say which global layer and experts a rank holds).
- Entry: the HF tensors a megatron parameter is made of, their layout and its sharding.

Layouts of the full (unsharded) megatron tensor, dim 0 = output rows:
- qkv: linear_qkv interleaves per query group g: [q heads of g; k head g; v head g] for g in groups
  (weight and bias alike).
- fc1: SwiGLU's [gate; up] per TP rank: with TP size t the full tensor is
  [gate_0; up_0; ...; gate_{t-1}; up_{t-1}] (gate_r: the r-th row block of gate_proj), because each
  rank splits its own output into gate and up. With t = 1 it is [gate; up].
- vocab: embedding / output-layer rows, padded with zero rows to a multiple of TP.
- copy: the HF tensor itself. A vision-language model's tower (relax_hpc/models/megatron_vision.py)
  is all copies: megatron's `vision.<name>` is the checkpoint's `visual.<name>`, replicated; so is
  an audio encoder (relax_hpc/models/megatron_audio.py): megatron's `audio.<name>` is the
  checkpoint's `<name>` (Qwen2-Audio's audio_tower.*, multi_modal_projector.*) or `thinker.<name>`
  (Qwen3-Omni's audio_tower.*).

Sharding: `Entry.split` is the dim that TP splits (0: column-parallel linear_qkv, linear_fc1,
embedding, output layer; 1: row-parallel linear_proj, linear_fc2; None: replicated norms and
router). In the layouts above, TP rank r holds the r-th contiguous block along that dim. Expert
parameters are split the same way over the expert-tensor-parallel group and held whole by one
expert-parallel rank: EP rank r holds experts [r * n, (r + 1) * n), n = experts / EP.
Pipeline stage s holds the layers megatron assigns it (`stage_layers`).
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from relax_hpc.models.arch import Arch, arch_of, padded_vocab_size
from relax_hpc.models.megatron_audio import AUDIO_PREFIX, audio_shapes
from relax_hpc.models.megatron_vision import VISION_PREFIX, vision_shapes

# Experts of SequentialMLP (local_experts.J.linear_fcK.weight) and TEGroupedMLP (linear_fcK.weightJ).
_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.linear_fc(?P<seq_fc>[12])\.weight"
    r"|linear_fc(?P<grp_fc>[12])\.weight(?P<grp>\d+))"
)
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# read(hf_name, rows, cols) -> the HF tensor's block (cols ignored for 1-D tensors).
Reader = Callable[[str, slice, slice], torch.Tensor]
ALL = slice(None)


@dataclass(frozen=True)
class Entry:
    hf: tuple[str, ...]  # the HF tensors this megatron parameter is made of
    layout: str  # "copy" | "qkv" | "fc1" | "vocab"
    split: int | None  # the dim TP (or expert-TP) splits; None: replicated
    expert: bool = False  # sharded over the expert groups
    export: bool = True  # False: a copy that export skips (the tied output layer of a last stage)


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of HF tensor `hf` (None: zero padding rows)."""

    hf: str | None
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


# ---------------------------------------------------------------- HF names and shapes


def hf_embed(arch: Arch) -> str:
    return f"{arch.hf_prefix}embed_tokens.weight"


def hf_norm(arch: Arch) -> str:
    return f"{arch.hf_prefix}norm.weight"


def hf_layers(arch: Arch) -> str:
    """What the names of the decoder layers' tensors start with, before the layer index."""
    return f"{arch.hf_prefix}layers."


def hf_specs(hf_config: Any, dtype: torch.dtype) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Every HF tensor `export_hf` yields, in its order: checkpoint names (MoE experts one by one,
    as safetensors checkpoints and SGLang name them); per layer in transformers' module order."""
    return [(name, shape, dtype) for name, shape in _hf_shapes(hf_config).items()]


def _hf_shapes(hf_config: Any) -> dict[str, torch.Size]:
    """Names and shapes in export order: the embedding, the encoders' tensors, each layer's, the
    final norm and head."""
    arch = arch_of(hf_config)
    shapes = {hf_embed(arch): torch.Size((arch.vocab, arch.hidden))}
    if arch.vision:
        shapes.update(vision_shapes(hf_config))
    if arch.audio:
        shapes.update(audio_shapes(hf_config))
    for layer in range(arch.num_layers):
        shapes.update(_hf_layer_shapes(arch, layer))
    shapes[hf_norm(arch)] = torch.Size((arch.hidden,))
    if not arch.tied:
        shapes[arch.hf_lm_head] = torch.Size((arch.vocab, arch.hidden))
    return shapes


def _hf_layer_shapes(arch: Arch, layer: int) -> dict[str, torch.Size]:
    p, h = f"{hf_layers(arch)}{layer}.", arch.hidden
    attn = p + "self_attn."
    q_rows, kv_rows = arch.heads * arch.head_dim, arch.groups * arch.head_dim
    shapes: dict[str, tuple] = {}
    for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        shapes[f"{attn}{proj}_proj.weight"] = (rows, h)
        if arch.qkv_bias:
            shapes[f"{attn}{proj}_proj.bias"] = (rows,)
    shapes[attn + "o_proj.weight"] = (h, q_rows)
    if arch.qk_norm:
        shapes[attn + "q_norm.weight"] = (arch.head_dim,)
        shapes[attn + "k_norm.weight"] = (arch.head_dim,)
    if arch.moe:
        for e in range(arch.num_experts):
            x = f"{p}mlp.experts.{e}."
            shapes.update({x + "gate_proj.weight": (arch.moe_ffn, h), x + "up_proj.weight": (arch.moe_ffn, h)})
            shapes[x + "down_proj.weight"] = (h, arch.moe_ffn)
        shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
    else:
        shapes.update({p + "mlp.gate_proj.weight": (arch.ffn, h), p + "mlp.up_proj.weight": (arch.ffn, h)})
        shapes[p + "mlp.down_proj.weight"] = (h, arch.ffn)
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    return {name: torch.Size(shape) for name, shape in shapes.items()}


# ---------------------------------------------------------------- megatron names -> entries


def mcore_names(hf_config: Any, te: bool = False) -> list[str]:
    """Canonical parameter names of an unsharded megatron model (local spec, or TE spec with its
    fused norms and grouped experts)."""
    arch = arch_of(hf_config)
    names = ["embedding.word_embeddings.weight"]
    if arch.vision:
        names += [VISION_PREFIX + name.removeprefix(arch.hf_vision_prefix) for name in vision_shapes(hf_config)]
    if arch.audio:
        names += [AUDIO_PREFIX + name.removeprefix(arch.hf_audio_prefix) for name in audio_shapes(hf_config)]
    for layer in range(arch.num_layers):
        names += [f"decoder.layers.{layer}.{rest}" for rest in _layer_names(arch, te)]
    names.append("decoder.final_layernorm.weight")
    if not arch.tied:
        names.append("output_layer.weight")
    return names


def _layer_names(arch: Arch, te: bool) -> list[str]:
    names = ["self_attention.linear_qkv.layer_norm_weight"] if te else ["input_layernorm.weight"]
    names += ["self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
    if arch.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if arch.qk_norm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    if not arch.moe:
        names.append("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")
        return [*names, "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    names += ["pre_mlp_layernorm.weight", "mlp.router.weight"]
    for e, fc in itertools.product(range(arch.num_experts), (1, 2)):
        names.append(
            f"mlp.experts.linear_fc{fc}.weight{e}" if te else f"mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
        )
    return names


def entry(name: str, arch: Arch) -> Entry:
    """The Entry of a canonical megatron parameter name (local or TE spec)."""
    if name == "embedding.word_embeddings.weight":
        return Entry((hf_embed(arch),), "vocab", 0)
    if name == "output_layer.weight":
        # Tied: a pipeline's last stage keeps its own copy of the embedding; export skips it.
        return Entry((hf_embed(arch) if arch.tied else arch.hf_lm_head,), "vocab", 0, export=not arch.tied)
    if name == "decoder.final_layernorm.weight":
        return Entry((hf_norm(arch),), "copy", None)
    if name.startswith(VISION_PREFIX):  # the replicated HF vision tower, under its own names
        return Entry((arch.hf_vision_prefix + name.removeprefix(VISION_PREFIX),), "copy", None)
    if name.startswith(AUDIO_PREFIX):  # the replicated audio tower (and projector), likewise
        return Entry((arch.hf_audio_prefix + name.removeprefix(AUDIO_PREFIX),), "copy", None)
    match = LAYER.fullmatch(name)
    found = _layer_entry(match[2], f"{hf_layers(arch)}{match[1]}.", arch) if match else None
    if found is None:
        raise KeyError(f"no HF tensor maps to megatron parameter {name!r}")
    return found


def _layer_entry(rest: str, p: str, arch: Arch) -> Entry | None:
    attn = p + "self_attn."
    simple = {
        "input_layernorm.weight": (p + "input_layernorm.weight", None),
        "self_attention.linear_qkv.layer_norm_weight": (p + "input_layernorm.weight", None),
        "pre_mlp_layernorm.weight": (p + "post_attention_layernorm.weight", None),
        "mlp.linear_fc1.layer_norm_weight": (p + "post_attention_layernorm.weight", None),
        "self_attention.q_layernorm.weight": (attn + "q_norm.weight", None),
        "self_attention.k_layernorm.weight": (attn + "k_norm.weight", None),
        "self_attention.linear_proj.weight": (attn + "o_proj.weight", 1),
        "mlp.linear_fc2.weight": (p + "mlp.down_proj.weight", 1),
        "mlp.router.weight": (p + "mlp.gate.weight", None),
    }
    if rest in simple:
        hf, split = simple[rest]
        return Entry((hf,), "copy", split)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return Entry(tuple(f"{attn}{x}_proj.{kind}" for x in "qkv"), "qkv", 0)
    if rest == "mlp.linear_fc1.weight":
        return Entry((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "fc1", 0)
    match = _EXPERT.fullmatch(rest)
    if match is None:
        return None
    expert, fc = (match["seq"], match["seq_fc"]) if match["seq"] is not None else (match["grp"], match["grp_fc"])
    x = f"{p}mlp.experts.{expert}."
    if fc == "1":
        return Entry((x + "gate_proj.weight", x + "up_proj.weight"), "fc1", 0, expert=True)
    return Entry((x + "down_proj.weight",), "copy", 1, expert=True)


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside megatron's wrappers (DDP, Float16Module: each has .module)."""
    while not isinstance(model, GPTModel):
        if not hasattr(model, "module"):
            raise TypeError(f"expected a megatron GPTModel (or a wrapper of one), got {type(model).__name__}")
        model = cast(torch.nn.Module, model.module)  # torch types any attribute of a Module as Tensor | Module
    return model


def canonical_name(name: str, model: GPTModel) -> str:
    """A rank's parameter name -> its canonical name (global layer and expert indices)."""
    match = LAYER.fullmatch(name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match[1])]
    return f"decoder.layers.{layer.layer_number - 1}.{_global_experts(match[2], layer)}"


def _global_experts(rest: str, layer: TransformerLayer) -> str:
    def renumber(m: re.Match) -> str:
        if m["seq"] is not None:
            expert = layer.mlp.local_expert_indices[int(m["seq"])]
            return f"mlp.experts.local_experts.{expert}.linear_fc{m['seq_fc']}.weight"
        return f"mlp.experts.linear_fc{m['grp_fc']}.weight{layer.mlp.local_expert_indices[int(m['grp'])]}"

    return _EXPERT.sub(renumber, rest)


def with_expert(name: str, expert: int) -> str:
    """The same parameter of another expert (canonical names)."""

    def renumber(m: re.Match) -> str:
        if m["seq"] is not None:
            return f"mlp.experts.local_experts.{expert}.linear_fc{m['seq_fc']}.weight"
        return f"mlp.experts.linear_fc{m['grp_fc']}.weight{expert}"

    return _EXPERT.sub(renumber, name)


def expert_index(name: str) -> int:
    m = _EXPERT.search(name)
    assert m is not None, f"{name} is not an expert's parameter"
    return int(m["seq"] if m["seq"] is not None else m["grp"])


def stage_layers(config: TransformerConfig, pp_rank: int) -> range:
    """The global layer indices pipeline stage pp_rank holds (megatron's own assignment)."""
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, pp_rank=pp_rank))


def rank_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global experts expert-parallel rank ep_rank holds (megatron's MoELayer assignment)."""
    n = num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


# ---------------------------------------------------------------- layouts


def _pieces(e: Entry, arch: Arch, tp: int) -> list[Piece]:
    """The full megatron tensor of a row-stacked layout (qkv, fc1, vocab) as HF row ranges."""
    if e.layout == "qkv":
        q, k, v = e.hf
        d, per_group = arch.head_dim, arch.heads // arch.groups
        out = []
        for g in range(arch.groups):
            out += [Piece(q, g * per_group * d, (g + 1) * per_group * d), Piece(k, g * d, (g + 1) * d)]
            out.append(Piece(v, g * d, (g + 1) * d))
        return out
    if e.layout == "fc1":
        gate, up = e.hf
        block = (arch.moe_ffn if e.expert else arch.ffn) // tp
        return [Piece(hf, r * block, (r + 1) * block) for r in range(tp) for hf in (gate, up)]
    if e.layout == "vocab":
        padding = padded_vocab_size(arch.vocab, tp) - arch.vocab
        return [Piece(e.hf[0], 0, arch.vocab)] + ([Piece(None, 0, padding)] if padding else [])
    raise ValueError(f"layout {e.layout!r} is not row-stacked")


def _restrict(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """The pieces of rows [start, stop) of the stacked tensor."""
    out, offset = [], 0
    for p in pieces:
        lo, hi = max(start, offset), min(stop, offset + p.rows)
        if lo < hi:
            out.append(Piece(p.hf, p.start + lo - offset, p.start + hi - offset))
        offset += p.rows
    return out


def _join(pieces: list[Piece], read: Reader, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    parts = [
        read(p.hf, slice(p.start, p.stop), ALL) if p.hf is not None else torch.zeros((p.rows, *trailing), dtype=dtype)
        for p in pieces
    ]
    return torch.cat([part.to(dtype) for part in parts])


def to_hf(full: torch.Tensor, e: Entry, arch: Arch, tp: int) -> dict[str, torch.Tensor]:
    """A full megatron tensor (layout of TP size tp) -> its HF tensors (padding dropped)."""
    if e.layout == "copy":
        return {e.hf[0]: full}
    blocks: dict[str, list[torch.Tensor]] = defaultdict(list)
    offset = 0
    for p in _pieces(e, arch, tp):
        if p.hf is not None:
            blocks[p.hf].append(full[offset : offset + p.rows])
        offset += p.rows
    if offset != full.shape[0]:
        raise ValueError(f"{e.hf}: megatron tensor has {full.shape[0]} rows, the layout {offset}")
    return {name: torch.cat(parts) if len(parts) > 1 else parts[0] for name, parts in blocks.items()}


def read_shard(
    e: Entry, arch: Arch, read: Reader, rank: int, world: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """TP rank `rank`'s block (of `world`) of the megatron tensor, read from HF tensors."""
    if e.split is None:
        return read(e.hf[0], ALL, ALL).to(dtype)
    if e.split == 1:
        n = shape[1]
        return read(e.hf[0], ALL, slice(rank * n, (rank + 1) * n)).to(dtype)
    n = shape[0]
    return _join(_restrict(_pieces(e, arch, world), rank * n, (rank + 1) * n), read, tuple(shape[1:]), dtype)


def hf_to_mcore(
    hf_state: Mapping[str, torch.Tensor], hf_config: Any, tp: int = 1, te: bool = False
) -> dict[str, torch.Tensor]:
    """Full megatron tensors (canonical names) of a full HF state dict. With tp > 1 the tensors
    have the layouts of a TP-tp model (fc1 per-rank [gate; up], vocab padded): TP rank r's shard
    is the r-th block along Entry.split."""
    arch = arch_of(hf_config)
    read = _dict_reader(hf_state)
    out = {}
    for name in mcore_names(hf_config, te):
        e = entry(name, arch)
        if e.layout == "copy":
            out[name] = read(e.hf[0], ALL, ALL)
        else:
            trailing, dtype = tuple(hf_state[e.hf[0]].shape[1:]), hf_state[e.hf[0]].dtype
            out[name] = _join(_pieces(e, arch, tp), read, trailing, dtype)
    return out


def mcore_to_hf(mcore_state: Mapping[str, torch.Tensor], hf_config: Any, tp: int = 1) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_mcore, in hf_specs order."""
    arch = arch_of(hf_config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in mcore_state.items():
        e = entry(name, arch)
        if e.export:
            out.update(to_hf(tensor, e, arch, tp))
    return {name: out[name] for name in _hf_shapes(hf_config)}


def _dict_reader(state: Mapping[str, torch.Tensor]) -> Reader:
    def read(name: str, rows: slice, cols: slice) -> torch.Tensor:
        tensor = state[name]
        return tensor[rows] if tensor.dim() == 1 else tensor[rows, cols]

    return read
