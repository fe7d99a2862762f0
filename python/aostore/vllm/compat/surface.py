"""The names a class shows: public attributes, instance attributes, constructor keywords."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any


def _public(names: Any) -> set[str]:
    return {name for name in names if isinstance(name, str) and not name.startswith("_")}


# Class -> the names its methods assign on self: a plan reads each class's source once.
_assigned_cache: dict[type, frozenset[str]] = {}


def assigned_on_self(cls: type, *, private: bool = False) -> set[str]:
    """Names that ``cls``'s own methods assign on ``self`` (instance attributes); best effort."""
    names = _assigned_cache.get(cls)
    if names is None:
        names = _read_assigned(cls)
        if cls.__module__.startswith("aostore"):  # vLLM's classes may be rewritten (tests)
            _assigned_cache[cls] = names
    return set(names) if private else _public(names)


def _read_assigned(cls: type) -> frozenset[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        }
    )


def _keywords(cls: type) -> set[str]:
    """The constructor's parameters a caller may pass by keyword."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {f"{p.name}=" for p in parameters if p.kind in kinds}


def surface(cls: type) -> frozenset[str]:
    """The public names of ``cls`` or its instances.

    Public names from ``dir(cls)``, public annotated fields (dataclass fields), public
    attributes that the class's methods assign on ``self``, and constructor keywords written
    ``"name="``. On a recognized release every name of vLLM's class must be aostore's too; on
    any other vLLM the stricter class-by-class check applies (:func:`plan`).
    """
    names = _public(dir(cls))
    for klass in cls.__mro__:
        names |= _public(vars(klass).get("__annotations__", {}))
        if klass.__module__ not in ("builtins", "abc", "typing"):
            names |= assigned_on_self(klass)
    if dataclasses.is_dataclass(cls):
        names |= _public(field.name for field in dataclasses.fields(cls))
    return frozenset(names | _keywords(cls))
