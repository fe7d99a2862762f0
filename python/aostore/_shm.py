"""``ShmBlockObjectStore``: the fixed store under the name and surface of vLLM's Mooncake branch.

vLLM's open Mooncake branch (vllm#57968) moves its fixed store to
``vllm/distributed/aux_output_connector/shm.py`` as ``ShmBlockObjectStore(*, max_bytes,
object_nbytes)``. That class still keeps referenced and unreferenced keys in one LRU and walks
it from the oldest key on every evicting put (the original store's rescan). Its semantics are those
of
aostore's ``fail-closed`` profile (docs/semantics.md and docs/mooncake.md), which this class uses,
with O(1)
eviction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Self, cast

from aostore._store import BlockObjectStore
from aostore.errors import ObjectMissingError

__all__ = ["ShmBlockObjectStore"]


def _missing(used: int, limit: int) -> str:
    # The branch's wording: unlike aostore's own store, it does not name the key.
    return (
        "auxiliary output object does not exist; the object may have been evicted "
        f"(used={used}, limit={limit} objects). Increase aux_output_config.max_bytes when a "
        "KV cache hit requires it."
    )


class ShmBlockObjectStore(BlockObjectStore):
    """A bounded fail-closed store with the contract of the Mooncake branch's class.

    ``ShmBlockObjectStore(*, max_bytes, object_nbytes, pin_memory=False, prefault=False)``
    holds ``num_slots = max_bytes // object_nbytes`` objects of exactly ``object_nbytes``
    bytes (attributes ``object_nbytes`` and ``num_slots``). It is
    ``BlockObjectStore(profile="fail-closed")`` without a victim policy, so:

    - ``put(objects, *, retain_keys=(), release_keys=())`` deduplicates by key (the last
      payload wins, the first occurrence keeps its place), applies retains, then releases,
      moves the batch's unreferenced keys and then the keys released to zero to the LRU tail,
      and evicts the oldest unreferenced keys (never a batch key this call does not release).
      When too few can go it raises ``BlockObjectStoreError`` ("auxiliary output store cannot
      retain the requested batch: limit=N objects"), evicts nothing and stores none of the new
      keys; the count changes and moves stay applied, as on the branch. The eviction walk never
      looks at referenced keys (the branch's walks all of them);
    - ``get_concatenated(keys)`` returns the payloads in order and moves the keys it read to
      the LRU tail (the branch's does; vLLM 0.33.0's store does not). A key that is not stored
      raises ``ObjectMissingError`` (a ``BlockObjectStoreError``) with the branch's message
      ("auxiliary output object does not exist; the object may have been evicted (used=N,
      limit=M objects). Increase aux_output_config.max_bytes when a KV cache hit requires
      it."), chained from ``KeyError(key)`` for the first key that is missing;
    - after ``close()`` (idempotent) both raise ``RuntimeError("auxiliary output store is
      closed")``; the constructor raises ``ValueError`` for ``object_nbytes <= 0`` ("object
      size must be positive") and ``max_bytes < object_nbytes`` ("must fit at least one
      object").

    Where it differs from the branch's class, on input the branch does not expect: a release
    of a key that is not referenced raises ``KeyError(key)`` here before anything changes (the
    branch keeps the retains and the releases before that key, at their old LRU places); a
    payload that is not exactly ``object_nbytes`` bytes raises ``ValueError`` before anything
    changes (the branch's arena raises ``IndexError`` while writing, after evicting); a key
    that is not ``str`` raises ``TypeError``. Behind the background wrapper these differences
    are not observable: the writer latches the first error and every later call raises it.
    """

    __slots__ = ()

    def __new__(
        cls,
        *,
        max_bytes: int,
        object_nbytes: int,
        pin_memory: bool = False,
        prefault: bool | Literal["background"] = False,
    ) -> Self:
        store = super().__new__(
            cls,
            max_bytes=max_bytes,
            object_nbytes=object_nbytes,
            policy=None,
            profile="fail-closed",
            pin_memory=pin_memory,
            prefault=prefault,
        )
        return cast(Self, store)

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        """The payloads of ``keys``, concatenated; the keys read move to the LRU tail."""
        wanted = keys if isinstance(keys, list | tuple) else list(keys)
        try:
            return super().get_concatenated(wanted)
        except ObjectMissingError:
            present = self.contains(wanted)
            first = next(key for key, found in zip(wanted, present, strict=True) if not found)
            stored = self.stats()["stored"]
            cause = KeyError(first)
            raise ObjectMissingError(_missing(stored, self.num_slots)) from cause
