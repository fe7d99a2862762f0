"""Faults: writer errors, policy errors, full queues, close() at any point, process exit,
and memory returned to the OS (docs/api.md, docs/guarantees.md, issue 5 part 4).

A writer error is latched: later updates are skipped and the next ``put``,
``get_concatenated`` or ``close`` raises ``BlockObjectStoreError("... publication failed")``
chained from the cause. Nothing is half-applied: ``check()`` holds and the snapshot shows
exactly the updates that went through.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError
from refused import put_refused

N = 64
EXIT_TIMEOUT = 20.0


class UserError(Exception):
    pass


def fill(value: int, nbytes: int = N) -> bytes:
    return bytes([value % 256]) * nbytes


def block(key: str, value: int = 1) -> BlockObject:
    return BlockObject(key, fill(value))


def assert_publication_failed(error: BaseException, cause: type[BaseException]) -> None:
    assert isinstance(error, BlockObjectStoreError), repr(error)
    assert "publication failed" in str(error)
    assert isinstance(error.__cause__, cause), repr(error.__cause__)


class PythonStore:
    """A store written in Python (as a vLLM store or a test double would be)."""

    def __init__(self, *, fail_on: int | None = None, delay: float = 0.0) -> None:
        self.fail_on = fail_on
        self.delay = delay
        self.calls: list[tuple[list[str], tuple[str, ...], tuple[str, ...]]] = []
        self.objects: dict[str, bytes] = {}
        self.close_calls = 0

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        if self.delay:
            time.sleep(self.delay)
        self.calls.append(([o.key for o in objects], tuple(retain_keys), tuple(release_keys)))
        if len(self.calls) == self.fail_on:
            raise UserError(f"put #{self.fail_on} failed")
        for obj in objects:
            self.objects.setdefault(obj.key, bytes(obj.payload))

    def get_concatenated(self, keys: Any) -> bytes:
        return b"".join(self.objects[k] for k in keys)

    def close(self) -> None:
        self.close_calls += 1


# --------------------------------------------------------------------------- writer errors


def test_an_exception_in_the_underlying_store_is_latched_and_surfaced():
    store = PythonStore(fail_on=2)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=4)
    writer.put([block("a")])
    put_refused(writer, [block("b")])  # fails on the writer thread
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.get_concatenated(["a"])  # waits for the queue, then raises the latched error
    assert_publication_failed(raised.value, UserError)
    assert "put #2 failed" in str(raised.value.__cause__)
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.put([block("c")])  # raises without queueing
    assert_publication_failed(raised.value, UserError)
    assert [keys for keys, _, _ in store.calls] == [["a"], ["b"]], "later updates must be skipped"
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.close()
    assert_publication_failed(raised.value, UserError)
    assert store.close_calls == 1
    writer.close()  # idempotent: no second raise, no second store.close()
    assert store.close_calls == 1
    with pytest.raises(RuntimeError, match="closed"):
        writer.put([block("d")])


def test_updates_queued_behind_a_failure_are_skipped():
    store = PythonStore(fail_on=1, delay=0.05)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
    writer.put([block("a")])
    queued = 0
    for key in "bcde":  # queued while the first update is still running
        try:
            writer.put([block(key)])
            queued += 1
        except BlockObjectStoreError as error:
            assert_publication_failed(error, UserError)
            break
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    assert len(store.calls) == 1, f"{queued} queued updates were applied after the failure"
    assert store.close_calls == 1


def test_a_mock_store_works_and_its_errors_are_latched():
    from unittest import mock

    store = mock.Mock(spec=["put", "get_concatenated", "close"])
    store.get_concatenated.return_value = b"xy"
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    writer.put([block("a")], retain_keys=["a"])
    assert writer.get_concatenated(["a"]) == b"xy"
    store.put.assert_called_once()
    store.put.side_effect = UserError("mock failed")
    put_refused(writer, [block("b")])
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.get_concatenated(["b"])
    assert_publication_failed(raised.value, UserError)
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    store.close.assert_called_once_with()


class RaisingPolicy:
    def __init__(self) -> None:
        self.armed = False

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        if self.armed:
            raise UserError(f"policy refused {key}")

    def select_victims(self, candidates: Any, count: int) -> list[str]:
        return [next(candidates) for _ in range(count)]

    def on_remove(self, keys: list[str], reason: str) -> None:
        pass


def test_an_exception_in_a_policy_callback_is_latched_and_nothing_half_applied():
    policy = RaisingPolicy()
    store = BlockObjectStore(max_bytes=8 * N, object_nbytes=N, policy=policy)
    store.put([block("a", 1), block("b", 2)], retain_keys=["a"])
    before = store.snapshot()
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)  # Python writer thread
    policy.armed = True
    put_refused(writer, [block("new", 3)], retain_keys=["new"])
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.get_concatenated(["a"])
    assert_publication_failed(raised.value, UserError)
    policy.armed = False
    with pytest.raises(BlockObjectStoreError):
        writer.put([block("later", 4)])
    store.check()
    after = store.snapshot()
    assert after["objects"] == before["objects"], "the failed batch stored a key"
    assert "later" not in after["objects"]
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    assert store.closed


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_capacity_error_in_the_writer_is_latched(kind):
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    store.put([block(f"r{i}", i) for i in range(3)], retain_keys=["r0", "r1", "r2"])
    if kind == "python":
        store.put = store.put  # type: ignore[method-assign]  # keeps it off the Rust writer
    before = store.snapshot()
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    put_refused(writer, [block("n1"), block("n2")], retain_keys=["n1", "n2"])  # 5 > 4 slots
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.get_concatenated(["r0"])
    assert_publication_failed(raised.value, BlockObjectStoreError)
    assert "cannot retain" in str(raised.value.__cause__)
    with pytest.raises(BlockObjectStoreError):
        writer.put([block("later")])
    store.check()
    after = store.snapshot()
    # As in vLLM, the refused call's counts stay applied; no key is evicted or stored.
    assert after["objects"] == before["objects"]
    assert after["references"] == {**before["references"], "n1": 1, "n2": 1}
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    writer.close()
    assert store.closed


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_bad_release_in_the_writer_changes_nothing(kind):
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    store.put([block("a")], retain_keys=["a"])
    if kind == "python":
        store.put = store.put  # type: ignore[method-assign]
    before = store.snapshot()
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    put_refused(writer, [block("b")], retain_keys=["a"], release_keys=["a", "a", "missing"])
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.get_concatenated(["a"])
    assert_publication_failed(raised.value, KeyError)
    assert store.snapshot() == before
    store.check()
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    assert store.closed


def test_the_store_closed_under_a_native_writer():
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    writer.put([block("a")])
    assert writer.get_concatenated(["a"]) == fill(1)
    store.close()  # behind the writer's back
    put_refused(writer, [block("b")])
    with pytest.raises(BlockObjectStoreError) as raised:
        writer.close()
    assert_publication_failed(raised.value, RuntimeError)
    assert "closed" in str(raised.value.__cause__)
    writer.close()


# --------------------------------------------------------------------------- full queue


def test_a_full_queue_blocks_the_caller_and_loses_nothing():
    store = PythonStore(delay=0.05)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=1)
    started = time.monotonic()
    for i in range(6):
        writer.put([block(f"k{i}", i)], retain_keys=[f"k{i}"])
    queued_in = time.monotonic() - started
    # The writer holds one update and the queue one more: the caller waited for at least
    # four of the six 50 ms puts.
    assert queued_in >= 4 * 0.05 * 0.9, f"puts did not block on a full queue ({queued_in:.3f} s)"
    assert writer.get_concatenated(["k5", "k0"]) == fill(5) + fill(0)
    assert [keys for keys, _, _ in store.calls] == [[f"k{i}"] for i in range(6)]  # in order
    writer.close()
    assert store.close_calls == 1


def test_a_failure_while_callers_wait_on_a_full_queue_reaches_them():
    store = PythonStore(fail_on=2, delay=0.05)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=1)
    raised: list[BaseException] = []
    for i in range(8):
        try:
            writer.put([block(f"k{i}", i)])
        except BlockObjectStoreError as error:
            raised.append(error)
            break
    assert raised, "a caller blocked on the full queue never saw the failure"
    assert_publication_failed(raised[0], UserError)
    with pytest.raises(BlockObjectStoreError):
        writer.close()
    assert len(store.calls) == 2, "updates queued behind the failure were applied"


def test_a_full_native_queue_blocks_and_drains():
    store = BlockObjectStore(max_bytes=64 * (1 << 16), object_nbytes=1 << 16)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=1)
    rows = np.ones((16, 1 << 16), dtype=np.uint8)
    for i in range(32):
        writer.put_blocks([f"k{i}-{j}" for j in range(16)], rows)
    assert writer.get_concatenated(["k31-15"]) == bytes(rows[0])
    store.check()
    assert store.stats()["objects_written"] == 32 * 16
    writer.close()


# --------------------------------------------------------------------------- close at any point


def test_store_close_is_idempotent_and_safe_at_any_point():
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    store.close()
    store.close()
    assert store.closed
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N)
    store.put([block("a"), block("b")], retain_keys=["a"])
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put([], release_keys=["a"])
    assert store.snapshot() == {"lru": [], "references": {}, "objects": {}}
    store.check()


def test_writer_close_is_idempotent_from_many_threads():
    store = PythonStore(delay=0.02)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=4)
    for i in range(4):
        writer.put([block(f"k{i}")])
    closers = [threading.Thread(target=writer.close, daemon=True) for _ in range(4)]
    for closer in closers:
        closer.start()
    writer.close()
    for closer in closers:
        closer.join(EXIT_TIMEOUT)
        assert not closer.is_alive(), "close() deadlocked"
    assert store.close_calls == 1
    assert len(store.calls) == 4, "close() must drain the queue first"


def test_writer_close_while_a_caller_is_blocked_on_a_full_queue():
    store = PythonStore(delay=0.1)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=1)
    outcomes: list[str] = []

    def producer() -> None:
        for i in range(10):
            try:
                writer.put([block(f"k{i}")])
            except RuntimeError as error:
                assert "closed" in str(error)
                outcomes.append("closed")
                return
        outcomes.append("all queued")

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    time.sleep(0.15)
    writer.close()
    thread.join(EXIT_TIMEOUT)
    assert not thread.is_alive(), "a caller blocked on the queue never returned"
    assert outcomes
    assert store.close_calls == 1
    with pytest.raises(RuntimeError, match="closed"):
        writer.put([block("late")])
    applied = [keys[0] for keys, _, _ in store.calls]
    assert applied == [f"k{i}" for i in range(len(applied))], "updates lost or reordered"


def test_an_abandoned_native_writer_is_collected_without_close():
    import gc

    store = BlockObjectStore(max_bytes=64 * N, object_nbytes=N)
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    for i in range(8):
        writer.put([block(f"k{i}", i)])
    del writer
    gc.collect()
    deadline = time.monotonic() + EXIT_TIMEOUT
    while store.stats()["objects_written"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["objects_written"] == 8, "queued updates of a dropped writer were lost"
    store.check()
    store.close()


# --------------------------------------------------------------------------- process exit

EXIT_SCRIPTS = {
    "open-store": """
        store = BlockObjectStore(max_bytes=1 << 26, object_nbytes=4096)
        store.put([BlockObject(f"k{i}", bytes(4096)) for i in range(100)], retain_keys=["k1"])
    """,
    "native-writer-queued": """
        store = BlockObjectStore(max_bytes=256 << 16, object_nbytes=1 << 16)
        writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
        rows = np.ones((16, 1 << 16), dtype=np.uint8)
        for i in range(40):
            writer.put_blocks([f"k{i}-{j}" for j in range(16)], rows)
            writer.put([BlockObject(f"b{i}", bytearray(1 << 16))])
    """,
    "native-writer-latched": """
        store = BlockObjectStore(max_bytes=2 * 64, object_nbytes=64)
        writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
        keys = [f"k{i}" for i in range(4)]
        writer.put([BlockObject(k, bytes(64)) for k in keys], retain_keys=keys)
        writer.put([BlockObject("x", bytes(64))])
    """,
    "python-writer-queued": """
        class Slow:
            def put(self, objects, *, retain_keys=(), release_keys=()):
                time.sleep(0.2)
            def get_concatenated(self, keys):
                return b""
            def close(self):
                pass
        writer = BackgroundBlockObjectStore(Slow(), max_pending_batches=8)
        for i in range(9):
            writer.put([BlockObject(f"k{i}", bytes(8))])
    """,
    "python-writer-policy-store": """
        class Policy:
            def on_reference_change(self, key, old, new):
                pass
            def select_victims(self, candidates, count):
                return [next(candidates) for _ in range(count)]
            def on_remove(self, keys, reason):
                pass
        store = BlockObjectStore(max_bytes=64 << 12, object_nbytes=1 << 12, policy=Policy())
        writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
        for i in range(200):
            writer.put([BlockObject(f"k{i}-{j}", bytes(1 << 12)) for j in range(8)])
    """,
    "producer-blocked-on-full-queue": """
        class Stuck:
            def __init__(self):
                self.gate = threading.Event()
            def put(self, objects, *, retain_keys=(), release_keys=()):
                self.gate.wait()
            def get_concatenated(self, keys):
                return b""
            def close(self):
                pass
        writer = BackgroundBlockObjectStore(Stuck(), max_pending_batches=1)
        def produce():
            for i in range(10):
                writer.put([BlockObject(f"k{i}", bytes(8))])
        threading.Thread(target=produce, daemon=True).start()
        time.sleep(0.2)
    """,
}

EXIT_PRELUDE = """
import threading, time
import numpy as np
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore
"""


@pytest.mark.parametrize("script", list(EXIT_SCRIPTS.values()), ids=list(EXIT_SCRIPTS))
def test_a_process_exits_promptly_with_an_open_store_or_a_running_writer(script):
    code = EXIT_PRELUDE + textwrap.dedent(script) + "\nprint('end of script', flush=True)\n"
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=EXIT_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process did not exit within {EXIT_TIMEOUT} s")
    elapsed = time.monotonic() - started
    assert "end of script" in result.stdout, result.stderr[-2000:]
    assert result.returncode == 0, f"exit code {result.returncode}: {result.stderr[-2000:]}"
    assert elapsed < EXIT_TIMEOUT


# --------------------------------------------------------------------------- memory

RSS_SCRIPT = """
import os
import numpy as np
from aostore import BlockObjectStore

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

