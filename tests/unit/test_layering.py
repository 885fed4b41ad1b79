"""The package layout's rules (docs/DESIGN.md, "The code"), checked on the import statements:
roles are processes that meet only through shared layers, so no role imports another role and no
shared layer imports a role; the shared layers are ranked, and each imports only layers of a lower
rank (no loop between them); entry points above the roles may import anything. And the driver,
which every start and restart of a run starts, imports no torch. And a component below the entry
points takes its own config section, not the whole JobConfig."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"
ROLES = {"engines", "rollout", "trainer", "launch"}
ENTRY_POINTS = {"submit", "inprocess", "status", "plot", "scale", "evaluate", "pipeline", "forkserver", "__init__"}
# Where a module may be imported by a name computed at run time, which no import rule sees: the
# fork server (the role modules the launcher names, launch.forkserver.ROLE_MODULES) and the options
# naming a user's own object (module:attribute).
DYNAMIC_IMPORTS = {"forkserver.py", "config/references.py"}
# The shared layers, lowest first: a layer imports only layers of a lower rank.
RANKS = [
    {"cli"},  # how an entry point exits (a closed pipe, a full disk): imports nothing of the package
    {"paths", "config"},
    {"fence"},  # one writer per run: every writing layer above checks it
    {"data", "protocol", "algos"},
    {"exchange", "envs", "rewards", "weights"},
    {"agents"},  # the agent gateway: an environment's episodes through OpenAI's API (envs names it)
    {"models"},
    {"ckpt"},
    {"metrics"},
]
RANK = {layer: rank for rank, layers in enumerate(RANKS) for layer in layers}
# Where every function that takes the whole JobConfig is listed (docs/DESIGN.md, "Config
# sections"): the entry points, and the functions whose callers in other packages still pass it.
SECTIONED = {"algos", "data", "envs", "rewards", "exchange", "ckpt", "metrics", "trainer", "engines"}
TAKES_JOB_CONFIG = {
    # An engine role's server command line: the model a pool serves, its dtype, seed, and the
    # features the run turns on (colocation, routing replay, LoRA) are the job's, not a section's.
    "engines/sglang_engine.py:server_args",
    "engines/vllm_engine.py:server_args",
    "trainer/backend.py:BackendConfig.of",  # the one place a backend's view is cut from a job
    "trainer/build.py:build_backend",  # the trainers' factories: they pick by the config
    "trainer/build.py:build_channel",
    "trainer/loop.py:Trainer.__init__",  # the roles' main objects
    "trainer/sft_loop.py:SftTrainer.__init__",
}
JOB_CONFIG_CEILING = 58  # the whole package's count: it may shrink (then lower this), not grow


def _import_module_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
        == "import_module"
    ]


def _imports(path: Path) -> set[str]:
    """Every relax_hpc module a file imports, at any depth of the file (lazy imports count, and
    importlib.import_module of a literal name)."""
    out = set()
    tree = ast.parse(path.read_text())
    for call in _import_module_calls(tree):
        if call.args and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("relax_hpc"):
            out.add(str(call.args[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("relax_hpc")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relax_hpc"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _owner(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _files() -> list[tuple[Path, str]]:
    return [(p, _owner(p)) for p in sorted(PACKAGE.rglob("*.py"))]


def _takes_job_config(path: Path) -> list[str]:
    """`file:qualified name` of each function or method in a file with a JobConfig parameter."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    a = child.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                    if any(p.annotation and "JobConfig" in ast.unparse(p.annotation) for p in params):
                        found.append(f"{path.relative_to(PACKAGE)}:{name}")
                visit(child, name + ".")

    visit(ast.parse(path.read_text()), "")
    return found


def test_components_take_their_config_section():
    """In the sectioned packages only the listed functions take the whole JobConfig: a backend, a
    reward or a sink reads its own section (a list of what it depends on), and a new function that
    takes JobConfig there fails here. A listed one that no longer takes it is to leave the list."""
    found = {f for path, owner in _files() if owner in SECTIONED for f in _takes_job_config(path)}
    assert found == TAKES_JOB_CONFIG


