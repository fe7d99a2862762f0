"""Reference model of profile ``grow``: the store semantics vLLM 0.33.0 ships (docs/semantics.md,
profile grow).

Written from reading vLLM 0.33.0's ``vllm/distributed/aux_output_connector/store.py`` and kept
as plain Python: a dict of stored bytes, a dict of reference counts and an ``OrderedDict`` LRU
of evictable keys. Slots are not modelled: which slot holds an object is not observable.

What vLLM 0.33.0's ``put`` does, in this model's words:

1. A closed store raises ``RuntimeError`` (``... closed``).
2. The batch is deduplicated by key (last payload wins, first occurrence fixes the position).
3. Every batch key that is stored and unreferenced when the call starts is *replaced*: its old
   bytes are dropped here and the new payload is written in step 9. A referenced stored key
   keeps its bytes.
4. Retains apply in order; a key going 0 -> 1 leaves the LRU. Releases apply in order; a key
   reaching 0 is *released* and, when stored, re-enters the LRU at the tail.
5. Every unreferenced batch key goes to the LRU tail in batch order.
6. Every released key that is in the LRU moves to the tail, in release order.
7. ``need = |stored | batch| - num_slots``. Victims: the first ``need`` LRU keys that are not
   batch keys kept by this call (batch keys released in this call are eligible). If fewer
   exist, all of them are evicted.
8. If ``|stored | batch|`` still exceeds ``num_slots``, the arena grows to
   ``num_slots = max(|stored | batch|, 2 * num_slots)`` and a warning is logged.
9. Every batch key that is not stored (new or replaced) and was not a victim is written.

``get_concatenated`` concatenates the payloads (a key that is not stored raises
``BlockObjectStoreError`` containing ``does not exist``) and then moves each evictable key it
named to the LRU tail, in the order given.

One deliberate difference from vLLM, the one aostore documents: vLLM applies retains and
earlier releases before a release of an unreferenced key raises ``KeyError``; this model (as
aostore) checks every release first and raises ``KeyError(key)`` having changed nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any


class BlockObjectStoreError(RuntimeError):
    """Storage or retrieval failed."""


class GrowModel:
    """vLLM 0.33.0's store semantics; counts growths and evictions for the differential test."""

    def __init__(self, *, max_bytes: int, object_nbytes: int) -> None:
        if object_nbytes <= 0:
            raise ValueError("object size must be positive")
        if max_bytes < object_nbytes:
            raise ValueError("store must fit at least one object")
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self.objects: dict[str, bytes] = {}
        self.references: dict[str, int] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.closed = False
        self.growths = 0
        self.evictions = 0

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("auxiliary output store is closed")

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        self._check_open()
        batch: dict[str, bytes] = {}
        for obj in objects:
            batch[obj.key] = bytes(obj.payload)
        retains = list(retain_keys)
        releases = list(release_keys)

        # The documented difference from vLLM: every release is checked before any change.
        counts = dict(self.references)
        for key in retains:
            counts[key] = counts.get(key, 0) + 1
        for key in releases:
            if counts.get(key, 0) == 0:
                raise KeyError(key)
            counts[key] -= 1

        for key in batch:  # step 3: replacement of stored, unreferenced keys
            if key in self.objects and key not in self.references:
                del self.objects[key]
                del self.lru[key]

        for key in retains:  # step 4
            if self.references.get(key, 0) == 0:
                self.lru.pop(key, None)
            self.references[key] = self.references.get(key, 0) + 1
        released: list[str] = []
        for key in releases:
            self.references[key] -= 1
            if self.references[key] == 0:
                del self.references[key]
                released.append(key)
                if key in self.objects:
                    self.lru[key] = None

        for key in batch:  # step 5
            if key not in self.references:
                self.lru[key] = None
                self.lru.move_to_end(key)
        for key in released:  # step 6
            if key in self.lru:
                self.lru.move_to_end(key)

        live = set(self.objects) | set(batch)  # step 7
        need = len(live) - self.num_slots
        if need > 0:
            kept = set(batch) - set(released)
            victims = [key for key in self.lru if key not in kept][:need]
            for key in victims:
                del self.lru[key]
                self.objects.pop(key, None)
                batch.pop(key, None)
                live.discard(key)
            self.evictions += len(victims)
        if len(live) > self.num_slots:  # step 8
            self.num_slots = max(len(live), 2 * self.num_slots)
            self.growths += 1

        for key, payload in batch.items():  # step 9
            if key not in self.objects:
                self.objects[key] = payload

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        self._check_open()
        keys = list(keys)
        for key in keys:
            if key not in self.objects:
                raise BlockObjectStoreError(
                    f"auxiliary output object {key!r} does not exist; "
                    "the object may have been evicted"
                )
        data = b"".join(self.objects[key] for key in keys)
        for key in keys:
            if key in self.lru:
                self.lru.move_to_end(key)
        return data

    def snapshot(self) -> dict[str, Any]:
        """Same shape as ``aostore.BlockObjectStore.snapshot()``."""
        return {
            "lru": list(self.lru),
            "references": dict(self.references),
            "objects": dict(self.objects),
        }

    def close(self) -> None:
        self.closed = True
