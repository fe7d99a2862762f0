"""The store class users construct: the native store with a Python face."""

from __future__ import annotations

from aostore._native import NativeStore


class BlockObjectStore(NativeStore):
    """A bounded store of fixed-size objects keyed by string, with reference counts.

    ``BlockObjectStore(*, max_bytes, object_nbytes, policy=None, profile="fail-closed")``
    holds ``num_slots = max_bytes // object_nbytes`` objects of ``object_nbytes`` bytes.
    Referenced keys are never evicted; unreferenced ones leave in LRU order. See the README
    for the exact semantics of ``put`` and ``get_concatenated``.

    Instances accept attribute assignment (tests replace methods with mocks). All methods are
    safe to call from several threads; payload copies run with the GIL released.
    """

    __slots__ = ("__dict__",)

    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        stats = self.stats()
        return (
            f"<{type(self).__name__} {stats['stored']}/{stats['capacity']} objects of "
            f"{stats['object_nbytes']} B, {stats['referenced']} referenced>"
        )