ARENA = 256 << 20
NBYTES = 1 << 16
store = BlockObjectStore(max_bytes=ARENA, object_nbytes=NBYTES)
rows = np.full((64, NBYTES), 7, dtype=np.uint8)
for i in range(ARENA // NBYTES // 64):
    store.put_blocks([f"k{i}-{j}" for j in range(64)], rows)
assert store.stats()["free_slots"] == 0
filled = rss()
store.close()
closed = rss()
print(ARENA, filled, closed)
"""


def test_close_returns_the_arena_to_the_os():
    result = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    arena, filled, closed = map(int, result.stdout.split())
    dropped = filled - closed
    assert dropped >= 0.8 * arena, (
        f"RSS {filled >> 20} MiB filled, {closed >> 20} MiB after close: "
        f"dropped {dropped >> 20} MiB of a {arena >> 20} MiB arena"
    )


LIMIT_SCRIPT = """
import os, resource
import numpy as np
from aostore import BlockObject, BlockObjectStore, BlockObjectStoreError

def vm():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")

NBYTES = 16 << 20
store = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES, profile="grow")
payload = np.ones(NBYTES, dtype=np.uint8)
store.put([BlockObject(f"k{i}", payload) for i in range(4)], retain_keys=["k0", "k1"])
limit = vm() + (48 << 20)  # no room to double the arena
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

