"""Hostile input at the variable-size store's boundary (SPEC section 11): user exceptions
propagate, lying lengths are only hints, user code may re-enter or close the store while it
iterates, and nothing crashes the process or changes the store on a failed call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import pytest
from aostore import BlockObject, BlockObjectStoreError, VariableBlockObjectStore


class UserError(Exception):
    pass


class RaisingIter(list):  # type: ignore[type-arg]
    """Yields its first item (if any), then raises."""

    def __iter__(self) -> Iterator[Any]:
        yield from list(list.__iter__(self))[:1]
        raise UserError("iter midway")


class LyingLen(list):  # type: ignore[type-arg]
    def __init__(self, items: Any, length: int) -> None:
        super().__init__(items)
        self.length = length

    def __len__(self) -> int:
        return self.length


class RaisingLen(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        raise UserError("len")


def populated() -> VariableBlockObjectStore:
    store = VariableBlockObjectStore(max_bytes=4_096)
    store.put(
        [BlockObject(k, k.encode() * 10) for k in ("r1", "e1", "r2", "e2")],
        retain_keys=["r1", "r2"],
    )
    return store


def unchanged(store: VariableBlockObjectStore, before: dict[str, Any]) -> None:
    assert store.snapshot() == before
    store.check()


def test_user_exception_from_iteration_propagates_and_changes_nothing():
    store = populated()
    before = store.snapshot()
    calls = [
        lambda: store.put(RaisingIter([BlockObject("n", b"1"), BlockObject("m", b"2")])),
        lambda: store.put([], retain_keys=RaisingIter(["e1", "e2"])),
        lambda: store.put([], release_keys=RaisingIter(["r1", "r2"])),
        lambda: store.get_concatenated(RaisingIter(["e1", "e2"])),
        lambda: store.get_many(RaisingIter(["e1", "e2"])),
        lambda: store.contains(RaisingIter(["e1", "e2"])),
    ]
    for call in calls:
        with pytest.raises(UserError, match="iter midway"):
            call()
    unchanged(store, before)


class RaisingKey:
    payload = b"x"

    @property
    def key(self) -> str:
        raise UserError("key")


class RaisingPayload:
    key = "raising-payload"

    @property
    def payload(self) -> bytes:
        raise UserError("payload")


@pytest.mark.parametrize("item", [RaisingKey(), RaisingPayload()], ids=type)
def test_user_exception_from_key_or_payload_property_is_not_swallowed(item):
    store = populated()
    before = store.snapshot()
    with pytest.raises((UserError, TypeError)) as raised:
        store.put([BlockObject("ok", b"1"), item])
    error = raised.value
    assert isinstance(error, UserError) or isinstance(
        error.__cause__ or error.__context__, UserError
    )
    unchanged(store, before)


def test_keyboard_interrupt_from_a_key_property_propagates():
    class Interrupting:
        payload = b"x"

        @property
        def key(self) -> str:
            raise KeyboardInterrupt

    store = populated()
    before = store.snapshot()
    with pytest.raises(KeyboardInterrupt):
        store.put([Interrupting()])
    unchanged(store, before)


def test_lying_or_raising_len_is_only_a_hint():
    store = populated()
    store.put(RaisingLen([BlockObject("n1", b"1" * 7)]), retain_keys=RaisingLen(["n1"]))
    store.put(LyingLen([BlockObject("n2", b"2")], 0), release_keys=LyingLen(["n1"], 10**6))
    assert store.get_concatenated(RaisingLen(["n1", "n2"])) == b"1" * 7 + b"2"
    assert store.get_many(LyingLen(["n2", "zz"], 10**9))[1] == ["zz"]
    assert store.contains(LyingLen(["n1"], 0)) == [True]
    store.check()


def test_user_code_reentering_the_store_while_put_iterates():
    store = populated()

    def reentering() -> Iterator[BlockObject]:
        yield BlockObject("g1", b"1")
        store.put([BlockObject("inner", b"555")], retain_keys=["inner"])
        assert store.get_many(["inner"])[0] == b"555"
        yield BlockObject("g2", b"22")

    store.put(reentering(), release_keys=["inner"])
    assert store.get_concatenated(["g1", "g2", "inner"]) == b"1" + b"22" + b"555"
    assert "inner" not in store.snapshot()["references"]
    store.check()


def test_user_code_closing_the_store_while_put_iterates():
    store = populated()

    def closing() -> Iterator[BlockObject]:
        yield BlockObject("g1", b"1")
        store.close()
        yield BlockObject("g2", b"2")

    with pytest.raises(RuntimeError, match="closed"):
        store.put(closing())
    assert store.closed


def test_a_policy_closing_its_store_gets_an_error_and_the_store_stays_consistent():
    holder: list[VariableBlockObjectStore] = []

    def on_reference_change(key: str, old: int, new: int) -> None:
        holder[0].close()

    policy = types.SimpleNamespace(
        on_reference_change=on_reference_change,
        select_victims=lambda c, n: None,
        on_remove=lambda keys, reason: None,
    )
    store = VariableBlockObjectStore(max_bytes=64, policy=policy)
    holder.append(store)
    store.put([BlockObject("a", b"1")])
    before = store.snapshot()
    with pytest.raises(BlockObjectStoreError, match="must not call back"):
        store.put([], retain_keys=["a"])
    assert not store.closed
    unchanged(store, before)
    store.close()
    assert store.closed


def test_enormous_nul_and_surrogate_keys():
    store = populated()
    big = "k" * (1 << 20)
    twin = big[:-1] + "j"
    store.put([BlockObject(big, b"1"), BlockObject(twin, b"22")], retain_keys=[big, twin])
    assert store.get_concatenated([twin, big]) == b"22" + b"1"
    nul = ["a", "a\x00", "\x00a", "a\x00b"]
    store.put([BlockObject(key, key.encode()) for key in nul])
    assert store.get_many(nul)[0] == b"".join(key.encode() for key in nul)
    before = store.snapshot()
    for call in (
        lambda: store.put([BlockObject("half-\ud800", b"x")]),
        lambda: store.put([], retain_keys=["\udfff"]),
        lambda: store.get_many(["\ud800"]),
        lambda: store.contains(["\ud800"]),
    ):
        with pytest.raises((TypeError, ValueError)):
            call()
    unchanged(store, before)


def test_payload_buffer_held_while_put_iterates():
    store = populated()
    before = store.snapshot()
    payload = bytearray(b"abc")

    def resizing() -> Iterator[BlockObject]:
        yield BlockObject("g1", payload)
        payload.append(0)  # the store holds the buffer exported: BufferError, nothing stored
        yield BlockObject("g2", b"2")

    with pytest.raises(BufferError):
        store.put(resizing())
    unchanged(store, before)


PRELUDE = """
import sys
from aostore import BlockObject, BlockObjectStoreError, VariableBlockObjectStore
store = VariableBlockObjectStore(max_bytes=4096)
store.put([BlockObject("a", b"a" * 9)], retain_keys=["a"])
before = store.snapshot()

