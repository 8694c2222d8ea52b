"""The package's layer order, as the README's layout states it, enforced on every import.

Layers, lowest first: errors → fileio → spec → parallel → cost, schedule → trace → sim → plan, runtime →
cluster → cli. A module may import its own package and anything below; never above, and peers on
one layer (cost and schedule; plan and runtime) stay independent of each other. Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "src" / "paratrain"

LAYER = {
    "errors": 0,
    "fileio": 1,
    "spec": 2,
    "data": 2,
    "parallel": 3,
    "cost": 4,
    "schedule": 4,
    "trace": 5,
    "sim": 6,
    "plan": 7,
    "runtime": 7,
    "cluster": 8,
    "cli": 9,
    "__main__": 10,
    "__init__": 10,
}


def _part(module: str) -> str:
    """'paratrain.sim.engine' -> 'sim'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(PKG.parent).with_suffix("")
    pkg = ".".join(rel.parts[:-1]) if rel.name != "__init__" else ".".join(rel.parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("paratrain")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("paratrain"):
                found.append((node.lineno, mod))
    return found


# Below in the order, yet kept apart: the runtime measures and the simulator predicts; they meet
# only in the trace format (paratrain.trace), so neither can drift into the other's assumptions.
APART = {("runtime", "sim")}


def _violations() -> list[str]:
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"
        if src not in LAYER:
            bad.append(f"{rel}: package {src!r} has no layer in the table")
            continue
        for line, mod in _imports(path):
            dst = _part(mod)
            if dst == src or dst not in LAYER:
                continue
            if LAYER[dst] > LAYER[src]:
                bad.append(f"{rel}:{line}: {src} (layer {LAYER[src]}) imports {mod} (layer {LAYER[dst]})")
            elif LAYER[dst] == LAYER[src] and src not in ("__init__", "__main__"):
                bad.append(f"{rel}:{line}: {src} imports its peer {mod}")
            elif (src, dst) in APART:
                bad.append(f"{rel}:{line}: {src} imports {mod}; they share only paratrain.trace")
    return bad


def test_no_import_goes_up_the_layers() -> None:
    bad = _violations()
    assert not bad, "layer order broken:\n" + "\n".join(bad)


def test_the_walk_sees_lazy_imports(tmp_path: Path) -> None:
    # The checker must notice an import inside a function, or it would pass vacuously.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from paratrain.cli import main\n")
    tree = ast.parse(f.read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names == ["paratrain.cli"]


CORE = ["paratrain.spec", "paratrain.cost", "paratrain.schedule", "paratrain.trace", "paratrain.sim", "paratrain.plan"]


@pytest.mark.parametrize("module", CORE)
def test_analytical_core_imports_no_torch(module: str) -> None:
    bad = []
    part = PKG / module.split(".")[1]
    for path in sorted(part.rglob("*.py")) if part.is_dir() else [part.with_suffix(".py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad += [f"{path.relative_to(PKG)}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not bad, "the analytical core must not import torch:\n" + "\n".join(bad)
