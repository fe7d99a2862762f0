"""Threads sharing one store (docs/guarantees.md, issue 5 part 3).

Several threads put, retain, release and read one store; a background writer serves
concurrent readers; a store is closed from another thread while others work. Each test runs
for about a second: no crash, no deadlock (every join has a timeout and a thread still alive
fails the test), no torn read (every payload is one repeated byte, derived from its key, and
always reads back whole), a retained key is always readable, and ``check()`` holds at the end.

Payloads are 512 bytes, the size from which slot writes use streaming stores.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError
from refused import put_refused
from scripts import TIMEOUT

N = 512
SLOTS = 256
DURATION = 1.0  # seconds of concurrent work per test
JOIN_TIMEOUT = 10.0  # a thread alive after this is a deadlock


def fill_of(key: str) -> int:
    return zlib.crc32(key.encode()) % 255 + 1


def payload_of(key: str) -> bytes:
    return bytes([fill_of(key)]) * N


def assert_whole(keys: list[str], data: bytes | memoryview) -> None:
    """Each N-byte chunk is the payload of its key: one repeated byte, never a mix."""
    assert len(data) == len(keys) * N
    for i, key in enumerate(keys):
        chunk = bytes(data[i * N : (i + 1) * N])
        if chunk != payload_of(key):
            values = sorted(set(chunk))
            raise AssertionError(f"torn or wrong read of {key!r}: byte values {values[:8]}")


def is_missing(error: BaseException) -> bool:
    return isinstance(error, BlockObjectStoreError) and "does not exist" in str(error)


def is_closed(error: BaseException) -> bool:
    return type(error) is RuntimeError and "closed" in str(error)


class Workers:
    """Runs ``target(worker_id, stop)`` on threads; records every unexpected exception."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []
        self.done = 0
        self._lock = threading.Lock()

    def spawn(self, name: str, target: Callable[[int, threading.Event], None], count: int) -> None:
        for worker in range(count):

            def run(worker: int = worker) -> None:
                try:
                    target(worker, self.stop)
                except BaseException as error:
                    with self._lock:
                        self.errors.append((f"{name}[{worker}]", error))
                    self.stop.set()
                with self._lock:
                    self.done += 1

            thread = threading.Thread(target=run, name=f"{name}-{worker}", daemon=True)
            self.threads.append(thread)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        self.stop.set()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        alive = [thread.name for thread in self.threads if thread.is_alive()]
        assert not alive, f"deadlock: threads still running after {JOIN_TIMEOUT} s: {alive}"
        if self.errors:
            where, error = self.errors[0]
            raise AssertionError(f"{len(self.errors)} thread errors; first in {where}") from error

    def run_for(self, seconds: float) -> None:
        self.start()
        self.stop.wait(seconds)
        self.join()


class FirstVictims:
    """A victim policy in Python: its callbacks run with the store's lock held."""

    def __init__(self) -> None:
        self.changes = 0

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        self.changes += 1

    def select_victims(self, candidates: Any, count: int) -> list[str]:
        return [next(candidates) for _ in range(count)]

    def on_remove(self, keys: list[str], reason: str) -> None:
        assert reason == "eviction", reason


class Written:
    """Keys written so far, for readers to pick from (bounded, thread-safe enough: appends
    and slices of a list are atomic under the GIL)."""

    def __init__(self) -> None:
        self.keys: list[str] = ["seed-0"]

    def add(self, keys: list[str]) -> None:
        self.keys.extend(keys)
        if len(self.keys) > 4 * SLOTS:
            del self.keys[: 2 * SLOTS]

    def sample(self, rng: random.Random, count: int) -> list[str]:
        keys = self.keys[-2 * SLOTS :]
        return [rng.choice(keys) for _ in range(count)]


