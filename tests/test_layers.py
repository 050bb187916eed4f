"""The import graph: no module imports one that (directly or not) imports it back, and each layer
imports only the layers below it. Imports inside functions and under ``TYPE_CHECKING`` count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
OUTSIDE_PACKAGE = {"tests", "benchmarks", "tools", "docs", "default_models"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in OUTSIDE_PACKAGE or rel.parts[0].startswith("."):
            continue
        parts = ["specloop", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = package_modules()


def imports_of(name: str) -> set[str]:
    """Every specloop module ``name`` imports, wherever the import statement is."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # ``from package import module`` imports the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_the_graph_sees_the_package():
    assert "specloop.kernel.engine_core" in GRAPH and "specloop.kernel.config" in GRAPH["specloop.kernel.engine_core"]
    assert "specloop.frontend.engine_args" in GRAPH["specloop.cli"]


def test_no_import_cycles():
    def reaches(start: str, target: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            for nxt in GRAPH[stack.pop()]:
                if nxt == target:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    cycles = [f"{a} -> {b}" for a, deps in GRAPH.items() for b in deps if reaches(b, a)]
    assert not cycles, "imports that come back around: " + ", ".join(sorted(cycles))


def layer(name: str) -> str:
    parts = name.split(".")
    if name == "specloop.plugins.models.config":
        return "model_config"  # torch-free: what the frontend reads from a model directory
    return parts[1] if len(parts) > 1 else "specloop"


# What each layer may import besides itself.
ALLOWED = {
    "kernel": set(),
    "plugins": {"kernel"},
    "frontend": {"kernel", "model_config"},
    "server": {"kernel", "frontend", "model_config", "specloop"},
}


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if layer(n) in ALLOWED
                                        and not n.startswith("specloop.plugins.models")))
def test_each_layer_imports_only_those_below_it(name):
    outside = {m for m in GRAPH[name] if layer(m) != layer(name) and layer(m) not in ALLOWED[layer(name)]}
    assert not outside, f"{name} imports {sorted(outside)}"
