"""Garbage collection and memory lifetime (docs/guarantees.md): a store, its writer, its policy and
its
objects in reference cycles are collected, and an arena goes back to the OS once the last reference
to its store (or an abandoned writer) goes. The arena's memory is measured in subprocesses.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore
from scripts import run_script

N = 64


def fill(value: int, nbytes: int = N) -> bytes:
    return bytes([value % 256]) * nbytes


# ---------------------------------------------------------------------------- reference cycles


class Collected:
    """Appends to ``log`` when finalized: proof that the cycle holding it was collected."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    def __del__(self) -> None:
        self.log.append(self.name)


class Policy:
    def on_reference_change(self, key: str, old: int, new: int) -> None:
        pass

    def select_victims(self, candidates: Any, count: int) -> list[str]:
        return [next(candidates) for _ in range(count)]

    def on_remove(self, keys: list[str], reason: str) -> None:
        pass


def collect_until(log: list[str], name: str) -> None:
    for _ in range(3):
        gc.collect()
        if name in log:
            return
    pytest.fail(f"the cycle through {name} was not collected")


def test_a_policy_that_refers_to_its_store_is_collected():
    log: list[str] = []
    policy = Policy()
    store = BlockObjectStore(max_bytes=16 * N, object_nbytes=N, policy=policy)
    policy.store = store  # type: ignore[attr-defined]
    policy.marker = Collected(log, "policy")  # type: ignore[attr-defined]
    del policy, store
    collect_until(log, "policy")


def test_a_writer_referred_to_by_its_store_is_collected():
    log: list[str] = []
    store = BlockObjectStore(max_bytes=16 * N, object_nbytes=N)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    store.writer = writer  # type: ignore[attr-defined]
    store.marker = Collected(log, "store")  # type: ignore[attr-defined]
    writer.put([BlockObject("k", fill(1))])
    del writer, store
    collect_until(log, "store")


def test_a_block_object_in_a_cycle_with_its_payload_is_collected():
    log: list[str] = []

    class Payload(bytearray):
        pass

    payload = Payload(fill(3))
    block = BlockObject("k", payload)
    payload.block = block  # type: ignore[attr-defined]
    payload.marker = Collected(log, "payload")  # type: ignore[attr-defined]
    del payload, block
    collect_until(log, "payload")


def test_an_arena_in_a_policy_cycle_is_returned_to_the_os():
    out = run_script(
        """
        class Policy:
            def on_reference_change(self, key, old, new): pass
            def select_victims(self, candidates, count): return None
            def on_remove(self, keys, reason): pass

        ARENA = 256 << 20
        before = rss()
        policy = Policy()
        store = BlockObjectStore(max_bytes=ARENA, object_nbytes=1 << 20, policy=policy,
                                 prefault=True)
        policy.store = store
        filled = rss()
        del policy, store
        gc.collect()
        print(filled - before >= ARENA * 0.8, filled - rss() >= ARENA * 0.8)
        """,
        timeout=120,
    )
    assert out.split() == ["True", "True"], out


# ---------------------------------------------------------------------------- an abandoned writer


def test_an_abandoned_writer_frees_the_arena_when_the_last_reference_goes():
    out = run_script(
        """
        ARENA = 256 << 20
        NBYTES = 1 << 20
        before = rss()
        store = BlockObjectStore(max_bytes=ARENA, object_nbytes=NBYTES, prefault=True)
        writer = BackgroundBlockObjectStore(store, max_pending_batches=4)
        for i in range(8):
            writer.put([BlockObject(f"k{i}", bytearray(NBYTES))])
        filled = rss()
        del writer, store
        gc.collect()
        # No further call into the extension: the arena must be gone already.
        print(filled - before >= ARENA * 0.8, filled - rss() >= ARENA * 0.8)
        """,
        timeout=120,
    )
    assert out.split() == ["True", "True"], out
