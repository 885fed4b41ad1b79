"""A run's checkpoint as an HF model folder that transformers (and SGLang, vLLM) load.

Reads RUN_DIR/config.yaml to know the backend and the base model, then the model tensors of
ckpt/latest (or ckpt/step-N) without the optimizer's: the torch backend's checkpoint is torch DCP
with HF names already; the megatron backend's is megatron's distributed checkpoint (torch_dist,
also DCP files), whose tensors are unsharded and mapped to HF names and layout by
relax_hpc.models.hf_mapping. Writes config.json and safetensors (sharded as transformers shards
them), copies the base model's other files (tokenizer, generation config, processor configs), and
leaves every file readable like the rest of the user's output (mode 0644 under the usual umask).
A LoRA run's checkpoint holds only the adapters: the export merges them into the base model's
weights exactly as the engines do (ckpt.export_lora=merged), or writes a PEFT adapter folder
(ckpt.export_lora=adapter). Needs no GPU and no process group.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig

from relax_hpc.ckpt.layout import latest_dir
from relax_hpc.config.load import read_frozen
from relax_hpc.models import lora
from relax_hpc.models.hf import empty_policy, is_omni, load_policy, torch_dtype
from relax_hpc.paths import CkptDirs, RunPaths
from relax_hpc.weights.lora import SCALING, merge_all

MODEL_PREFIX = "model."  # the torch backend's state is {"model": ..., "optim": ...}
SHARD_SIZE = "50GB"  # transformers' save_pretrained default


class ExportError(RuntimeError):
    """The checkpoint cannot be turned into the base model's HF layout."""


def checkpoint_folder(paths: RunPaths, step: int | None) -> Path:
    folder = latest_dir(paths.ckpt) if step is None else CkptDirs(paths.ckpt).step(step)
    if folder is None or not folder.is_dir():
        raise ExportError(f"no complete checkpoint {'' if step is None else f'for step {step} '}in {paths.ckpt}")
    return folder


def torch_backend_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The HF-named model tensors of a torch-backend DCP checkpoint, unsharded."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {key[len(MODEL_PREFIX) :]: t for key, t in state.items()}


def megatron_backend_tensors(folder: Path, hf_config: Any) -> dict[str, torch.Tensor]:
    """HF-named tensors of a megatron distributed checkpoint (its model part only)."""
    from relax_hpc.models.hf_checkpoint import megatron_checkpoint_to_hf  # needs megatron-core

    return megatron_checkpoint_to_hf(folder, hf_config)


def convert(
    run_dir: Path, out: Path, step: int | None = None, lora_format: Literal["merged", "adapter"] | None = None
) -> Path:
    """Write the checkpoint of `step` (default: the latest) to `out`; returns the checkpoint folder.
    A LoRA run's is written as `lora_format` (default: the run's ckpt.export_lora)."""
    paths = RunPaths(run_dir)
    cfg = read_frozen(paths.config)
    folder = checkpoint_folder(paths, step)
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    if cfg.trainer.backend == "megatron":
        tensors = megatron_backend_tensors(folder, hf_config)
    else:
        tensors = torch_backend_tensors(folder)
    if cfg.trainer.lora is not None:
        adapter = {lora.sync_name(k): t for k, t in tensors.items()} | {SCALING: lora.scaling(cfg.trainer.lora)}
        if (lora_format or cfg.ckpt.export_lora) == "adapter":
            lora.write_adapter_folder(out, cfg.trainer.lora, cfg.model.path, adapter)
            _copy_companions(Path(cfg.model.path), out)
            _readable_like_other_output(out)
            return folder
        base = load_policy(cfg.model.path, torch_dtype(cfg.model.dtype)).state_dict()
        tensors = base | merge_all(base, adapter)  # what the engines hold: relax_hpc.weights.lora
    if cfg.trainer.backend == "megatron":
        _save_checkpoint_layout(out, tensors, hf_config, cfg.model.dtype)
    else:
        _save_policy(out, tensors, cfg.model.path, cfg.model.dtype, folder)
    _copy_companions(Path(cfg.model.path), out)
    _readable_like_other_output(out)
    return folder


def _save_checkpoint_layout(out: Path, tensors: dict[str, torch.Tensor], hf_config: Any, dtype: str) -> None:
    """The megatron backend's tensors, already the checkpoint's names and layout
    (relax_hpc.models.hf_mapping: an Omni thinker's under thinker.*, MoE experts one tensor each),
    written as they are, beside the base's config (an Omni model's whole: thinker, talker,
    code2wav). transformers' module would not take them as they are: it fuses MoE experts at
    load, and save_pretrained splits them again."""
    from huggingface_hub import save_torch_state_dict

    out.mkdir(parents=True, exist_ok=True)
    # Views into a larger tensor (q, k and v of megatron's fused projection) get storages of their
    # own: safetensors refuses to save a part of a storage.
    whole = {
        n: t if t.untyped_storage().nbytes() == t.nbytes and t.is_contiguous() else t.clone()
        for n, t in tensors.items()
    }
    save_torch_state_dict(whole, out, max_shard_size=SHARD_SIZE, metadata={"format": "pt"})
    hf_config.dtype = dtype
    hf_config.save_pretrained(out)


def _save_policy(out: Path, tensors: dict[str, torch.Tensor], base: str, dtype: str, folder: Path) -> None:
    """The torch backend's tensors (transformers' module names) through the policy's own
    save_pretrained; an Omni thinker's as the full model's folder."""
    model = empty_policy(base, torch_dtype(dtype))
    # a bf16 run's checkpoint holds fp32 master weights: the export holds what the engines serve
    tensors = {n: t.to(torch_dtype(dtype)) for n, t in tensors.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = any(getattr(c, "tie_word_embeddings", False) for c in (model.config, model.config.get_text_config()))
    missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise ExportError(f"{folder} does not match {base}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    if is_omni(base):
        _as_full_omni(out, Path(base))


def convert_into_place(
    run_dir: Path, out: Path, step: int | None = None, lora_format: Literal["merged", "adapter"] | None = None
) -> Path:
    """convert() into a folder beside `out`, renamed into place once complete: `out` exists only
    whole (what an eval job and a pipeline's export stage decide by). Returns the checkpoint folder."""
    partial = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    folder = convert(run_dir, partial, step, lora_format)
    partial.rename(out)
    return folder


def _as_full_omni(out: Path, base: Path) -> None:
    """A trained Omni thinker as the full model's folder that SGLang serves and the thinker class
    loads: the base config.json (thinker, talker, code2wav), the thinker's tensors named thinker.*
    (the talker's are left out: it is not trained here, and SGLang does not build it for text)."""
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        save_file({f"thinker.{k}": v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {f"thinker.{k}": v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    shutil.copy(base / "config.json", out / "config.json")


def _copy_companions(base: Path, out: Path) -> None:
    """The base model's files that are not its weights or its config: tokenizer, chat template,
    generation config, and a multimodal model's processor configs, as they are (re-saving a
    processor through transformers would name classes of relax_hpc's own in them)."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
    for source in base.iterdir():
        if source.is_file() and source.name != "config.json" and not source.name.endswith(weights):
            shutil.copy(source, out / source.name)


def _readable_like_other_output(folder: Path) -> None:
    """safetensors writes its files owner-only (0600); give every exported file the mode a newly
    created file gets under the user's umask, like the rest of the output."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
