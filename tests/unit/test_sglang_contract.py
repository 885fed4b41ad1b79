"""The engine protocol against SGLang's own definitions.

SGLang cannot run (or even be imported cheaply) on a CPU machine, so this reads the sources of
the pinned release (constraints.txt) straight from its wheel: the request classes in
srt/managers/io_struct.py, the routes in srt/entrypoints/http_server.py and the arguments of
SamplingParams. Every request class relax_hpc sends must exist there with the same field names,
compatible types and the same defaults; every route it calls must be served.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
import typing
import zipfile
from pathlib import Path

import pytest

from relax_hpc.rollout import protocol as P

REPO = Path(__file__).resolve().parents[2]
PINNED = re.search(r"^sglang==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE).group(1)

# Every request class relax_hpc sends (or the torch engine accepts) and every route it calls.
CLASSES = [
    P.GenerateReqInput, P.InitWeightsUpdateGroupReqInput, P.DestroyWeightsUpdateGroupReqInput,
    P.UpdateWeightsFromDistributedReqInput, P.GetWeightsByNameReqInput, P.BeginWeightUpdateReqInput,
    P.EndWeightUpdateReqInput, P.AbortReq, P.PauseGenerationReqInput, P.ContinueGenerationReqInput,
]  # fmt: skip
ROUTES = [
    "/generate", "/health", "/model_info", "/flush_cache", "/abort_request", "/pause_generation",
    "/continue_generation", "/init_weights_update_group", "/destroy_weights_update_group",
    "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update", "/get_weights_by_name",
]  # fmt: skip


@pytest.fixture(scope="module")
def sglang_sources(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("sglang")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={PINNED}", "-d", str(folder)],
        check=True, timeout=600,
    )  # fmt: skip
    (wheel,) = folder.glob("sglang-*.whl")
    names = {
        "io_struct": "sglang/srt/managers/io_struct.py",
        "http_server": "sglang/srt/entrypoints/http_server.py",
        "sampling_params": "sglang/srt/sampling/sampling_params.py",
    }
    with zipfile.ZipFile(wheel) as zf:
        return {key: zf.read(path).decode() for key, path in names.items()}


def _class_fields(tree: ast.Module) -> dict[str, dict[str, tuple[str, str | None]]]:
    """class name -> field -> (annotation source, default source), inherited fields included."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> dict[str, tuple[str, str | None]]:
        node = classes[name]
        out: dict[str, tuple[str, str | None]] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                value = stmt.value
                if isinstance(value, ast.Call):  # field(default=...) / msgspec.field(default=...)
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                default = ast.unparse(value) if value is not None else None
                out[stmt.target.id] = (ast.unparse(stmt.annotation), default)
        return out

    return {name: fields(name) for name in classes}


def _leaf_types(annotation: str) -> set[str]:
    """Base type names in an annotation: 'Optional[Union[List[int], str]]' -> {list, int, str, None}."""
    words = set(re.findall(r"[A-Za-z_]+", annotation))
    aliases = {"List": "list", "Dict": "dict", "NoneType": "None", "Optional": "None"}
    return {aliases.get(w, w) for w in words} - {"Union", "Annotated", "typing"}


def _ours(cls: type) -> dict[str, tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    render = lambda t: t.__name__ if isinstance(t, type) else str(t).replace("typing.", "")
    return {f.name: (render(hints[f.name]), f.default) for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_request_class_matches_sglang(sglang_sources, cls):
    theirs = _class_fields(ast.parse(sglang_sources["io_struct"])).get(cls.__name__)
    assert theirs is not None, f"SGLang {PINNED} has no request class {cls.__name__}"
    for name, (annotation, default) in _ours(cls).items():
        assert name in theirs, f"{cls.__name__}.{name} is not a field of SGLang's class: {sorted(theirs)}"
        their_annotation, their_default = theirs[name]
        extra = _leaf_types(annotation) - _leaf_types(their_annotation) - {"Any"}
        assert not extra, f"{cls.__name__}.{name}: ours {annotation}, SGLang's {their_annotation}"
        # Required here and defaulted there is fine (relax_hpc always sends it); the reverse would
        # let to_json() omit a field SGLang requires.
        if their_default is None:
            assert default is dataclasses.MISSING, f"{cls.__name__}.{name} is required by SGLang"
        elif default is not dataclasses.MISSING:
            assert ast.literal_eval(their_default) == default, (
                f"{cls.__name__}.{name}: default {default!r} here, {their_default} in SGLang"
            )


def test_routes_exist_in_sglang(sglang_sources):
    served = set(re.findall(r"@app\.(?:get|post|put|api_route)\(\s*\"([^\"]+)\"", sglang_sources["http_server"]))
    missing = [r for r in ROUTES if r not in served]
    assert missing == [], f"routes not served by SGLang {PINNED}: {missing}"


def test_sampling_params_exist_in_sglang(sglang_sources):
    theirs = set(_class_fields(ast.parse(sglang_sources["sampling_params"]))["SamplingParams"])
    assert set(P.SAMPLING_PARAMS) <= theirs, set(P.SAMPLING_PARAMS) - theirs


def test_the_torch_engine_routes_cover_what_relax_hpc_calls():
    source = (REPO / "relax_hpc" / "rollout" / "torch_engine.py").read_text()
    assert [r for r in ROUTES if f'"{r}"' not in source] == []
