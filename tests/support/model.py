"""Reference model of the aostore block store, profile ``fail-closed`` (docs/semantics.md).

This is the contract written as plain Python: dicts, an ``OrderedDict`` for the LRU
of evictable keys, and ``bytes`` copies for payloads. It favours being obviously
correct over being fast. The differential test runs it beside the Rust store and
requires identical results, errors and ``snapshot()`` after every step.

Choices where docs/semantics.md is silent:

* Validation order: the closed check first, then each object in batch order (its
  ``key``/``payload`` attributes, the key's type, the payload's buffer type and
  C-contiguity, then its length), then the types of ``retain_keys`` and
  ``release_keys``, then the release counts. Overwritten duplicates are validated
  too: every object in the call must be well formed.
* "Released, in release order" means the order in which keys *reach zero*: with
  ``a`` at count 2 and ``release_keys=[a, b, a]``, ``b`` is released before ``a``.
* A release that reaches zero for a key that is neither stored nor in the batch
  just drops the count; the key never enters the LRU.
* A batch key that is new, released in the same call and picked as a victim is
  never written; it counts as an eviction and is visited by the walk.
* A key in ``retain_keys``/``release_keys`` that is not ``str`` raises ``TypeError``, like an
  object's key; so does a key passed to ``get_concatenated``.
* ``stats()["referenced"]`` counts every key with a count >= 1, stored or not.
* ``eviction_visits`` counts every key the eviction walk looks at (victims and
  skipped batch keys), including walks that end in a capacity error.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class BlockObjectStoreError(RuntimeError):
    """Storage or retrieval failed (capacity, missing key, latched writer error)."""


@dataclass(frozen=True)
class BlockObject:
    """One immutable object: ``payload`` holds ``object_nbytes`` bytes."""

    key: str
    payload: Any


def _payload_bytes(key: str, payload: Any, object_nbytes: int) -> bytes:
    """Validate one payload and return a private copy of its bytes."""
    try:
        view = memoryview(payload)
    except TypeError:
        raise TypeError(
            f"payload for key {key!r} must be a C-contiguous buffer, not {type(payload).__name__}"
        ) from None
    with view:
        if not view.c_contiguous:
            raise TypeError(f"payload for key {key!r} must be a C-contiguous buffer")
        if view.nbytes != object_nbytes:
            raise ValueError(
                f"payload for key {key!r} has {view.nbytes} bytes, expected {object_nbytes} bytes"
            )
        return view.tobytes()


def _str_keys(keys: Iterable[Any], what: str) -> list[str]:
    result = list(keys)
    for key in result:
        if not isinstance(key, str):
            raise TypeError(f"{what} must be str, not {type(key).__name__}")
    return result


class ModelStore:
    """Fail-closed block store: bounded, reference-counted, LRU over evictable keys."""

    def __init__(
        self,
        *,
        max_bytes: int,
        object_nbytes: int,
        policy: Any = None,
        profile: str = "fail-closed",
    ) -> None:
        if not isinstance(max_bytes, int) or not isinstance(object_nbytes, int):
            raise TypeError("max_bytes and object_nbytes must be int")
        if object_nbytes <= 0:
            raise ValueError("auxiliary output object size must be positive")
        if max_bytes < object_nbytes:
            raise ValueError("auxiliary output store must fit at least one object")
        if policy is not None:
            raise NotImplementedError("the model has no victim policy")
        if profile != "fail-closed":
            raise ValueError(f"the model only implements profile 'fail-closed', not {profile!r}")
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._closed = False
        # Every stored key and its bytes.
        self._objects: dict[str, bytes] = {}
        # Keys with a count >= 1, stored or not.
        self._references: dict[str, int] = {}
        # Stored keys with no reference, oldest first. Values are unused.
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._stats = dict.fromkeys(
            (
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
            ),
            0,
        )

    # ------------------------------------------------------------------ put

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        # Rule 1: a closed store refuses everything.
        self._raise_if_closed()

        # Rule 2: validate everything before changing anything.
        batch_items: list[tuple[str, bytes]] = []
        for obj in list(objects):
            try:
                key, payload = obj.key, obj.payload
            except AttributeError:
                raise TypeError(
                    f"objects must have .key and .payload, not {type(obj).__name__}"
                ) from None
            if not isinstance(key, str):
                raise TypeError(f"object key must be str, not {type(key).__name__}")
            batch_items.append((key, _payload_bytes(key, payload, self.object_nbytes)))
        retains = _str_keys(retain_keys, "retain key")
        releases = _str_keys(release_keys, "release key")
        counts = dict(self._references)
        for key in retains:
            counts[key] = counts.get(key, 0) + 1
        for key in releases:
            if counts.get(key, 0) == 0:
                raise KeyError(key)
            counts[key] -= 1

        self._stats["puts"] += 1

        # Rule 3: deduplicate; last payload wins, first occurrence fixes position.
        batch: dict[str, bytes] = {}
        for key, payload in batch_items:
            batch[key] = payload

        # Rule 4: retains, then releases.
        for key in retains:
            old = self._references.get(key, 0)
            self._references[key] = old + 1
            self._stats["retains"] += 1
            if old == 0:
                self._lru.pop(key, None)
        released: list[str] = []
        for key in releases:
            self._references[key] -= 1
            self._stats["releases"] += 1
            if self._references[key] == 0:
                del self._references[key]
                released.append(key)

        # Rule 5: unreferenced batch keys to the tail in batch order (new keys enter
        # tentatively), then released keys that are stored or in the batch.
        for key in batch:
            if key not in self._references:
                self._lru[key] = None
                self._lru.move_to_end(key)
        for key in released:
            if key in self._objects or key in batch:
                self._lru[key] = None
                self._lru.move_to_end(key)

        # Rule 6: evict from the front, skipping batch keys not released here.
        new_keys = [key for key in batch if key not in self._objects]
        need = len(self._objects) + len(new_keys) - self.num_slots
        victims: list[str] = []
        if need > 0:
            protected = set(batch) - set(released)
            for key in self._lru:
                self._stats["eviction_visits"] += 1
                if key in protected:
                    continue
                victims.append(key)
                if len(victims) == need:
                    break
            if len(victims) < need:
                # Fail closed: nobody is evicted and the new keys are not stored;
                # the count changes and order moves above stay applied.
                for key in new_keys:
                    self._lru.pop(key, None)
                self._stats["capacity_errors"] += 1
                raise BlockObjectStoreError(
                    "auxiliary output store cannot retain the requested batch: "
                    f"limit={self.num_slots} objects"
                )
            for key in victims:
                del self._lru[key]
                self._objects.pop(key, None)
            self._stats["evictions"] += len(victims)

        # Rule 7: write the new keys that were not chosen as victims.
        chosen = set(victims)
        for key in new_keys:
            if key not in chosen:
                self._objects[key] = batch[key]
                self._stats["objects_written"] += 1
                self._stats["bytes_written"] += self.object_nbytes

    # ------------------------------------------------------------------ read

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        self._raise_if_closed()
        wanted = _str_keys(keys, "key")
        for key in wanted:
            if key not in self._objects:
                self._stats["read_misses"] += 1
                raise BlockObjectStoreError(
                    f"auxiliary output object {key!r} does not exist; it may have been "
                    f"evicted (used={len(self._objects)}, limit={self.num_slots} objects). "
                    "Increase aux_output_config.max_bytes when a KV cache hit requires it."
                )
        result = b"".join(self._objects[key] for key in wanted)
        for key in wanted:
            if key in self._lru:
                self._lru.move_to_end(key)
        self._stats["reads"] += 1
        self._stats["bytes_read"] += len(result)
        return result

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._objects.clear()
            self._lru.clear()
            self._references.clear()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")

    # ------------------------------------------------------------------ introspection

    def snapshot(self) -> dict[str, Any]:
        return {
            "lru": list(self._lru),
            "references": dict(self._references),
            "objects": dict(self._objects),
        }

    def stats(self) -> dict[str, int]:
        referenced = len(self._references)
        return {
            "capacity": self.num_slots,
            "stored": len(self._objects),
            "referenced": referenced,
            "evictable": len(self._lru),
            "free_slots": self.num_slots - len(self._objects),
            **self._stats,
        }

    def check(self) -> None:
        if len(self._objects) > self.num_slots:
            raise AssertionError("more stored objects than slots")
        for key, payload in self._objects.items():
            if len(payload) != self.object_nbytes:
                raise AssertionError(f"object {key!r} has the wrong size")
        evictable = [key for key in self._objects if key not in self._references]
        if set(self._lru) != set(evictable):
            raise AssertionError("the LRU must hold exactly the stored unreferenced keys")
        if any(count < 1 for count in self._references.values()):
            raise AssertionError("reference counts must be >= 1 where present")