def writer_loop(store: Any, written: Written, counts: dict[str, int]) -> Callable[..., None]:
    """Puts batches of new keys, retains half of each batch (a running request), reads its
    retained keys back (they must be there), and releases them two batches later, in reverse
    order; every fourth batch goes through put_blocks."""

    def loop(worker: int, stop: threading.Event) -> None:
        rng = random.Random(worker)
        held: list[list[str]] = []
        batch = 0
        while not stop.is_set():
            keys = [f"w{worker}-{batch}-{i}" for i in range(8)]
            retains = keys[::2]
            releases = list(reversed(held.pop(0))) if len(held) >= 2 else []
            if batch % 4 == 3:
                rows = np.stack([np.frombuffer(payload_of(k), dtype=np.uint8) for k in keys])
                store.put_blocks(keys, rows, retain_keys=retains, release_keys=releases)
            else:
                store.put(
                    [BlockObject(k, payload_of(k)) for k in keys],
                    retain_keys=retains,
                    release_keys=releases,
                )
            held.append(retains)
            assert_whole(retains, store.get_concatenated(retains))  # retained: never evicted
            written.add(keys)
            batch += 1
            if rng.random() < 0.1:
                time.sleep(0)
        for keys in held:
            store.put([], release_keys=list(reversed(keys)))
        counts[f"writer-{worker}"] = batch

    return loop


def reader_loop(store: Any, written: Written, counts: dict[str, int]) -> Callable[..., None]:
    """Reads random recent keys three ways; an evicted key is the only allowed failure."""

    def loop(worker: int, stop: threading.Event) -> None:
        rng = random.Random(1000 + worker)
        reads = misses = 0
        out = np.empty(4 * N, dtype=np.uint8)
        while not stop.is_set():
            keys = written.sample(rng, 4)
            try:
                how = reads % 3
                if how == 0:
                    assert_whole(keys, store.get_concatenated(keys))
                elif how == 1:
                    store.get_into(keys, out)
                    assert_whole(keys, out.data)
                else:
                    array = store.get_array(keys, dtype=np.uint8, shape_per_token=(N,))
                    assert_whole(keys, array.tobytes())
                reads += 1
            except BlockObjectStoreError as error:
                if not is_missing(error):
                    raise
                misses += 1
        counts[f"reader-{worker}"] = reads
        assert reads > 0, f"reader {worker} never read (misses: {misses})"

    return loop


def checker_loop(store: Any) -> Callable[..., None]:
    def loop(worker: int, stop: threading.Event) -> None:
        while not stop.is_set():
            store.check()
            stats = store.stats()
            assert stats["stored"] <= stats["capacity"]
            time.sleep(0.01)

    return loop


@pytest.mark.parametrize("policy", [None, FirstVictims], ids=["no-policy", "python-policy"])
def test_threads_putting_retaining_releasing_and_reading_one_store(policy):
    store = BlockObjectStore(
        max_bytes=SLOTS * N, object_nbytes=N, policy=policy() if policy else None
    )
    store.put([BlockObject("seed-0", payload_of("seed-0"))])
    written, counts = Written(), {}
    workers = Workers()
    workers.spawn("writer", writer_loop(store, written, counts), 3)
    workers.spawn("reader", reader_loop(store, written, counts), 3)
    workers.spawn("checker", checker_loop(store), 1)
    workers.run_for(DURATION)
    store.check()
    assert store.snapshot()["references"] == {}, "balanced retains and releases leave no count"
    assert all(counts.get(f"writer-{w}", 0) > 0 for w in range(3)), counts
    stats = store.stats()
    assert stats["evictions"] > 0, "the workload never evicted: it tested nothing"
    store.close()


