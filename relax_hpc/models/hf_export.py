"""A megatron model's full HF tensors, gathered from its shards one unit at a time (a collective
over the model's parallel groups; relax_hpc.models.hf_mapping has the names and layouts)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from relax_hpc.models.arch import Arch, arch_of
from relax_hpc.models.hf_mapping import (
    LAYER,
    Entry,
    canonical_name,
    entry,
    expert_index,
    hf_embed,
    hf_layers,
    hf_specs,
    rank_experts,
    stage_layers,
    to_hf,
    unwrap,
    with_expert,
)
from relax_hpc.models.megatron_audio import AUDIO_PREFIX, HF_AUDIO_PREFIXES
from relax_hpc.models.megatron_vision import VISION_PREFIX


@dataclass(frozen=True)
class _Local:
    name: str  # canonical
    entry: Entry
    param: torch.Tensor


Holders = Literal["rank0", "every_rank", "stage"]


def export_hf(
    model: torch.nn.Module, hf_config: Any, to: Holders = "rank0"
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The full HF tensors of the model, one at a time, in hf_specs order: a COLLECTIVE that every
    rank of the model's process groups must run to the end. `to` says which ranks get each tensor;
    every other rank yields (name, None) for the same names, after its part in that tensor's
    gathers and sends, so all ranks can run the same loop:
    - "rank0": global rank 0 alone;
    - "every_rank": every rank (colocated ranks each serve the engines on their own device);
    - "stage": every rank of the pipeline stage that holds the tensor (the sharded channel: each
      sends its share of them, and no tensor crosses a stage; `hf_stages` says which stage).

    Per unit (the embedding, each layer, the final norm + lm_head) the owning stage gathers its
    TP-split tensors with one all_gather over the TP group (experts: one over the expert-TP group
    and one over the EP group). For "rank0" only data-parallel replica 0 gathers, and a stage
    other than rank 0's sends the unit's HF tensors to rank 0 in one message over the pipeline
    group. Otherwise every replica gathers (so each rank of the owning stage holds the unit: with
    TP=PP=EP=1 nothing crosses a process), and for "every_rank" the owning stage broadcasts it over
    each pipeline group in one message. Yielded tensors have the model's params_dtype, live on its
    device and may alias its parameters: copy, never modify them."""
    gpt = unwrap(model)
    arch = arch_of(hf_config)
    dtype = gpt.config.params_dtype
    device = next(gpt.parameters()).device
    local = _local_units(gpt, arch)
    owners = _unit_owners(gpt.config, arch)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    stage, rank = parallel_state.get_pipeline_model_parallel_rank(), dist.get_rank()
    every_replica = to != "rank0"
    for unit, unit_specs in itertools.groupby(hf_specs(hf_config, dtype), key=lambda spec: _unit_of_hf(spec[0], arch)):
        specs = list(unit_specs)
        src = pp_ranks[owners[unit]]  # the owning stage's rank in this rank's pipeline group
        if owners[unit] == stage:
            tensors = _gather_unit(local.get(unit, []), arch, every_replica)
            if rank == 0 or every_replica:
                _check_names(unit, tensors, specs)
                if to == "every_rank" and pp_group.size() > 1:
                    dist.broadcast(_flat(tensors, specs, dtype), src, pp_group)
                yield from ((name, tensors[name].to(dtype)) for name, _, _ in specs)
                continue
            if 0 in pp_ranks:  # this stage's rank in rank 0's pipeline group
                _check_names(unit, tensors, specs)
                dist.send(_flat(tensors, specs, dtype), pp_ranks[0], pp_group)
        elif to == "every_rank" or (to == "rank0" and rank == 0):
            buffer = torch.empty(sum(shape.numel() for _, shape, _ in specs), dtype=dtype, device=device)
            (dist.broadcast if to == "every_rank" else dist.recv)(buffer, src, pp_group)
            yield from _unpack(buffer, specs)
            continue
        yield from ((name, None) for name, _, _ in specs)


def hf_stages(model: torch.nn.Module, hf_config: Any) -> dict[str, int]:
    """The pipeline stage that holds each HF tensor (export_hf's "stage")."""
    gpt = unwrap(model)
    arch = arch_of(hf_config)
    owners = _unit_owners(gpt.config, arch)
    return {name: owners[_unit_of_hf(name, arch)] for name, _, _ in hf_specs(hf_config, gpt.config.params_dtype)}


def _flat(tensors: dict[str, torch.Tensor], specs: list, dtype: torch.dtype) -> torch.Tensor:
    """A unit's HF tensors as one message: concatenated in spec order."""
    return torch.cat([tensors[name].to(dtype).reshape(-1) for name, _, _ in specs])


