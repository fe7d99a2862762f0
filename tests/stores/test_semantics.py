"""One test per rule of docs/semantics.md (profile fail-closed), on aostore and on the model.

Behaviour is observed only through ``snapshot()``, ``get_concatenated``, ``stats()``
and the exceptions raised; no test looks at internals.
"""

from __future__ import annotations

import array
import re
import types
from typing import Any
from unittest import mock

import numpy as np
import pytest
from conftest import Impl, payload


def objs(impl: Impl, *pairs: tuple[str, int], nbytes: int = 4) -> list[Any]:
    """BlockObjects from ``(key, fill byte)`` pairs."""
    return [impl.BlockObject(key, payload(fill, nbytes)) for key, fill in pairs]


def lru(store: Any) -> list[str]:
    return store.snapshot()["lru"]


def refs(store: Any) -> dict[str, int]:
    return store.snapshot()["references"]


def stored(store: Any) -> dict[str, bytes]:
    return store.snapshot()["objects"]


def fill_unreferenced(impl: Impl, store: Any, *keys: str) -> None:
    """Store ``keys`` one put each, so the LRU order is ``keys``; key i holds byte i+1."""
    for i, key in enumerate(keys):
        store.put(objs(impl, (key, i + 1)))


# --------------------------------------------------------------------------- rule 1


def test_put_on_closed_store_raises_runtime_error_naming_closed(impl, make_store):
    store = make_store(2)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put(objs(impl, ("a", 1)))
    with pytest.raises(RuntimeError, match="closed"):
        store.put([])


def test_get_on_closed_store_raises_runtime_error_naming_closed(impl, make_store):
    store = make_store(2)
    store.put(objs(impl, ("a", 1)))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.get_concatenated(["a"])
    with pytest.raises(RuntimeError, match="closed"):
        store.get_concatenated([])


def test_close_is_idempotent(impl, make_store):
    store = make_store(2)
    store.put(objs(impl, ("a", 1)))
    assert store.close() is None
    assert store.close() is None
    with pytest.raises(RuntimeError, match="closed"):
        store.put(objs(impl, ("b", 2)))


# --------------------------------------------------------------------------- rule 2


