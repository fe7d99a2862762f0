"""The plugin's drop-in checker (``aostore.vllm.compat``) on plain classes: it imports nothing
of aostore, so a comparison or a differential needs no vLLM tree and no aostore store."""

from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

compat = pytest.importorskip("aostore.vllm.compat")
from aostore.vllm.compat import compare, differential  # noqa: E402
from aostore.vllm.compat.usage import Usage  # noqa: E402

COMPAT = Path(__file__).resolve().parents[2] / "python" / "aostore" / "vllm" / "compat"


def test_the_checker_imports_nothing_of_aostore() -> None:
    files = sorted(COMPAT.glob("*.py"))
    assert {path.name for path in files} >= {"compare.py", "differential.py", "usage.py"}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                assert not any(name.split(".")[0] == "aostore" for name in names), path.name
            elif isinstance(node, ast.ImportFrom):
                # Relative imports stay inside compat/ (level 1); nothing names aostore.
                assert node.level in (0, 1), (path.name, node.module)
                assert (node.module or "").split(".")[0] != "aostore", (path.name, node.module)


def _vllm_class(name: str, namespace: dict[str, Any]) -> type:
    """A class that the checker takes for vLLM's (its module is under ``vllm``)."""
    return type(name, (), {"__module__": "vllm.fake", **namespace})


def _put(self: Any, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
    """A ``put`` with vLLM's keywords."""


def test_compare_on_plain_classes() -> None:
    theirs = _vllm_class("Store", {"put": _put, "close": lambda self: None})

    class Same:
        def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = None) -> None:
            """``None`` for the keys is read as ``()``, as aostore's stores read it."""

        def close(self) -> None:
            """Closes."""

    class NoClose:
        def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
            """Puts."""

    class Positional:
        def put(self, objects: Any, retain_keys: Any = (), release_keys: Any = ()) -> None:
            """Puts, with the keys positional."""

        def close(self) -> None:
            """Closes."""

    used = Usage()
    assert compare.compare(theirs, Same, used) is None
    assert compare.compare(theirs, NoClose, used) == "aostore's Store lacks close"
    assert compare.compare(theirs, Positional, used) == (
        "Store.put: aostore's has an extra positional parameter retain_keys"
    )


class _MissingError(Exception):
    """vLLM's error class, in the differential's terms."""


class _OurError(Exception):
    """The error class the swap would put in its place."""


class _OurMissingError(_OurError):
    """A subclass of it (as ``ObjectMissingError`` is of ``BlockObjectStoreError``)."""


class _LruStore:
    """A plain fail-closed LRU store with reference counts, shaped as vLLM's."""

    error: type[Exception] = _MissingError

    def __init__(self, *, max_bytes: int, object_nbytes: int) -> None:
        self.num_slots = max_bytes // object_nbytes
        self.data: OrderedDict[str, bytes] = OrderedDict()
        self.refs: dict[str, int] = {}
        self.closed = False

    def put(self, objects: Any, retain_keys: Any = (), release_keys: Any = ()) -> None:
        if self.closed:
            raise self.error("closed")
        counts = dict(self.refs)
        for key in retain_keys:
            counts[key] = counts.get(key, 0) + 1
        for key in release_keys:
            if counts.get(key, 0) <= 0:
                raise self.error(f"{key} is not referenced")
            counts[key] -= 1
        data = OrderedDict(self.data)
        for obj in objects:
            if obj.key in data and counts.get(obj.key, 0) > 0:
                continue
            data.pop(obj.key, None)
            data[obj.key] = obj.payload
        while len(data) > self.num_slots:
            victim = next((k for k in data if counts.get(k, 0) <= 0), None)
            if victim is None:
                raise self.error("every object is referenced")
            del data[victim]
        self.data = data
        self.refs = {key: count for key, count in counts.items() if count > 0}

    def get_concatenated(self, keys: Any) -> bytes:
        if self.closed:
            raise self.error("closed")
        for key in keys:
            if key not in self.data:
                raise self.error(f"{key} does not exist")
        for key in keys:
            self.data.move_to_end(key)
        return b"".join(self.data[key] for key in keys)

    def close(self) -> None:
        self.closed = True


class _Object:
    def __init__(self, key: str, payload: bytes) -> None:
        self.key, self.payload = key, payload


def test_differential_on_plain_stores_accepts_a_subclass_of_the_mapped_error() -> None:
    class Ours(_LruStore):
        error = _OurMissingError

    same = differential.differential(_LruStore, _LruStore, make_object=_Object)
    assert same.same and same.calls > 100
    # vLLM code catches vLLM's class, which the swap maps to ours: a subclass of it serves.
    mapped = differential.differential(
        _LruStore, Ours, make_object=_Object, errors={_MissingError: _OurError}
    )
    assert mapped.same, mapped.difference
    unmapped = differential.differential(_LruStore, Ours, make_object=_Object)
    assert unmapped.difference is not None
    assert "raises _MissingError in vLLM's, _OurMissingError in aostore's" in unmapped.difference
