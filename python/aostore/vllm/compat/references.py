"""Where imported ``vllm`` modules hold a class other than as a module global."""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any

from .usage import vllm_modules

_CONTAINERS = (tuple, list, set, frozenset, dict)
_SKIPPED_CLASS_ENTRIES = frozenset(
    {"__annotations__", "__dict__", "__weakref__", "__mro__", "__bases__", "__orig_bases__"}
)


def _holds(value: Any, targets: Mapping[int, str], depth: int = 0) -> set[str]:
    """Which of ``targets`` (by id) ``value`` holds inside it: containers, defaults, cells."""
    if depth > 4:
        return set()
    held: set[str] = set()
    items: Iterable[Any] = ()
    if isinstance(value, _CONTAINERS):
        if len(value) > 10_000:
            return set()
        items = list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
    elif isinstance(value, classmethod | staticmethod):
        items = [value.__func__]
    elif isinstance(value, types.FunctionType):
        # ``__class__`` is the cell of a method that calls super(): its own class, not a holder.
        names = value.__code__.co_freevars
        cells = [
            cell.cell_contents
            for name, cell in zip(names, value.__closure__ or (), strict=False)
            if name != "__class__" and _cell_set(cell)
        ]
        items = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values(), *cells]
    elif isinstance(value, property):
        items = [value.fget, value.fset, value.fdel]
    for item in items:
        name = targets.get(id(item))
        if name is not None:
            held.add(name)
        elif item is not value:
            held |= _holds(item, targets, depth + 1)
    return held


def _cell_set(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def hidden_references(originals: Mapping[str, type]) -> dict[str, list[str]]:
    """Where imported ``vllm`` modules hold each of ``originals`` other than as a module global.

    The swap rebinds module globals only. A class also held in a container (``MISS_ERRORS =
    (BlockObjectStoreError, KeyError)``), as a class attribute, as a default argument or in a
    closure keeps pointing at vLLM's class.
    """
    targets = {id(cls): name for name, cls in originals.items()}
    found: dict[str, list[str]] = {}
    for module_name, module in vllm_modules():
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for global_name, value in list(namespace.items()):
            where = f"{module_name}.{global_name}"
            try:
                held = _holds(value, targets)
                members: list[tuple[str, set[str]]] = []
                if isinstance(value, type) and value.__module__ == module_name:
                    for entry, member in list(vars(value).items()):
                        if entry in _SKIPPED_CLASS_ENTRIES:
                            continue
                        name = targets.get(id(member))
                        hits = {name} if name else _holds(member, targets)
                        # A class's own methods that hold the class itself (a frozen
                        # dataclass's __setattr__) are replaced along with it.
                        hits.discard(targets.get(id(value), ""))
                        members.append((entry, hits))
            except Exception:  # a container subclass that cannot be iterated: not ours to judge
                continue
            for entry, hits in members:
                for hit in hits:
                    found.setdefault(hit, []).append(f"{where}.{entry}")
            for hit in held:
                found.setdefault(hit, []).append(where)
    return found
