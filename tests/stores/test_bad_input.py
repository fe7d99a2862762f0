"""Bad input raises the documented exception and changes nothing (docs/semantics.md, rule 2, and
section 13 for the variable-size store).

Every case runs against both stores, each as aostore and as its reference model
(``model.ModelStore``, ``model_variable.VariableModelStore``), on a store that already holds
referenced and evictable keys, and compares ``snapshot()`` and ``stats()`` before and after the
failing call. The cases that only one store has (the fixed store's payload size, the variable
store's capacity in bytes, each constructor's arguments) are grouped at the end.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import model
import model_variable as mv
import numpy as np
import pytest
from conftest import payload

NBYTES = 16  # the fixed store's object size
VARIABLE_NBYTES = 7  # the size of the variable store's valid new objects below


@dataclass(frozen=True)
class Impl:
    """One store (``kind``: fixed or variable), as aostore or as its model (``name``)."""

    kind: str
    name: str
    Store: Any
    Error: type[BaseException]
    BlockObject: Any

    def data(self, fill: int) -> bytes:
        """A valid payload for this store."""
        return payload(fill, NBYTES if self.kind == "fixed" else VARIABLE_NBYTES)


def load(kind: str, name: str) -> Impl:
    if name == "model":
        if kind == "fixed":
            return Impl(
                kind, name, model.ModelStore, model.BlockObjectStoreError, model.BlockObject
            )
        return Impl(kind, name, mv.VariableModelStore, mv.BlockObjectStoreError, mv.BlockObject)
    import aostore  # imported lazily: the model cases run without the native package

    store = aostore.BlockObjectStore if kind == "fixed" else aostore.VariableBlockObjectStore
    return Impl(kind, name, store, aostore.BlockObjectStoreError, aostore.BlockObject)


IMPLS = [(kind, name) for kind in ("fixed", "variable") for name in ("aostore", "model")]
FIXED = [pair for pair in IMPLS if pair[0] == "fixed"]
VARIABLE = [pair for pair in IMPLS if pair[0] == "variable"]


def ids(pair: tuple[str, str]) -> str:
    return "-".join(pair)


@pytest.fixture(params=IMPLS, ids=ids)
def impl(request: pytest.FixtureRequest) -> Impl:
    return load(*request.param)


def each(pairs: list[tuple[str, str]], cases: list[Any]) -> list[Any]:
    """Parameters for a test taking ``impl`` (indirect) and the case's own arguments."""
    return [
        pytest.param(pair, *(case if isinstance(case, tuple) else (case,)), id=f"{ids(pair)}-{i}")
        for pair in pairs
        for i, case in enumerate(cases)
    ]