def test_identical_keys_from_many_threads_read_back_whole():
    """Threads racing to put the same keys (same bytes per key) and read them."""
    store = BlockObjectStore(max_bytes=64 * N, object_nbytes=N)
    keys = [f"shared-{i}" for i in range(200)]

    def loop(worker: int, stop: threading.Event) -> None:
        rng = random.Random(worker)
        while not stop.is_set():
            batch = rng.sample(keys, 16)
            store.put([BlockObject(k, payload_of(k)) for k in batch], retain_keys=batch[:2])
            assert_whole(batch[:2], store.get_concatenated(batch[:2]))
            store.put([], release_keys=batch[:2])
            try:
                assert_whole(batch, store.get_concatenated(batch))
            except BlockObjectStoreError as error:
                if not is_missing(error):
                    raise

    workers = Workers()
    workers.spawn("racer", loop, 4)
    workers.run_for(DURATION)
    store.check()
    assert store.snapshot()["references"] == {}
    store.close()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_background_writer_with_concurrent_readers(kind):
    store = BlockObjectStore(max_bytes=SLOTS * N, object_nbytes=N)
    store.put([BlockObject("seed-0", payload_of("seed-0"))])
    if kind == "python":
        store.put = store.put  # type: ignore[method-assign]  # keeps it off the Rust writer
    writer = BackgroundBlockObjectStore(store, max_pending_batches=4)
    written, counts = Written(), {}
    published: list[str] = []

    def producer(worker: int, stop: threading.Event) -> None:
        held: list[list[str]] = []
        batch = 0
        while not stop.is_set():
            keys = [f"p{worker}-{batch}-{i}" for i in range(8)]
            releases = list(reversed(held.pop(0))) if len(held) >= 2 else []
            if batch % 3 == 2:
                rows = np.stack([np.frombuffer(payload_of(k), dtype=np.uint8) for k in keys])
                writer.put_blocks(keys, rows, retain_keys=keys[:4], release_keys=releases)
            else:
                writer.put(
                    [BlockObject(k, payload_of(k)) for k in keys],
                    retain_keys=keys[:4],
                    release_keys=releases,
                )
            held.append(keys[:4])
            written.add(keys)
            published.append(keys[0])
            batch += 1
        for keys in held:
            writer.put([], release_keys=list(reversed(keys)))
        counts[f"producer-{worker}"] = batch

    def waiting_reader(worker: int, stop: threading.Event) -> None:
        """Reads through the writer: it waits for queued puts, so a retained key that was
        published before the read began must be there."""
        reads = 0
        while not stop.is_set():
            if published:
                key = published[-1]
                # Still retained unless two more batches of its producer went out since.
                try:
                    assert_whole([key], writer.get_concatenated([key]))
                    reads += 1
                except BlockObjectStoreError as error:
                    if not is_missing(error):
                        raise
            time.sleep(0.001)
        counts[f"waiting-reader-{worker}"] = reads

    workers = Workers()
    workers.spawn("producer", producer, 2)
    workers.spawn("reader", reader_loop(store, written, counts), 2)
    workers.spawn("waiting-reader", waiting_reader, 1)
    workers.spawn("checker", checker_loop(store), 1)
    workers.run_for(DURATION)
    assert writer.get_concatenated([]) == b""  # drained, no latched error
    store.check()
    assert store.snapshot()["references"] == {}
    assert counts.get("producer-0", 0) > 0 and counts.get("producer-1", 0) > 0, counts
    writer.close()
    assert store.closed


def worker_until_closed(store: Any, operation: str, counts: dict[str, int]) -> Callable[..., None]:
    """Repeats one operation until the store reports closed; any other error is a failure."""

    def loop(worker: int, stop: threading.Event) -> None:
        rng = random.Random(worker)
        done = 0
        out = np.empty(2 * N, dtype=np.uint8)
        deadline = time.monotonic() + JOIN_TIMEOUT
        while time.monotonic() < deadline:
            key = f"{operation}-{worker}-{done}"
            old = f"seed-{rng.randrange(8)}"
            try:
                if operation == "put":
                    store.put([BlockObject(key, payload_of(key))], retain_keys=[key])
                    store.put([], release_keys=[key])
                elif operation == "put_blocks":
                    store.put_blocks([key], np.frombuffer(payload_of(key), dtype=np.uint8))
                elif operation == "get":
                    assert_whole([old, old], store.get_concatenated([old, old]))
                elif operation == "get_into":
                    store.get_into([old, old], out)
                    assert_whole([old, old], out.data)
                elif operation == "get_array":
                    store.get_array([old], dtype=np.uint8, shape_per_token=(N,))
                else:  # stats, check and snapshot keep working after close
                    store.check()
                    store.stats()
                    store.snapshot()
                    if store.closed:
                        break
            except RuntimeError as error:
                if is_closed(error):
                    break
                if not is_missing(error):
                    raise
            done += 1
        else:
            raise AssertionError(f"{operation} never saw the store closed")
        counts[f"{operation}-{worker}"] = done

    return loop


OPERATIONS = ["put", "put_blocks", "get", "get_into", "get_array", "inspect"]