def _unit_of_hf(name: str, arch: Arch) -> str | int:
    if name == hf_embed(arch):
        return "embed"
    if arch.vision and name.startswith(arch.hf_vision_prefix):
        return "vision"
    if arch.audio and name.startswith(tuple(arch.hf_audio_prefix + p for p in HF_AUDIO_PREFIXES)):
        return "audio"
    if name.startswith(hf_layers(arch)):
        return int(name.removeprefix(hf_layers(arch)).split(".")[0])
    return "final"


def _unit_of_mcore(name: str) -> str | int:
    if name.startswith("embedding."):
        return "embed"
    if name.startswith(VISION_PREFIX):
        return "vision"
    if name.startswith(AUDIO_PREFIX):
        return "audio"
    match = LAYER.fullmatch(name)
    return int(match[1]) if match else "final"


def _local_units(gpt: GPTModel, arch: Arch) -> dict[str | int, list[_Local]]:
    units: dict[str | int, list[_Local]] = defaultdict(list)
    for name, param in gpt.named_parameters():
        canonical = canonical_name(name, gpt)
        units[_unit_of_mcore(canonical)].append(_Local(canonical, entry(canonical, arch), param.detach()))
    return units


def _unit_owners(config: TransformerConfig, arch: Arch) -> dict[str | int, int]:
    stages = config.pipeline_model_parallel_size
    owners: dict[str | int, int] = {"embed": 0, "final": stages - 1}
    encoders = [unit for unit, present in (("vision", arch.vision), ("audio", arch.audio)) if present]
    owners.update(dict.fromkeys(encoders, 0))  # before the first layer (the config refuses more than one stage)
    for stage in range(stages):
        owners.update(dict.fromkeys(stage_layers(config, stage), stage))
    if len(owners) != arch.num_layers + 2 + len(encoders):
        raise ValueError("megatron's pipeline stages do not cover every layer exactly once")
    return owners


def _check_names(unit: str | int, tensors: dict[str, torch.Tensor], specs: list) -> None:
    expected = {name for name, _, _ in specs}
    if set(tensors) != expected:
        raise RuntimeError(
            f"export unit {unit}: missing {sorted(expected - set(tensors))}, "
            f"unexpected {sorted(set(tensors) - expected)}"
        )


def _unpack(buffer: torch.Tensor, specs: list) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, shape, _ in specs:
        yield name, buffer[offset : offset + shape.numel()].view(shape)
        offset += shape.numel()


def _gather_unit(items: list[_Local], arch: Arch, every_replica: bool) -> dict[str, torch.Tensor]:
    """A unit's HF tensors from its local shards; empty on ranks that do not take part."""
    exported = [it for it in items if it.entry.export]
    dense = [it for it in exported if not it.entry.expert]
    experts = [it for it in exported if it.entry.expert]
    out: dict[str, torch.Tensor] = {}
    # Data-parallel replicas hold the same weights: replica 0 alone gathers, unless each needs them.
    if dense and (every_replica or parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0):
        group = parallel_state.get_tensor_model_parallel_group()
        for it, full in zip(dense, _gather_split(dense, group), strict=True):
            out.update(to_hf(full, it.entry, arch, group.size()))
    if experts and (every_replica or parallel_state.get_expert_data_parallel_rank() == 0):
        out.update(_gather_experts(experts, arch))
    return out


def _gather_split(items: list[_Local], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Full tensors of items: TP-split ones gathered over group (one collective), others as held."""
    split = [it for it in items if it.entry.split is not None]
    per_rank = iter(zip(*_all_gather([it.param for it in split], group), strict=True)) if split else iter(())
    return [torch.cat(next(per_rank), dim=it.entry.split) if it.entry.split is not None else it.param for it in items]


def _gather_experts(items: list[_Local], arch: Arch) -> dict[str, torch.Tensor]:
    expert_tp = parallel_state.get_expert_tensor_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    fulls = _gather_split(items, expert_tp)
    first = rank_experts(arch.num_experts, ep_group.size(), ep_group.rank()).start
    out: dict[str, torch.Tensor] = {}
    for ep_rank, tensors in enumerate(_all_gather(fulls, ep_group)):
        shift = rank_experts(arch.num_experts, ep_group.size(), ep_rank).start - first
        for it, full in zip(items, tensors, strict=True):
            e = entry(with_expert(it.name, expert_index(it.name) + shift), arch)
            out.update(to_hf(full, e, arch, expert_tp.size()))
    return out


def _all_gather(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Every group rank's `tensors` (same shapes on all ranks), indexed [group rank][i], through
    one all_gather of their concatenation."""
    if group.size() == 1:
        return [tensors]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"export gathers tensors of one dtype, got {sorted(map(str, dtypes))}")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = torch.empty(group.size() * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=group)
    out = []
    for chunk in gathered.chunk(group.size()):
        sizes = [t.numel() for t in tensors]
        out.append([part.view(t.shape) for part, t in zip(chunk.split(sizes), tensors, strict=True)])
    return out
