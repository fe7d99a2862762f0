"""A reference model of ``ShmBlockObjectStore`` on vLLM's Mooncake branch (vllm#57968).

Written for aostore from the behaviour of the branch's ``shm.py`` (commit d713fb23 of
vllm-project/vllm); none of its code. The branch is not on the package index, so the tests
and benchmarks use this model in its place. What it keeps, as the branch does:

* one ``OrderedDict`` of every stored key, referenced or not, oldest first, to its slot; a
  batch's new keys enter it first with no slot (``None``) and get one only when written;
* a ``dict`` of reference counts (a key is absent at zero), counted apart from storage;
* on every put that must evict, a walk from the oldest stored key that skips each referenced
  key and each batch key the call does not release, until it has enough victims: the walk
  looks at every referenced key older than the victims (the original store's rescan);
* a read moves every key it read to the tail, referenced or not.

And its order of work in ``put``: the closed check; the batch deduplicated (last payload wins,
first occurrence keeps the place); each retain applied (+1); each release applied (-1; a key
at zero leaves the counts and is noted as released); a release of a key with no count raises
``KeyError(key)`` on the spot, the retains and earlier releases staying applied and nothing
moved; then every batch key moved to the tail (new ones entering), then every released key
that is in the LRU; then the eviction walk, which on too few victims drops the batch's new keys
and raises ``BlockObjectStoreError``; then each new key gets a slot (the most recently freed
first, else the next unused) and its payload, which must be exactly ``object_nbytes`` bytes
(else ``IndexError``, as the branch's ``mmap`` slice assignment raises, with the work so far
kept). The messages are the branch's.

``hashes`` counts nothing itself: the no-rescan test gives it keys that count their own hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


class BlockObjectStoreError(RuntimeError):
    """Storage or retrieval failed."""


class ShmModel:
    """The Mooncake branch's ``ShmBlockObjectStore``, as a plain-Python model."""

    def __init__(self, *, max_bytes: int, object_nbytes: int) -> None:
        if object_nbytes <= 0:
            raise ValueError("auxiliary output object size must be positive")
        if max_bytes < object_nbytes:
            raise ValueError("auxiliary output store must fit at least one object")
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._lru: OrderedDict[Any, int | None] = OrderedDict()
        self._references: dict[Any, int] = {}
        self._freed: list[int] = []
        self._used_slots = 0
        self._arena: bytearray | None = bytearray(self.num_slots * object_nbytes)

    # -- put -----------------------------------------------------------------------------------

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[Any] = (),
        release_keys: Iterable[Any] = (),
    ) -> None:
        arena = self._open_arena()
        batch: dict[Any, Any] = {}
        for obj in objects:
            batch[obj.key] = obj
        for key in retain_keys:
            self._references[key] = self._references.get(key, 0) + 1
        released: list[Any] = []
        for key in release_keys:
            count = self._references[key] - 1  # KeyError for a key with no count
            if count:
                self._references[key] = count
            else:
                del self._references[key]
                released.append(key)
        for key in batch:
            if key not in self._lru:
                self._lru[key] = None
            self._lru.move_to_end(key)
        for key in released:
            if key in self._lru:
                self._lru.move_to_end(key)
        try:
            self._evict(set(batch) - set(released))
        except BlockObjectStoreError:
            for key in batch:
                if key in self._lru and self._lru[key] is None:
                    del self._lru[key]
            raise
        size = self.object_nbytes
        for key, obj in batch.items():
            if key not in self._lru or self._lru[key] is not None:
                continue  # stored before (its bytes stay) or chosen as a victim
            slot = self._take_slot()
            payload = bytes(memoryview(obj.payload))
            if len(payload) != size:
                raise IndexError("mmap slice assignment is wrong size")
            arena[slot * size : (slot + 1) * size] = payload
            self._lru[key] = slot

    def _evict(self, protected: set[Any]) -> None:
        excess = len(self._lru) - self.num_slots
        if excess <= 0:
            return
        victims: list[Any] = []
        for key in self._lru:
            if key in self._references or key in protected:
                continue
            victims.append(key)
            if len(victims) == excess:
                break
        if len(victims) < excess:
            raise BlockObjectStoreError(
                "auxiliary output store cannot retain the requested batch: "
                f"limit={self.num_slots} objects"
            )
        for key in victims:
            slot = self._lru.pop(key)
            if slot is not None:
                self._freed.append(slot)

    def _take_slot(self) -> int:
        if self._freed:
            return self._freed.pop()
        self._used_slots += 1
        return self._used_slots - 1

    # -- reads ---------------------------------------------------------------------------------

    def get_concatenated(self, keys: list[Any]) -> bytes:
        arena = self._open_arena()
        slots = []
        for key in keys:
            slot = self._lru.get(key, -1)
            if slot is None or slot == -1:  # unknown, or referenced before it was stored
                raise BlockObjectStoreError(
                    "auxiliary output object does not exist; the object may have been evicted "
                    f"(used={len(self._lru)}, limit={self.num_slots} objects). Increase "
                    "aux_output_config.max_bytes when a KV cache hit requires it."
                ) from KeyError(key)
            slots.append(slot)
        size = self.object_nbytes
        data = b"".join(bytes(arena[s * size : (s + 1) * size]) for s in slots)
        for key in keys:
            self._lru.move_to_end(key)
        return data

    def close(self) -> None:
        self._arena = None

    def _open_arena(self) -> bytearray:
        if self._arena is None:
            raise RuntimeError("auxiliary output store is closed")
        return self._arena

    # -- what the differential compares --------------------------------------------------------

    def stored(self) -> set[Any]:
        return {key for key, slot in self._lru.items() if slot is not None}

    def evictable_order(self) -> list[Any]:
        """Stored unreferenced keys, oldest first: the order in which eviction takes them."""
        return [
            key
            for key, slot in self._lru.items()
            if slot is not None and key not in self._references
        ]

    def references(self) -> dict[Any, int]:
        return dict(self._references)

    def payload(self, key: Any) -> bytes:
        slot = self._lru[key]
        assert slot is not None and self._arena is not None
        size = self.object_nbytes
        return bytes(self._arena[slot * size : (slot + 1) * size])

    def check(self) -> None:
        slots = [slot for slot in self._lru.values() if slot is not None]
        if len(slots) != len(set(slots)) or len(slots) > self.num_slots:
            raise AssertionError("slots must be unique and within capacity")
        if set(slots) & set(self._freed):
            raise AssertionError("a freed slot is still in use")
        if any(count < 1 for count in self._references.values()):
            raise AssertionError("reference counts must be >= 1 where present")
