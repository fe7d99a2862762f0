"""The upstream report's property: eviction never rescans referenced keys (docs/semantics.md, rule
6).

The seed counted hashes of a str subclass to see every lookup of a referenced key.
A Rust store copies keys into its own strings, so that probe sees nothing there;
instead the store reports ``eviction_visits``, the cumulative number of keys its
eviction walks looked at. Each evicting put may visit at most
``need + len(batch)`` keys, however many keys are referenced. No timing involved.
"""

from __future__ import annotations

from typing import Any

import model
import pytest
from conftest import Impl

SLOTS = 10_000
REFERENCED = 9_000  # the oldest 90%
NBYTES = 8
PUTS = 100


def block(i: int) -> bytes:
    return i.to_bytes(NBYTES, "little")


def fill(impl: Impl, store: Any) -> tuple[list[str], list[str]]:
    """Fill every slot: the oldest 9,000 keys referenced, the newest 1,000 evictable."""
    referenced = [f"ref-{i}" for i in range(REFERENCED)]
    evictable = [f"free-{i}" for i in range(SLOTS - REFERENCED)]
    for start in range(0, REFERENCED, 1000):
        chunk = referenced[start : start + 1000]
        store.put(
            [impl.BlockObject(key, block(start + i)) for i, key in enumerate(chunk)],
            retain_keys=chunk,
        )
    store.put([impl.BlockObject(key, block(REFERENCED + i)) for i, key in enumerate(evictable)])
    stats = store.stats()
    assert (stats["stored"], stats["evictable"], stats["free_slots"]) == (SLOTS, len(evictable), 0)
    assert stats["referenced"] == REFERENCED
    return referenced, evictable


def evicting_puts(impl: Impl, store: Any, batch_size: int) -> list[str]:
    """Make 100 puts of new keys; check the walk bound on each; return keys in put order."""
    new_keys: list[str] = []
    for n in range(PUTS):
        batch = [f"new-{n}-{j}" for j in range(batch_size)]
        visits = store.stats()["eviction_visits"]
        evictions = store.stats()["evictions"]
        store.put([impl.BlockObject(key, block(n)) for key in batch])
        walked = store.stats()["eviction_visits"] - visits
        need = batch_size
        assert store.stats()["evictions"] - evictions == need
        assert need <= walked <= need + len(batch), (
            f"put {n}: eviction walk visited {walked} keys for need={need}, batch={len(batch)}"
        )
        new_keys.extend(batch)
    return new_keys


@pytest.mark.parametrize("batch_size", [1, 64])
def test_evicting_put_does_not_rescan_referenced_keys(impl, make_store, batch_size):
    store = make_store(SLOTS, nbytes=NBYTES)
    referenced, evictable = fill(impl, store)
    new_keys = evicting_puts(impl, store, batch_size)

    # Victims are the unreferenced keys, oldest first, then the oldest new keys.
    evicted = PUTS * batch_size
    order = evictable + new_keys
    survivors = order[evicted:]
    snapshot = store.snapshot()
    assert snapshot["lru"] == survivors
    assert set(snapshot["objects"]) == set(referenced) | set(survivors)
    for key in order[:evicted:97]:
        with pytest.raises(impl.Error, match="does not exist"):
            store.get_concatenated([key])

    # Every referenced object is still readable, with its bytes.
    assert store.get_concatenated(referenced) == b"".join(block(i) for i in range(REFERENCED))
    assert store.stats()["referenced"] == REFERENCED
    store.check()


def test_victims_are_the_oldest_unreferenced_keys_one_by_one(impl, make_store):
    store = make_store(SLOTS, nbytes=NBYTES)
    referenced, evictable = fill(impl, store)
    for n in range(PUTS):
        store.put([impl.BlockObject(f"one-{n}", block(n))])
        # A failed read touches nothing, so it does not disturb the order under test.
        with pytest.raises(impl.Error, match="does not exist"):
            store.get_concatenated([evictable[n]])
    snapshot = store.snapshot()
    assert snapshot["lru"] == evictable[PUTS:] + [f"one-{n}" for n in range(PUTS)]
    assert len(snapshot["objects"]) == SLOTS
    assert snapshot["references"] == dict.fromkeys(referenced, 1)


def test_walk_with_all_referenced_but_one_visits_one_key(impl, make_store):
    store = make_store(SLOTS, nbytes=NBYTES)
    keys = [f"k{i}" for i in range(SLOTS)]
    store.put(
        [impl.BlockObject(key, block(i)) for i, key in enumerate(keys)], retain_keys=keys[:-1]
    )
    visits = store.stats()["eviction_visits"]
    store.put([impl.BlockObject("late", block(0))])
    assert store.stats()["eviction_visits"] - visits <= 2
    assert store.snapshot()["lru"] == ["late"]


class RescanningModel(model.ModelStore):
    """The store before the fix: one LRU for all stored keys, walked from the oldest."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        objects = list(objects)
        batch = {obj.key for obj in objects}
        need = len(set(self._objects) | batch) - self.num_slots
        if need > 0:
            # Count the referenced stored keys a single-LRU walk would skip first.
            self._stats["eviction_visits"] += sum(
                1 for key in self._objects if key in self._references
            )
        super().put(objects, retain_keys=retain_keys, release_keys=release_keys)


def test_bound_catches_a_rescanning_store():
    impl = Impl("rescanning", RescanningModel, model.BlockObjectStoreError, model.BlockObject)
    store = RescanningModel(max_bytes=SLOTS * NBYTES, object_nbytes=NBYTES)
    fill(impl, store)
    with pytest.raises(AssertionError, match="eviction walk visited"):
        evicting_puts(impl, store, 1)
