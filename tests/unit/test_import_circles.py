"""No import circle between the modules of one package, counting imports inside functions too
(a function-level import hides a circle from the interpreter, not from a reader): each package
reads top-down. A package's ``__init__`` re-exporting its modules is not counted."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("models", "harness", "recovery", "fieldrecovery", "console", "tasks", "cli")


def _imports() -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in its body)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                edges[module].update(n for n in names if n.split(".")[0] == package and "." in n and n != module)
    return edges


def _cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    modules = set(edges)
    graph = {m: {t for t in edges[m] if t in modules} for m in modules}
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt == start:
                found.add(tuple(sorted(path)))
            elif nxt not in path and len(path) < 8:
                walk(start, nxt, [*path, nxt])

    for module in sorted(modules):
        walk(module, module, [module])
    return found


def test_the_checker_finds_a_circle_hidden_in_a_function() -> None:
    edges = {"harness.a": {"harness.b"}, "harness.b": {"harness.a"}, "harness.c": set()}
    assert _cycles(edges) == {("harness.a", "harness.b")}


def test_no_package_has_an_import_circle_between_its_modules() -> None:
    cycles = _cycles(_imports())
    assert cycles == set(), f"import circles: {sorted(cycles)}"