try:
    BlockObjectStore(max_bytes=1 << 32, object_nbytes=1 << 20)
except MemoryError as error:
    assert "could not map" in str(error), error
    print("constructor: MemoryError")

new = [f"n{i}" for i in range(4)]
try:
    store.put([BlockObject(k, payload) for k in new], retain_keys=new)
except MemoryError as error:
    print("growth: MemoryError")
store.check()
stats = store.stats()
assert store.num_slots == 4, store.num_slots
assert stats["stored"] == 4 and stats["evictions"] == 0, stats
for key in ("k0", "k1", "k2", "k3"):  # nothing evicted, nothing lost
    assert store.get_concatenated([key]) == payload.tobytes()
for key in new:
    try:
        store.get_concatenated([key])
    except BlockObjectStoreError:
        pass
    else:
        raise AssertionError(f"{key} stored by a failed put")
store.close()
print("consistent")
"""


def test_an_arena_the_os_cannot_give_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-c", LIMIT_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == [
        "constructor: MemoryError",
        "growth: MemoryError",
        "consistent",
    ], result.stdout


# --------------------------------------------------------------------------- a raising log handler


class Explode(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("this log filter raises")


@pytest.fixture
def raising_aostore_logger():
    logger = logging.getLogger("aostore")
    bomb = Explode()
    logger.addFilter(bomb)
    raise_exceptions = logging.raiseExceptions
    logging.raiseExceptions = False  # keep the test's output quiet; the rule holds either way
    yield
    logging.raiseExceptions = raise_exceptions
    logger.removeFilter(bomb)


def test_a_raising_log_filter_loses_no_batch_and_skips_no_close(raising_aostore_logger):
    store = BlockObjectStore(max_bytes=2 * N, object_nbytes=N, profile="grow")
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    keys = [f"k{i}" for i in range(4)]
    writer.put([BlockObject(k, fill(i)) for i, k in enumerate(keys)], retain_keys=keys)
    writer.put([BlockObject("after", fill(9))], retain_keys=["after"])
    assert writer.get_concatenated([*keys, "after"]) == b"".join(fill(i) for i in [0, 1, 2, 3, 9])
    assert store.stats()["growths"] >= 1
    writer.close()
    assert store.closed


def test_a_raising_log_filter_does_not_fail_a_growing_put(raising_aostore_logger):
    store = BlockObjectStore(max_bytes=N, object_nbytes=N, profile="grow")
    store.put([BlockObject("a", fill(1)), BlockObject("b", fill(2))], retain_keys=["a", "b"])
    assert store.get_concatenated(["a", "b"]) == fill(1) + fill(2)
    store.close()


MEMORY_LIMIT_SCRIPT = """
import os
import resource

