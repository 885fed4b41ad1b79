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


def _section_model(location: tuple[str, ...]) -> type[BaseModel] | None:
    """The schema class that the dotted location points into, or None if it is not a section."""
    model: type[BaseModel] = JobConfig
    for key in location:
        if key.isdigit():  # an item of a list of sections (eval.models.0): its class is the list's
            continue
        field = model.model_fields.get(key)
        annotation = field.annotation if field else None
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section (X | None)
            annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), None)
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


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
        section = _section_model(tuple(parts[:depth]))
        if section is None:
            raise ConfigError(f"override {key}: {'.'.join(parts[:depth])} is not a section")
        if part not in section.model_fields:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(
                f"override {key}: unknown key {part!r} in {where}{suggest(part, list(section.model_fields))}"
            )
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part} is a value in the YAML, not a section")
    node[parts[-1]] = value


def _describe(error: ErrorDetails) -> str:
    loc = tuple(str(p) for p in error["loc"])
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        section = _section_model(loc[:-1])
        hint = suggest(loc[-1], list(section.model_fields)) if section else ""
        return f"{key}: unknown key{hint}"
    if error["type"] == "value_error":  # a cross-field check: its message names the options
        where = f"{key}: " if key else ""
        return where + str(error["ctx"]["error"])
    value = error.get("input")
    allowed = ""
    ctx = error.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in error["msg"]:  # an enum's message lists them already
        allowed = f"; allowed: {ctx['expected']}"
    return f"{key}: {error['msg']} (got {value!r}){allowed}"


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
