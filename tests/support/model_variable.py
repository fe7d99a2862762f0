"""Reference model of the variable-size store (docs/variable-store.md), written as plain Python.

Dicts for payloads and counts, an ``OrderedDict`` for the LRU of evictable keys, and a deep
copy of the state to roll back to: obviously correct rather than fast. The differential test
runs it beside ``aostore.VariableBlockObjectStore`` and requires identical results, errors,
``snapshot()`` and counters after every step.

The contract, where docs/variable-store.md leaves room:

* Capacity is ``max_bytes`` counted in chunks of ``chunk_nbytes``: an object of ``n`` bytes
  takes ``ceil(n / chunk_nbytes)`` of the ``max_bytes // chunk_nbytes`` chunks (zero bytes:
  none). Stores under 8 KiB default to 1-byte chunks, i.e. exact bytes.
* ``put`` validates as the fixed store does (the closed check, then each object's attributes,
  key type and payload buffer, then the types of ``retain_keys`` and ``release_keys``, then
  release counts); bad input changes nothing. Payloads may have any length.
* Objects are deduplicated by key (last payload wins, first occurrence fixes the position).
  Retains apply, then releases; a key reaching zero is *released*, in the order it reaches zero.
* LRU order: unreferenced batch keys go to the tail in batch order (stored or new), then
  released keys that are stored or in the batch, in release order.
* Every batch key holds its new payload: a stored key is replaced, referenced or not, and its
  old bytes no longer count. If the chunks then exceed the capacity, the victims are the
  shortest prefix of the LRU, skipping batch keys not released by this call, whose chunks
  cover the excess (a victim in the batch frees its new payload's chunks and is not written).
* If the eligible keys cannot cover it: ``BlockObjectStoreError("... cannot retain the
  requested batch: limit=N bytes")`` and the call changes nothing at all (counts, LRU order,
  contents); only ``capacity_errors`` counts it.
* ``get_concatenated`` raises ``BlockObjectStoreError("... does not exist ...")`` for a missing
  key and changes nothing; otherwise every evictable key read moves to the LRU tail, in order.
* ``get_many(keys) -> (data, missing, offsets)``: the stored keys' payloads concatenated,
  the missing keys once per occurrence, and ``len(keys) + 1`` offsets (key ``i`` is
  ``data[offsets[i]:offsets[i + 1]]``); present keys move as in a read, missing ones do not.
  ``get_optional(key)`` is ``get_many([key])``'s payload or ``None``. ``contains(keys)`` answers
  per key and moves nothing.
* Counters: ``puts``, ``retains``, ``releases`` count successful puts and what they applied;
  ``objects_written``/``bytes_written`` the payloads stored; ``evictions`` the victims;
  ``eviction_visits`` the keys the eviction walk looked at, which are the victims (or, in a
  refused put, every eligible key) and nothing else; ``reads``/``bytes_read`` the
  objects and bytes returned; ``read_misses`` one per failed ``get_concatenated`` and one per
  missing key of ``get_many``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class BlockObjectStoreError(RuntimeError):
    """Storage or retrieval failed (capacity, missing key)."""


@dataclass(frozen=True)
class BlockObject:
    """One immutable object."""

    key: str
    payload: Any


def default_chunk_nbytes(max_bytes: int) -> int:
    """256 bytes, halved until the store has 4,096 chunks (down to 1)."""
    chunk = 256
    while chunk > 1 and max_bytes // chunk < 4096:
        chunk //= 2
    return chunk


def _payload_bytes(key: str, payload: Any) -> bytes:
    try:
        view = memoryview(payload)
    except TypeError:
        raise TypeError(
            f"payload for key {key!r} must be a C-contiguous buffer, not {type(payload).__name__}"
        ) from None
    with view:
        if not view.c_contiguous or "O" in view.format:
            raise TypeError(f"payload for key {key!r} must be a C-contiguous buffer of bytes")
        return view.tobytes()


def _str_keys(keys: Iterable[Any], what: str) -> list[str]:
    result = list(keys)
    for key in result:
        if not isinstance(key, str):
            raise TypeError(f"{what} must be str, not {type(key).__name__}")
    return result


class VariableModelStore:
    """The variable-size store's contract, without a victim policy."""

    COUNTERS = (
        "puts",
        "objects_written",
        "retains",
        "releases",
        "evictions",
        "capacity_errors",
        "reads",
        "read_misses",
        "bytes_written",
        "bytes_read",
        "eviction_visits",
    )

    def __init__(self, *, max_bytes: int, chunk_nbytes: int | None = None) -> None:
        for value in (max_bytes, chunk_nbytes):
            if isinstance(value, bool) or not isinstance(value, int | None):
                raise TypeError("max_bytes and chunk_nbytes must be int")
        if max_bytes <= 0:
            raise ValueError("auxiliary output store max_bytes must be positive")
        chunk = default_chunk_nbytes(max_bytes) if chunk_nbytes is None else chunk_nbytes
        if chunk <= 0:
            raise ValueError("auxiliary output store chunk size must be positive")
        if chunk > max_bytes:
            raise ValueError("auxiliary output store must fit at least one chunk")
        self.max_bytes = max_bytes
        self.chunk_nbytes = chunk
        self.capacity_chunks = max_bytes // chunk
        self.capacity_bytes = self.capacity_chunks * chunk
        self._closed = False
        self._objects: dict[str, bytes] = {}
        self._references: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._stats = dict.fromkeys(self.COUNTERS, 0)

    def _chunks(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_nbytes)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")

    # ------------------------------------------------------------------ put

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> None:
        self._raise_if_closed()
        items: list[tuple[str, bytes]] = []
        for obj in list(objects):
            try:
                key, payload = obj.key, obj.payload
            except AttributeError:
                raise TypeError(
                    f"objects must have .key and .payload, not {type(obj).__name__}"
                ) from None
            if not isinstance(key, str):
                raise TypeError(f"object key must be str, not {type(key).__name__}")
            items.append((key, _payload_bytes(key, payload)))
        retains = _str_keys(retain_keys or (), "retain key")
        releases = _str_keys(release_keys or (), "release key")
        counts = dict(self._references)
        for key in retains:
            counts[key] = counts.get(key, 0) + 1
        for key in releases:
            if counts.get(key, 0) == 0:
                raise KeyError(key)
            counts[key] -= 1

        before = (copy.copy(self._objects), dict(self._references), OrderedDict(self._lru))
        batch: dict[str, bytes] = {}
        for key, payload in items:
            batch[key] = payload
        for key in retains:
            old = self._references.get(key, 0)
            self._references[key] = old + 1
            if old == 0:
                self._lru.pop(key, None)
        released: list[str] = []
        for key in releases:
            self._references[key] -= 1
            if self._references[key] == 0:
                del self._references[key]
                released.append(key)
        for key in batch:
            if key not in self._references:
                self._lru[key] = None
                self._lru.move_to_end(key)
        for key in released:
            if key in self._objects or key in batch:
                self._lru[key] = None
                self._lru.move_to_end(key)

        def charge(key: str) -> int:
            return self._chunks(len(batch[key] if key in batch else self._objects[key]))

        used = sum(charge(key) for key in self._objects.keys() | batch.keys())
        need = used - self.capacity_chunks
        victims: list[str] = []
        if need > 0:
            protected = set(batch) - set(released)
            freed = 0
            for key in self._lru:
                if freed >= need:
                    break
                if key in protected:
                    continue
                victims.append(key)
                freed += charge(key)
            self._stats["eviction_visits"] += len(victims)
            if freed < need:
                self._objects, self._references, self._lru = before
                self._stats["capacity_errors"] += 1
                raise BlockObjectStoreError(
                    "auxiliary output store cannot retain the requested batch: "
                    f"limit={self.capacity_bytes} bytes"
                )
        for key in victims:
            del self._lru[key]
            self._objects.pop(key, None)
        for key, payload in batch.items():
            if key not in victims:
                self._objects[key] = payload
                self._stats["objects_written"] += 1
                self._stats["bytes_written"] += len(payload)
        self._stats["evictions"] += len(victims)
        self._stats["retains"] += len(retains)
        self._stats["releases"] += len(releases)
        self._stats["puts"] += 1

    # ------------------------------------------------------------------ reads

    def _touch(self, keys: list[str]) -> None:
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        self._raise_if_closed()
        wanted = _str_keys(keys, "key")
        for key in wanted:
            if key not in self._objects:
                self._stats["read_misses"] += 1
                used = sum(len(payload) for payload in self._objects.values())
                raise BlockObjectStoreError(
                    f"auxiliary output object {key!r} does not exist; the object may have been "
                    f"evicted (used={used}, limit={self.capacity_bytes} bytes). Increase "
                    "aux_output_config.max_bytes when a KV cache hit requires it."
                )
        result = b"".join(self._objects[key] for key in wanted)
        self._touch(wanted)
        self._stats["reads"] += len(wanted)
        self._stats["bytes_read"] += len(result)
        return result

    def get_many(self, keys: Iterable[str]) -> tuple[bytes, list[str], list[int]]:
        self._raise_if_closed()
        wanted = _str_keys(keys, "key")
        chunks: list[bytes] = []
        missing: list[str] = []
        offsets = [0]
        for key in wanted:
            payload = self._objects.get(key)
            if payload is None:
                missing.append(key)
            else:
                chunks.append(payload)
            offsets.append(offsets[-1] + (0 if payload is None else len(payload)))
        self._touch([key for key in wanted if key in self._objects])
        data = b"".join(chunks)
        self._stats["reads"] += len(wanted) - len(missing)
        self._stats["read_misses"] += len(missing)
        self._stats["bytes_read"] += len(data)
        return data, missing, offsets

    def get_optional(self, key: str) -> bytes | None:
        data, missing, _ = self.get_many([key])
        return None if missing else data

    def contains(self, keys: Iterable[str]) -> list[bool]:
        self._raise_if_closed()
        return [key in self._objects for key in _str_keys(keys, "key")]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._objects.clear()
            self._lru.clear()
            self._references.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ introspection

    def snapshot(self) -> dict[str, Any]:
        return {
            "lru": list(self._lru),
            "references": dict(self._references),
            "objects": dict(self._objects),
        }

    def stats(self) -> dict[str, int]:
        stored_bytes = sum(len(payload) for payload in self._objects.values())
        used = sum(self._chunks(len(payload)) for payload in self._objects.values())
        return {
            "capacity": self.capacity_bytes,
            "chunk_nbytes": self.chunk_nbytes,
            "stored": len(self._objects),
            "stored_bytes": stored_bytes,
            "used_bytes": used * self.chunk_nbytes,
            "free_bytes": (self.capacity_chunks - used) * self.chunk_nbytes,
            "referenced": len(self._references),
            "evictable": len(self._lru),
            **self._stats,
        }

    def check(self) -> None:
        used = sum(self._chunks(len(payload)) for payload in self._objects.values())
        if used > self.capacity_chunks:
            raise AssertionError("stored objects exceed the capacity")
        evictable = [key for key in self._objects if key not in self._references]
        if set(self._lru) != set(evictable):
            raise AssertionError("the LRU must hold exactly the stored unreferenced keys")
        if any(count < 1 for count in self._references.values()):
            raise AssertionError("reference counts must be >= 1 where present")
