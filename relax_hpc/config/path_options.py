"""Options that name files and folders (marked `PathOption` in the schema), and everything derived
from the mark: absolute paths at load, existence checks before a job starts, container binds."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from relax_hpc.config.schema import VLLM_INSTALL_HINT, JobConfig, PathOption, RolloutConfig

# The tiny policies tools/make_tiny_policy.py builds (folder name: its --task), and where the
# repository ships them.
TINY_POLICIES = {"tiny-qwen3-addition": "addition", "tiny-qwen3-calculator": "calculator"}
SHIPPED_ASSETS = Path(__file__).resolve().parents[2] / "assets"
# vLLM's environment when rollout.vllm.python is unset and no container holds one (tools/install_vllm.sh).
VENV_VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True, slots=True)
class PathField:
    key: str  # dotted, e.g. model.path
    owner: BaseModel  # the section that holds it
    name: str
    option: PathOption

    @property
    def value(self) -> str | None:
        value = getattr(self.owner, self.name)
        return None if value is None else str(value)


def path_fields(section: BaseModel, prefix: str = "", in_image: bool | None = None) -> Iterator[PathField]:
    """Every host path option of `section` and its subsections, in schema order (of a job, only the
    sections its kind reads). A job run in a container leaves out the options that then name a
    path inside its image (PathOption.in_image); `in_image` says so for the subsections."""
    if in_image is None:
        in_image = isinstance(section, JobConfig) and section.launch.container is not None
    unused = section.unused_sections() if isinstance(section, JobConfig) else set()
    for name, field in type(section).model_fields.items():
        if name in unused:
            continue
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from path_fields(value, f"{prefix}{name}.", in_image)
            continue
        if isinstance(value, list):  # a list of sections (eval.models): eval.models.0.path, ...
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from path_fields(item, f"{prefix}{name}.{i}.", in_image)
            continue
        marks = [m for m in field.metadata if isinstance(m, PathOption)]
        if marks and not (in_image and marks[0].in_image):
            yield PathField(f"{prefix}{name}", section, name, marks[0])


def make_absolute(config: BaseModel, base: Path) -> None:
    """Resolve every set path option against `base`, so that every role, whatever its working
    directory, reads the same files."""
    for f in path_fields(config):
        if f.value is not None:
            path = (base / f.value).resolve()
            setattr(f.owner, f.name, str(_run_export(path) if f.option.kind == "hf_model" else path))


def _run_export(path: Path) -> Path:
    """A model option may name a run (a folder with RUN_DIR/config.yaml and no config.json of its
    own, e.g. an sft run): it stands for the HF folder that run exported, RUN_DIR/hf."""
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        return path / "hf"
    return path


def path_problems(config: BaseModel) -> list[str]:
    """What is wrong with the set path options, one message each (empty: all usable)."""
    problems = []
    for f in path_fields(config):
        path = None if f.value is None else Path(f.value)
        if path is None:
            continue
        if f.option.kind == "run_dir":
            problems += [f"{f.key}: {why}"] if (why := run_dir_problem(path)) else []
            continue
        hint = f"; {f.option.hint}" if f.option.hint else ""
        if f.option.kind == "hf_model" and path.name == "hf" and (path.parent / "config.yaml").is_file():
            if not (path / "config.json").is_file():
                problems.append(
                    f"{f.key}: the run {path.parent} has exported no model yet ({path} is written when it "
                    "completes, with ckpt.export_hf); finish that run, or export a checkpoint with "
                    f"{python_command()} tools/dcp_to_hf.py --run-dir {path.parent} --out {path}"
                )
        elif f.option.kind == "hf_model" and not (path / "config.json").is_file():
            problems.append(
                f"{f.key}: {path} is not an HF model folder (no config.json){hint}{tiny_policy_hint(f.key, path)}"
            )
        elif f.option.kind == "file" and not path.is_file():
            problems.append(f"{f.key}: {path} does not exist or is not a file{hint}")
        elif f.option.kind == "checkpoint" and not checkpoint_folder(path):
            problems.append(
                f"{f.key}: {path} is not a run's checkpoint (RUN_DIR/ckpt/step-N, beside RUN_DIR/config.yaml)"
            )
        elif f.option.kind == "image" and not path.exists():
            problems.append(f"{f.key}: {path} does not exist{hint}")
    if isinstance(config, JobConfig) and "rollout" not in config.unused_sections():
        problems += default_vllm_python_problems(config.rollout, config.launch.container is not None)
    return problems


def default_vllm_python_problems(rollout: RolloutConfig, in_container: bool) -> list[str]:
    """Why vLLM engines cannot start with rollout.vllm.python unset (empty: they can, or run none):
    its default, .venv-vllm beside the package, is checked as a named one is."""
    if rollout.engine != "vllm" or rollout.vllm.python is not None or in_container or VENV_VLLM_PYTHON.is_file():
        return []
    why = f"rollout.engine=vllm: vLLM's environment {VENV_VLLM_PYTHON.parent.parent} is missing"
    return [f"{why}; {VLLM_INSTALL_HINT} (or set rollout.vllm.python)"]


def checkpoint_folder(path: Path) -> bool:
    """Whether `path` is a run's complete checkpoint (a step folder exists once complete)."""
    return (
        path.is_dir()
        and re.fullmatch(r"step-\d+", path.name) is not None
        and (path.parent.parent / "config.yaml").is_file()
    )


def python_command() -> str:
    """The interpreter that runs this process, as a hint printed for the user should name it: relative
    to the working directory when it lies inside it (`.venv/bin/python`), else its absolute path, so
    that the hint copied as written runs where the package is installed (a bare `python` may not)."""
    exe = sys.executable
    if not exe:
        return "python"
    rel = os.path.relpath(exe)  # not resolved: a venv's python is a link to the base interpreter
    if rel.startswith(os.pardir):
        return exe
    return rel if os.sep in rel else os.path.join(os.curdir, rel)  # `python` alone would search PATH


def tiny_policy_hint(key: str, path: Path) -> str:
    """How to get a missing tiny policy back, for the folder names tools/make_tiny_policy.py
    writes only, and never by a command that would overwrite the shipped assets."""
    task = TINY_POLICIES.get(path.name)
    if task is None:
        return ""
    build = f"{python_command()} tools/make_tiny_policy.py --task {task} --out"
    if path.parent == SHIPPED_ASSETS:
        return (
            f"; it ships with relax_hpc: restore it with `git checkout -- {path}`, or build one in a folder of "
            f"your own with `{build} FOLDER` and set {key}=FOLDER/{path.name}"
        )
    return f"; build it with `{build} {path.parent}`"


def run_dir_problem(path: Path) -> str | None:
    """Why RUN_DIR cannot be created or written (None: it can), found without leaving anything
    behind: a folder made and removed again where it would go (its nearest existing parent)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is" if existing == path else f"would be below {existing}, which is"
        return f"{path} {where} a file, not a folder; pick another run.dir"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".relax-probe-", dir=existing))
    except OSError as e:
        return (
            f"{path} cannot be created or written: {existing} refuses a new folder ({e.strerror}); pick another run.dir"
        )
    return None


def bind_sources(config: BaseModel) -> list[str]:
    """Host folders that roles read or write through path options (a file's folder), absolute,
    without repeats: what a container must bind. Images are run, not bound."""
    out: list[str] = []
    for f in path_fields(config):
        if f.value is None or f.option.kind == "image":
            continue
        path = Path(f.value).resolve()
        folder = str(path.parent if f.option.kind == "file" else path)
        if folder not in out:
            out.append(folder)
    return out
