"""Reads that do not raise, on the fixed store: ``get_many`` and ``contains``, and the opt-in
routed-experts helper built on them (the variable store's are in ``test_variable*.py``)."""

from __future__ import annotations

import aostore
import numpy as np
import pytest
from aostore import BlockObject, BlockObjectStore, VariableBlockObjectStore
from aostore.routed_experts import materialize_available_routed_experts
from hypothesis import given, settings
from hypothesis import strategies as st

NBYTES = 4


def filled(keys: str, slots: int = 6) -> BlockObjectStore:
    store = BlockObjectStore(max_bytes=slots * NBYTES, object_nbytes=NBYTES)
    store.put([BlockObject(k, k.encode() * NBYTES) for k in keys])
    return store


def test_get_many_returns_stored_payloads_and_missing_keys_in_order():
    store = filled("abc")
    data, missing = store.get_many(["c", "x", "a", "x", "c"])
    assert data == b"cccc" + b"aaaa" + b"cccc"
    assert missing == ["x", "x"]
    assert store.get_many([]) == (b"", [])
    assert store.get_many(["a", "b"]) == (b"aaaabbbb", [])
    store.close()


def test_get_many_moves_present_keys_like_a_read_and_missing_ones_not_at_all():
    store = filled("abcd")
    store.put([], retain_keys=["b"])
    store.get_many(["a", "zz", "b", "c"])
    assert store.snapshot()["lru"] == ["d", "a", "c"]
    stats = store.stats()
    assert (stats["reads"], stats["read_misses"], stats["bytes_read"]) == (3, 1, 12)
    store.check()
    store.close()


def test_contains_touches_nothing():
    store = filled("abc")
    before = store.snapshot(), store.stats()
    assert store.contains(["c", "a", "nope", "a"]) == [True, True, False, True]
    assert store.contains([]) == []
    assert (store.snapshot(), store.stats()) == before
    store.close()


@pytest.mark.parametrize("method", ["get_many", "contains"])
@pytest.mark.parametrize("keys", [[1], ["a", None], [b"a"], 5], ids=repr)
def test_bad_keys_raise_type_error_and_change_nothing(method, keys):
    store = filled("ab")
    before = store.snapshot(), store.stats()
    with pytest.raises(TypeError):
        getattr(store, method)(keys)
    assert (store.snapshot(), store.stats()) == before
    store.close()


@pytest.mark.parametrize("method", ["get_many", "contains"])
def test_closed_store_raises_runtime_error(method):
    store = filled("ab")
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        getattr(store, method)(["a"])


@settings(max_examples=300, deadline=None)
@given(
    stored=st.lists(st.sampled_from("abcdefgh"), max_size=8),
    held=st.lists(st.sampled_from("abcdefgh"), max_size=3),
    wanted=st.lists(st.sampled_from("abcdefghij"), max_size=8),
)
def test_get_many_is_a_read_of_the_present_keys(stored, held, wanted):
    """Against a twin store: get_many(keys) leaves what get_concatenated(present keys) leaves."""
    twins = [filled("", slots=5), filled("", slots=5)]
    for store in twins:
        for key in stored:
            try:
                store.put([BlockObject(key, key.encode() * NBYTES)], retain_keys=held)
            except aostore.BlockObjectStoreError:
                pass  # everything referenced; both twins refuse alike
    subject, reference = twins
    present = [key for key, here in zip(wanted, reference.contains(wanted), strict=True) if here]
    data, missing = subject.get_many(wanted)
    assert data == reference.get_concatenated(present)
    assert missing == [key for key in wanted if key not in set(present)]
    assert subject.snapshot() == reference.snapshot()
    subject.check()
    for store in twins:
        store.close()


# --------------------------------------------------------------------------- routed experts


SHAPE = (3, 2)
BLOCK = 4


def block(fill: int) -> np.ndarray:
    return np.full((BLOCK, *SHAPE), fill, dtype=np.uint8)


class PlainStore:
    """A store with only vLLM's read surface (no get_many)."""

    def __init__(self, blocks: dict[str, bytes]) -> None:
        self.blocks = blocks

    def get_concatenated(self, keys: list[str]) -> bytes:
        for key in keys:
            if key not in self.blocks:
                raise aostore.BlockObjectStoreError(f"object {key!r} does not exist")
        return b"".join(self.blocks[key] for key in keys)


@pytest.mark.parametrize("kind", ["aostore", "plain"])
def test_available_routed_experts_returns_rows_and_ranges_to_recompute(kind):
    keys = ["k0", "k1", "k2", "k3", "k4"]
    stored = {"k0": 1, "k3": 4}
    if kind == "aostore":
        store = BlockObjectStore(max_bytes=1 << 16, object_nbytes=BLOCK * 6)
        store.put([BlockObject(k, block(v)) for k, v in stored.items()])
    else:
        store = PlainStore({k: block(v).tobytes() for k, v in stored.items()})
    rows, recompute = materialize_available_routed_experts(
        store,
        keys,
        shape_per_token=SHAPE,
        dtype=np.dtype(np.uint8),
        block_size=BLOCK,
        first_token=100,
    )
    assert rows.shape == (5 * BLOCK, *SHAPE)
    np.testing.assert_array_equal(rows[:BLOCK], block(1))
    np.testing.assert_array_equal(rows[3 * BLOCK : 4 * BLOCK], block(4))
    assert not rows[BLOCK : 3 * BLOCK].any() and not rows[4 * BLOCK :].any()
    assert recompute == [(104, 112), (116, 120)]


def test_available_routed_experts_with_everything_or_nothing_stored():
    store = BlockObjectStore(max_bytes=1 << 16, object_nbytes=BLOCK * 6)
    store.put([BlockObject("a", block(7))])
    hit = materialize_available_routed_experts(
        store, ["a"], shape_per_token=SHAPE, dtype=np.dtype(np.uint8), block_size=BLOCK
    )
    assert hit.recompute == []
    np.testing.assert_array_equal(hit.rows, block(7))
    miss = materialize_available_routed_experts(
        store, ["x", "y"], shape_per_token=SHAPE, dtype=np.dtype(np.uint8), block_size=BLOCK
    )
    assert miss.recompute == [(0, 2 * BLOCK)]
    empty = materialize_available_routed_experts(
        store, [], shape_per_token=SHAPE, dtype=np.dtype(np.uint8), block_size=BLOCK
    )
    assert empty.rows.shape == (0, *SHAPE) and empty.recompute == []


def test_available_routed_experts_rejects_a_block_size_the_store_does_not_hold():
    store = BlockObjectStore(max_bytes=1 << 16, object_nbytes=BLOCK * 6)
    store.put([BlockObject("a", block(7))])
    with pytest.raises(ValueError, match="bytes"):
        materialize_available_routed_experts(
            store, ["a"], shape_per_token=(5,), dtype=np.dtype(np.uint8), block_size=BLOCK
        )


def test_available_routed_experts_reads_a_variable_store_too():
    store = VariableBlockObjectStore(max_bytes=1 << 16)
    store.put([BlockObject("a", block(2))])
    rows, recompute = materialize_available_routed_experts(
        store, ["a", "b"], shape_per_token=SHAPE, dtype=np.dtype(np.uint8), block_size=BLOCK
    )
    np.testing.assert_array_equal(rows[:BLOCK], block(2))
    assert recompute == [(BLOCK, 2 * BLOCK)]
