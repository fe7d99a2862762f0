"""Bad input to the variable-size store raises the documented exception and changes nothing.

As ``test_bad_input.py`` does for the fixed store, every case runs against aostore and the
reference model, on a store that already holds referenced and evictable keys, and compares
``snapshot()`` and ``stats()`` before and after the failing call.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import model_variable as mv
import numpy as np
import pytest


@dataclass(frozen=True)
class Impl:
    name: str
    Store: Any
    Error: type[BaseException]
    BlockObject: Any


def load(name: str) -> Impl:
    if name == "model":
        return Impl("model", mv.VariableModelStore, mv.BlockObjectStoreError, mv.BlockObject)
    import aostore

    return Impl(
        "aostore",
        aostore.VariableBlockObjectStore,
        aostore.BlockObjectStoreError,
        aostore.BlockObject,
    )


@pytest.fixture(params=["aostore", "model"])
def impl(request: pytest.FixtureRequest) -> Impl:
    return load(request.param)


@pytest.fixture
def store(impl: Impl) -> Iterator[Any]:
    """100 bytes: r1 (count 2) and r2 referenced, e1, e2 evictable (in that order)."""
    store = impl.Store(max_bytes=100)
    store.put(
        [
            impl.BlockObject("r1", b"r" * 10),
            impl.BlockObject("e1", b"e" * 20),
            impl.BlockObject("r2", b""),
            impl.BlockObject("e2", b"f" * 30),
        ],
        retain_keys=["r1", "r1", "r2"],
    )
    assert store.snapshot()["lru"] == ["e1", "e2"]
    yield store
    store.close()


@contextlib.contextmanager
def changes_nothing(store: Any) -> Iterator[None]:
    snapshot, stats = store.snapshot(), store.stats()
    yield
    assert store.snapshot() == snapshot
    assert store.stats() == stats
    store.check()


def good(impl: Impl, key: str = "new", size: int = 7) -> Any:
    return impl.BlockObject(key, b"g" * size)


def loose(key: Any, data: Any) -> Any:
    return types.SimpleNamespace(key=key, payload=data)


# --------------------------------------------------------------------------- keys and payloads


@pytest.mark.parametrize("key", [7, b"new", None, 1.5, ("k",)], ids=repr)
def test_non_str_key_raises_type_error(impl, store, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n1"), loose(key, b"x")], retain_keys=["e1"])


@pytest.mark.parametrize("argument", ["retain_keys", "release_keys"])
@pytest.mark.parametrize("key", [1, b"r1", None])
def test_non_str_retain_or_release_key_raises_type_error(store, argument, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([], **{argument: ["r1", key]})


@pytest.mark.parametrize(
    "data",
    [12, "text", [1, 2], None, {"a": 1}, 1.0, object()],
    ids=["int", "str", "list", "None", "dict", "float", "object"],
)
def test_non_buffer_payload_raises_type_error(impl, store, data):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n1"), loose("n2", data)], retain_keys=["e2"])


@pytest.mark.parametrize(
    "data",
    [
        np.zeros(16, dtype=np.uint8)[::2],
        np.zeros((4, 4), dtype=np.uint8, order="F"),
        memoryview(bytes(16))[::2],
        np.array([1, "a"], dtype=object),
    ],
    ids=["strided", "fortran", "memoryview-strided", "object-array"],
)
def test_non_contiguous_or_object_payload_raises_type_error(impl, store, data):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([loose("n1", data)], retain_keys=["e1"])


@pytest.mark.parametrize(
    "item", [("n1", b"x"), {"key": "n1", "payload": b"x"}, "n1", None], ids=repr
)
def test_object_without_key_and_payload_raises_type_error(impl, store, item):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n0"), item], retain_keys=["e1"])


def test_any_payload_size_is_accepted_and_counted_in_bytes(impl, store):
    elements = np.arange(4, dtype=np.int32)  # 4 elements, 16 bytes
    store.put([loose("wide", elements), impl.BlockObject("empty", b"")])
    assert store.get_concatenated(["wide", "empty"]) == elements.tobytes()
    store.check()


# --------------------------------------------------------------------------- releases


def test_release_of_unreferenced_stored_key_raises_key_error(store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([], release_keys=["e1"])
    assert info.value.args == ("e1",)


def test_valid_releases_before_the_bad_one_are_not_applied(impl, store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([good(impl, "n1")], retain_keys=["e2"], release_keys=["r2", "r1", "r1", "e1"])
    assert info.value.args == ("e1",)


def test_releasing_more_than_retained_in_the_call_raises_key_error(store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([], retain_keys=["t", "t"], release_keys=["t", "t", "t"])
    assert info.value.args == ("t",)


def test_retain_and_release_in_one_call_is_legal_from_zero(impl, store):
    store.put([good(impl, "n1")], retain_keys=["n1"], release_keys=["n1"])
    assert store.snapshot()["lru"] == ["e1", "e2", "n1"]
    assert "n1" not in store.snapshot()["references"]


# --------------------------------------------------------------------------- capacity


def test_object_larger_than_the_store_cannot_be_retained_and_changes_nothing(impl, store):
    snapshot = store.snapshot()
    errors = store.stats()["capacity_errors"]
    with pytest.raises(impl.Error, match="cannot retain") as info:
        store.put([impl.BlockObject("huge", b"h" * 101)], retain_keys=["e1", "huge"])
    assert "limit=100 bytes" in str(info.value)
    assert store.snapshot() == snapshot
    assert store.stats()["capacity_errors"] == errors + 1
    store.check()


def test_refused_put_restores_counts_order_and_replaced_bytes(impl, store):
    snapshot = store.snapshot()
    with pytest.raises(impl.Error, match="cannot retain"):
        # r1 grows to 95 bytes: 30 must go, and only r2 (released here, 0 bytes) may.
        store.put(
            [impl.BlockObject("e1", b"E" * 5), impl.BlockObject("r1", b"R" * 95)],
            retain_keys=["e2", "new"],
            release_keys=["r2"],
        )
    assert store.snapshot() == snapshot
    store.check()


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("method", ["get_concatenated", "get_many", "contains"])
@pytest.mark.parametrize("keys", [[1], ["e1", None], [b"e1"]], ids=repr)
def test_read_with_non_str_key_raises_type_error_and_changes_nothing(store, method, keys):
    with changes_nothing(store), pytest.raises(TypeError):
        getattr(store, method)(keys)


def test_read_of_missing_key_changes_nothing_but_the_miss_count(impl, store):
    before, stats = store.snapshot(), store.stats()
    with pytest.raises(impl.Error, match="does not exist") as info:
        store.get_concatenated(["e1", "r1", "absent"])
    assert "absent" in str(info.value)
    assert store.snapshot() == before
    after = store.stats()
    assert after["read_misses"] == stats["read_misses"] + 1
    assert after["bytes_read"] == stats["bytes_read"]


# --------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": 0}, "max_bytes must be positive"),
        ({"max_bytes": -64}, "max_bytes must be positive"),
        ({"max_bytes": 64, "chunk_nbytes": 0}, "chunk size must be positive"),
        ({"max_bytes": 64, "chunk_nbytes": -4}, "chunk size must be positive"),
        ({"max_bytes": 64, "chunk_nbytes": 65}, "at least one chunk"),
    ],
)
def test_bad_sizes_raise_value_error(impl, kwargs, message):
    with pytest.raises(ValueError, match=message):
        impl.Store(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bytes": "64"},
        {"max_bytes": 64.0},
        {"max_bytes": True},
        {"max_bytes": 64, "chunk_nbytes": 4.0},
        {},
        {"max_bytes": 64, "object_nbytes": 16},
    ],
    ids=["str", "float", "bool", "float-chunk", "no-max-bytes", "object-nbytes"],
)
def test_bad_constructor_arguments_raise_type_error(impl, kwargs):
    with pytest.raises(TypeError):
        impl.Store(**kwargs)


def test_sizes_too_large_for_the_machine_raise_cleanly():
    import aostore

    with pytest.raises((OverflowError, MemoryError)):
        aostore.VariableBlockObjectStore(max_bytes=1 << 80)
    with pytest.raises((OverflowError, MemoryError)):
        aostore.VariableBlockObjectStore(max_bytes=(1 << 62), chunk_nbytes=1)


# --------------------------------------------------------------------------- closed store


@pytest.mark.parametrize(
    "call",
    [
        lambda s, i: s.put([good(i)]),
        lambda s, i: s.put([loose(7, b"x")]),
        lambda s, i: s.put([], release_keys=["nowhere"]),
        lambda s, i: s.get_concatenated(["e1"]),
        lambda s, i: s.get_many([]),
        lambda s, i: s.contains(["e1"]),
    ],
    ids=["put", "put-bad-key", "put-bad-release", "get", "get-many", "contains"],
)
def test_closed_store_raises_runtime_error_before_validating(impl, store, call):
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed") as info:
        call(store, impl)
    assert not isinstance(info.value, (KeyError, TypeError, ValueError, impl.Error))
