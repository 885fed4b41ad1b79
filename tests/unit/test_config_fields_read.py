"""Every option of the schema is read by some code outside the config package: an option nothing
reads is a promise the system does not keep (metrics.progress_every_s once was one)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from relax_hpc.config.docs import list_section
from relax_hpc.config.schema import JobConfig

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"


def _leaves(model: type[BaseModel], parent: str = "") -> list[tuple[str, tuple[str, str], str]]:
    """(dotted key, (name of the enclosing section's field, its class), option name) of every option."""
    out = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _leaves(annotation, f"{parent}{name}.")
        else:
            section = parent.rstrip(".").rsplit(".", 1)[-1]
            out.append((f"{parent}{name}", (section, model.__name__), name))
            if (item := list_section(annotation)) is not None:  # the items' options too (eval.models.path)
                out += _leaves(item, f"{parent}{name}.")
    return out


def _source() -> str:
    """The package outside config/, where options are used (config/ only declares and loads them)."""
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.parent.name != "config")


def _aliases(source: str, section: str, cls: str) -> set[str]:
    """Names a section is bound to: `ro` in `ro = cfg.rollout` or `sl, x = cfg.launch.slurm, ...`,
    and parameters of its class (`role: SlurmRoleConfig`)."""
    names = {section} | set(re.findall(rf"(\w+): {cls}\b", source))
    for match in re.finditer(r"^\s*([\w, ]+?)\s*=\s*([^\n]+)$", source, re.M):
        targets = [t.strip() for t in match[1].split(",")]
        values = [v.strip() for v in match[2].split(",")]
        for target, value in zip(targets, values, strict=False):
            if re.search(rf"\.{section}\b$", value):
                names.add(target)
    return names


def unread_options() -> list[str]:
    source = _source()
    leaves = _leaves(JobConfig)
    shared = Counter(name for _, _, name in leaves)
    unread = []
    for key, section, name in leaves:
        if shared[name] == 1:  # a unique name: any attribute access counts
            read = re.search(rf"\.{name}\b", source) is not None
        else:  # a name several sections use: it must be read through its own section
            read = any(re.search(rf"\b{alias}\.{name}\b", source) for alias in _aliases(source, *section))
        if not read:
            unread.append(key)
    return unread


def test_every_schema_option_is_read_somewhere():
    assert unread_options() == []


def test_the_check_can_fail():
    class Probe(BaseModel):
        never_read_by_anything_xyz: int = 0

    assert _leaves(Probe) == [("never_read_by_anything_xyz", ("", "Probe"), "never_read_by_anything_xyz")]
    assert re.search(r"\.never_read_by_anything_xyz\b", _source()) is None
