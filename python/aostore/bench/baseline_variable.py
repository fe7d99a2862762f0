"""A pure-Python variable-size store that benchmarks measure aostore against, in the same run.

``PythonVariableBlockObjectStore`` has ``aostore.VariableBlockObjectStore``'s contract
(docs/variable-store.md: a byte budget counted in chunks, replacement on re-put, refused puts
change nothing) in the design a Python implementation would use, as the vLLM branches'
replica does: dicts for objects and counts, an ``OrderedDict`` LRU of evictable keys, and an
``mmap`` arena cut into chunks, each object a list of chunk indices. A put checks that the
batch fits before changing anything, so a refusal needs no undo.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from aostore import BlockObjectStoreError


def default_chunk_nbytes(max_bytes: int) -> int:
    """256 bytes, halved until the store has 4,096 chunks (as aostore's default)."""
    chunk = 256
    while chunk > 1 and max_bytes // chunk < 4096:
        chunk //= 2
    return chunk


class PythonVariableBlockObjectStore:
    """Baseline: the variable-size store's contract in pure Python."""

    def __init__(self, *, max_bytes: int, chunk_nbytes: int | None = None) -> None:
        self.chunk_nbytes = chunk_nbytes or default_chunk_nbytes(max_bytes)
        self.capacity_chunks = max_bytes // self.chunk_nbytes
        self.capacity_bytes = self.capacity_chunks * self.chunk_nbytes
        # key -> (chunk indices, payload length)
        self._objects: dict[str, tuple[list[int], int]] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._refs: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._used = 0
        self._arena: mmap.mmap | None = mmap.mmap(-1, max(self.capacity_bytes, 1))

    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_nbytes)

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
        unique = {obj.key: memoryview(obj.payload).cast("B") for obj in objects}
        retains, releases = list(retain_keys), list(release_keys)
        refs = self._refs
        counts = {key: refs.get(key, 0) for key in (*retains, *releases)}
        for key in retains:
            counts[key] += 1
        released: list[str] = []
        for key in releases:
            if not counts[key]:
                raise KeyError(key)
            counts[key] -= 1
            if not counts[key]:
                released.append(key)
        chunks, objects_ = self._chunks, self._objects
        charges = {key: chunks(len(view)) for key, view in unique.items()}
        used = self._used + sum(charges.values())
        used -= sum(chunks(objects_[key][1]) for key in unique if key in objects_)
        victims = self._victims(used - self.capacity_chunks, unique, charges, counts, released)
        # It fits: apply the counts and order moves, evict, then write.
        lru = self._lru
        for key in retains:
            if not refs.get(key):
                lru.pop(key, None)
            refs[key] = refs.get(key, 0) + 1
        for key in releases:
            refs[key] -= 1
            if not refs[key]:
                del refs[key]
        for key in unique:
            if key not in refs:
                lru[key] = None
                lru.move_to_end(key)
        for key in released:
            if key in objects_ or key in unique:
                lru[key] = None
                lru.move_to_end(key)
        for key in victims:
            del lru[key]
            self._drop(key)
        written = [key for key in unique if key not in victims]
        for key in written:
            self._drop(key)  # every replaced chain first, so the writes find their room
        for key in written:
            self._write(key, unique[key], charges[key], arena)

    def _victims(
        self,
        need: int,
        unique: dict[str, memoryview],
        charges: dict[str, int],
        counts: dict[str, int],
        released: list[str],
    ) -> set[str]:
        """The shortest eligible LRU prefix covering ``need`` chunks, in the order the put leaves
        the LRU; raises (changing nothing) when the eligible keys cannot cover it."""
        victims: set[str] = set()
        if need <= 0:
            return victims
        freed = 0
        moved = unique.keys() | set(released)
        objects_ = self._objects
        for key in self._lru:
            if freed >= need:
                break
            if key in moved or counts.get(key, 0):
                continue  # moves to the tail, or leaves the LRU
            victims.add(key)
            freed += self._chunks(objects_[key][1])
        for key in released:
            if freed >= need:
                break
            if key in unique:
                victims.add(key)
                freed += charges[key]
            elif key in objects_:
                victims.add(key)
                freed += self._chunks(objects_[key][1])
        if freed < need:
            raise BlockObjectStoreError(
                "auxiliary output store cannot retain the requested batch: "
                f"limit={self.capacity_bytes} bytes"
            )
        return victims

    def _drop(self, key: str) -> None:
        entry = self._objects.pop(key, None)
        if entry is not None:
            self._free.extend(reversed(entry[0]))
            self._used -= len(entry[0])

    def _write(self, key: str, view: memoryview, count: int, arena: mmap.mmap) -> None:
        size, free = self.chunk_nbytes, self._free
        taken: list[int] = []
        for _ in range(count):
            if free:
                taken.append(free.pop())
            else:
                taken.append(self._next)
                self._next += 1
        # Copy run by run: adjacent chunks are one slice assignment.
        start = copied = 0
        for i in range(1, count + 1):
            if i == count or taken[i] != taken[i - 1] + 1:
                nbytes = min((i - start) * size, len(view) - copied)
                offset = taken[start] * size
                arena[offset : offset + nbytes] = view[copied : copied + nbytes]
                copied += nbytes
                start = i
        self._objects[key] = (taken, len(view))
        self._used += count

    def _read(self, key: str, view: memoryview) -> bytes:
        taken, length = self._objects[key]
        size = self.chunk_nbytes
        pieces = []
        start = copied = 0
        for i in range(1, len(taken) + 1):
            if i == len(taken) or taken[i] != taken[i - 1] + 1:
                nbytes = min((i - start) * size, length - copied)
                offset = taken[start] * size
                pieces.append(view[offset : offset + nbytes])
                copied += nbytes
                start = i
        return b"".join(pieces)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        arena = self._arena
        if arena is None:
            raise RuntimeError("auxiliary output store is closed")
        for key in keys:
            if key not in self._objects:
                raise BlockObjectStoreError(f"auxiliary output object {key!r} does not exist")
        view = memoryview(arena)
        try:
            data = b"".join([self._read(key, view) for key in keys])
        finally:
            view.release()
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
        return data

    def get_many(self, keys: Sequence[str]) -> tuple[bytes, list[str], list[int]]:
        arena = self._arena
        if arena is None:
            raise RuntimeError("auxiliary output store is closed")
        view = memoryview(arena)
        pieces, missing, offsets = [], [], [0]
        try:
            for key in keys:
                if key in self._objects:
                    pieces.append(self._read(key, view))
                    offsets.append(offsets[-1] + len(pieces[-1]))
                else:
                    missing.append(key)
                    offsets.append(offsets[-1])
        finally:
            view.release()
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
        return b"".join(pieces), missing, offsets

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._objects for key in keys]

    def snapshot(self) -> dict[str, Any]:
        """The whole contents (for tests), in the same form as aostore's."""
        arena = self._arena
        assert arena is not None
        view = memoryview(arena)
        try:
            objects = {key: self._read(key, view) for key in self._objects}
        finally:
            view.release()
        return {"lru": list(self._lru), "references": dict(self._refs), "objects": objects}

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.capacity_bytes,
            "stored": len(self._objects),
            "stored_bytes": sum(length for _, length in self._objects.values()),
            "used_bytes": self._used * self.chunk_nbytes,
        }

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
