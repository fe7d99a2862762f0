"""Bad input raises the documented exception and changes nothing (SPEC section 2, rule 2).

Each case runs against a store that already holds referenced and evictable keys,
and compares ``snapshot()`` and ``stats()`` before and after the failing call.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import Impl, payload

NBYTES = 16


@pytest.fixture
def store(impl: Impl, make_store: Any) -> Any:
    """Five slots: r1 (count 2) and r2 referenced, e1, e2 evictable (in that order)."""
    store = make_store(5, nbytes=NBYTES)
    store.put(
        [
            impl.BlockObject(key, payload(i, NBYTES))
            for i, key in enumerate(["r1", "e1", "r2", "e2"])
        ],
        retain_keys=["r1", "r1", "r2"],
    )
    assert store.snapshot()["lru"] == ["e1", "e2"]
    return store


@contextlib.contextmanager
def changes_nothing(store: Any) -> Iterator[None]:
    snapshot, stats = store.snapshot(), store.stats()
    yield
    assert store.snapshot() == snapshot
    assert store.stats() == stats
    store.check()


def good(impl: Impl, key: str = "new") -> Any:
    return impl.BlockObject(key, payload(7, NBYTES))


def loose(key: Any, data: Any) -> Any:
    """An object with .key and .payload that does not validate anything itself."""
    return types.SimpleNamespace(key=key, payload=data)


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", [7, b"new", None, 1.5, ("k",)], ids=repr)
def test_non_str_key_raises_type_error(impl, store, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n1"), loose(key, payload(1, NBYTES))], retain_keys=["e1"])


@pytest.mark.parametrize("key", [7, b"new", None])
def test_block_object_with_non_str_key_is_rejected_at_construction_or_put(impl, store, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([impl.BlockObject(key, payload(1, NBYTES))])


def test_str_subclass_key_is_accepted(impl, store):
    class Tagged(str):
        pass

    store.put([impl.BlockObject(Tagged("sub"), payload(9, NBYTES))])
    assert store.get_concatenated(["sub"]) == payload(9, NBYTES)


@pytest.mark.parametrize("argument", ["retain_keys", "release_keys"])
@pytest.mark.parametrize("key", [1, b"r1", None])
def test_non_str_retain_or_release_key_raises_type_error(store, argument, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([], **{argument: ["r1", key]})


def test_lone_surrogate_key_is_stored_or_refused_cleanly(impl, store):
    key = "half-\ud800"
    try:
        store.put([impl.BlockObject(key, payload(3, NBYTES))])
    except (TypeError, ValueError):
        # A store over UTF-8 strings may refuse it; then nothing may change.
        assert "half-\ud800" not in store.snapshot()["objects"]
        assert store.snapshot()["lru"] == ["e1", "e2"]
    else:
        assert store.get_concatenated([key]) == payload(3, NBYTES)


# --------------------------------------------------------------------------- payloads


@pytest.mark.parametrize(
    "data",
    [12, "x" * NBYTES, list(range(NBYTES)), None, {"a": 1}, 1.0, object()],
    ids=["int", "str", "list", "None", "dict", "float", "object"],
)
def test_non_buffer_payload_raises_type_error(impl, store, data):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n1"), loose("n2", data)], retain_keys=["e2"])


def non_contiguous_payloads() -> list[Any]:
    return [
        np.zeros(2 * NBYTES, dtype=np.uint8)[::2],
        np.zeros((4, 4), dtype=np.uint8, order="F"),
        np.zeros((4, 4), dtype=np.uint8).T,
        np.zeros((NBYTES, 2), dtype=np.uint8)[:, 0],
        memoryview(bytes(2 * NBYTES))[::2],
    ]


@pytest.mark.parametrize(
    "index", range(5), ids=["strided", "fortran", "transposed", "column", "memoryview-strided"]
)
def test_non_c_contiguous_payload_raises_type_error(impl, store, index):
    data = non_contiguous_payloads()[index]
    assert memoryview(data).nbytes == NBYTES  # right size, wrong layout
    assert not memoryview(data).c_contiguous
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([loose("n1", data)], retain_keys=["e1"])


@pytest.mark.parametrize("size", [0, 1, NBYTES - 1, NBYTES + 1, 3 * NBYTES])
def test_wrong_payload_length_raises_value_error_naming_key_and_sizes(impl, store, size):
    with changes_nothing(store), pytest.raises(ValueError) as info:
        store.put([good(impl, "n1"), loose("odd-block", b"z" * size)], retain_keys=["e1"])
    message = str(info.value)
    assert "odd-block" in message
    assert re.search(rf"\b{size}\b", message), message
    assert re.search(rf"\b{NBYTES}\b", message), message


def test_payload_length_is_counted_in_bytes_not_elements(impl, store):
    elements = np.zeros(NBYTES, dtype=np.int32)  # 16 elements, 64 bytes
    with changes_nothing(store), pytest.raises(ValueError, match="64"):
        store.put([loose("wide", elements)])


def test_wrong_length_of_an_overwritten_duplicate_is_still_rejected(impl, store):
    with changes_nothing(store), pytest.raises(ValueError, match="dup"):
        store.put([loose("dup", b"short"), loose("dup", payload(1, NBYTES))])


# --------------------------------------------------------------------------- objects


@pytest.mark.parametrize(
    "item",
    [("n1", payload(1, NBYTES)), {"key": "n1", "payload": payload(1, NBYTES)}, "n1", None, b"n1"],
    ids=["tuple", "dict", "str", "None", "bytes"],
)
def test_object_without_key_and_payload_raises_type_error(impl, store, item):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n0"), item], retain_keys=["e1"])


@pytest.mark.parametrize("objects", [5, None, 2.5], ids=repr)
def test_objects_that_are_not_iterable_raise_type_error(store, objects):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put(objects)


# --------------------------------------------------------------------------- releases


def test_release_of_unreferenced_stored_key_raises_key_error(store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([], release_keys=["e1"])
    assert info.value.args == ("e1",)


def test_release_of_unknown_key_raises_key_error(impl, store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([good(impl, "n1")], retain_keys=["n1"], release_keys=["nowhere"])
    assert info.value.args == ("nowhere",)


def test_releasing_more_than_referenced_raises_key_error(store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([], release_keys=["r2", "r1", "r2"])
    assert info.value.args == ("r2",)


def test_releasing_more_than_retained_in_the_call_raises_key_error(store):
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([], retain_keys=["t", "t"], release_keys=["t", "t", "t"])
    assert info.value.args == ("t",)


def test_valid_releases_before_the_bad_one_are_not_applied(impl, store):
    # r1 and r2 would reach zero and move to the LRU if the call were applied.
    with changes_nothing(store), pytest.raises(KeyError) as info:
        store.put([good(impl, "n1")], retain_keys=["e2"], release_keys=["r2", "r1", "r1", "e1"])
    assert info.value.args == ("e1",)


def test_key_error_even_when_batch_also_stores_the_key(impl, store):
    with changes_nothing(store), pytest.raises(KeyError):
        store.put([good(impl, "n1")], release_keys=["n1"])


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("keys", [[1], ["e1", None], [b"e1"]], ids=repr)
def test_read_with_non_str_key_raises_and_changes_nothing(impl, store, keys):
    before = store.snapshot()
    with pytest.raises((TypeError, impl.Error)):
        store.get_concatenated(keys)
    assert store.snapshot() == before


def test_read_of_missing_key_changes_nothing_but_the_miss_count(impl, store):
    before, stats = store.snapshot(), store.stats()
    with pytest.raises(impl.Error, match="does not exist"):
        store.get_concatenated(["e1", "r1", "absent"])
    assert store.snapshot() == before
    after = store.stats()
    assert after["read_misses"] == stats["read_misses"] + 1
    assert after["bytes_read"] == stats["bytes_read"]


# --------------------------------------------------------------------------- constructor


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": 64, "object_nbytes": 0}, "object size must be positive"),
        ({"max_bytes": 64, "object_nbytes": -16}, "object size must be positive"),
        ({"max_bytes": 0, "object_nbytes": -1}, "object size must be positive"),
        ({"max_bytes": 15, "object_nbytes": 16}, "must fit at least one object"),
        ({"max_bytes": 0, "object_nbytes": 16}, "must fit at least one object"),
        ({"max_bytes": -64, "object_nbytes": 16}, "must fit at least one object"),
    ],
)
def test_bad_sizes_raise_value_error(impl, kwargs, message):
    with pytest.raises(ValueError, match=message):
        impl.Store(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bytes": "64", "object_nbytes": 16},
        {"max_bytes": 64, "object_nbytes": None},
        {"max_bytes": 64.0, "object_nbytes": 16},
        {"max_bytes": 64},
        {"object_nbytes": 16},
        {"max_bytes": 64, "object_nbytes": 16, "no_such_option": 1},
    ],
    ids=["str-size", "None-size", "float-size", "no-object-size", "no-max-bytes", "unknown-kwarg"],
)
def test_bad_constructor_arguments_raise_type_error(impl, kwargs):
    with pytest.raises(TypeError):
        impl.Store(**kwargs)


def test_unknown_profile_raises_value_error(impl):
    with pytest.raises(ValueError):
        impl.Store(max_bytes=64, object_nbytes=16, profile="no-such-profile")


# --------------------------------------------------------------------------- closed store


@pytest.mark.parametrize(
    "call",
    [
        lambda s, i: s.put([good(i)]),
        lambda s, i: s.put([loose(7, b"x")]),
        lambda s, i: s.put([], release_keys=["nowhere"]),
        lambda s, i: s.put([], retain_keys=["e1"]),
        lambda s, i: s.get_concatenated(["e1"]),
        lambda s, i: s.get_concatenated([]),
    ],
    ids=["put", "put-bad-key", "put-bad-release", "retain", "get", "get-empty"],
)
def test_closed_store_raises_runtime_error_before_validating(impl, store, call):
    store.close()
    with pytest.raises(RuntimeError, match="closed") as info:
        call(store, impl)
    assert not isinstance(info.value, (KeyError, TypeError, ValueError))
