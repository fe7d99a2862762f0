"""BackgroundBlockObjectStore (docs/api.md), with a Mock store and with real stores.

Every wait has a timeout, so a broken writer fails a test instead of hanging the run.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import model
import numpy as np
import pytest
from refused import put_refused
from scripts import TIMEOUT as SCRIPT_TIMEOUT
from scripts import run_script

TIMEOUT = 10.0  # seconds; only reached when something is broken
SETTLE = 0.2  # seconds to give a thread that should stay blocked the chance not to


@pytest.fixture
def aostore() -> Any:
    import aostore

    return aostore


def obj(key: str, fill: int = 1, nbytes: int = 4) -> model.BlockObject:
    return model.BlockObject(key, bytes([fill]) * nbytes)


def mock_store() -> mock.Mock:
    store = mock.Mock(spec=["put", "get_concatenated", "close"])
    store.put.return_value = None
    store.get_concatenated.return_value = b"from-store"
    store.close.return_value = None
    return store


class Gate:
    """Makes ``store.put`` wait until opened, and tells when a put has started."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.entered.set()
        assert self.opened.wait(TIMEOUT), "test never opened the gate"


class InThread:
    """Runs ``call`` on a daemon thread and keeps its result or error."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def target() -> None:
            try:
                self.result = call()
            except BaseException as error:
                self.error = error
            finally:
                self.done.set()

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()


@pytest.fixture
def background(aostore: Any) -> Iterator[Callable[..., Any]]:
    """Factory for background stores; all are closed (errors ignored) at teardown."""
    made: list[Any] = []

    def factory(store: Any, max_pending_batches: int = 16) -> Any:
        bg = aostore.BackgroundBlockObjectStore(store, max_pending_batches=max_pending_batches)
        made.append(bg)
        return bg

    yield factory
    for bg in made:
        try:
            bg.close()
        except Exception:
            pass


def os_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def put_until_it_raises(bg: Any) -> BaseException:
    """The writer latches its error asynchronously: put until a put reports it."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            bg.put([], retain_keys=("probe",))
        except Exception as error:
            return error
        time.sleep(0.001)
    raise AssertionError("no put raised the latched writer error")


# --------------------------------------------------------------------------- queueing


def test_put_hands_the_batch_to_the_writer_without_waiting(background):
    store, gate = mock_store(), Gate()
    store.put.side_effect = gate
    bg = background(store)
    batch = [obj("a"), obj("b", 2)]
    started = time.monotonic()
    bg.put(batch, retain_keys=["a"])
    bg.put([obj("c", 3)])
    assert time.monotonic() - started < TIMEOUT / 2
    assert gate.entered.wait(TIMEOUT), "the writer never called store.put"
    assert not gate.opened.is_set()  # both puts returned while the store was still busy
    gate.opened.set()
    bg.close()
    assert store.put.call_count == 2


def test_put_passes_objects_and_keys_through(background):
    store = mock_store()
    bg = background(store)
    batch = [obj("a"), obj("b", 2)]
    bg.put(batch, retain_keys=(k for k in ["a", "b"]), release_keys=iter(["z"]))
    bg.close()
    (call,) = store.put.call_args_list
    objects = list(call.args[0])
    assert [(o.key, bytes(o.payload)) for o in objects] == [("a", b"\x01" * 4), ("b", b"\x02" * 4)]
    assert tuple(call.kwargs["retain_keys"]) == ("a", "b")
    assert tuple(call.kwargs["release_keys"]) == ("z",)


def test_updates_reach_the_store_in_call_order(background):
    store = mock_store()
    seen: list[str] = []
    store.put.side_effect = lambda objects, **kw: seen.append(next(iter(objects)).key)
    bg = background(store, max_pending_batches=4)
    keys = [f"k{i}" for i in range(50)]
    for key in keys:
        bg.put([obj(key)])
    bg.close()
    assert seen == keys


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"retain_keys": ()}, {"release_keys": []}, {"retain_keys": iter(()), "release_keys": ()}],
)
def test_put_of_nothing_is_a_no_op(background, kwargs):
    store = mock_store()
    bg = background(store)
    bg.put([], **kwargs)
    bg.put(iter([]), **kwargs)
    bg.close()
    store.put.assert_not_called()
    store.close.assert_called_once_with()