def test_close_from_another_thread_while_others_work():
    store = BlockObjectStore(max_bytes=64 * N, object_nbytes=N)
    store.put([BlockObject(f"seed-{i}", payload_of(f"seed-{i}")) for i in range(8)])
    store.put([], retain_keys=[f"seed-{i}" for i in range(8)])
    counts: dict[str, int] = {}
    workers = Workers()
    for operation in OPERATIONS:
        workers.spawn(operation, worker_until_closed(store, operation, counts), 1)
    workers.start()
    time.sleep(DURATION / 2)
    closers = [threading.Thread(target=store.close, daemon=True) for _ in range(3)]
    for closer in closers:  # several threads closing at once: idempotent, no crash
        closer.start()
    for closer in closers:
        closer.join(JOIN_TIMEOUT)
        assert not closer.is_alive(), "close() deadlocked"
    workers.join()
    assert store.closed
    assert all(counts.get(f"{op}-0", 0) > 0 for op in OPERATIONS), counts
    store.close()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_closing_a_background_writer_while_producers_and_readers_work(kind):
    store = BlockObjectStore(max_bytes=64 * N, object_nbytes=N)
    store.put([BlockObject("seed-0", payload_of("seed-0"))], retain_keys=["seed-0"])
    if kind == "python":
        store.put = store.put  # type: ignore[method-assign]
    writer = BackgroundBlockObjectStore(store, max_pending_batches=1)  # producers block often
    results: dict[str, int] = {}

    def producer(worker: int, stop: threading.Event) -> None:
        done = 0
        deadline = time.monotonic() + JOIN_TIMEOUT
        while time.monotonic() < deadline:
            keys = [f"p{worker}-{done}-{i}" for i in range(4)]
            try:
                writer.put([BlockObject(k, payload_of(k)) for k in keys])
            except RuntimeError as error:
                if is_closed(error):
                    break
                raise
            done += 1
        else:
            raise AssertionError("the producer never saw the writer closed")
        results[f"producer-{worker}"] = done

    def reader(worker: int, stop: threading.Event) -> None:
        done = 0
        deadline = time.monotonic() + JOIN_TIMEOUT
        while time.monotonic() < deadline:
            try:
                assert_whole(["seed-0"], writer.get_concatenated(["seed-0"]))
            except RuntimeError as error:
                if is_closed(error):
                    break
                raise
            done += 1
        else:
            raise AssertionError("the reader never saw the writer closed")
        results[f"reader-{worker}"] = done

    workers = Workers()
    workers.spawn("producer", producer, 3)
    workers.spawn("reader", reader, 2)
    workers.start()
    time.sleep(DURATION / 2)
    closer = threading.Thread(target=writer.close, daemon=True)
    closer.start()
    writer.close()  # two closes at once
    closer.join(JOIN_TIMEOUT)
    assert not closer.is_alive(), "close() deadlocked"
    workers.join()
    assert store.closed
    assert results.get("producer-0", 0) > 0, results


# --------------------------------------------------------------------------- concurrent close


class SlowClose(BlockObjectStore):
    """A store whose close() takes a while, so a second closer arrives during it."""

    def close(self) -> None:
        time.sleep(0.3)
        super().close()


class PythonSlowStore:
    def __init__(self) -> None:
        self.closed = False
        self.objects: dict[str, bytes] = {}

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        if retain_keys:
            raise RuntimeError("this store refuses retains")
        for obj in objects:
            self.objects[obj.key] = bytes(obj.payload)

    def get_concatenated(self, keys: Any) -> bytes:
        return b"".join(self.objects[k] for k in keys)

    def close(self) -> None:
        time.sleep(0.3)
        self.closed = True


@pytest.mark.parametrize("kind", ["native", "python"])
def test_every_concurrent_close_returns_after_the_store_closed_and_raises(kind):
    if kind == "native":
        store: Any = SlowClose(max_bytes=N, object_nbytes=N)
        failing = [BlockObject("a", bytes([1]) * N), BlockObject("b", bytes([2]) * N)]
        writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
        put_refused(writer, failing, retain_keys=["a", "b"])  # cannot retain: latched
    else:
        store = PythonSlowStore()
        writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
        put_refused(writer, [BlockObject("a", bytes([1]) * N)], retain_keys=["a"])  # writer raises
    seen: list[tuple[bool, str]] = []

    def close() -> None:
        try:
            writer.close()
            seen.append((bool(store.closed), "returned"))
        except BlockObjectStoreError as error:
            seen.append((bool(store.closed), str(error)))

    threads = [threading.Thread(target=close) for _ in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(TIMEOUT)
    assert len(seen) == 3
    assert all(closed for closed, _ in seen), seen
    assert all("publication failed" in message for _, message in seen), seen