def test_the_whole_config_count_does_not_grow():
    """Not counted: config/rules.py, the table of what the sections cannot combine, whose every
    row reads the whole job by definition."""
    found = [f for path, _ in _files() if path != PACKAGE / "config" / "rules.py" for f in _takes_job_config(path)]
    assert len(found) <= JOB_CONFIG_CEILING, found


def test_every_package_is_a_role_an_entry_point_or_a_ranked_layer():
    """A new package must be placed (a layer without a rank would escape the rank rule)."""
    unplaced = {owner for _, owner in _files()} - ROLES - ENTRY_POINTS - set(RANK)
    assert unplaced == set()


def test_no_role_imports_another_role_and_no_shared_layer_imports_a_role():
    offences = []
    for path, owner in _files():
        rel = path.relative_to(PACKAGE)
        if owner in ENTRY_POINTS:
            continue
        for module in _imports(path):
            target = _top(module)
            if target in ROLES and target != owner:
                offences.append(f"{rel} imports {module}")
    assert offences == []


def test_modules_imported_by_computed_names_only_where_listed():
    """An import_module of a name computed at run time escapes every rule above, so it is allowed
    only in DYNAMIC_IMPORTS; the fork server's names are checked instead (next test)."""
    offences = [
        f"{path.relative_to(PACKAGE)}:{call.lineno}"
        for path, _ in _files()
        if str(path.relative_to(PACKAGE)) not in DYNAMIC_IMPORTS
        for call in _import_module_calls(ast.parse(path.read_text()))
        if not (call.args and isinstance(call.args[0], ast.Constant))
    ]
    assert offences == []


def test_the_fork_server_imports_only_role_modules_and_lives_above_them():
    """The fork server imports what the launcher names: its modules are roles' modules, so it is an
    entry point (above the roles), and launch/, itself a role, only names them in commands."""
    from relax_hpc.launch.forkserver import ROLE_MODULES

    assert ROLE_MODULES and all(_top(m) in ROLES - {"launch"} | {"metrics"} for m in ROLE_MODULES)
    assert all((PACKAGE.parent / (m.replace(".", "/") + ".py")).is_file() for m in ROLE_MODULES)
    assert "forkserver" in ENTRY_POINTS and (PACKAGE / "forkserver.py").is_file()
    assert not any(_import_module_calls(ast.parse((PACKAGE / "launch" / "forkserver.py").read_text())))


def test_a_shared_layer_imports_only_lower_ranked_layers():
    offences = []
    for path, owner in _files():
        if owner not in RANK:
            continue
        for module in _imports(path):
            target = _top(module)
            if target in RANK and target != owner and RANK[target] >= RANK[owner]:
                offences.append(
                    f"{path.relative_to(PACKAGE)} (rank {RANK[owner]}) imports {module} (rank {RANK[target]})"
                )
    assert offences == []


def test_the_driver_imports_no_torch():
    """Importing the driver module in a fresh interpreter leaves torch unimported: torch costs
    seconds of CPU on every start and restart of a run, and the driver never needs it."""
    modules = "relax_hpc.rollout.driver, relax_hpc.agents.env"  # the agent gateway runs in the driver
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_runtime_module_imports_the_test_models():
    """models/tiny*.py build the shipped test models (tools/make_tiny_*.py) and serve the tests:
    no part of a run may come to depend on them."""
    offences = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path, _ in _files()
        if not path.stem.startswith("tiny")
        for module in _imports(path)
        if module.startswith("relax_hpc.models.tiny")
    ]
    assert offences == []


def test_the_rule_is_not_vacuous():
    """The walk sees the package's real imports (a broken walk would pass the test above)."""
    imports = _imports(PACKAGE / "trainer" / "loop.py")
    assert "relax_hpc.weights.sender" in imports and "relax_hpc.trainer.build" in imports
    assert _top("relax_hpc.engines.torch_engine") == "engines"
    assert "relax_hpc.ckpt.layout" in _imports(PACKAGE / "metrics" / "summary.py")
    assert "relax_hpc.models.tiny" in _imports(PACKAGE / "models" / "tiny_multimodal.py")
    assert "relax_hpc.trainer.torch_backend" in _imports(PACKAGE / "trainer" / "main.py")  # import_module("...")