def test_put_blocks_while_the_queue_is_full(background):
    limit = 2
    store, gate = mock_store(), Gate()
    store.put.side_effect = gate
    bg = background(store, max_pending_batches=limit)
    bg.put([obj("first")])
    assert gate.entered.wait(TIMEOUT)  # the writer holds "first"; the queue is empty
    completed: list[int] = []

    def producer() -> None:
        for i in range(limit + 2):
            bg.put([obj(f"more-{i}")])
            completed.append(i)

    worker = InThread(producer)
    assert not worker.done.wait(SETTLE), "a full queue must make put wait"
    # `limit` queued batches (one fewer if the batch the writer holds counts against it).
    assert limit - 1 <= len(completed) <= limit, completed
    gate.opened.set()
    assert worker.done.wait(TIMEOUT), "put stayed blocked after the writer drained the queue"
    assert worker.error is None
    bg.close()
    assert store.put.call_count == limit + 3


# --------------------------------------------------------------------------- latched errors


def test_writer_error_is_raised_by_the_next_put(aostore, background):
    store = mock_store()
    cause = ValueError("disk on fire")
    store.put.side_effect = [cause]
    bg = background(store)
    bg.put([obj("a")])
    error = put_until_it_raises(bg)
    assert isinstance(error, aostore.BlockObjectStoreError)
    assert "publication failed" in str(error)
    assert error.__cause__ is cause
    assert store.put.call_count == 1  # later updates were skipped


def test_writer_error_stays_latched(aostore, background):
    store = mock_store()
    cause = KeyError("gone")
    store.put.side_effect = [cause]
    bg = background(store)
    bg.put([obj("a")])
    put_until_it_raises(bg)
    for call in (lambda: bg.put([obj("b")]), lambda: bg.get_concatenated(["a"])):
        with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
            call()
        assert info.value.__cause__ is cause
    store.get_concatenated.assert_not_called()
    assert store.put.call_count == 1


def test_writer_error_is_raised_by_get_concatenated(aostore, background):
    store = mock_store()
    cause = RuntimeError("store broke")
    store.put.side_effect = [cause, None]
    bg = background(store)
    put_refused(bg, [obj("a")])
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
        bg.get_concatenated(["a"])
    assert info.value.__cause__ is cause
    store.get_concatenated.assert_not_called()


def test_updates_queued_behind_a_failure_are_skipped(aostore, background):
    store, gate = mock_store(), Gate()
    cause = ValueError("first batch failed")

    def fail_after_gate(*args: Any, **kwargs: Any) -> None:
        gate(*args, **kwargs)
        raise cause

    store.put.side_effect = fail_after_gate
    bg = background(store)
    bg.put([obj("a")])
    assert gate.entered.wait(TIMEOUT)
    bg.put([obj("b")])  # queued before the error exists
    bg.put([], release_keys=["a"])
    gate.opened.set()
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
        bg.close()
    assert info.value.__cause__ is cause
    assert store.put.call_count == 1
    store.close.assert_called_once_with()


def test_close_raises_the_latched_error_after_closing_the_store(aostore, background):
    store = mock_store()
    cause = OSError("no space")
    store.put.side_effect = [cause]
    bg = background(store)
    put_refused(bg, [obj("a")])
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
        bg.close()
    assert info.value.__cause__ is cause
    store.close.assert_called_once_with()
    assert bg.close() is None  # idempotent: the error was reported once
    store.close.assert_called_once_with()


# --------------------------------------------------------------------------- reads and close


def test_get_concatenated_waits_for_queued_puts(background):
    store, gate = mock_store(), Gate()
    store.put.side_effect = gate
    bg = background(store)
    bg.put([obj("a")])
    bg.put([obj("b")])
    reader = InThread(lambda: bg.get_concatenated(["a", "b"]))
    assert not reader.done.wait(SETTLE), "the read did not wait for the queued puts"
    store.get_concatenated.assert_not_called()
    gate.opened.set()
    assert reader.done.wait(TIMEOUT)
    assert reader.error is None
    assert reader.result == b"from-store"
    assert [name for name, _, _ in store.method_calls] == ["put", "put", "get_concatenated"]
    store.get_concatenated.assert_called_once()
    assert list(store.get_concatenated.call_args.args[0]) == ["a", "b"]


def test_close_drains_the_queue_then_closes_the_store_once(background):
    store, gate = mock_store(), Gate()
    store.put.side_effect = gate
    bg = background(store)
    for key in ("a", "b", "c"):
        bg.put([obj(key)])
    closer = InThread(bg.close)
    assert not closer.done.wait(SETTLE), "close returned before the queue drained"
    store.close.assert_not_called()
    gate.opened.set()
    assert closer.done.wait(TIMEOUT)
    assert closer.error is None
    assert [name for name, _, _ in store.method_calls] == ["put", "put", "put", "close"]
    bg.close()
    bg.close()
    store.close.assert_called_once_with()


