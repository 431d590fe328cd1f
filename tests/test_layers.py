"""The package's layers: each imports only the layers below it, so there
are no import circles and no arrow that climbs (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ringserve"

# Lowest first; a module may import its own layer and any layer before it.
LAYERS = [
    {"config", "params", "logs"},
    {"cache", "ring", "kernels"},
    {"models"},
    {"sched"},
    {"engine"},
    {"plan"},
    {"http"},
    {"launch", "replay"},
    {"llm", "client", "cli", "benchmark", "__main__", "__init__"},
]


def layer_of(part: str) -> int:
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    raise AssertionError(f"ringserve.{part} is in no layer of tests/test_layers.py")


def imports(path: Path) -> set[str]:
    """The top-level ringserve parts `path` imports, lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "ringserve" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_module_imports_a_layer_above_its_own() -> None:
    climbing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        own = layer_of(rel.parts[0].removesuffix(".py"))
        for part in imports(path):
            if layer_of(part) > own:
                climbing.append(f"{rel} imports ringserve.{part}")
    assert climbing == []


def module_imports(path: Path) -> set[str]:
    """The ringserve modules `path` imports at module level (not in a function)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("ringserve.")
        ):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_import_circles() -> None:
    modules = {
        ".".join(("ringserve", *p.relative_to(PACKAGE).with_suffix("").parts)): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {
        m: {i for i in module_imports(p) if i in modules and i != m} for m, p in modules.items()
    }
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circles.append(" -> ".join(path[path.index(n) :] + [n]))
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_layer_check_sees_a_climbing_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ringserve.launch.boot import build_stage\n")
    assert imports(bad) == {"launch"}
    assert layer_of("launch") > layer_of("engine")
