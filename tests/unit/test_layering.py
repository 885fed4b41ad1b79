"""The package layout's rules (docs/DESIGN.md, "The code"), checked on the import statements:
roles are processes that meet only through shared layers, so no role imports another role and no
shared layer imports a role; entry points above the roles may import anything."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"
ROLES = {"engines", "rollout", "trainer", "launch"}
ENTRY_POINTS = {"submit", "inprocess", "status", "plot", "scale", "__init__"}


def _imports(path: Path) -> set[str]:
    """Every relax_hpc module a file imports, at any depth of the file (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("relax_hpc")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relax_hpc"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_role_imports_another_role_and_no_shared_layer_imports_a_role():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        owner = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if owner in ENTRY_POINTS:
            continue
        for module in _imports(path):
            target = _top(module)
            if target in ROLES and target != owner:
                offences.append(f"{rel} imports {module}")
    assert offences == []


def test_the_rule_is_not_vacuous():
    """The walk sees the package's real imports (a broken walk would pass the test above)."""
    imports = _imports(PACKAGE / "trainer" / "loop.py")
    assert "relax_hpc.weights.sender" in imports and "relax_hpc.trainer.build" in imports
    assert _top("relax_hpc.engines.torch_engine") == "engines"
