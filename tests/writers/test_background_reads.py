"""The background wrapper's flush() and non-raising reads (docs/variable-store.md): they see every
queued update, report misses without raising, and surface a latched error."""

from __future__ import annotations

import time
from typing import Any

import pytest
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError
from refused import put_refused

N = 32


def fill(value: int) -> bytes:
    return bytes([value]) * N


class SlowStore:
    """A Python store (as vLLM's would be) whose puts take a while; misses raise its own
    ``BlockObjectStoreError`` class."""

    class BlockObjectStoreError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        time.sleep(0.02)
        for obj in objects:
            self.objects.setdefault(obj.key, bytes(obj.payload))

    def get_concatenated(self, keys: Any) -> bytes:
        for key in keys:
            if key not in self.objects:
                raise SlowStore.BlockObjectStoreError(f"object {key!r} does not exist")
        return b"".join(self.objects[k] for k in keys)

    def close(self) -> None:
        pass


def stores() -> list[Any]:
    return [BlockObjectStore(max_bytes=64 * N, object_nbytes=N), SlowStore()]


@pytest.mark.parametrize("store", stores(), ids=["aostore", "python-store"])
def test_get_optional_sees_queued_puts_and_reports_a_miss_as_none(store: Any) -> None:
    writer = BackgroundBlockObjectStore(store, max_pending_batches=4)
    for i in range(5):
        writer.put([BlockObject(f"k{i}", fill(i))])
    assert writer.get_optional("k4") == fill(4)
    assert writer.get_optional("missing") is None
    writer.close()


@pytest.mark.parametrize("store", stores(), ids=["aostore", "python-store"])
def test_flush_waits_for_every_queued_update(store: Any) -> None:
    writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
    for i in range(8):
        writer.put([BlockObject(f"k{i}", fill(i))])
    writer.flush()
    # Read from the store itself, bypassing the wrapper's own wait.
    assert store.get_concatenated([f"k{i}" for i in range(8)]) == b"".join(
        fill(i) for i in range(8)
    )
    writer.close()


def test_flush_and_get_optional_raise_a_latched_error() -> None:
    store = BlockObjectStore(max_bytes=N, object_nbytes=N)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    keys = ["a", "b"]
    put_refused(writer, [BlockObject(k, fill(1)) for k in keys], retain_keys=keys)  # too many
    with pytest.raises(BlockObjectStoreError, match="publication failed"):
        writer.flush()
    with pytest.raises(BlockObjectStoreError, match="publication failed"):
        writer.get_optional("a")
    with pytest.raises(BlockObjectStoreError):
        writer.close()


def test_get_optional_on_a_store_error_other_than_a_miss_propagates() -> None:
    class Broken(SlowStore):
        def get_concatenated(self, keys: Any) -> bytes:
            raise OSError("disk on fire")

    writer = BackgroundBlockObjectStore(Broken(), max_pending_batches=2)
    with pytest.raises(OSError, match="disk on fire"):
        writer.get_optional("k")
    writer.close()
