"""What vLLM's files on disk do with the store package's classes that a swap would break."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from .names import OBJECT
from .usage import Sources, shown

# Functions that need a dataclass instance (aostore's BlockObject is a native class, not one).
_DATACLASS_FUNCTIONS = frozenset({"replace", "fields", "asdict", "astuple"})
_DATACLASS_ATTRIBUTES = frozenset(
    {"__dataclass_fields__", "__dataclass_params__", "__match_args__"}
)


class _Hazards(ast.NodeVisitor):
    """What one file does with the classes that aostore's could not serve after the swap."""

    def __init__(self, names: Iterable[str], where: str, *, except_tuples: bool) -> None:
        self.names = set(names)
        self.where = where
        self.except_tuples = except_tuples
        self.found: dict[str, list[str]] = {}
        self.aliases: dict[str, str] = {}  # local name -> class name
        self.dataclass_names: set[str] = set()  # names bound to dataclasses' functions
        self.dataclass_modules = {"dataclasses", "copy"}  # and to those modules
        self.depth = 0  # inside a function body: evaluated when called, not at import

    def _add(self, name: str, node: ast.AST, what: str) -> None:
        line = getattr(node, "lineno", 0)
        self.found.setdefault(name, []).append(f"{self.where}:{line} {what}")

    def _named(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr in self.names:
            return node.attr
        return None

    def _held(self, node: ast.AST | None) -> set[str]:
        """Classes that the display ``node`` (a tuple, list, set or dict) holds."""
        if node is None:
            return set()
        held: set[str] = set()
        for inner in ast.walk(node):
            if isinstance(inner, ast.Tuple | ast.List | ast.Set | ast.Dict):
                parts = [*inner.keys, *inner.values] if isinstance(inner, ast.Dict) else inner.elts
                held |= {name for part in parts if part and (name := self._named(part))}
        return held

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in ("dataclasses", "copy") and alias.asname:
                self.dataclass_modules.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name in self.names:
                self.aliases[alias.asname or alias.name] = alias.name
            elif node.module in ("dataclasses", "copy") and alias.name in _DATACLASS_FUNCTIONS:
                self.dataclass_names.add(alias.asname or alias.name)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
        for default in defaults:
            held = {self._named(default)} | self._held(default)
            for name in held - {None}:
                self._add(cast(str, name), default, "holds it as a default argument")
        for decorator in getattr(node, "decorator_list", []):
            self.visit(decorator)
        self.depth += 1
        for child in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(child)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self._named(base)
            if name:
                self._add(name, base, f"subclasses it ({node.name})")
        for statement in node.body:
            value = getattr(statement, "value", None)
            if isinstance(statement, ast.Assign | ast.AnnAssign) and value is not None:
                name = self._named(value)
                if name and self.depth == 0:
                    self._add(name, statement, f"holds it as a class attribute of {node.name}")
        self.generic_visit(node)

    def visit_Tuple(self, node: ast.expr) -> None:
        if self.depth == 0:
            for name in self._held(node):
                self._add(name, node, "holds it in a container at import")
        else:
            self.generic_visit(node)

    visit_List = visit_Set = visit_Dict = visit_Tuple

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if self.except_tuples and isinstance(node.type, ast.Tuple):
            for name in self._held(node.type):
                self._add(name, node, "holds it in an except tuple")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = (
            func.attr
            if isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in self.dataclass_modules
            else func.id
            if isinstance(func, ast.Name) and func.id in self.dataclass_names
            else ""
        )
        if called in _DATACLASS_FUNCTIONS or called == "is_dataclass":
            self._add(OBJECT, node, f"calls {called}() (needs a dataclass)")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _DATACLASS_ATTRIBUTES:
            self._add(OBJECT, node, f"reads {node.attr} (a dataclass attribute)")
        self.generic_visit(node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        if self._named(node.cls) == OBJECT and node.patterns:
            self._add(OBJECT, node, "matches it with positional patterns (__match_args__)")
        self.generic_visit(node)


def source_hazards(
    sources: Sources, class_names: Iterable[str], *, package: Path | None, inside: bool
) -> tuple[dict[str, list[str]], list[str]]:
    """What vLLM's files on disk do with ``class_names`` that a swap breaks, by class name:
    subclassing one; holding one where the swap cannot rebind it (a tuple, list, set or dict
    built at import, a default argument, a class attribute; outside the package an ``except``
    tuple too); and, for ``BlockObject``, what needs vLLM's dataclass (``dataclasses.replace``,
    ``fields``, ``asdict``, ``astuple``, ``is_dataclass``, ``copy.replace``, the dataclass
    attributes, positional class patterns) in a file that names it. ``inside``: also the files
    of the package ``package`` (on a release CI proves, CI ran those). Also returns the files
    that could not be parsed."""
    names = set(class_names)
    found: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for path, text in sources.files.items():
        in_package = package is not None and path.is_relative_to(package)
        if in_package and not inside:
            continue
        if not any(name in text for name in names):
            continue
        where = shown(path, sources.root)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            unreadable.append(where)
            continue
        visitor = _Hazards(names, where, except_tuples=not in_package)
        visitor.visit(tree)
        if OBJECT in visitor.found and OBJECT not in visitor.aliases.values():
            # No file names it: its dataclass uses are of other classes.
            if not any(isinstance(n, ast.Attribute) and n.attr == OBJECT for n in ast.walk(tree)):
                del visitor.found[OBJECT]
        for name, where_list in visitor.found.items():
            if name in names:
                found.setdefault(name, []).extend(where_list)
    return found, unreadable
