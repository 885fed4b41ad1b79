"""Render docs/config.md from the schema: every option, its type, default and docstring.

    python -m relax_hpc.config.docs > docs/config.md

tests/unit/test_config_docs.py fails when the checked-in file is stale.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel

from relax_hpc import cli
from relax_hpc.config.load import section_classes, tag_field
from relax_hpc.config.pipeline import PipelineConfig
from relax_hpc.config.schema import RESUMABLE_CHANGES, JobConfig

HEADER = """# Configuration reference

Generated from `relax_hpc/config/schema.py` by `python -m relax_hpc.config.docs`; do not edit.

A job config is YAML with the sections below. Any option can be overridden on the command line
as `section.key=value` (the value is parsed as YAML: `3`, `1e-3`, `true`, `[0.9, 0.95]`).
Unknown keys and invalid values are rejected before anything starts, with the key, the bad value
and what is allowed. The resolved config is frozen in `RUN_DIR/config.yaml`; resuming a run may
change only these options (a trailing dot means the whole section): {resumable}.
"""


def _type_name(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:  # Literal[...] | None
        return _type_name(args[0]) + " \\| None"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _optional_section(annotation: object) -> type[BaseModel] | None:
    """X of an `X | None` option whose X is a section (trainer.lora)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def list_section(annotation: object) -> type[BaseModel] | None:
    """X of a `list[X]` option whose X is a section (eval.models)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _section(defaults: BaseModel, prefix: str, top: str = "top level") -> list[str]:
    """One table per section; defaults come from the instance, since a nested section's default
    may differ from its class's (launch.slurm.rollout.nodes is 0, trainer.nodes 1)."""
    model = type(defaults)
    if prefix and (variants := _variants_of(model)):
        return _tagged_section(variants, prefix)
    lines = [
        f"\n## `{prefix.rstrip('.')}`\n" if prefix else f"\n## {top}\n",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    nested = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((getattr(defaults, name), f"{prefix}{name}."))
            continue
        doc = " ".join((field.description or "").split())
        item = list_section(annotation)
        if item is not None:  # its items' keys are listed below it, as `key[].option`
            default = "required" if field.is_required() else f"`{getattr(defaults, name)!r}`"
            lines.append(f"| `{prefix}{name}` | list of sections | {default} | {doc} |")
            nested.append((item.model_construct(), f"{prefix}{name}[]."))
            continue
        variants = section_classes(annotation)
        if len(variants) > 1:  # a tagged union (weights): its tag, the shared keys, each variant's own
            nested.append((getattr(defaults, name), f"{prefix}{name}."))
            continue
        optional = _optional_section(annotation)
        if optional is not None:  # unset by default; its keys are listed with their defaults once set
            lines.append(f"| `{prefix}{name}` | section \\| None | `None` | {doc} |")
            nested.append((optional(), f"{prefix}{name}."))
            continue
        default = "required" if field.is_required() else f"`{getattr(defaults, name)!r}`"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        choices = extra.get("choices")  # a str option checked against a table (rollout.engine)
        kind = " \\| ".join(f"`{c}`" for c in choices) if isinstance(choices, list) else _type_name(annotation)
        lines.append(f"| `{prefix}{name}` | {kind} | {default} | {doc} |")
    if len(lines) == 3:
        lines = []
    for sub, sub_prefix in nested:
        lines += _section(sub, sub_prefix)
    return lines


def _variants_of(model: type[BaseModel]) -> list[type[BaseModel]]:
    """The variants of the tagged union whose default is of class `model` (weights), or []."""
    for field in JobConfig.model_fields.values():
        variants = section_classes(field.annotation)
        if len(variants) > 1 and model in variants:
            return variants
    return []


def _tagged_section(variants: list[type[BaseModel]], prefix: str) -> list[str]:
    """One table for a tagged union: the tag with each value's meaning, the keys every variant
    takes, then each variant's own keys, marked with the tag value that takes them."""
    tag = tag_field(variants)
    assert tag is not None, variants
    shared = set.intersection(*(set(v.model_fields) for v in variants)) - {tag}
    first = variants[0]
    meanings = " ".join(" ".join((v.model_fields[tag].description or "").split()) for v in variants)
    values = " \\| ".join(f"`{v.model_fields[tag].default}`" for v in variants)
    lines = [f"\n## `{prefix.rstrip('.')}`\n", "| key | type | default | meaning |", "|---|---|---|---|",
             f"| `{prefix}{tag}` | {values} | `{first.model_fields[tag].default!r}` | {meanings} |"]  # fmt: skip
    rows = [(first, name, "") for name in first.model_fields if name in shared]
    seen: set[str] = set()
    for variant in variants:
        for name in variant.model_fields:
            if name in shared or name == tag or name in seen:
                continue
            seen.add(name)
            takers = [f"`{prefix}{tag}={v.model_fields[tag].default}`" for v in variants if name in v.model_fields]
            rows.append((variant, name, f"({' or '.join(takers)} only) "))
    for variant, name, only in rows:
        field = variant.model_fields[name]
        doc = " ".join((field.description or "").split())
        lines.append(f"| `{prefix}{name}` | {_type_name(field.annotation)} | `{field.default!r}` | {only}{doc} |")
    return lines


PIPELINE_HEADER = """
# Pipeline files

A pipeline file (`python -m relax_hpc.pipeline --config FILE`) lists stages, each a job config
above with overrides, or an export of a run's checkpoint; a stage names an earlier stage's
output as `${stages.NAME.run_dir}`, `${stages.NAME.hf}` or `${stages.NAME.ckpt}`. Unknown keys,
references to a later or unknown stage and outputs a stage does not have are refused before
anything runs. Example: `configs/tiny-pipeline.yaml`.
"""


def render() -> str:
    header = HEADER.format(resumable=", ".join(f"`{k}`" for k in RESUMABLE_CHANGES))
    pipeline = _section(PipelineConfig.model_construct(dir="", stages=[]), "", top="pipeline file")
    return (
        header
        + "\n".join(_section(JobConfig.model_construct(), ""))
        + "\n"
        + PIPELINE_HEADER
        + "\n".join(pipeline)
        + "\n"
    )


if __name__ == "__main__":
    cli.run(lambda: print(render(), end=""))
