"""The package's shape, checked from its import graph: layers a reader can draw, each knowing only the
ones below it, no import cycle between files, a small self-contained kernel, no oversized file.

Every import counts, module-level or inside a function, under ``TYPE_CHECKING`` or not: a lazy import
is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = "specloop"
NOT_PACKAGE = {"tests", "tools", "benchmarks", "docs", ".venv", "build", "dist"}

# Lowest first. A file may import its own folder and the folders before it, never one after it.
LAYERS = ["kernel", "kernels", "plugins", "models", "sampling", "proposers", "backends", "default_models",
          "frontend", "server", ""]  # "": cli.py, __init__.py, __main__.py at the root

MAX_FILE_LINES = 400
MAX_KERNEL_LINES = 1500


def package_files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel.parts):
            continue
        parts = [PACKAGE, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


FILES = package_files()


def imported_modules(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports (resolved to the longest existing module name)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # ``from package import module`` depends on the module (the package's __init__ runs
            # too, but counting it would make every sibling import a cycle through the package).
            names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in FILES else prefix for a in node.names]
        for name in names:
            while name and name not in FILES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {module: imported_modules(module, path) for module, path in FILES.items()}


def folder(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    path = FILES[module]
    return parts[1] if path.parent != ROOT else ""


def test_the_graph_is_read():
    assert "specloop.kernel.engine_core" in FILES and "specloop.backends.runner" in FILES
    assert "specloop.kernel.outputs" in GRAPH["specloop.kernel.engine_core"]
    assert set(LAYERS) >= {folder(m) for m in FILES}, f"a folder without a layer: {set(map(folder, FILES)) - set(LAYERS)}"


@pytest.mark.parametrize("module", sorted(FILES))
def test_imports_go_down_the_layers(module: str) -> None:
    rank = LAYERS.index(folder(module))
    upward = sorted(m for m in GRAPH[module] if LAYERS.index(folder(m)) > rank)
    assert not upward, f"{module} ({folder(module) or 'root'}) imports a layer above it: {upward}"


def test_no_import_cycle_between_files():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_kernel_is_small_and_self_contained():
    kernel = [m for m in FILES if folder(m) == "kernel"]
    outside = sorted({d for m in kernel for d in GRAPH[m] if folder(d) != "kernel" and d != PACKAGE})
    assert not outside, f"kernel/ imports {outside}"
    lines = sum(len(FILES[m].read_text().splitlines()) for m in kernel)
    assert lines <= MAX_KERNEL_LINES, f"kernel/ has {lines} lines"


def test_the_triton_kernels_import_nothing_of_the_engine():
    for module in (m for m in FILES if folder(m) == "kernels"):
        assert all(folder(d) == "kernels" for d in GRAPH[module]), module


@pytest.mark.parametrize("module", sorted(FILES))
def test_no_file_is_oversized(module: str) -> None:
    lines = len(FILES[module].read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{FILES[module].relative_to(ROOT)} has {lines} lines"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_scripts_parse_on_this_python(script: str) -> None:
    # The benchmarks run on the GPU machine's Python, the tests on this one: a script this one
    # cannot parse (a 3.12-only f-string, say) fails here, not halfway through a device session.
    compile((ROOT / "benchmarks" / script).read_text(), script, "exec")