def test_put_after_close_raises_closed(background):
    store = mock_store()
    bg = background(store)
    bg.close()
    with pytest.raises(RuntimeError, match="closed"):
        bg.put([obj("a")])
    with pytest.raises(RuntimeError, match="closed"):
        bg.put([], retain_keys=["a"])
    bg.put([])  # still a no-op
    store.put.assert_not_called()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.parametrize("kind", ["mock", "aostore", "reference"])
def test_close_stops_the_writer_thread(aostore, background, kind):
    if kind == "mock":
        store = mock_store()
    elif kind == "aostore":
        store = aostore.BlockObjectStore(max_bytes=64, object_nbytes=4)
    else:
        store = model.ModelStore(max_bytes=64, object_nbytes=4)
    before = os_thread_count()
    bg = background(store)
    bg.put([obj("a")])
    bg.close()
    deadline = time.monotonic() + TIMEOUT
    while os_thread_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)  # a thread may take a moment to vanish from /proc after join
    assert os_thread_count() <= before


# --------------------------------------------------------------------------- real stores


@pytest.fixture(params=["aostore", "reference"])
def real_store(request, aostore):
    """An aostore store, or the reference model: the writer must drive any store."""
    if request.param == "aostore":
        store = aostore.BlockObjectStore(max_bytes=8 * 4, object_nbytes=4)
    else:
        store = model.ModelStore(max_bytes=8 * 4, object_nbytes=4)
    yield store
    store.close()


def test_puts_through_the_writer_are_readable_at_once(background, real_store):
    bg = background(real_store, max_pending_batches=2)
    for i in range(40):
        key = f"k{i}"
        bg.put([obj(key, i)], retain_keys=[key] if i % 2 else ())
        if i % 2:
            bg.put([], release_keys=[key])
    # The read waits for every queued put: the last eight keys survive, in order.
    keys = [f"k{i}" for i in range(32, 40)]
    assert bg.get_concatenated(keys) == b"".join(bytes([i]) * 4 for i in range(32, 40))
    assert real_store.snapshot()["lru"] == keys
    bg.close()
    with pytest.raises(RuntimeError, match="closed"):
        real_store.put([obj("late")])


def test_capacity_error_in_the_writer_is_latched(aostore, background, real_store):
    bg = background(real_store)
    pinned = [f"p{i}" for i in range(8)]
    bg.put([obj(key) for key in pinned], retain_keys=pinned)
    put_refused(bg, [obj("overflow")])
    try:
        bg.put([], release_keys=["p0"])  # skipped: it comes after the failure
    except aostore.BlockObjectStoreError:
        pass  # the writer had already latched the error
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
        bg.get_concatenated(["p0"])
    assert "cannot retain the requested batch" in str(info.value.__cause__)
    assert real_store.snapshot()["references"] == dict.fromkeys(pinned, 1)
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
        bg.close()
    with pytest.raises(RuntimeError, match="closed"):
        real_store.get_concatenated(["p0"])


@pytest.mark.parametrize(
    ("bad", "cause"),
    [
        (model.BlockObject(7, b"xxxx"), TypeError),  # type: ignore[arg-type]
        (model.BlockObject("k", 1234), TypeError),
        (model.BlockObject("k", b"too long"), ValueError),
    ],
    ids=["key", "payload-type", "payload-size"],
)
def test_bad_input_through_the_writer_is_reported_with_its_cause(
    aostore, background, real_store, bad, cause
):
    bg = background(real_store)
    bg.put([obj("good")])
    assert bg.get_concatenated(["good"]) == b"\x01" * 4
    try:
        bg.put([obj("also-good"), bad], retain_keys=["good"])
        bg.get_concatenated(["good"])
    except aostore.BlockObjectStoreError as error:
        assert "publication failed" in str(error)
        assert isinstance(error.__cause__, cause)
    else:
        pytest.fail("bad input through the writer was not reported")
    # The malformed batch changed nothing.
    assert real_store.snapshot() == {
        "lru": ["good"],
        "references": {},
        "objects": {"good": b"\x01" * 4},
    }
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
        bg.close()


def test_release_error_in_the_writer_is_latched_as_key_error(aostore, background, real_store):
    bg = background(real_store)
    bg.put([obj("a")], retain_keys=["a"])
    put_refused(bg, [], release_keys=["a", "a"])
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as info:
        bg.get_concatenated(["a"])
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.__cause__.args == ("a",)
    assert real_store.snapshot()["references"] == {"a": 1}


