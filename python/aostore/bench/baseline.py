"""Pure-Python stores that benchmarks measure aostore against, in the same run.

``PythonBlockObjectStore`` is the design vLLM ships after the fix (a dict of slots, an
``OrderedDict`` LRU of evictable keys, an mmap arena) with aostore's ``fail-closed`` semantics.
``RescanBlockObjectStore`` is the design before the fix: referenced and unreferenced keys share
one LRU, so every evicting put walks past every referenced key.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from aostore import BlockObjectStoreError

_PENDING = -1


class PythonBlockObjectStore:
    """Baseline: an LRU of evictable keys only (vLLM's design after the fix)."""

    def __init__(self, *, max_bytes: int, object_nbytes: int, prefault: bool = False) -> None:
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._slots: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._refs: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._arena: mmap.mmap | None = mmap.mmap(-1, self.num_slots * object_nbytes)
        if prefault:
            # Commit every page now, as aostore's prefault does, so both pay no faults in puts.
            self._arena.madvise(mmap.MADV_HUGEPAGE)
            for offset in range(0, len(self._arena), mmap.PAGESIZE):
                self._arena[offset] = 0

    def put(
        self,
        objects: Sequence[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        arena = self._arena
        if arena is None:
            raise RuntimeError("auxiliary output store is closed")
        unique = {obj.key: obj.payload for obj in objects}
        refs = self._refs
        lru = self._lru
        for key in retain_keys:
            count = refs.get(key, 0)
            if not count:
                lru.pop(key, None)
            refs[key] = count + 1
        released = []
        for key in release_keys:
            count = refs[key] - 1
            if count:
                refs[key] = count
                continue
            del refs[key]
            released.append(key)
            if key in self._slots:
                lru[key] = None
        slots = self._slots
        for key in unique:
            slots.setdefault(key, _PENDING)
            if key not in refs:
                lru[key] = None
                lru.move_to_end(key)
        for key in released:
            if key in lru:
                lru.move_to_end(key)
        need = len(slots) - self.num_slots
        if need > 0:
            protected = unique.keys() - set(released)
            victims = []
            for key in lru:
                if key not in protected:
                    victims.append(key)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                raise self._refuse(unique)
        else:
            victims = []
        self._evict_and_write(victims, unique, arena)

    def _refuse(self, unique: dict[str, Any]) -> BlockObjectStoreError:
        """Drops the batch's new keys; the error to raise."""
        for key in unique:
            if self._slots.get(key) == _PENDING:
                del self._slots[key]
                self._lru.pop(key, None)
        return BlockObjectStoreError(
            "auxiliary output store cannot retain the requested batch: "
            f"limit={self.num_slots} objects"
        )

    def _evict_and_write(
        self, victims: list[str], unique: dict[str, Any], arena: mmap.mmap
    ) -> None:
        slots = self._slots
        for key in victims:
            del self._lru[key]
            slot = slots.pop(key)
            if slot != _PENDING:
                self._free.append(slot)
        size = self.object_nbytes
        for key, payload in unique.items():
            if slots.get(key) != _PENDING:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next
                self._next += 1
            arena[slot * size : (slot + 1) * size] = payload
            slots[key] = slot

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        arena = self._arena
        if arena is None:
            raise RuntimeError("auxiliary output store is closed")
        try:
            entries = [self._slots[key] for key in keys]
        except KeyError as error:
            raise BlockObjectStoreError("auxiliary output object does not exist") from error
        size = self.object_nbytes
        view = memoryview(arena)
        try:
            data = b"".join(view[s * size : (s + 1) * size] for s in entries)
        finally:
            view.release()
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
        return data

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None


class RescanBlockObjectStore(PythonBlockObjectStore):
    """The design before the fix: referenced keys stay in the LRU and are skipped."""

    def put(
        self,
        objects: Sequence[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        arena = self._arena
        if arena is None:
            raise RuntimeError("auxiliary output store is closed")
        unique = {obj.key: obj.payload for obj in objects}
        refs = self._refs
        for key in retain_keys:
            refs[key] = refs.get(key, 0) + 1
        released = []
        for key in release_keys:
            count = refs[key] - 1
            if count:
                refs[key] = count
            else:
                del refs[key]
                released.append(key)
        slots = self._slots
        lru = self._lru
        for key in unique:
            slots.setdefault(key, _PENDING)
            lru[key] = None
            lru.move_to_end(key)
        for key in released:
            if key in lru:
                lru.move_to_end(key)
        need = len(slots) - self.num_slots
        if need > 0:
            protected = unique.keys() - set(released)
            victims = []
            for key in lru:  # the rescan: walks every referenced key at the front
                if key not in refs and key not in protected:
                    victims.append(key)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                raise self._refuse(unique)
        else:
            victims = []
        self._evict_and_write(victims, unique, arena)