from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError

from aostore import VariableBlockObjectStore


def address_space():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def limit(headroom):
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + headroom, resource.RLIM_INFINITY))


def unlimit():
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


MB = 1 << 20
# Construction: headrooms where the arena maps but the key index or the entries do not.
for headroom in (8, 64, 96, 128, 192, 400):
    for build in (
        lambda: BlockObjectStore(max_bytes=1 << 30, object_nbytes=64),
        lambda: VariableBlockObjectStore(max_bytes=1 << 30),
    ):
        limit((1024 + headroom) * MB)
        try:
            build().close()
            print("built", headroom)
        except MemoryError as error:
            print("refused", headroom, error)
        finally:
            unlimit()

# A put whose bookkeeping does not fit: refused whole, then accepted with room.
store = BlockObjectStore(max_bytes=1000 * 64, object_nbytes=64)
store.put([BlockObject(f"k{i}", bytes([i % 256]) * 64) for i in range(1000)], retain_keys=["k1"])
keys = [f"vllm-artifact/0/{i:064x}" for i in range(200_000)]
before = (store.stats(), store.snapshot())
refusals = 0
for headroom in (1, 2, 4, 6, 8, 12, 16, 24, 32, 64):
    limit(headroom * MB)
    try:
        store.put([BlockObject("new", b"n" * 64)], retain_keys=keys, release_keys=["k1"])
    except MemoryError:
        unlimit()
        refusals += 1
        store.check()
        assert (store.stats(), store.snapshot()) == before
        continue
    unlimit()
    break