def test_writer_over_a_store_with_mocked_put_calls_the_mock(aostore, background):
    store = aostore.BlockObjectStore(max_bytes=64, object_nbytes=4)
    try:
        store.put = mock.Mock(wraps=store.put)
        bg = background(store)
        bg.put([obj("a")], retain_keys=["a"])
        assert bg.get_concatenated(["a"]) == b"\x01" * 4
        store.put.assert_called_once()
        bg.close()
    finally:
        store.close()


# ------------------------------------------------------------- which writer, and payload lifetimes
# Real stores only, by the module's lazy ``aostore`` fixture; N-byte objects.

N = 64


def fill(value: int, nbytes: int = N) -> bytes:
    return bytes([value % 256]) * nbytes


def test_a_second_bad_put_drops_its_exception_outside_the_writer_lock():
    # The dropped exception holds an object whose __del__ reads writer.closed, which takes the
    # writer's state lock: dropping it under that lock deadlocked the caller's own thread.
    out = run_script(
        """
        store = BlockObjectStore(max_bytes=8 * 64, object_nbytes=64)
        writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
        native = writer._writer

        class Trap:
            def __del__(self):
                native.closed

        class BadKey(TypeError):
            pass

        class Item:
            payload = bytes(64)

            @property
            def key(self):
                raise BadKey("a key that is not str", Trap())

        for attempt in range(3):
            try:
                writer.put([Item()])
            except BlockObjectStoreError as error:
                assert "publication failed" in str(error)
        print("no deadlock")
        try:
            writer.close()
        except BlockObjectStoreError:
            pass
        """
    )
    assert "no deadlock" in out


def test_a_subclass_put_override_is_honoured_by_the_background_writer(aostore):
    class CountingStore(aostore.BlockObjectStore):
        def put(self, objects: Any, **kwargs: Any) -> None:
            self.calls = getattr(self, "calls", 0) + 1
            super().put(objects, **kwargs)

    store = CountingStore(max_bytes=8 * N, object_nbytes=N)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    writer.put([aostore.BlockObject("a", fill(1))])
    writer.put([aostore.BlockObject("b", fill(2))])
    assert writer.get_concatenated(["a", "b"]) == fill(1) + fill(2)
    assert store.calls == 2
    writer.close()


def test_aostore_stores_without_overrides_still_get_the_rust_writer(aostore):
    from aostore._native import NativeWriter
    from aostore.vllm_plugin import GrowBlockObjectStore

    class SlowClose(aostore.BlockObjectStore):
        def close(self) -> None:
            time.sleep(0.3)
            super().close()

    for store in (
        aostore.BlockObjectStore(max_bytes=8 * N, object_nbytes=N),
        GrowBlockObjectStore(max_bytes=8 * N, object_nbytes=N),
        SlowClose(max_bytes=8 * N, object_nbytes=N),  # close is called through Python anyway
        aostore.VariableBlockObjectStore(max_bytes=8 * N),  # logprob rows: the same writer
    ):
        writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
        assert type(writer._writer) is NativeWriter
        writer.close()


def python_calls_during(call: Callable[[], None]) -> list[str]:
    """The Python functions (not C functions) that ``call`` runs on this thread."""
    names: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return names


@pytest.mark.parametrize("kind", ["fixed", "variable"])
def test_a_put_through_the_rust_writer_runs_no_python_on_the_engine_thread(aostore, kind):
    # The engine thread's put goes straight to the Rust writer: no Python frame of the wrapper.
    if kind == "fixed":
        store = aostore.BlockObjectStore(max_bytes=8 * N, object_nbytes=N)
    else:
        store = aostore.VariableBlockObjectStore(max_bytes=8 * N)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    objects = [aostore.BlockObject("a", fill(1))]
    assert python_calls_during(lambda: writer.put(objects, retain_keys=["a"])) == ["<lambda>"]
    assert writer.get_concatenated(["a"]) == fill(1)
    writer.close()
    # A store the Rust writer cannot drive keeps the wrapper's Python put (and its writer).
    plain = mock.Mock(spec=["put", "get_concatenated", "close"])
    python_writer = aostore.BackgroundBlockObjectStore(plain, max_pending_batches=2)
    calls = python_calls_during(lambda: python_writer.put(objects))
    assert "put" in calls
    python_writer.close()
    assert plain.put.call_count == 1


