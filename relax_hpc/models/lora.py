"""LoRA adapters on an HF policy, through PEFT (trainer.lora).

The adapters are injected into the policy in place (`peft.inject_adapter_in_model`), so the model
keeps its transformers class, its decoder layers and its HF parameter names (each target module's
weight becomes `<module>.base_layer.weight`, its adapters `<module>.lora_A.default.weight` and
`<module>.lora_B.default.weight`): FSDP2, the checkpoints and the frozen reference see a plain HF
model. Outside the trainer the adapters go by their sync names (relax_hpc.weights.lora), which
are also a PEFT adapter file's names without its `base_model.model.` prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from relax_hpc.weights.lora import SCALING

if TYPE_CHECKING:  # the engines read adapter folders without the config's schema (pydantic) or peft
    from peft import LoraConfig as PeftLoraConfig

    from relax_hpc.config.schema import LoraConfig

ADAPTER = "default"  # PEFT's name for a model's only adapter
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF names in an adapter file
ADAPTER_FILE = "adapter_model.safetensors"


def peft_config(cfg: LoraConfig, base_path: str) -> PeftLoraConfig:
    # Imported here, not above: peft costs seconds of CPU at every start of a trainer rank and an
    # engine, and only LoRA runs use it (tests/unit/test_startup_imports.py).
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        base_model_name_or_path=base_path,
    )


def scaling(cfg: LoraConfig) -> torch.Tensor:
    """alpha / rank, as PEFT scales each adapter (and as the engines merge it)."""
    return torch.tensor([cfg.alpha / cfg.rank], dtype=torch.float32)


def is_adapter_parameter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def sync_name(name: str) -> str:
    """A trainer parameter's name as the engines and PEFT's files name it (without the adapter's)."""
    for kind in ("lora_A", "lora_B"):
        name = name.replace(f".{kind}.{ADAPTER}.", f".{kind}.")
    return name


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, base_path: str, seed: int) -> None:
    """Inject the adapters in place and freeze everything else. The adapters' random start (A;
    B starts at zero, so the policy starts as the base) draws from `seed` alone: every rank builds
    the same adapters whatever its own RNG state."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(cfg, base_path), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))


def write_adapter_folder(out: Path, cfg: LoraConfig, base_path: str, adapter: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) of `adapter`
    (sync names), which `peft.PeftModel.from_pretrained(base, out)` loads."""
    out.mkdir(parents=True, exist_ok=True)
    peft_config(cfg, base_path).save_pretrained(str(out))
    tensors = {PEFT_PREFIX + name: t.contiguous() for name, t in adapter.items() if name != SCALING}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})


def read_adapter_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter of a folder write_adapter_folder wrote, under sync names with its SCALING, as
    the engines merge it (relax_hpc.weights.lora.merge_all)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / ADAPTER_FILE))
    adapter = {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
    adapter[SCALING] = torch.tensor([config["lora_alpha"] / config["r"]], dtype=torch.float32)
    return adapter
