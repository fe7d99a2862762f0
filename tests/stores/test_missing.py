"""A miss is ``aostore.ObjectMissingError``, a ``BlockObjectStoreError``, from every face.

Every store raises the typed miss (the Rust stores through their one error mapping, the
Mooncake store and the tier from Python, the tier also for a read that Mooncake did not answer
within ``read_deadline_s``), so ``except BlockObjectStoreError`` (vLLM's) still catches it. A
foreign store (vLLM's own, which the wrappers accept) says "does not exist" in a plain
``BlockObjectStoreError`` of its own: ``aostore.errors.is_missing`` is the one place that reads
that text, and the wrappers treat such an error as a miss.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from aostore import (
    BackgroundBlockObjectStore,
    BlockObject,
    BlockObjectStore,
    BlockObjectStoreError,
    ObjectMissingError,
    ShmBlockObjectStore,
    VariableBlockObjectStore,
)
from aostore.errors import is_missing
from aostore.mooncake import MooncakeBlockObjectStore, TieredBlockObjectStore
from aostore.routed_experts import materialize_available_routed_experts
from mooncake_fakes import FakeClient

N = 64
WAIT = 30.0  # only reached when something is broken


def blob(i: int) -> bytes:
    return bytes([i % 251]) * N


def assert_miss(call: Any, key: str) -> None:
    with pytest.raises(ObjectMissingError, match="does not exist") as raised:
        call()
    assert isinstance(raised.value, BlockObjectStoreError)
    assert key in str(raised.value) or "object does not exist" in str(raised.value)
    assert is_missing(raised.value)


def faces(store: Any) -> list[Any]:
    """Every raising read of a fixed-size store, for the key ``absent``."""
    reads = [
        lambda: store.get_concatenated(["k", "absent"]),
        lambda: store.get_into(["k", "absent"], bytearray(2 * N)),
        lambda: store.get_array(["absent"], dtype=np.uint8, shape_per_token=(N,)),
    ]
    return reads


def test_the_class_is_a_store_error() -> None:
    assert issubclass(ObjectMissingError, BlockObjectStoreError)
    assert issubclass(ObjectMissingError, RuntimeError)
    from aostore import errors

    assert errors.ObjectMissingError is ObjectMissingError
    assert errors.BlockObjectStoreError is BlockObjectStoreError


@pytest.mark.parametrize("kind", ["fixed", "grow", "shm"])
def test_fixed_stores_raise_the_typed_miss(kind: str) -> None:
    if kind == "shm":
        store: Any = ShmBlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    else:
        profile = "grow" if kind == "grow" else "fail-closed"
        store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N, profile=profile)
    store.put([BlockObject("k", blob(1))])
    for read in faces(store):
        assert_miss(read, "absent")
    if kind == "shm":  # the branch's message and cause, now with the typed class
        with pytest.raises(ObjectMissingError) as raised:
            store.get_concatenated(["absent"])
        assert isinstance(raised.value.__cause__, KeyError)
    store.close()


def test_variable_store_raises_the_typed_miss() -> None:
    store = VariableBlockObjectStore(max_bytes=1 << 16)
    store.put([BlockObject("k", b"abc")])
    assert_miss(lambda: store.get_concatenated(["k", "absent"]), "absent")
    store.close()


@pytest.mark.parametrize("policy", [False, True])
def test_background_store_passes_the_typed_miss_on(policy: bool) -> None:
    class Oldest:
        def select_victims(self, candidates: Any, count: int) -> list[str]:
            return [key for key, _ in zip(candidates, range(count), strict=False)]

    local = BlockObjectStore(max_bytes=4 * N, object_nbytes=N, policy=Oldest() if policy else None)
    store = BackgroundBlockObjectStore(local, max_pending_batches=2)  # Rust, then Python writer
    store.put([BlockObject("k", blob(1))])
    for read in faces(store):
        assert_miss(read, "absent")
    assert store.get_optional("absent") is None
    store.close()


def test_mooncake_store_raises_the_typed_miss() -> None:
    remote = MooncakeBlockObjectStore(FakeClient(), object_nbytes=N)
    remote.put([BlockObject("k", blob(1))])
    for read in faces(remote):
        assert_miss(read, "absent")
    remote.close()


def tier(local_objects: int = 4, **options: Any) -> tuple[TieredBlockObjectStore, FakeClient]:
    client = FakeClient()
    remote = MooncakeBlockObjectStore(client, object_nbytes=N)
    local = BlockObjectStore(max_bytes=local_objects * N, object_nbytes=N)
    options = {"read_deadline_s": 0.3, "retry_backoff_s": 0.05, "check_interval_s": 0.1, **options}
    return TieredBlockObjectStore(local, remote, **options), client


def test_tier_raises_the_typed_miss_for_a_key_in_neither_tier() -> None:
    store, _ = tier()
    store.put([BlockObject("k", blob(1))])
    assert store.flush(timeout=WAIT)
    for read in faces(store):
        assert_miss(read, "absent")
    assert store.get_many(["k", "absent"]) == (blob(1), ["absent"])
    store.close()


def test_tier_raises_the_typed_miss_for_an_unpublished_key() -> None:
    """Mooncake refused the publication and the local tier evicted the key: a miss."""
    store, client = tier(local_objects=2)
    client.put_code = -800
    for start in (0, 2):  # k0, k1 are evicted locally by the second put
        store.put([BlockObject(f"k{i}", blob(i)) for i in range(start, start + 2)])
    store.flush(timeout=WAIT)
    assert "k0" in store.unpublished_keys()
    assert_miss(lambda: store.get_concatenated(["k0"]), "k0")
    store.close()


def test_tier_raises_the_typed_miss_at_the_read_deadline() -> None:
    """Mooncake holds the key but does not answer within read_deadline_s: a miss, in time."""
    release = threading.Event()

    class Stalled(FakeClient):
        def batch_get_buffer(self, keys: list[str]) -> list[bytes | None]:
            release.wait(WAIT)
            return super().batch_get_buffer(keys)

    client = Stalled()
    client.data["far"] = blob(7)
    remote = MooncakeBlockObjectStore(client, object_nbytes=N)
    local = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    store = TieredBlockObjectStore(local, remote, read_deadline_s=0.3, close_timeout_s=2.0)
    try:
        started = time.monotonic()
        assert_miss(lambda: store.get_concatenated(["far"]), "far")
        assert time.monotonic() - started < 0.3 + 3.0
        assert store.stats()["remote_read_failures"] == 1
    finally:
        release.set()
        store.close()


class ForeignError(RuntimeError):
    """A foreign store's own error class, named as vLLM's is."""


ForeignError.__name__ = "BlockObjectStoreError"


class ForeignStore:
    """A store with vLLM's surface only: its misses say "does not exist" in its own class."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        for item in objects:
            self.data[item.key] = bytes(item.payload)

    def get_concatenated(self, keys: Any) -> bytes:
        for key in keys:
            if key not in self.data:
                raise ForeignError("auxiliary output object does not exist")
        return b"".join(self.data[key] for key in keys)

    def close(self) -> None:
        pass


def test_is_missing_reads_a_foreign_stores_text_only() -> None:
    assert is_missing(ObjectMissingError("any words"))
    assert is_missing(ForeignError("auxiliary output object does not exist"))
    assert not is_missing(ForeignError("auxiliary output store cannot retain the batch"))
    assert not is_missing(RuntimeError("auxiliary output object does not exist"))  # not a store's
    assert not is_missing(BlockObjectStoreError("publication failed"))


def test_wrappers_treat_a_foreign_text_miss_as_a_miss() -> None:
    store = BackgroundBlockObjectStore(ForeignStore(), max_pending_batches=2)
    store.put([BlockObject("k", blob(1))])
    assert store.get_optional("k") == blob(1)
    assert store.get_optional("absent") is None
    with pytest.raises(ForeignError, match="does not exist"):  # the foreign error, unchanged
        store.get_concatenated(["absent"])
    store.close()
    foreign = ForeignStore()  # no get_many: one get_concatenated per key
    foreign.put([BlockObject("k", blob(1))])
    found = materialize_available_routed_experts(
        foreign, ["k", "absent"], shape_per_token=(N,), dtype=np.dtype(np.uint8), block_size=1
    )
    assert found.recompute == [(1, 2)]
