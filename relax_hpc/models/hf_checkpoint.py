"""A megatron distributed checkpoint (torch_dist) converted to HF tensors on the CPU, without a
process group (relax_hpc.models.hf_mapping has the names and layouts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relax_hpc.models.hf_mapping import mcore_to_hf


def megatron_checkpoint_to_hf(folder: str | Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """The model of a megatron distributed checkpoint (torch_dist format: DCP files) as HF tensors.

    megatron saves each tensor at its TP=1 layout (a fused SwiGLU fc1 as [gate; up] over all
    ranks, QKV grouped as above) and the layers of the decoder stacked on a leading axis under
    Transformer Engine names; only the model's keys are read (not the optimizer's), unsharded, on
    the CPU, without a process group.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    stored = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }
    dcp.load(stored, checkpoint_id=str(folder), no_dist=True)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in stored.items():
        if not key.startswith("decoder.layers."):
            state[key] = tensor
            continue
        rest = key[len("decoder.layers.") :]
        for i, layer in enumerate(tensor):
            if rest.startswith(_STACKED_EXPERTS):  # SequentialMLP stacks its experts on a second axis
                tail = rest[len(_STACKED_EXPERTS) :]
                state.update(
                    {f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{tail}": t for e, t in enumerate(layer)}
                )
            else:
                state[f"decoder.layers.{i}.{rest}"] = layer
    return mcore_to_hf(state, hf_config)


_STACKED_EXPERTS = "mlp.experts.experts."
