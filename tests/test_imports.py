"""No two modules of the package import each other, directly or in a loop (docs/layout.md): every
import counts, at module level or inside a function, except those under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "aostore"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports: a module by its name; a name a module (or a
    package's ``__init__``) defines, by that module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                module = f"{base}.{alias.name}"
                if module in known:
                    found.add(module)
                elif base in known:
                    found.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def test_no_module_imports_one_that_imports_it() -> None:
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    loops = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                loops.append([*path[path.index(other) :], other])
            elif other not in state:
                walk(other)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)
    assert len(graph) > 50
    assert not loops, "\n".join(" -> ".join(loop) for loop in loops)