@pytest.fixture
def store(impl: Impl) -> Iterator[Any]:
    """r1 (count 2) and r2 referenced, e1, e2 evictable (in that order). The fixed store has five
    slots of 16 bytes; the variable one 100 bytes holding 10, 20, 0 and 30."""
    if impl.kind == "fixed":
        store = impl.Store(max_bytes=5 * NBYTES, object_nbytes=NBYTES)
        sizes = [NBYTES] * 4
    else:
        store = impl.Store(max_bytes=100)
        sizes = [10, 20, 0, 30]
    store.put(
        [
            impl.BlockObject(key, payload(i, size))
            for i, (key, size) in enumerate(zip(["r1", "e1", "r2", "e2"], sizes, strict=True))
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


def good(impl: Impl, key: str = "new") -> Any:
    return impl.BlockObject(key, impl.data(7))


def loose(key: Any, data: Any) -> Any:
    """An object with .key and .payload that does not validate anything itself."""
    return types.SimpleNamespace(key=key, payload=data)


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("key", [7, b"new", None, 1.5, ("k",)], ids=repr)
def test_non_str_key_raises_type_error(impl, store, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([good(impl, "n1"), loose(key, impl.data(1))], retain_keys=["e1"])


@pytest.mark.parametrize("key", [7, b"new", None])
def test_block_object_with_non_str_key_is_rejected_at_construction_or_put(impl, store, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([impl.BlockObject(key, impl.data(1))])


def test_str_subclass_key_is_accepted(impl, store):
    class Tagged(str):
        pass

    store.put([impl.BlockObject(Tagged("sub"), impl.data(9))])
    assert store.get_concatenated(["sub"]) == impl.data(9)


@pytest.mark.parametrize("argument", ["retain_keys", "release_keys"])
@pytest.mark.parametrize("key", [1, b"r1", None])
def test_non_str_retain_or_release_key_raises_type_error(store, argument, key):
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([], **{argument: ["r1", key]})


def test_lone_surrogate_key_is_stored_or_refused_cleanly(impl, store):
    key = "half-\ud800"
    try:
        store.put([impl.BlockObject(key, impl.data(3))])
    except (TypeError, ValueError):
        # A store over UTF-8 strings may refuse it; then nothing may change.
        assert "half-\ud800" not in store.snapshot()["objects"]
        assert store.snapshot()["lru"] == ["e1", "e2"]
    else:
        assert store.get_concatenated([key]) == impl.data(3)


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
    """Buffers of the fixed store's size in a layout that is not C-contiguous."""
    return [
        np.zeros(2 * NBYTES, dtype=np.uint8)[::2],
        np.zeros((4, 4), dtype=np.uint8, order="F"),
        np.zeros((4, 4), dtype=np.uint8).T,
        np.zeros((NBYTES, 2), dtype=np.uint8)[:, 0],
        memoryview(bytes(2 * NBYTES))[::2],
        np.zeros(NBYTES, dtype=np.uint8)[::2],  # half the size: the variable store's own case
    ]


@pytest.mark.parametrize(
    "index",
    range(6),
    ids=["strided", "fortran", "transposed", "column", "memoryview-strided", "short-strided"],
)
def test_non_c_contiguous_payload_raises_type_error(impl, store, index):
    data = non_contiguous_payloads()[index]
    assert not memoryview(data).c_contiguous
    if index < 5:
        assert memoryview(data).nbytes == NBYTES  # right size, wrong layout
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([loose("n1", data)], retain_keys=["e1"])


# model.ModelStore takes any C-contiguous buffer: the object-dtype check is aostore's and the
# variable model's.
@pytest.mark.parametrize(
    "impl", [p for p in IMPLS if p != ("fixed", "model")], ids=ids, indirect=True
)
def test_object_array_payload_raises_type_error(impl, store):
    data = np.array([1, "a"], dtype=object)
    assert memoryview(data).nbytes == NBYTES  # right size and layout, but Python objects
    with changes_nothing(store), pytest.raises(TypeError):
        store.put([loose("n1", data)], retain_keys=["e1"])


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


def test_retain_and_release_in_one_call_is_legal_from_zero(impl, store):
    store.put([good(impl, "n1")], retain_keys=["n1"], release_keys=["n1"])
    assert store.snapshot()["lru"] == ["e1", "e2", "n1"]
    assert "n1" not in store.snapshot()["references"]


# --------------------------------------------------------------------------- reads

# The fixed store's model has get_concatenated only; aostore's two stores have all three.
READS = ["get_concatenated", "get_many", "contains"]
READ_CASES = [
    pytest.param(pair, method, keys, id=f"{ids(pair)}-{method}-{keys!r}")
    for pair in IMPLS
    for method in READS
    if method == "get_concatenated" or pair != ("fixed", "model")
    for keys in ([1], ["e1", None], [b"e1"])
]


@pytest.mark.parametrize(("impl", "method", "keys"), READ_CASES, indirect=["impl"])
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


# --------------------------------------------------------------------------- closed store

CLOSED_CALLS = {
    "put": lambda s, i: s.put([good(i)]),
    "put-bad-key": lambda s, i: s.put([loose(7, b"x")]),
    "put-bad-release": lambda s, i: s.put([], release_keys=["nowhere"]),
    "retain": lambda s, i: s.put([], retain_keys=["e1"]),
    "get": lambda s, i: s.get_concatenated(["e1"]),
    "get-empty": lambda s, i: s.get_concatenated([]),
    "get-many": lambda s, i: s.get_many([]),
    "contains": lambda s, i: s.contains(["e1"]),
}
CLOSED_CASES = [
    pytest.param(pair, call, id=f"{ids(pair)}-{name}")
    for pair in IMPLS
    for name, call in CLOSED_CALLS.items()
    if name not in ("get-many", "contains") or pair != ("fixed", "model")
]


@pytest.mark.parametrize(("impl", "call"), CLOSED_CASES, indirect=["impl"])
def test_closed_store_raises_runtime_error_before_validating(impl, store, call):
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed") as info:
        call(store, impl)
    assert not isinstance(info.value, (KeyError, TypeError, ValueError, impl.Error))


# --------------------------------------------------------------------------- constructors
# Each store has its own arguments.


@pytest.mark.parametrize(
    ("impl", "kwargs", "message"),
    each(
        FIXED,
        [
            ({"max_bytes": 64, "object_nbytes": 0}, "object size must be positive"),
            ({"max_bytes": 64, "object_nbytes": -16}, "object size must be positive"),
            ({"max_bytes": 0, "object_nbytes": -1}, "object size must be positive"),
            ({"max_bytes": 15, "object_nbytes": 16}, "must fit at least one object"),
            ({"max_bytes": 0, "object_nbytes": 16}, "must fit at least one object"),
            ({"max_bytes": -64, "object_nbytes": 16}, "must fit at least one object"),
        ],
    )
    + each(
        VARIABLE,
        [
            ({"max_bytes": 0}, "max_bytes must be positive"),
            ({"max_bytes": -64}, "max_bytes must be positive"),
            ({"max_bytes": 64, "chunk_nbytes": 0}, "chunk size must be positive"),
            ({"max_bytes": 64, "chunk_nbytes": -4}, "chunk size must be positive"),
            ({"max_bytes": 64, "chunk_nbytes": 65}, "at least one chunk"),
        ],
    ),
    indirect=["impl"],
)
def test_bad_sizes_raise_value_error(impl, kwargs, message):
    with pytest.raises(ValueError, match=message):
        impl.Store(**kwargs)


@pytest.mark.parametrize(
    ("impl", "kwargs"),
    each(
        FIXED,
        [
            {"max_bytes": "64", "object_nbytes": 16},
            {"max_bytes": 64, "object_nbytes": None},
            {"max_bytes": 64.0, "object_nbytes": 16},
            {"max_bytes": 64},
            {"object_nbytes": 16},
            {"max_bytes": 64, "object_nbytes": 16, "no_such_option": 1},
        ],
    )
    + each(
        VARIABLE,
        [
            {"max_bytes": "64"},
            {"max_bytes": 64.0},
            {"max_bytes": True},
            {"max_bytes": 64, "chunk_nbytes": 4.0},
            {},
            {"max_bytes": 64, "object_nbytes": 16},
        ],
    ),
    indirect=["impl"],
)
def test_bad_constructor_arguments_raise_type_error(impl, kwargs):
    with pytest.raises(TypeError):
        impl.Store(**kwargs)


# =========================================================================== the fixed store only


@pytest.mark.parametrize("impl", FIXED, ids=ids, indirect=True)
@pytest.mark.parametrize("size", [0, 1, NBYTES - 1, NBYTES + 1, 3 * NBYTES])
def test_wrong_payload_length_raises_value_error_naming_key_and_sizes(impl, store, size):
    with changes_nothing(store), pytest.raises(ValueError) as info:
        store.put([good(impl, "n1"), loose("odd-block", b"z" * size)], retain_keys=["e1"])
    message = str(info.value)
    assert "odd-block" in message
    assert re.search(rf"\b{size}\b", message), message
    assert re.search(rf"\b{NBYTES}\b", message), message


@pytest.mark.parametrize("impl", FIXED, ids=ids, indirect=True)
def test_payload_length_is_counted_in_bytes_not_elements(impl, store):
    elements = np.zeros(NBYTES, dtype=np.int32)  # 16 elements, 64 bytes
    with changes_nothing(store), pytest.raises(ValueError, match="64"):
        store.put([loose("wide", elements)])


@pytest.mark.parametrize("impl", FIXED, ids=ids, indirect=True)
def test_wrong_length_of_an_overwritten_duplicate_is_still_rejected(impl, store):
    with changes_nothing(store), pytest.raises(ValueError, match="dup"):
        store.put([loose("dup", b"short"), loose("dup", payload(1, NBYTES))])


@pytest.mark.parametrize("impl", FIXED, ids=ids, indirect=True)
def test_unknown_profile_raises_value_error(impl):
    with pytest.raises(ValueError):
        impl.Store(max_bytes=64, object_nbytes=16, profile="no-such-profile")


# ======================================================================== the variable store only


@pytest.mark.parametrize("impl", VARIABLE, ids=ids, indirect=True)
def test_any_payload_size_is_accepted_and_counted_in_bytes(impl, store):
    elements = np.arange(4, dtype=np.int32)  # 4 elements, 16 bytes
    store.put([loose("wide", elements), impl.BlockObject("empty", b"")])
    assert store.get_concatenated(["wide", "empty"]) == elements.tobytes()
    store.check()


@pytest.mark.parametrize("impl", VARIABLE, ids=ids, indirect=True)
def test_object_larger_than_the_store_cannot_be_retained_and_changes_nothing(impl, store):
    snapshot = store.snapshot()
    errors = store.stats()["capacity_errors"]
    with pytest.raises(impl.Error, match="cannot retain") as info:
        store.put([impl.BlockObject("huge", b"h" * 101)], retain_keys=["e1", "huge"])
    assert "limit=100 bytes" in str(info.value)
    assert store.snapshot() == snapshot
    assert store.stats()["capacity_errors"] == errors + 1
    store.check()


@pytest.mark.parametrize("impl", VARIABLE, ids=ids, indirect=True)
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


def test_sizes_too_large_for_the_machine_raise_cleanly():
    import aostore

    with pytest.raises((OverflowError, MemoryError)):
        aostore.VariableBlockObjectStore(max_bytes=1 << 80)
    with pytest.raises((OverflowError, MemoryError)):
        aostore.VariableBlockObjectStore(max_bytes=(1 << 62), chunk_nbytes=1)
