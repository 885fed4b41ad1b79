"""HF safetensors folders read into a megatron model's shards (any TP/PP/EP layout): each rank
reads only the blocks it holds (relax_hpc.models.hf_mapping has the names and layouts)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

import torch
from megatron.core import parallel_state
from safetensors import safe_open

from relax_hpc.models.arch import arch_of
from relax_hpc.models.hf_mapping import Entry, canonical_name, entry, read_shard, unwrap


def load_hf_weights(model: torch.nn.Module, hf_path: str | Path, hf_config: Any = None) -> None:
    """Copy an HF safetensors folder into this rank's parameters, in place, for any TP/PP/EP
    layout of megatron's parallel_state. Reads only the blocks this rank holds."""
    gpt = unwrap(model)
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_path)
    arch = arch_of(hf_config)
    with _SafetensorsFolder(Path(hf_path)) as folder, torch.no_grad():
        for name, param in gpt.named_parameters():
            e = entry(canonical_name(name, gpt), arch)
            rank, world = _shard_coords(e)
            shard = read_shard(e, arch, folder.read, rank, world, param.shape, param.dtype)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name}: HF tensors {e.hf} give shape {tuple(shard.shape)}, model has {tuple(param.shape)}"
                )
            param.copy_(shard)


def _shard_coords(e: Entry) -> tuple[int, int]:
    if e.split is None:
        return 0, 1
    if e.expert:
        return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class _SafetensorsFolder:
    """The tensors of an HF folder (model.safetensors, or shards with an index), read by block."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: path / file for name, file in weight_map.items()}
        else:
            self._file_of = {}
            for file in sorted(path.glob("*.safetensors")):
                with safe_open(file, framework="pt") as handle:
                    self._file_of.update(dict.fromkeys(handle.keys(), file))
        if not self._file_of:
            raise FileNotFoundError(f"no safetensors weights in {path}")
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"the HF checkpoint has no tensor {name!r}")
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        block = self._open[file].get_slice(name)
        return block[rows] if len(block.get_shape()) == 1 else block[rows, cols]