class LyingLen(list):
    def __init__(self, items, length):
        super().__init__(items)
        self.length = length
    def __len__(self):
        return self.length

DOCUMENTED = (TypeError, ValueError, KeyError, OverflowError, MemoryError, BlockObjectStoreError)
try:
    CALL
except DOCUMENTED as error:
    print("raised", type(error).__name__)
    assert store.snapshot() == before, "a failed call changed the store"
else:
    print("ok")
store.check()
print("survived")
"""

HUGE_LEN_CALLS = {
    f"{name}-{length}": call.replace("HUGE", length)
    for length in ("2**40", "sys.maxsize")
    for name, call in {
        "put-objects": 'store.put(LyingLen([BlockObject("b", b"b")], HUGE))',
        "put-retains": 'store.put([], retain_keys=LyingLen(["a"], HUGE))',
        "get-many": 'store.get_many(LyingLen(["a", "zz"], HUGE))',
        "contains": 'store.contains(LyingLen(["a"], HUGE))',
    }.items()
}


@pytest.mark.parametrize("call", list(HUGE_LEN_CALLS.values()), ids=list(HUGE_LEN_CALLS))
def test_a_lying_len_never_crashes_the_process(call):
    code = textwrap.dedent(PRELUDE).replace("CALL", call)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RUST_BACKTRACE": "0"},
    )
    assert result.returncode == 0, result.stderr[:1500]
    assert "survived" in result.stdout, result.stderr[:1500]


FORK_SCRIPT = """
import os, threading, time
from aostore import BlockObject, VariableBlockObjectStore
store = VariableBlockObjectStore(max_bytes=1 << 22, prefault="background")
payload = bytes(3000)
stop = threading.Event()

def busy():  # keeps the store lock busy at fork time
    i = 0
    while not stop.is_set():
        store.put([BlockObject(f"k{i % 64}", payload)])
        i += 1

thread = threading.Thread(target=busy)
thread.start()
time.sleep(0.2)
pid = os.fork()
if pid == 0:
    outcomes = []
    for call in (lambda: store.put([BlockObject("c", payload)]),
                 lambda: store.get_concatenated(["k1"]),
                 lambda: store.get_many(["k1"]),
                 lambda: store.contains(["k1"]),
                 lambda: store.stats()):
        try:
            call()
            outcomes.append("worked")
        except RuntimeError as error:
            outcomes.append("fork" in str(error))
    print("child", outcomes, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
stop.set()
thread.join()
store.check()
store.close()
print("parent ok", flush=True)
"""


def test_a_forked_child_gets_a_clear_error_never_a_hang():
    result = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert "child [True, True, True, True, True]" in result.stdout, result.stdout + result.stderr
    assert "parent ok" in result.stdout, result.stderr


@pytest.mark.parametrize("prefault", [True, False, "background"])
def test_prefault_modes(prefault):
    store = VariableBlockObjectStore(max_bytes=1 << 20, prefault=prefault)
    store.put([BlockObject("a", b"x" * 3000)])
    assert store.get_concatenated(["a"]) == b"x" * 3000
    store.close()


@pytest.mark.parametrize("prefault", ["now", 1, None, "True"], ids=repr)
def test_bad_prefault_is_a_value_error(prefault):
    with pytest.raises(ValueError, match="prefault"):
        VariableBlockObjectStore(max_bytes=1 << 20, prefault=prefault)
