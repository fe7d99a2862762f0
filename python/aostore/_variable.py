"""The variable-size store users construct: objects of any size under one byte budget."""

from __future__ import annotations

from typing import Any, Literal

from aostore._native import NativeVariableStore


class VariableBlockObjectStore(NativeVariableStore):
    """A bounded store of objects of any size (zero included) keyed by string.

    ``VariableBlockObjectStore(*, max_bytes, policy=None, chunk_nbytes=None, prefault=False)``
    (``prefault`` as ``BlockObjectStore``'s: ``True``, ``False`` or ``"background"``) holds
    objects whose sizes, each rounded up to whole chunks of ``chunk_nbytes`` bytes, sum to
    at most ``max_bytes``. The default chunk is 256 bytes, halved for stores under 1 MiB until
    they have 4,096 chunks (stores under 8 KiB count exact bytes). Objects need not be
    contiguous in the arena, so a batch fits whenever its chunks do, and eviction frees exactly
    the bytes it needs.

    Semantics (docs/variable-store.md): reference counts as ``BlockObjectStore``; a re-put of a
    stored
    key replaces its payload (the size may change), referenced or not; unreferenced keys leave
    in LRU order, oldest first, until the batch fits; a batch that cannot be held raises
    ``BlockObjectStoreError("... cannot retain ...")`` and changes nothing, reference counts
    included. ``get_many`` and ``contains`` read without raising for missing keys.

    Instances accept attribute assignment. All methods are safe to call from several threads;
    payload copies run with the GIL released.
    """

    __slots__ = ("__dict__",)

    def __new__(
        cls,
        *,
        max_bytes: int,
        policy: Any | None = None,
        chunk_nbytes: int | None = None,
        prefault: bool | Literal["background"] = False,
    ) -> VariableBlockObjectStore:
        return super().__new__(
            cls, max_bytes=max_bytes, policy=policy, chunk_nbytes=chunk_nbytes, prefault=prefault
        )

    def __init__(self, **_: Any) -> None:
        """Construction happens in ``__new__``; see the class docstring."""

    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        stats = self.stats()
        return (
            f"<{type(self).__name__} {stats['stored']} objects, {stats['stored_bytes']}/"
            f"{stats['capacity']} B, {stats['referenced']} referenced>"
        )
