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
from transformers import PreTrainedModel

from relax_hpc.weights.lora import SCALING

if TYPE_CHECKING:  # the engines read adapter folders without the config's schema (pydantic) or peft
    from peft import LoraConfig as PeftLoraConfig

    from relax_hpc.config.schema import LoraConfig

ADAPTER = "default"  # PEFT's name for a model's only adapter
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF names in an adapter file
ADAPTER_FILE = "adapter_model.safetensors"
TIED_INPUT, TIED_OUTPUT = "embed_tokens.weight", "lm_head.weight"  # HF causal LMs' names


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


def saved_modules(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """Names of the modules trained whole (cfg.modules_to_save), matched as PEFT matches them (the
    name ends with the string), outermost only; an entry that matches nothing is an error."""
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    for wanted in cfg.modules_to_save:
        if not any(name.endswith(wanted) for name in names):
            raise ValueError(f"trainer.lora.modules_to_save: no module name of the model ends with {wanted!r}")
    matched = [name for name in names if name and any(name.endswith(wanted) for wanted in cfg.modules_to_save)]
    outermost = [name for name in matched if not any(name.startswith(f"{outer}.") for outer in matched)]
    tied = getattr(model.config, "tie_word_embeddings", False)
    output = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    if tied and any(model.get_submodule(name) is output for name in outermost):
        # One tensor, named after the input embedding in the trainer and at weight sync.
        raise ValueError(
            "trainer.lora.modules_to_save: this model ties its output embedding to the input one; "
            "name the input one (embed_tokens)"
        )
    return outermost


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, base_path: str, seed: int) -> None:
    """Inject the adapters in place and freeze everything else but the modules_to_save, which
    train whole under their HF names. The adapters' random start (A; B starts at zero, so the
    policy starts as the base) draws from `seed` alone: every rank builds the same adapters
    whatever its own RNG state."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(cfg, base_path), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))
    for name in saved_modules(model, cfg):  # a tied output embedding trains with its input one
        model.get_submodule(name).requires_grad_(True)


def _tied_output(base_path: str, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The output embedding of a model that ties it to a trained input embedding: one tensor in
    the trainer (named after the input one), which PEFT ties to the trained copy
    (ensure_weight_tying) and then reads from the file under its own name too."""
    embedding = next((t for name, t in adapter.items() if name.endswith(TIED_INPUT)), None)
    if embedding is None:
        return {}
    from transformers import AutoConfig

    return (
        {TIED_OUTPUT: embedding.clone()}
        if getattr(AutoConfig.from_pretrained(base_path), "tie_word_embeddings", False)
        else {}
    )


def write_adapter_folder(out: Path, cfg: LoraConfig, base_path: str, adapter: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) of `adapter`
    (sync names; a module trained whole under its HF name, as PEFT writes modules_to_save),
    which `peft.PeftModel.from_pretrained(base, out)` loads."""
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg, base_path)
    if cfg.modules_to_save:  # the trainer's model has them unwrapped; the folder's loader wraps them
        config.modules_to_save = list(cfg.modules_to_save)
        adapter = adapter | _tied_output(base_path, adapter)
        config.ensure_weight_tying = TIED_OUTPUT in adapter
    config.save_pretrained(str(out))
    tensors = {PEFT_PREFIX + name: t.contiguous() for name, t in adapter.items() if name != SCALING}
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})


def read_adapter_folder(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter of a folder write_adapter_folder wrote, under sync names with its SCALING, as
    the engines merge it (relax_hpc.weights.lora.merge_all)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / ADAPTER_FILE))
    adapter = {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
    if config.get("ensure_weight_tying"):  # the output embedding is the input one's tensor here
        adapter.pop(TIED_OUTPUT, None)
    adapter[SCALING] = torch.tensor([config["lora_alpha"] / config["r"]], dtype=torch.float32)
    return adapter
