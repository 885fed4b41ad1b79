"""YAML + `key=value` overrides -> a validated JobConfig, or a ConfigError naming what to fix."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from relax_hpc.config.path_options import make_absolute
from relax_hpc.config.schema import JobConfig, unused_sections


class ConfigError(ValueError):
    """The config cannot be used; the message lists every problem, one per line."""


# Keys renamed since 0.1.0: configs and frozen RUN_DIR/config.yaml files that use the old name
# keep working (the value moves to the new key).
RENAMED = {"rollout.reward": "reward.name"}


def _migrate(tree: dict[str, Any]) -> dict[str, Any]:
    for old, new in RENAMED.items():
        *old_parents, old_key = old.split(".")
        node: Any = tree
        for part in old_parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_key not in node:
            continue
        value = node.pop(old_key)
        *new_parents, new_key = new.split(".")
        target = tree
        for part in new_parents:
            target = target.setdefault(part, {})
        target.setdefault(new_key, value)
    return tree


def suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(sorted(choices))}"


def section_classes(annotation: Any) -> list[type[BaseModel]]:
    """The section classes an option's annotation holds: [X] for X, X | None and list[X], every
    variant of a tagged union of sections (weights), [] for a plain value."""
    if typing.get_origin(annotation) is typing.Annotated:
        return section_classes(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [c for a in typing.get_args(annotation) for c in section_classes(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def tag_field(variants: Sequence[type[BaseModel]]) -> str | None:
    """The option that picks the variant of a tagged union (weights.channel): a one-value Literal
    in every variant."""
    if len(variants) < 2:
        return None
    names = [
        name
        for name, f in variants[0].model_fields.items()
        if all(name in v.model_fields and _one_value(v.model_fields[name].annotation) for v in variants)
    ]  # fmt: skip
    return names[0] if names else None


def _one_value(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Literal and len(typing.get_args(annotation)) == 1


def _fields(variants: Sequence[type[BaseModel]]) -> dict[str, Any]:
    return {name: f for variant in variants for name, f in variant.model_fields.items()}


def _walk(loc: Sequence[str]) -> tuple[list[str], list[type[BaseModel]]]:
    """The dotted location without the tags pydantic puts in it (weights.file.relay ->
    weights.relay), and the section classes it points into ([] past a plain value)."""
    classes: list[type[BaseModel]] = [JobConfig]
    clean: list[str] = []
    for key in loc:
        if key.isdigit() or (tag_field(classes) and key not in _fields(classes)):
            if not key.isdigit():  # a variant's tag: that variant
                classes = [c for c in classes if c.model_fields[str(tag_field(classes))].default == key]
            else:  # an item of a list of sections (eval.models.0): its class is the list's
                clean.append(key)
            continue
        clean.append(key)
        field = _fields(classes).get(key)
        classes = section_classes(field.annotation) if field else []
    return clean, classes


def _section_model(location: tuple[str, ...]) -> list[type[BaseModel]]:
    """The schema classes (one, or a tagged union's variants) the dotted location points into;
    [] if it is not a section."""
    return _walk(location)[1]


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in the nested dict; the value is parsed as YAML (so 3, 1e-3, true, [1, 2])."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. trainer.lr=3e-4")
    key, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: cannot parse value {raw!r} ({e})") from None
    set_option(tree, key, value)


def set_option(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted option `key` to `value` (already parsed) in the nested dict, after checking
    that the schema has that key."""
    key = RENAMED.get(key.strip(), key)
    parts = key.strip().split(".")
    for depth, part in enumerate(parts):
        fields = _fields(_section_model(tuple(parts[:depth])))
        if not fields:
            raise ConfigError(f"override {key}: {'.'.join(parts[:depth])} is not a section")
        if part not in fields:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"override {key}: unknown key {part!r} in {where}{suggest(part, list(fields))}")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is a value in the YAML, not a section")
    node[parts[-1]] = value


def _describe(error: ErrorDetails) -> str:
    loc, classes = _walk([str(p) for p in error["loc"]])
    key = ".".join(loc)
    if error["type"] == "union_tag_invalid":  # a tagged union's tag (weights.channel)
        ctx = error.get("ctx") or {}
        return f"{key}.{tag_field(classes)}: {ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}"
    if error["type"] == "extra_forbidden":
        return _unknown_key(loc)
    if error["type"] == "value_error":  # a cross-field check: its message names the options
        where = f"{key}: " if key else ""
        return where + str(error["ctx"]["error"])
    value = error.get("input")
    allowed = ""
    ctx = error.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in error["msg"]:  # an enum's message lists them already
        allowed = f"; allowed: {ctx['expected']}"
    return f"{key}: {error['msg']} (got {value!r}){allowed}"


def _unknown_key(loc: list[str]) -> str:
    """An unknown key's line: the key it is close to, or, where a tagged union's other variants
    take it (weights.relay with weights.channel=file), which of them."""
    key, name = ".".join(loc), loc[-1]
    variants = _section_model(tuple(loc[:-1]))
    tag = tag_field(variants)
    takers = [str(v.model_fields[tag].default) for v in variants if tag and name in v.model_fields]
    if takers:
        parent = ".".join(loc[:-1])
        return f"{key}: an option of {' or '.join(f'{parent}.{tag}={t}' for t in takers)} only"
    return f"{key}: unknown key{suggest(name, list(_fields(variants)))}"


def _refuse_other_kinds_sections(tree: dict[str, Any]) -> None:
    """A config that sets sections its kind does not read (rollout in an sft job, sft in an RL
    one) is refused rather than silently ignored. Checked on what the user wrote (the file and
    the overrides) only: a resolved config's dump holds every section."""
    kind = tree.get("kind", "rl")
    given = sorted(name for name in unused_sections(kind) if tree.get(name))
    if given:
        why = {
            "sft": "has no rollout, reward, algorithm or weight sync",
            "eval": "trains nothing and reads its prompts from eval.datasets",
        }.get(kind, "is not kind=sft or kind=eval")
        raise ConfigError(f"invalid config:\n  {', '.join(given)}: a kind={kind} job {why}; remove these sections")


def validate(tree: dict[str, Any]) -> JobConfig:
    try:
        return JobConfig.model_validate(_migrate(tree))
    except ValidationError as e:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(err) for err in e.errors())) from None


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    base_dir: Path | None = None,
    options: Mapping[str, Any] | None = None,
) -> JobConfig:
    """Read `path` (or start from the defaults when None), apply overrides (`key=value` strings,
    then `options`, dotted keys with parsed values), validate (which also resolves the settings
    that depend on others), and make the path options absolute against `base_dir` (default: the
    working directory)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for override in overrides:
        apply_override(tree, override)
    for key, value in (options or {}).items():
        set_option(tree, key, value)
    _refuse_other_kinds_sections(tree)
    config = validate(tree)
    make_absolute(config, base_dir or Path.cwd())
    return config


def to_yaml(config: JobConfig) -> str:
    """The resolved config as YAML, without the sections its kind does not read."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude=config.unused_sections()), sort_keys=False)


def read_frozen(path: Path) -> JobConfig:
    """The resolved config a run saved in RUN_DIR/config.yaml."""
    return validate(yaml.safe_load(path.read_text()))