def test_the_variable_store_through_the_rust_writer_keeps_its_contract(aostore):
    BlockObject = aostore.BlockObject
    store = aostore.VariableBlockObjectStore(max_bytes=64)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    writer.put([BlockObject("a", b"x" * 10), BlockObject("b", b"")], retain_keys=["a"])
    writer.put([BlockObject("a", b"y" * 20)])  # replaced, referenced or not
    assert writer.get_optional("a") == b"y" * 20
    assert writer.get_optional("b") == b""
    assert writer.get_optional("zz") is None
    data, missing, _offsets = writer.get_many(["a", "zz", "b"])
    assert (bytes(data), missing) == (b"y" * 20, ["zz"])
    assert writer.contains(["a", "zz"]) == [True, False]
    writer.flush()
    # A batch it cannot hold is refused whole, latched, and raised from the next call.
    put_refused(writer, [BlockObject("big", b"z" * 100)])
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as raised:
        writer.flush()
    assert "cannot retain" in str(raised.value.__cause__)
    assert store.get_concatenated(["a"]) == b"y" * 20
    store.check()
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
        writer.close()


def test_put_blocks_on_a_variable_store_background_is_an_argument_error(aostore):
    store = aostore.VariableBlockObjectStore(max_bytes=64)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as raised:
        writer.put_blocks(["a"], np.zeros((1, 4), dtype=np.uint8))
    assert isinstance(raised.value.__cause__, TypeError)
    with pytest.raises(aostore.BlockObjectStoreError):
        writer.close()


def test_a_variable_store_with_a_policy_gets_the_python_writer(aostore):
    from aostore._native import NativeWriter

    class Oldest:
        def on_reference_change(self, key: str, old: int, new: int) -> None:
            pass

        def select_victims(self, candidates: Any, count: int) -> list[str]:
            return [next(candidates) for _ in range(count)]

        def on_remove(self, keys: Any, reason: str) -> None:
            pass

    store = aostore.VariableBlockObjectStore(max_bytes=8, policy=Oldest())
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    assert type(writer._writer) is not NativeWriter
    for key in "abc":
        writer.put([aostore.BlockObject(key, b"1234")])
    assert writer.get_optional("a") is None
    assert writer.get_concatenated(["b", "c"]) == b"12341234"
    writer.close()


def test_set_on_a_tensor_after_a_background_put_blocks_is_harmless(aostore):
    torch = pytest.importorskip("torch")
    store = aostore.BlockObjectStore(max_bytes=128 * N, object_nbytes=N)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=64)
    tensors = [torch.full((4, N), i, dtype=torch.uint8) for i in range(32)]
    for i, tensor in enumerate(tensors):
        writer.put_blocks([f"k{i}-{j}" for j in range(4)], tensor)
        tensor.set_(torch.empty(0, dtype=torch.uint8))  # the caller's tensor lets go at once
    del tensors
    gc.collect()
    for i in range(32):
        assert writer.get_concatenated([f"k{i}-{j}" for j in range(4)]) == fill(i) * 4
    writer.close()


def test_a_bytearray_payload_is_released_once_its_batch_is_applied(aostore):
    store = aostore.BlockObjectStore(max_bytes=8 * N, object_nbytes=N)
    writer = aostore.BackgroundBlockObjectStore(store, max_pending_batches=2)
    payload = bytearray(fill(5))
    writer.put([aostore.BlockObject("k", payload)])
    deadline = time.monotonic() + SCRIPT_TIMEOUT
    resized = False
    while time.monotonic() < deadline:
        # Ordinary Python code runs the interpreter's pending calls, where the writer releases
        # applied batches; no call into the writer happens here.
        try:
            payload.extend(b"!")
            resized = True
            break
        except BufferError:
            time.sleep(0.01)
    assert resized, "the payload stayed exported after its batch was applied"
    assert store.get_concatenated(["k"]) == fill(5)
    writer.close()


@pytest.mark.parametrize("synchronous", [False, True])
def test_a_synchronous_writer_reports_a_failed_put_at_the_next_call(
    aostore: Any, synchronous: bool
) -> None:
    """``NativeWriter._synchronous`` (the connector differential's): a put returns once its
    batch is applied, so the next put always reports a put that failed; a writer held back
    has not applied it yet, and the next put is queued as if nothing failed."""
    background = aostore.BackgroundBlockObjectStore(
        aostore.BlockObjectStore(max_bytes=64, object_nbytes=64), max_pending_batches=4
    )
    writer = background._writer
    writer._synchronous(synchronous)
    writer._hold_back(0 if synchronous else SETTLE)
    try:
        two = [aostore.BlockObject(f"k{i}", bytes(64)) for i in range(2)]
        # Two referenced objects in a one-slot fail-closed store: refused by the writer.
        background.put(two, retain_keys=["k0", "k1"])
        other = [aostore.BlockObject("k2", bytes(64))]
        if synchronous:
            with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
                background.put(other)
        else:
            background.put(other)  # queued behind the failing put, not yet applied
    finally:
        writer._hold_back(0)
        with pytest.raises(aostore.BlockObjectStoreError):
            background.close()