def test_non_str_key_raises_type_error_and_changes_nothing(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b")
    before = store.snapshot()
    with pytest.raises(TypeError):
        store.put(
            [impl.BlockObject("c", payload(3)), impl.BlockObject(7, payload(4))],
            retain_keys=["a"],
        )
    assert store.snapshot() == before


def test_non_buffer_payload_raises_type_error_and_changes_nothing(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b")
    before = store.snapshot()
    with pytest.raises(TypeError):
        store.put([impl.BlockObject("a", payload(9)), impl.BlockObject("c", 1234)])
    assert store.snapshot() == before


def test_non_contiguous_payload_raises_type_error(impl, make_store):
    store = make_store(4)
    strided = np.arange(8, dtype=np.uint8)[::2]  # 4 bytes, but not C-contiguous
    assert strided.nbytes == 4
    with pytest.raises(TypeError):
        store.put([impl.BlockObject("a", strided)])
    assert stored(store) == {}


def test_wrong_payload_length_raises_value_error_naming_key_and_sizes(impl, make_store):
    store = make_store(4, nbytes=16)
    with pytest.raises(ValueError) as info:
        store.put([impl.BlockObject("blk-A", b"x" * 16), impl.BlockObject("blk-B", b"x" * 23)])
    message = str(info.value)
    assert "blk-B" in message
    assert re.search(r"\b23\b", message), message
    assert re.search(r"\b16\b", message), message
    assert stored(store) == {}


def test_release_of_unreferenced_key_raises_key_error_with_the_key(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b")
    store.put([], retain_keys=["a"])
    before = store.snapshot()
    with pytest.raises(KeyError) as info:
        store.put(objs(impl, ("c", 3)), retain_keys=["b"], release_keys=["a", "zz"])
    assert info.value.args == ("zz",)
    assert store.snapshot() == before


def test_release_counts_this_calls_retains_first(impl, make_store):
    store = make_store(4)
    # Legal: the retain is applied before the release.
    store.put([], retain_keys=["x"], release_keys=["x"])
    assert refs(store) == {}
    # Illegal: two releases against one retain.
    with pytest.raises(KeyError) as info:
        store.put([], retain_keys=["x"], release_keys=["x", "x"])
    assert info.value.args == ("x",)
    assert refs(store) == {}


# --------------------------------------------------------------------------- rule 3


def test_duplicate_keys_last_payload_wins_first_position_kept(impl, make_store):
    store = make_store(4)
    store.put(objs(impl, ("a", 1), ("b", 2), ("a", 3)))
    assert lru(store) == ["a", "b"]
    assert stored(store) == {"a": payload(3), "b": payload(2)}
    assert store.get_concatenated(["a"]) == payload(3)


def test_duplicate_keys_take_one_slot(impl, make_store):
    store = make_store(1)
    store.put(objs(impl, ("a", 1), ("a", 2), ("a", 3)))
    assert stored(store) == {"a": payload(3)}


# --------------------------------------------------------------------------- rule 4


def test_retain_and_release_of_one_key_in_one_call_from_zero_is_legal(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["a"], release_keys=["a"])
    assert refs(store) == {}
    # "a" was released in this call, so it went to the LRU tail.
    assert lru(store) == ["b", "c", "a"]


def test_retains_are_applied_before_releases(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a")
    store.put([], retain_keys=["a"])
    # Release first in the list, retains listed after: still legal, net count 1.
    store.put([], release_keys=["a", "a"], retain_keys=["a", "a"])
    assert refs(store) == {"a": 1}
    assert lru(store) == []


def test_reference_counts_add_up(impl, make_store):
    store = make_store(4)
    store.put([], retain_keys=["a", "a", "b"])
    store.put([], retain_keys=["a"], release_keys=["b"])
    assert refs(store) == {"a": 3}


def test_first_reference_takes_key_out_of_lru(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["b"])
    assert lru(store) == ["a", "c"]
    assert refs(store) == {"b": 1}
    # A second reference changes nothing in the LRU.
    store.put([], retain_keys=["b"])
    assert lru(store) == ["a", "c"]
    assert refs(store) == {"b": 2}


def test_last_release_puts_key_at_lru_tail(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["a", "a"])
    store.put([], release_keys=["a"])
    assert lru(store) == ["b", "c"]  # count 2 -> 1: still referenced
    store.put([], release_keys=["a"])
    assert lru(store) == ["b", "c", "a"]
    assert refs(store) == {}


def test_release_order_is_the_order_keys_reach_zero(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["a", "a", "b"])
    # "a" reaches zero at its second release, after "b" did.
    store.put([], release_keys=["a", "b", "a"])
    assert lru(store) == ["c", "b", "a"]


# --------------------------------------------------------------------------- rule 5


def test_unreferenced_batch_keys_go_to_lru_tail_in_batch_order(impl, make_store):
    store = make_store(6)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put(objs(impl, ("c", 9), ("x", 4), ("a", 9)))
    assert lru(store) == ["b", "c", "x", "a"]


def test_stored_keys_keep_their_bytes_when_put_again(impl, make_store):
    store = make_store(4)
    store.put(objs(impl, ("a", 1)))
    store.put(objs(impl, ("a", 2)))
    assert store.get_concatenated(["a"]) == payload(1)
    assert stored(store) == {"a": payload(1)}


def test_referenced_stored_key_put_again_keeps_bytes_and_stays_out_of_lru(impl, make_store):
    store = make_store(4)
    store.put(objs(impl, ("a", 1)), retain_keys=["a"])
    store.put(objs(impl, ("a", 2), ("b", 3)))
    assert lru(store) == ["b"]
    assert stored(store) == {"a": payload(1), "b": payload(3)}


def test_released_keys_go_after_batch_keys_in_release_order(impl, make_store):
    store = make_store(8)
    for key in ("r1", "r2", "r3"):
        store.put(objs(impl, (key, 1)), retain_keys=[key])
    fill_unreferenced(impl, store, "old")
    store.put(objs(impl, ("n1", 5), ("n2", 6)), release_keys=["r2", "r3", "r1"])
    assert lru(store) == ["old", "n1", "n2", "r2", "r3", "r1"]


def test_released_batch_key_goes_after_other_batch_keys(impl, make_store):
    store = make_store(4)
    store.put(objs(impl, ("n1", 1), ("n2", 2), ("n3", 3)), retain_keys=["n1"], release_keys=["n1"])
    assert lru(store) == ["n2", "n3", "n1"]


def test_reverse_release_makes_the_tail_block_the_first_victim(impl, make_store):
    store = make_store(3)
    blocks = ["blk0", "blk1", "blk2"]
    # A request retains its blocks, then writes them in order.
    store.put(objs(impl, *[(key, i) for i, key in enumerate(blocks)]), retain_keys=blocks)
    assert lru(store) == []
    # Finishing, it releases them in reverse.
    store.put([], release_keys=list(reversed(blocks)))
    assert lru(store) == ["blk2", "blk1", "blk0"]
    store.put(objs(impl, ("new", 7)))
    assert sorted(stored(store)) == ["blk0", "blk1", "new"]


def test_referenced_batch_key_is_stored_but_not_evictable(impl, make_store):
    store = make_store(4)
    store.put(objs(impl, ("a", 1), ("b", 2)), retain_keys=["b"])
    assert lru(store) == ["a"]
    assert refs(store) == {"b": 1}
    assert stored(store) == {"a": payload(1), "b": payload(2)}


def test_key_can_be_referenced_before_it_is_stored(impl, make_store):
    store = make_store(4)
    store.put([], retain_keys=["early"])
    assert refs(store) == {"early": 1}
    assert stored(store) == {}
    assert lru(store) == []
    store.put(objs(impl, ("early", 5)))
    assert stored(store) == {"early": payload(5)}
    assert lru(store) == []  # referenced: stored, not evictable
    store.put([], release_keys=["early"])
    assert lru(store) == ["early"]
    assert refs(store) == {}


def test_releasing_an_unstored_key_does_not_put_it_in_lru(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a")
    store.put([], retain_keys=["ghost"])
    store.put([], release_keys=["ghost"])
    assert refs(store) == {}
    assert lru(store) == ["a"]
    assert stored(store) == {"a": payload(1)}


# --------------------------------------------------------------------------- rule 6


def test_eviction_takes_the_oldest_evictable_key_first(impl, make_store):
    store = make_store(3)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put(objs(impl, ("d", 4)))
    assert lru(store) == ["b", "c", "d"]
    store.put(objs(impl, ("e", 5), ("f", 6)))
    assert lru(store) == ["d", "e", "f"]
    assert stored(store) == {"d": payload(4), "e": payload(5), "f": payload(6)}


def test_eviction_skips_referenced_keys(impl, make_store):
    store = make_store(3)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["a"])
    store.put(objs(impl, ("d", 4)))
    assert sorted(stored(store)) == ["a", "c", "d"]
    assert store.get_concatenated(["a"]) == payload(1)


def test_read_moves_key_away_from_eviction(impl, make_store):
    store = make_store(2)
    fill_unreferenced(impl, store, "a", "b")
    store.get_concatenated(["a"])
    store.put(objs(impl, ("c", 3)))
    assert sorted(stored(store)) == ["a", "c"]


def test_stored_batch_keys_do_not_count_as_new(impl, make_store):
    store = make_store(2)
    fill_unreferenced(impl, store, "a", "b")
    store.put(objs(impl, ("b", 7), ("a", 8)))
    assert stored(store) == {"a": payload(1), "b": payload(2)}
    assert lru(store) == ["b", "a"]
    assert store.stats()["evictions"] == 0


def test_batch_keys_are_protected_unless_released_in_the_call(impl, make_store):
    store = make_store(2)
    store.put(objs(impl, ("r", 1)), retain_keys=["r"])
    fill_unreferenced(impl, store, "a")
    # LRU after ordering: a (batch), c (batch, new), r (released). Only r is eligible.
    store.put(objs(impl, ("a", 5), ("c", 3)), release_keys=["r"])
    assert stored(store) == {"a": payload(1), "c": payload(3)}
    assert lru(store) == ["a", "c"]
    assert refs(store) == {}


def test_new_batch_key_released_in_the_call_can_be_its_own_victim(impl, make_store):
    store = make_store(1)
    store.put(objs(impl, ("pinned", 1)), retain_keys=["pinned"])
    store.put(objs(impl, ("b", 2)), retain_keys=["b"], release_keys=["b"])
    assert stored(store) == {"pinned": payload(1)}
    assert lru(store) == []
    assert refs(store) == {"pinned": 1}
    with pytest.raises(impl.Error, match="does not exist"):
        store.get_concatenated(["b"])


def test_stored_batch_key_released_in_the_call_can_be_evicted(impl, make_store):
    store = make_store(2)
    store.put(objs(impl, ("p", 1), ("q", 2)), retain_keys=["p", "q"])
    # q is in the batch but released here: eligible. p is still referenced.
    store.put(objs(impl, ("q", 9), ("n", 3)), release_keys=["q"])
    assert stored(store) == {"p": payload(1), "n": payload(3)}
    assert refs(store) == {"p": 1}
    assert lru(store) == ["n"]


def test_eviction_never_moves_live_objects(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c", "d")
    for round_ in range(5):
        store.put(objs(impl, (f"n{round_}", 10 + round_)))
    survivors = ["n1", "n2", "n3", "n4"]
    assert sorted(stored(store)) == survivors
    assert store.get_concatenated(survivors) == b"".join(payload(f) for f in (11, 12, 13, 14))


# --------------------------------------------------------------------------- capacity error


def test_capacity_error_names_the_limit(impl, make_store):
    store = make_store(1)
    store.put(objs(impl, ("a", 1)), retain_keys=["a"])
    with pytest.raises(impl.Error, match=r"cannot retain the requested batch: limit=1 objects"):
        store.put(objs(impl, ("b", 2)))
    assert stored(store) == {"a": payload(1)}
    assert refs(store) == {"a": 1}
    assert lru(store) == []


def test_capacity_error_is_a_runtime_error(impl, make_store):
    store = make_store(1)
    with pytest.raises(RuntimeError, match="limit=1 objects"):
        store.put(objs(impl, ("a", 1), ("b", 2)))
    assert stored(store) == {}
    assert lru(store) == []


def test_capacity_error_evicts_nobody_and_stores_no_new_key(impl, make_store):
    store = make_store(3)
    store.put(objs(impl, ("a", 1)), retain_keys=["a"])
    fill_unreferenced(impl, store, "b", "e")
    # LRU after ordering: e, c, d, b; need 2; only e is eligible -> error.
    with pytest.raises(impl.Error, match="cannot retain the requested batch: limit=3 objects"):
        store.put(objs(impl, ("c", 3), ("d", 4), ("b", 5)), retain_keys=["f"])
    snap = store.snapshot()
    assert snap["objects"] == {"a": payload(1), "b": payload(1), "e": payload(2)}
    # The move of stored batch key b stays applied, and f's retain stays applied.
    assert snap["lru"] == ["e", "b"]
    assert snap["references"] == {"a": 1, "f": 1}
    store.check()


def test_capacity_error_keeps_releases_and_their_moves(impl, make_store):
    store = make_store(2)
    store.put(objs(impl, ("p", 1), ("q", 2)), retain_keys=["p", "q", "q"])
    # need 2 (n and m are new); only p, released here, is eligible.
    with pytest.raises(impl.Error, match="limit=2 objects"):
        store.put(objs(impl, ("n", 3), ("m", 4)), retain_keys=["x"], release_keys=["q", "p"])
    # p reached zero and moved to the LRU; q went 2 -> 1; x was retained.
    assert refs(store) == {"q": 1, "x": 1}
    assert lru(store) == ["p"]
    assert stored(store) == {"p": payload(1), "q": payload(2)}


def test_capacity_error_keeps_first_reference_out_of_lru(impl, make_store):
    store = make_store(1)
    fill_unreferenced(impl, store, "a")
    with pytest.raises(impl.Error, match="cannot retain"):
        store.put(objs(impl, ("b", 2)), retain_keys=["a"])
    assert refs(store) == {"a": 1}
    assert lru(store) == []
    assert stored(store) == {"a": payload(1)}


def test_store_works_after_a_capacity_error(impl, make_store):
    store = make_store(1)
    store.put(objs(impl, ("a", 1)), retain_keys=["a"])
    with pytest.raises(impl.Error):
        store.put(objs(impl, ("b", 2)))
    store.put([], release_keys=["a"])
    store.put(objs(impl, ("b", 2)))
    assert stored(store) == {"b": payload(2)}
    store.check()


# --------------------------------------------------------------------------- rule 7


def test_new_keys_are_written_and_read_back(impl, make_store):
    store = make_store(3, nbytes=8)
    store.put([impl.BlockObject("a", b"AAAAAAAA"), impl.BlockObject("b", b"bbbbbbbb")])
    assert store.get_concatenated(["a", "b"]) == b"AAAAAAAAbbbbbbbb"


@pytest.mark.parametrize(
    "make_payload",
    [
        lambda raw: bytes(raw),
        lambda raw: bytearray(raw),
        lambda raw: memoryview(bytes(raw)),
        lambda raw: np.frombuffer(bytes(raw), dtype=np.uint8).copy(),
        lambda raw: np.frombuffer(bytes(raw), dtype=np.int32).copy(),
        lambda raw: np.frombuffer(bytes(raw), dtype=np.int16).copy().reshape(2, 4),
        lambda raw: array.array("B", raw),
    ],
    ids=["bytes", "bytearray", "memoryview", "uint8", "int32", "int16-2d", "array"],
)
def test_any_c_contiguous_buffer_is_a_payload(impl, make_store, make_payload):
    raw = bytes(range(1, 17))
    store = make_store(2, nbytes=16)
    store.put([impl.BlockObject("k", make_payload(raw))])
    assert store.get_concatenated(["k"]) == raw
    assert stored(store) == {"k": raw}


def test_payload_is_copied_at_put(impl, make_store):
    store = make_store(2)
    source = bytearray(b"abcd")
    array_source = np.array([1, 2, 3, 4], dtype=np.uint8)
    store.put([impl.BlockObject("a", source), impl.BlockObject("b", array_source)])
    source[:] = b"zzzz"
    array_source[:] = 9
    assert store.get_concatenated(["a", "b"]) == b"abcd\x01\x02\x03\x04"


def test_put_accepts_any_object_with_key_and_payload(impl, make_store):
    store = make_store(2)
    store.put([types.SimpleNamespace(key="a", payload=b"aaaa")])
    assert stored(store) == {"a": b"aaaa"}


def test_put_accepts_iterables(impl, make_store):
    store = make_store(4)
    store.put(
        tuple(objs(impl, ("a", 1), ("b", 2))),
        retain_keys=(key for key in ["a", "b"]),
        release_keys=iter(["b"]),
    )
    assert refs(store) == {"a": 1}
    assert lru(store) == ["b"]


def test_put_returns_none(impl, make_store):
    store = make_store(2)
    assert store.put(objs(impl, ("a", 1))) is None
    assert store.put([]) is None


def test_any_str_is_a_key(impl, make_store):
    store = make_store(4)
    keys = ["", "ключ-🔑", "a" * 1000, "with\x00nul"]
    store.put([impl.BlockObject(key, payload(i)) for i, key in enumerate(keys)])
    assert store.get_concatenated(keys) == b"".join(payload(i) for i in range(4))
    assert lru(store) == keys


# --------------------------------------------------------------------------- get_concatenated


def test_get_concatenated_keeps_order_and_duplicates(impl, make_store):
    store = make_store(3)
    fill_unreferenced(impl, store, "a", "b", "c")
    assert store.get_concatenated(["c", "a", "c", "b"]) == (
        payload(3) + payload(1) + payload(3) + payload(2)
    )


def test_get_concatenated_of_no_keys_is_empty_bytes(impl, make_store):
    store = make_store(2)
    fill_unreferenced(impl, store, "a", "b")
    result = store.get_concatenated([])
    assert result == b""
    assert isinstance(result, bytes)
    assert lru(store) == ["a", "b"]


def test_get_concatenated_returns_bytes(impl, make_store):
    store = make_store(2)
    fill_unreferenced(impl, store, "a")
    assert type(store.get_concatenated(["a"])) is bytes


def test_get_missing_key_raises_with_max_bytes_hint(impl, make_store):
    store = make_store(2)
    fill_unreferenced(impl, store, "a", "b")
    before = store.snapshot()
    with pytest.raises(impl.Error) as info:
        store.get_concatenated(["a", "missing", "b"])
    assert "does not exist" in str(info.value)
    assert "Increase aux_output_config.max_bytes" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    # Nothing moved: "a" was not touched although it came before the missing key.
    assert store.snapshot() == before


def test_evicted_key_cannot_be_read(impl, make_store):
    store = make_store(1)
    fill_unreferenced(impl, store, "a", "b")
    with pytest.raises(impl.Error, match="does not exist"):
        store.get_concatenated(["a"])


def test_read_moves_evictable_keys_to_tail_in_given_order(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b", "c", "d")
    store.get_concatenated(["a", "c", "a"])
    assert lru(store) == ["b", "d", "c", "a"]


def test_read_of_referenced_key_does_not_put_it_in_lru(impl, make_store):
    store = make_store(4)
    fill_unreferenced(impl, store, "a", "b")
    store.put([], retain_keys=["a"])
    assert store.get_concatenated(["a", "b"]) == payload(1) + payload(2)
    assert lru(store) == ["b"]
    assert refs(store) == {"a": 1}


# --------------------------------------------------------------------------- constructor


@pytest.mark.parametrize("object_nbytes", [0, -1, -4096])
def test_constructor_rejects_non_positive_object_size(impl, object_nbytes):
    with pytest.raises(ValueError, match="object size must be positive"):
        impl.Store(max_bytes=1024, object_nbytes=object_nbytes)


@pytest.mark.parametrize("max_bytes", [0, 7, -8])
def test_constructor_rejects_store_smaller_than_one_object(impl, max_bytes):
    with pytest.raises(ValueError, match="must fit at least one object"):
        impl.Store(max_bytes=max_bytes, object_nbytes=8)


@pytest.mark.parametrize(
    ("max_bytes", "object_nbytes", "num_slots"),
    [(8, 8, 1), (15, 8, 1), (16, 8, 2), (100, 3, 33), (4096, 1, 4096)],
)
def test_num_slots_is_max_bytes_floor_divided_by_object_size(
    impl, max_bytes, object_nbytes, num_slots
):
    store = impl.Store(max_bytes=max_bytes, object_nbytes=object_nbytes)
    try:
        assert store.num_slots == num_slots
        assert store.object_nbytes == object_nbytes
        assert store.stats()["capacity"] == num_slots
    finally:
        store.close()


def test_constructor_arguments_are_keyword_only(impl):
    with pytest.raises(TypeError):
        impl.Store(64, 8)


def test_store_holds_exactly_num_slots_objects(impl):
    store = impl.Store(max_bytes=23, object_nbytes=4)  # 5 slots, 3 bytes unused
    try:
        keys = [f"k{i}" for i in range(6)]
        store.put([impl.BlockObject(k, payload(i)) for i, k in enumerate(keys[:5])])
        assert len(stored(store)) == 5
        store.put([impl.BlockObject("k5", payload(5))])
        assert sorted(stored(store)) == keys[1:]
    finally:
        store.close()


def test_store_with_one_slot_full_of_references_fails_closed(impl, make_store):
    store = make_store(1)
    with pytest.raises(impl.Error, match="limit=1 objects"):
        store.put(objs(impl, ("a", 1), ("b", 2)), retain_keys=["a", "b"])
    assert stored(store) == {}
    assert refs(store) == {"a": 1, "b": 1}


# --------------------------------------------------------------------------- API surface


def test_instances_accept_attribute_assignment(impl, make_store):
    store = make_store(2)
    store.put = mock.Mock(return_value=None)
    store.get_concatenated = mock.Mock(return_value=b"mocked")
    store.put(["anything"], retain_keys=("k",))
    store.put.assert_called_once_with(["anything"], retain_keys=("k",))
    assert store.get_concatenated(["x"]) == b"mocked"
    assert stored(store) == {}


def test_block_object_has_key_and_payload_and_is_frozen(impl):
    obj = impl.BlockObject("k", b"data")
    assert obj.key == "k"
    assert bytes(obj.payload) == b"data"
    keyword = impl.BlockObject(key="k2", payload=b"more")
    assert (keyword.key, bytes(keyword.payload)) == ("k2", b"more")
    with pytest.raises(AttributeError):
        obj.key = "other"
    with pytest.raises(AttributeError):
        obj.payload = b"other"


def test_store_error_is_a_runtime_error(impl):
    assert issubclass(impl.Error, RuntimeError)


def test_snapshot_has_no_side_effects(impl, make_store):
    store = make_store(3)
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put([], retain_keys=["b"])
    first = store.snapshot()
    second = store.snapshot()
    assert first == second
    assert first == {
        "lru": ["a", "c"],
        "references": {"b": 1},
        "objects": {"a": payload(1), "b": payload(2), "c": payload(3)},
    }
    # Mutating a snapshot does not reach the store.
    first["lru"].clear()
    first["objects"].clear()
    assert store.snapshot() == second


def test_check_passes_on_a_busy_store(impl, make_store):
    store = make_store(3)
    store.check()
    fill_unreferenced(impl, store, "a", "b", "c")
    store.put(objs(impl, ("d", 4)), retain_keys=["d", "zz"], release_keys=["zz"])
    store.get_concatenated(["b", "d"])
    with pytest.raises(impl.Error):
        store.put(objs(impl, ("e", 5), ("f", 6), ("g", 7)))
    assert store.check() is None


def test_stats_count_what_happened(impl, make_store):
    store = make_store(2, nbytes=8)
    zero = store.stats()
    for name in (
        "puts", "objects_written", "retains", "releases", "evictions", "capacity_errors",
        "reads", "read_misses", "bytes_written", "bytes_read", "eviction_visits", "stored",
        "referenced", "evictable",
    ):  # fmt: skip
        assert zero[name] == 0, name
    assert zero["capacity"] == 2
    assert zero["free_slots"] == 2

    store.put(objs(impl, ("a", 1), ("b", 2), nbytes=8), retain_keys=["a", "a"])
    store.put([], release_keys=["a"])
    stats = store.stats()
    assert stats["puts"] == 2
    assert (stats["objects_written"], stats["bytes_written"]) == (2, 16)
    assert (stats["retains"], stats["releases"]) == (2, 1)
    assert (stats["stored"], stats["referenced"], stats["evictable"]) == (2, 1, 1)
    assert stats["free_slots"] == 0

    store.put(objs(impl, ("c", 3), nbytes=8))
    assert store.get_concatenated(["a", "c", "c"]) == payload(1, 8) + payload(3, 8) * 2
    stats = store.stats()
    assert stats["evictions"] == 1
    assert stats["eviction_visits"] >= 1
    assert stats["bytes_read"] == 24
    assert stats["objects_written"] == 3

    with pytest.raises(impl.Error):
        store.get_concatenated(["b"])
    store.put([], retain_keys=["c"])
    with pytest.raises(impl.Error):
        store.put(objs(impl, ("d", 4), nbytes=8))
    stats = store.stats()
    assert stats["read_misses"] == 1
    assert stats["capacity_errors"] == 1
    assert stats["evictions"] == 1
    assert stats["bytes_read"] == 24