else:
    raise AssertionError("the put never fitted")
store.check()
assert store.get_concatenated(["new"]) == b"n" * 64
print("put refused", refusals, "times, then accepted")

# Through the Rust writer: refused at hand-over (MemoryError) or latched, never an abort.
writer = BackgroundBlockObjectStore(
    BlockObjectStore(max_bytes=1000 * 64, object_nbytes=64), max_pending_batches=4
)
limit(2 * MB)
try:
    writer.put([BlockObject("w", b"w" * 64)], retain_keys=keys)
    writer.get_concatenated(["w"])
    outcome = "applied"
except MemoryError:
    outcome = "refused"
except BlockObjectStoreError as error:
    outcome = f"latched {type(error.__cause__).__name__}"
unlimit()
print("writer", outcome)
"""


def test_a_store_that_cannot_get_memory_raises_and_changes_nothing() -> None:
    # Under an address-space limit, construction printed "memory allocation of ... failed" and
    # aborted the interpreter (SIGABRT), and so did a put whose bookkeeping could not grow.
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_LIMIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused")]
    assert refused and any(line.startswith("built") for line in lines), result.stdout
    assert all("could not" in line for line in refused), refused
    put_line = next(line for line in lines if line.startswith("put refused"))
    assert int(put_line.split()[2]) >= 1, result.stdout
    writer_line = next(line for line in lines if line.startswith("writer"))
    assert writer_line in {"writer applied", "writer refused", "writer latched MemoryError"}, (
        writer_line
    )


def test_a_snapshot_that_does_not_fit_in_memory_raises_memory_error() -> None:
    # snapshot() copies every payload: under an address-space limit that a put survives, it
    # aborted the interpreter ("memory allocation of N bytes failed", SIGABRT).
    script = """
import os, resource
import numpy as np
from aostore import BlockObject, BlockObjectStore

def address_space():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")

NBYTES = 16 << 20
store = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES)
payloads = [np.full(NBYTES, i, dtype=np.uint8) for i in range(4)]
store.put([BlockObject(f"k{i}", payloads[i]) for i in range(4)], retain_keys=["k0"])
before = store.stats()
resource.setrlimit(resource.RLIMIT_AS, (address_space() + (24 << 20), resource.RLIM_INFINITY))
store.put([], release_keys=["k0"])  # a put fits
try:
    store.snapshot()
    print("copied")
except MemoryError as error:
    print("refused", "snapshot" in str(error))
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
store.check()
snapshot = store.snapshot()
print("intact", all(snapshot["objects"][f"k{i}"] == payloads[i].tobytes() for i in range(4)))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"
    assert result.stdout.split() == ["refused", "True", "intact", "True"]
