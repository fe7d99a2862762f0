"""Hostile input at every Python entry point of both stores (docs/guarantees.md, issue 5 part 1).

Every call gets wrong types, wrong sizes, huge and negative numbers, NaN, keys with lone
surrogates, NUL bytes and 1 MB of text, strided and object buffers, and user objects whose
``__len__``, ``__iter__``, ``.key`` or ``.payload`` raise or lie. Only the documented
exceptions may come out: ``TypeError``, ``ValueError``, ``KeyError``, ``OverflowError``,
``MemoryError``, ``BlockObjectStoreError``, ``RuntimeError`` for a closed store, or the
user's own exception. A failing call changes nothing: ``snapshot()`` before and after are
equal and ``check()`` holds. A call with valid input succeeds and does what the contract says.

Anything that may take the process down runs in a subprocess, so a crash fails one test and
not the run. The hand-written cases run against both stores (``kind``: the fixed
``BlockObjectStore`` and the ``VariableBlockObjectStore``); the generated ones, and the entry
points only the fixed store has (``get_into``, ``put_blocks``, tensors), run against the fixed
store.
"""

from __future__ import annotations

import array
import os
import pickle
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from aostore import (
    BackgroundBlockObjectStore,
    BlockObject,
    BlockObjectStore,
    BlockObjectStoreError,
    VariableBlockObjectStore,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

N = 16  # object_nbytes of the stores below
SLOTS = 64  # room for every batch the strategies draw: no capacity error on valid input
BASE_KEYS = ("r1", "e1", "r2", "e2", "a\x00b", "ключ🔑")
PENDING = "pending"  # referenced, never stored

# The documented exceptions for bad input (RuntimeError only for a closed store).
DOCUMENTED = (
    TypeError,
    ValueError,
    KeyError,
    OverflowError,
    MemoryError,
    BlockObjectStoreError,
)

# AOSTORE_HOSTILE_EXAMPLES=5000 for a longer hunt; the default keeps the file at a few seconds.
EXAMPLES = int(os.environ.get("AOSTORE_HOSTILE_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class UserError(Exception):
    """Raised by the test's own hostile objects; may propagate from any call."""


ALLOWED = (*DOCUMENTED, UserError)


def fill(value: int, nbytes: int = N) -> bytes:
    return bytes([value % 256]) * nbytes


KINDS = ("fixed", "variable")


def new_store(kind: str, policy: Any = None, slots: int = SLOTS, **options: Any) -> Any:
    """A fixed store of ``slots`` objects of N bytes, or a variable store of as many bytes."""
    if kind == "fixed":
        return BlockObjectStore(max_bytes=slots * N, object_nbytes=N, policy=policy, **options)
    return VariableBlockObjectStore(max_bytes=slots * N, policy=policy, **options)


def valid(kind: str, value: int) -> bytes:
    """A valid payload: N bytes for the fixed store, 1 to 11 (by value) for the variable one."""
    return fill(value, N if kind == "fixed" else 1 + value % 11)


def populated(policy: Any = None, slots: int = SLOTS, kind: str = "fixed") -> Any:
    """r1 (count 2) and r2 referenced; e1, e2, "a\\0b", "ключ🔑" evictable; "pending"
    referenced but not stored."""
    store = new_store(kind, policy, slots)
    store.put(
        [BlockObject(key, fill(i + 1)) for i, key in enumerate(BASE_KEYS)],
        retain_keys=["r1", "r1", "r2", PENDING],
    )
    store.check()
    return store


def assert_unchanged(store: BlockObjectStore, before: dict[str, Any]) -> None:
    assert store.snapshot() == before
    store.check()


def is_key(value: object) -> bool:
    """A valid key: a str (subclasses too) that is valid Unicode (no lone surrogates)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def plain_buffer(value: object) -> memoryview | None:
    """A memoryview of ``value`` if it is a C-contiguous buffer of plain data, else None."""
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not view.c_contiguous or "O" in view.format:
        view.release()
        return None
    return view


def buffer_bytes(value: object) -> bytes:
    with memoryview(value) as view:  # type: ignore[arg-type]
        return view.tobytes()


# --------------------------------------------------------------------------- hostile objects


class StrKey(str):
    """A str subclass whose own hash and equality raise: the store must use the text."""

    def __hash__(self) -> int:
        raise UserError("hash")

    def __eq__(self, other: object) -> bool:
        raise UserError("eq")

    def __repr__(self) -> str:
        raise UserError("repr")


class RaisingKey:
    payload = fill(1)

    @property
    def key(self) -> str:
        raise UserError("key")


class RaisingPayload:
    key = "raising-payload"

    @property
    def payload(self) -> bytes:
        raise UserError("payload")


class LyingLen(list):  # type: ignore[type-arg]
    """A list that iterates normally but claims an absurd length."""

    def __init__(self, items: Any, length: int) -> None:
        super().__init__(items)
        self.length = length

    def __len__(self) -> int:
        return self.length


class RaisingLen(list):  # type: ignore[type-arg]
    def __len__(self) -> int:
        raise UserError("len")


class RaisingIter(list):  # type: ignore[type-arg]
    """Yields its first item (if any), then raises."""

    def __iter__(self) -> Iterator[Any]:
        yield from list(list.__iter__(self))[:1]
        raise UserError("iter midway")


class Unprintable:
    def __repr__(self) -> str:
        raise UserError("repr")

    def __str__(self) -> str:
        raise UserError("str")


# --------------------------------------------------------------------------- strategies

surrogate_keys = st.builds(
    lambda head, lone, tail: head + lone + tail,
    st.text(max_size=3),
    st.sampled_from(["\ud800", "\udfff", "\udc80", "\udbff"]),
    st.text(max_size=3),
)
good_keys = st.one_of(
    st.sampled_from([*BASE_KEYS, PENDING, "new-1", "new-2", "", "\x00", "a"]),
    st.text(max_size=12),
    st.text(max_size=12).map(StrKey),
)
non_str_keys = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.binary(max_size=4),
    st.builds(bytearray, st.binary(max_size=4)),
    st.just(("e1",)),
    st.just(["e1"]),
    st.builds(Unprintable),
)
any_keys = st.one_of(good_keys, good_keys, surrogate_keys, non_str_keys)
# Retains of anything valid; releases of what is referenced (r1 twice, r2 and "pending" once),
# so that an over-release (KeyError) stays possible but rare.
clean_retains = st.lists(st.one_of(st.sampled_from([*BASE_KEYS, PENDING]), good_keys), max_size=4)
clean_releases = st.lists(st.sampled_from(["r1", "r1", "r2", PENDING]), max_size=2)


def key_lists(data: st.DataObject, clean: bool, releases: bool = False) -> list[Any]:
    if clean:
        return data.draw(clean_releases if releases else clean_retains)
    return data.draw(st.lists(any_keys, max_size=4))


byte_values = st.integers(0, 255)


@st.composite
def numpy_payloads(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["u1", "i2", "<f4", ">f8", "c16", "?", "O", "V4"]))
    itemsize = np.dtype(dtype).itemsize
    count = draw(st.sampled_from([N // itemsize, N // itemsize + 1, max(N // itemsize - 1, 0)]))
    layout = draw(st.sampled_from(["flat", "rows", "strided", "fortran", "scalar"]))
    if dtype == "O":
        return np.array([None] * max(count, 1), dtype=object)
    if layout == "scalar":  # 0-d of the right size: see the test of 0-d payloads below
        return np.zeros((), dtype=dtype if itemsize != N else "u1")
    if layout == "strided":
        return np.zeros(2 * count, dtype=dtype)[::2]
    if layout in ("rows", "fortran") and count % 2 == 0 and count:
        order = "F" if layout == "fortran" else "C"
        return np.full((2, count // 2), draw(byte_values), dtype="u1").astype(dtype, order=order)
    if dtype == "<f4":
        return np.full(count, np.nan, dtype=dtype)
    return np.full(count, draw(byte_values), dtype="u1").astype(dtype)


payloads = st.one_of(
    st.builds(fill, byte_values, st.sampled_from([N, N, N, 0, N - 1, N + 1, 2 * N])),
    st.builds(lambda v, n: bytearray(fill(v, n)), byte_values, st.sampled_from([N, N + 1])),
    st.builds(lambda v: memoryview(fill(v)), byte_values),
    st.builds(lambda v: memoryview(bytearray(fill(v))).cast("B", (2, N // 2)), byte_values),
    st.builds(lambda v: memoryview(fill(v, 2 * N))[::2], byte_values),
    st.builds(lambda v: array.array("B", fill(v)), byte_values),
    st.builds(lambda v: array.array("d", [float("nan")] * (N // 8)), byte_values),
    numpy_payloads(),
    st.sampled_from([None, "x" * N, 0, float("nan"), [0] * N, (1, 2)]),
    st.builds(Unprintable),
)


def payload_ok(payload: object) -> bool:
    view = plain_buffer(payload)
    if view is None:
        return False
    with view:
        return view.nbytes == N


valid_payloads = st.one_of(
    st.builds(fill, byte_values),
    st.builds(lambda v: bytearray(fill(v)), byte_values),
    st.builds(lambda v: memoryview(fill(v)), byte_values),
    st.builds(lambda v: np.full(N, v, dtype="u1").view("<f8"), byte_values),
    st.builds(lambda v: np.full((2, N // 2), v, dtype="u1"), byte_values),
    st.builds(lambda v: array.array("B", fill(v)), byte_values),
)


@st.composite
def batch_items(draw: st.DrawFn, clean: bool = False) -> tuple[Any, bool]:
    """One element of ``put``'s ``objects``: (item, whether it is valid). ``clean`` draws
    valid items only, so that the valid path is exercised as often as the hostile one."""
    if clean:
        key, payload = draw(good_keys), draw(valid_payloads)
        if draw(st.booleans()):
            return BlockObject(key, payload), True
        return types.SimpleNamespace(key=key, payload=payload), True
    kind = draw(st.sampled_from(["block"] * 4 + ["loose", "raising", "other"]))
    if kind == "block":
        key, payload = draw(any_keys), draw(payloads)
        return BlockObject(key, payload), is_key(key) and payload_ok(payload)
    if kind == "loose":  # vLLM's BlockObject or anything with .key and .payload
        key, payload = draw(any_keys), draw(payloads)
        return types.SimpleNamespace(key=key, payload=payload), is_key(key) and payload_ok(payload)
    if kind == "raising":
        return draw(st.sampled_from([RaisingKey(), RaisingPayload()])), False
    return draw(st.sampled_from([None, 5, "e1", b"e1", ("e1", fill(1)), Unprintable()])), False


def containers(items: list[Any], kind: str) -> Any:
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "generator":
        return (item for item in items)
    if kind == "lying_len":
        return LyingLen(items, 0 if not items else 3 * len(items))
    if kind == "raising_len":
        return RaisingLen(items)
    assert kind == "raising_iter"
    return RaisingIter(items)


container_kinds = st.sampled_from(
    ["list", "list", "tuple", "generator", "lying_len", "raising_len", "raising_iter"]
)


Outcome = tuple[dict[str, int], dict[str, bytes]]


def batch_outcome(
    before: dict[str, Any], objects: list[Any], retains: list[Any], releases: list[Any]
) -> Outcome | None:
    """(references, objects) after a valid put of ``objects`` (each with .key and .payload)
    on a store with room for all of them; None when the keys are not all valid or a release
    has nothing to release (the put must fail and change nothing)."""
    if not all(is_key(k) for k in [*retains, *releases]):
        return None
    counts: dict[str, int] = dict(before["references"])
    for key in map(str, retains):
        counts[key] = counts.get(key, 0) + 1
    for key in map(str, releases):
        if counts.get(key, 0) == 0:
            return None
        counts[key] -= 1
    stored = dict(before["objects"])
    for item in objects:  # the last payload wins; a stored key keeps its bytes
        if str(item.key) not in before["objects"]:
            stored[str(item.key)] = buffer_bytes(item.payload)
    return {k: c for k, c in counts.items() if c}, stored


def assert_applied(store: BlockObjectStore, outcome: Outcome | None) -> None:
    assert outcome is not None
    after = store.snapshot()
    assert after["references"] == outcome[0]
    assert after["objects"] == outcome[1]
    store.check()


# --------------------------------------------------------------------------- constructor

SIZE_EDGES = [
    0,
    1,
    -1,
    N,
    2**31,
    2**32 - 1,
    2**32,
    2**32 + 1,
    2**62,
    2**63 - 1,
    2**63,
    2**63 + 1,
    2**64 - 1,
    2**64,
    2**64 + 1,
    2**127,
    2**128,
    2**200,
    -(2**63),
    -(2**64),
    -(2**200),
]


class IntSub(int):
    pass


sizes = st.one_of(
    st.sampled_from(SIZE_EDGES),
    st.integers(-(2**70), 2**70),
    st.builds(lambda k, d: 2**k + d, st.integers(0, 130), st.integers(-2, 2)),
    st.integers(1, 2**20).map(IntSub),
    st.sampled_from(
        [None, True, False, 16.0, float("nan"), float("inf"), "64", b"64", 1j, np.int64(64)]
    ),
)


def size_ok(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@SETTINGS
@given(max_bytes=sizes, object_nbytes=sizes)
def test_constructor_accepts_valid_sizes_and_refuses_the_rest_cleanly(max_bytes, object_nbytes):
    try:
        store = BlockObjectStore(max_bytes=max_bytes, object_nbytes=object_nbytes)
    except (TypeError, ValueError, OverflowError, MemoryError) as error:
        if not (size_ok(max_bytes) and size_ok(object_nbytes)):
            # The other argument, checked first, may be an int beyond any size.
            huge = [v for v in (max_bytes, object_nbytes) if size_ok(v) and abs(v) >= 2**64]
            assert isinstance(error, OverflowError if huge else TypeError) or (
                huge and isinstance(error, TypeError)
            ), error
        elif object_nbytes <= 0 or max_bytes < object_nbytes:
            assert isinstance(error, (ValueError, OverflowError)), error
        else:
            # Valid ints: only a size the arena cannot hold may be refused.
            assert isinstance(error, (OverflowError, MemoryError)), error
            small = max_bytes <= 2**40 and max_bytes // object_nbytes < 2**31
            assert not small, f"refused a small store: {error!r}"
        return
    try:
        assert size_ok(max_bytes) and size_ok(object_nbytes)
        assert 0 < object_nbytes <= max_bytes
        assert store.object_nbytes == object_nbytes
        assert store.num_slots == max_bytes // object_nbytes
        if object_nbytes <= 1 << 16:
            payload = fill(9, object_nbytes)
            store.put([BlockObject("k", payload)])
            assert store.get_concatenated(["k"]) == payload
        store.check()
    finally:
        store.close()
    assert store.closed


@pytest.mark.parametrize(
    ("max_bytes", "object_nbytes", "error", "match"),
    [
        (2**63, 1, OverflowError, "too large"),
        (2**64 + 5, 4, OverflowError, "too large"),
        (2**64 - 1, 2**64 - 1, OverflowError, "too large"),
        (2**40, 2**8, OverflowError, "too large"),  # 2**32 slots: more than u32 indices
        (2**63 - 1, 2**62, MemoryError, "could not map"),  # an arena the OS cannot give
        (2**62, 2**61, MemoryError, "could not map"),
        (16, 0, ValueError, "object size must be positive"),
        (16, -4, ValueError, "object size must be positive"),
        (3, 4, ValueError, "must fit at least one object"),
        (-1, 4, ValueError, "must fit at least one object"),
        (True, 1, TypeError, "bool"),
        (16, True, TypeError, "bool"),
        (float("nan"), 4, TypeError, "float"),
        (16.0, 4, TypeError, "float"),
        (None, 4, TypeError, "NoneType"),
    ],
    ids=repr,
)
def test_constructor_errors_are_clear(max_bytes, object_nbytes, error, match):
    with pytest.raises(error, match=match):
        BlockObjectStore(max_bytes=max_bytes, object_nbytes=object_nbytes)


@SETTINGS
@given(
    profile=st.one_of(
        st.sampled_from(["fail-closed", "grow", "FAIL-CLOSED", "", "grow\x00", "\ud800"]),
        st.text(max_size=5),
        st.none(),
        st.integers(),
        st.binary(max_size=4),
    ),
    prefault=st.one_of(
        st.booleans(),
        st.none(),
        st.integers(-1, 2),
        st.text(max_size=2),
        st.sampled_from(["background", "Background"]),
    ),
)
def test_profile_and_prefault_are_validated(profile, prefault):
    valid_profile = profile in ("fail-closed", "grow") and type(profile) is str
    valid_prefault = isinstance(prefault, bool) or (
        type(prefault) is str and prefault == "background"
    )
    try:
        store = BlockObjectStore(
            max_bytes=4 * N, object_nbytes=N, profile=profile, prefault=prefault
        )
    except (TypeError, ValueError) as error:
        assert not (valid_profile and valid_prefault), error
        return
    assert valid_profile and valid_prefault
    assert store.profile == profile
    store.close()


def test_pin_memory_without_cuda_is_a_clear_error():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning succeeds")
    with pytest.raises(RuntimeError, match="CUDA"):
        BlockObjectStore(max_bytes=4 * N, object_nbytes=N, pin_memory=True)
    with pytest.raises(ValueError, match="fixed arena"):
        BlockObjectStore(max_bytes=4 * N, object_nbytes=N, pin_memory=True, profile="grow")


# --------------------------------------------------------------------------- put


@SETTINGS
@given(
    data=st.data(),
    clean=st.booleans(),
    container=container_kinds,
    keyword_form=st.sampled_from(["lists", "tuples", "generators"]),
)
def test_put_with_hostile_input_raises_documented_errors_and_changes_nothing(
    data, clean, container, keyword_form
):
    items = data.draw(st.lists(batch_items(clean), max_size=6))
    retains, releases = key_lists(data, clean), key_lists(data, clean, releases=True)
    store = populated()
    before = store.snapshot()
    objects = [item for item, _ in items]
    valid = container != "raising_iter" and all(ok for _, ok in items)
    outcome = batch_outcome(before, objects if valid else [], retains, releases)
    valid = valid and outcome is not None

    def wrap(keys: list[Any]) -> Any:
        if keyword_form == "tuples":
            return tuple(keys)
        if keyword_form == "generators":
            return (key for key in keys)
        return keys

    event(f"valid={valid}")
    try:
        store.put(
            containers(objects, container),
            retain_keys=wrap(retains),
            release_keys=wrap(releases),
        )
    except ALLOWED as error:
        assert not valid, f"valid input refused: {error!r}"
        assert not isinstance(error, BlockObjectStoreError), error  # no capacity error here
        assert_unchanged(store, before)
        return
    finally:
        store.check()
    assert valid, "invalid input accepted"
    assert_applied(store, outcome)
    store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_user_exception_from_iteration_propagates_and_changes_nothing(kind):
    store = populated(kind=kind)
    before = store.snapshot()
    objects = RaisingIter([BlockObject("new", valid(kind, 1)), BlockObject("new2", valid(kind, 2))])
    calls = [
        lambda: store.put(objects),
        lambda: store.put([], retain_keys=RaisingIter(["e1", "e2"])),
        lambda: store.put([], release_keys=RaisingIter(["r1", "r2"])),
        lambda: store.get_concatenated(RaisingIter(["e1", "e2"])),
        lambda: store.get_many(RaisingIter(["e1", "e2"])),
        lambda: store.contains(RaisingIter(["e1", "e2"])),
    ]
    if kind == "fixed":
        calls.append(lambda: store.put_blocks(RaisingIter(["n1", "n2"]), fill(1, 2 * N)))
    for call in calls:
        with pytest.raises(UserError, match="iter midway"):
            call()
    assert_unchanged(store, before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("item", [RaisingKey(), RaisingPayload()], ids=type)
def test_user_exception_from_key_or_payload_property_is_not_swallowed(item, kind):
    """The user's exception propagates (or at least is the cause of the TypeError)."""
    store = populated(kind=kind)
    before = store.snapshot()
    with pytest.raises((UserError, TypeError)) as raised:
        store.put([BlockObject("ok", fill(1)), item])
    error = raised.value
    assert isinstance(error, UserError) or isinstance(
        error.__cause__ or error.__context__, UserError
    ), f"the user's exception was replaced by {error!r} and lost"
    assert_unchanged(store, before)


@pytest.mark.parametrize("kind", KINDS)
def test_keyboard_interrupt_from_a_key_property_propagates(kind):
    class Interrupting:
        payload = fill(1)

        @property
        def key(self) -> str:
            raise KeyboardInterrupt

    store = populated(kind=kind)
    before = store.snapshot()
    with pytest.raises(KeyboardInterrupt):
        store.put([Interrupting()])
    assert_unchanged(store, before)


@pytest.mark.parametrize("kind", KINDS)
def test_lying_or_raising_len_is_only_a_hint(kind):
    store = populated(kind=kind)
    one, two = valid(kind, 1), valid(kind, 2)
    store.put(RaisingLen([BlockObject("n1", one)]), retain_keys=RaisingLen(["n1"]))
    store.put(LyingLen([BlockObject("n2", two)], 0), release_keys=LyingLen(["n1"], 10**6))
    assert store.get_concatenated(RaisingLen(["n1", "n2"])) == one + two
    assert store.get_many(LyingLen(["n2", "zz"], 10**9))[1] == ["zz"]
    assert store.contains(LyingLen(["n1"], 0)) == [True]
    store.check()


@pytest.mark.parametrize("kind", KINDS)
def test_buffers_mutated_while_put_iterates(kind):
    store = populated(kind=kind)
    before = store.snapshot()
    payload = bytearray(valid(kind, 1))
    size, two = len(payload), valid(kind, 2)

    def resizing() -> Iterator[BlockObject]:
        yield BlockObject("g1", payload)
        payload.append(0)  # the store holds the buffer exported: BufferError, nothing stored
        yield BlockObject("g2", two)

    with pytest.raises(BufferError):
        store.put(resizing())
    assert_unchanged(store, before)

    def rewriting() -> Iterator[BlockObject]:
        yield BlockObject("g1", payload)
        payload[:] = fill(7, size)  # same size: allowed; the put copies what is there at the end
        yield BlockObject("g2", two)

    store.put(rewriting())
    assert store.get_concatenated(["g1", "g2"]) == fill(7, size) + two
    payload[:] = fill(8, size)  # the store copied: later writes to the caller's buffer do not leak
    assert store.get_concatenated(["g1"]) == fill(7, size)
    payload.append(0)  # and it released the export
    store.check()


def test_out_resized_while_get_into_iterates_its_keys():
    store = populated()
    before = store.snapshot()
    out = bytearray(2 * N)

    def growing() -> Iterator[str]:
        yield "e1"
        out.extend(bytes(N))  # not exported yet: allowed, and now the size is wrong
        yield "e2"

    with pytest.raises(ValueError):
        store.get_into(growing(), out)
    assert_unchanged(store, before)

    def shrinking() -> Iterator[str]:
        yield "e1"
        del out[2 * N :]
        yield "e2"

    assert store.get_into(shrinking(), out) is out
    assert bytes(out) == fill(2) + fill(4)
    store.check()


@pytest.mark.parametrize("kind", KINDS)
def test_user_code_closing_the_store_while_put_iterates(kind):
    store = populated(kind=kind)

    def closing() -> Iterator[BlockObject]:
        yield BlockObject("g1", valid(kind, 1))
        store.close()
        yield BlockObject("g2", valid(kind, 2))

    with pytest.raises(RuntimeError, match="closed"):
        store.put(closing())
    assert store.closed
    with pytest.raises(RuntimeError, match="closed"):
        store.put([BlockObject("g3", valid(kind, 3))])


@pytest.mark.parametrize("kind", KINDS)
def test_user_code_reentering_the_store_while_put_iterates(kind):
    store = populated(kind=kind)
    one, two, five = valid(kind, 1), valid(kind, 2), valid(kind, 5)

    def reentering() -> Iterator[BlockObject]:
        yield BlockObject("g1", one)
        store.put([BlockObject("inner", five)], retain_keys=["inner"])
        assert store.get_concatenated(["inner"]) == five
        assert store.get_many(["inner"])[0] == five
        yield BlockObject("g2", two)

    store.put(reentering(), release_keys=["inner"])
    assert store.get_concatenated(["g1", "g2", "inner"]) == one + two + five
    assert "inner" not in store.snapshot()["references"]
    store.check()


# --------------------------------------------------------------------------- keys


@pytest.mark.parametrize("kind", KINDS)
def test_enormous_keys(kind):
    store = populated(kind=kind)
    one, two, three = valid(kind, 1), valid(kind, 2), valid(kind, 3)
    big = "k" * (1 << 20)
    twin = big[:-1] + "j"  # differs in the last of 1 MiB characters
    store.put([BlockObject(big, one), BlockObject(twin, two)], retain_keys=[big, twin, twin])
    assert store.get_concatenated([twin, big]) == two + one
    store.put([], release_keys=[big, twin])
    assert store.snapshot()["references"][twin] == 1
    wide = "\U0010ffff" * (1 << 18)  # 1 MiB of UTF-8 in 4-byte characters
    store.put([BlockObject(wide, three)])
    assert store.get_concatenated([wide]) == three
    with pytest.raises(BlockObjectStoreError, match="does not exist"):
        store.get_concatenated([big + "x"])
    store.check()


@pytest.mark.parametrize("kind", KINDS)
def test_keys_differing_only_after_a_nul_byte_are_distinct(kind):
    store = populated(kind=kind)
    keys = ["a", "a\x00", "a\x00\x00", "\x00a", "a\x00b\x00c", "a\x00c"]
    payloads = [valid(kind, 10 + i) for i in range(len(keys))]
    store.put(
        [BlockObject(key, p) for key, p in zip(keys, payloads, strict=True)], retain_keys=keys
    )
    assert store.get_concatenated(keys) == b"".join(payloads)
    assert store.get_many(keys)[0] == b"".join(payloads)
    refs = store.snapshot()["references"]
    assert all(refs[key] == 1 for key in keys)
    assert store.get_concatenated(["a\x00b"]) == fill(5)  # BASE_KEYS[4]
    store.check()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("key", ["\ud800", "a\udfffb", "\udc80" * 3], ids=ascii)
def test_lone_surrogate_keys_are_refused_everywhere(key, kind):
    store = populated(kind=kind)
    before = store.snapshot()
    calls = [
        lambda: store.put([BlockObject(key, valid(kind, 1))]),
        lambda: store.put([], retain_keys=[key]),
        lambda: store.put([], release_keys=[key]),
        lambda: store.get_concatenated([key]),
        lambda: store.get_many([key]),
        lambda: store.contains([key]),
    ]
    if kind == "fixed":
        calls.append(lambda: store.put_blocks([key], fill(1)))
        calls.append(lambda: store.get_into([key], bytearray(N)))
    for call in calls:
        with pytest.raises((TypeError, ValueError)):
            call()
    assert_unchanged(store, before)


@pytest.mark.parametrize("kind", KINDS)
def test_str_subclass_keys_use_their_text(kind):
    store = populated(kind=kind)
    key = StrKey("sub")
    store.put([BlockObject(key, valid(kind, 4))], retain_keys=[key])
    assert store.get_concatenated(["sub"]) == valid(kind, 4)
    store.put([], release_keys=["sub"])
    store.put([], retain_keys=[StrKey("e1")], release_keys=[StrKey("e1")])
    assert store.get_concatenated([StrKey("e1")]) == fill(2)
    store.check()


# --------------------------------------------------------------------------- reads


read_keys = st.one_of(
    st.sampled_from([*BASE_KEYS, *BASE_KEYS, PENDING, "missing"]), surrogate_keys, non_str_keys
)


def expected_lru(lru: list[str], keys: list[str]) -> list[str]:
    order = list(lru)
    for key in keys:
        if key in order:
            order.remove(key)
            order.append(key)
    return order


stored_keys = st.sampled_from(BASE_KEYS)


@SETTINGS
@given(data=st.data(), clean=st.booleans(), container=container_kinds)
def test_get_concatenated_with_hostile_keys(data, clean, container):
    keys = data.draw(st.lists(stored_keys if clean else read_keys, max_size=6))
    store = populated()
    before = store.snapshot()
    valid = container != "raising_iter"
    valid = valid and all(is_key(k) and k in before["objects"] for k in keys)
    event(f"valid={valid}")
    try:
        data = store.get_concatenated(containers(keys, container))
    except ALLOWED as error:
        assert not valid, f"valid read refused: {error!r}"
        assert_unchanged(store, before)
        return
    assert valid
    assert data == b"".join(before["objects"][k] for k in keys)
    after = store.snapshot()
    assert after["lru"] == expected_lru(before["lru"], keys)
    assert after["objects"] == before["objects"]
    assert after["references"] == before["references"]
    store.check()
    store.close()


@st.composite
def outs(draw: st.DrawFn, nbytes: int, clean: bool = False) -> Any:
    if clean:
        return draw(
            st.sampled_from(
                [bytearray(nbytes), np.zeros(nbytes, "u1"), np.zeros(nbytes // 8, "<f8")]
            )
        )
    kind = draw(
        st.sampled_from(
            (
                "bytearray bytes memoryview_ro numpy numpy_ro strided "
                "object fortran array scalar none str"
            ).split()
        )
    )
    size = draw(st.sampled_from([nbytes, nbytes, nbytes + 1, max(nbytes - 1, 0)]))
    if kind == "bytearray":
        return bytearray(size)
    if kind == "bytes":
        return bytes(size)
    if kind == "memoryview_ro":
        return memoryview(bytes(size))
    if kind == "numpy":
        dtype = draw(st.sampled_from(["u1", "<f8", "c16", "?"]))
        itemsize = np.dtype(dtype).itemsize
        return np.full(max(size // itemsize, 0), 0xAB, dtype="u1").astype(dtype)
    if kind == "numpy_ro":
        out = np.zeros(size, dtype="u1")
        out.flags.writeable = False
        return out
    if kind == "strided":
        return np.zeros(2 * size, dtype="u1")[::2]
    if kind == "object":
        return np.empty(size, dtype=object)
    if kind == "fortran":
        return np.zeros((2, max(size // 2, 1)), dtype="u1", order="F")
    if kind == "array":
        return array.array("B", bytes(size))
    if kind == "scalar":
        return np.zeros((), dtype="u1")
    return None if kind == "none" else "x" * size


@SETTINGS
@given(data=st.data(), clean=st.booleans())
def test_get_into_with_hostile_keys_and_buffers(data, clean):
    keys = data.draw(st.lists(stored_keys if clean else read_keys, max_size=4))
    store = populated()
    before = store.snapshot()
    out = data.draw(outs(len(keys) * N, clean))
    view = plain_buffer(out)
    valid = view is not None and not view.readonly and view.nbytes == len(keys) * N
    if view is not None:
        view.release()
    valid = valid and all(is_key(k) and k in before["objects"] for k in keys)
    event(f"valid={valid}")
    try:
        result = store.get_into(keys, out)
    except ALLOWED as error:
        assert not valid, f"valid read refused: {error!r}"
        assert_unchanged(store, before)
        return
    assert valid
    assert result is out
    assert buffer_bytes(out) == b"".join(before["objects"][k] for k in keys)
    assert store.snapshot()["lru"] == expected_lru(before["lru"], keys)
    store.check()
    store.close()


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("not-a-dtype", (1,)),
        (object, (1,)),
        (np.uint8, (3,)),  # 2 x 16 bytes cannot be rows of 3
        (np.uint8, (-1,)),
        (np.uint8, (2**62,)),
        (np.float64, (5,)),
        (np.uint8, ("x",)),
    ],
    ids=repr,
)
def test_get_array_with_a_bad_dtype_or_shape_changes_nothing(dtype, shape):
    """A failing read is not a successful read: it must not move keys in the LRU."""
    store = populated()
    before = store.snapshot()
    with pytest.raises((TypeError, ValueError)):
        store.get_array(["e1", "e2"], dtype=dtype, shape_per_token=shape)
    assert_unchanged(store, before)


def test_get_array_and_tensor_valid_reads():
    store = populated()
    array_ = store.get_array(["e1", "r1"], dtype=np.uint16, shape_per_token=(2,))
    assert array_.shape == (8, 2)
    assert array_.tobytes() == fill(2) + fill(1)
    empty = store.get_array([], dtype=np.uint8, shape_per_token=(4,))
    assert empty.shape == (0, 4)
    store.check()


def test_get_tensor_with_a_bad_shape_changes_nothing():
    torch = pytest.importorskip("torch")
    store = populated()
    before = store.snapshot()
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        store.get_tensor(["e1", "e2"], dtype=torch.uint8, shape_per_token=(3,))
    assert_unchanged(store, before)


# --------------------------------------------------------------------------- put_blocks


@st.composite
def blocks_for(draw: st.DrawFn, count: int) -> Any:
    kind = draw(
        st.sampled_from(
            (
                "bytes bytes bytearray rows rows_f4 wrong_rows wide_rows "
                "strided fortran object scalar none str list"
            ).split()
        )
    )
    value = draw(byte_values)
    size = draw(st.sampled_from([count * N, count * N, count * N + 1, max(count * N - 1, 0)]))
    if kind == "bytes":
        return fill(value, size)
    if kind == "bytearray":
        return bytearray(fill(value, size))
    if kind == "rows":
        return np.full((count, N), value, dtype="u1")
    if kind == "rows_f4":
        return np.full((count, N), value, dtype="u1").view("<f4")
    if kind == "wrong_rows":
        return np.full((count + 1, N), value, dtype="u1")
    if kind == "wide_rows":
        return np.full((count, N + 4), value, dtype="u1")
    if kind == "strided":
        return np.full((count, 2 * N), value, dtype="u1")[:, ::2]
    if kind == "fortran":
        return np.asfortranarray(np.full((max(count, 2), N), value, dtype="u1"))
    if kind == "object":
        return np.empty((count, N), dtype=object)
    if kind == "scalar":
        return np.zeros((), dtype="u1")
    return {"none": None, "str": "x" * size, "list": [value] * size}[kind]


def block_rows(keys: list[str], blocks: Any) -> list[Any]:
    raw = buffer_bytes(blocks)
    return [
        types.SimpleNamespace(key=k, payload=raw[i * N : (i + 1) * N]) for i, k in enumerate(keys)
    ]


def blocks_ok(blocks: object, count: int) -> bool:
    view = plain_buffer(blocks)
    if view is None:
        return False
    with view:
        if view.nbytes != count * N:
            return False
        if view.ndim == 1 and view.itemsize == 1:
            return True
        return view.ndim > 0 and view.shape is not None and view.shape[0] == count


@SETTINGS
@given(data=st.data(), clean=st.booleans())
def test_put_blocks_with_hostile_input(data, clean):
    keys = data.draw(st.lists(good_keys if clean else any_keys, max_size=4))
    retains, releases = key_lists(data, clean), key_lists(data, clean, releases=True)
    store = populated()
    before = store.snapshot()
    blocks = data.draw(blocks_for(len(keys)))
    valid = all(is_key(k) for k in keys) and blocks_ok(blocks, len(keys))
    outcome = batch_outcome(before, block_rows(keys, blocks) if valid else [], retains, releases)
    valid = valid and outcome is not None
    event(f"valid={valid}")
    try:
        store.put_blocks(keys, blocks, retain_keys=retains, release_keys=releases)
    except ALLOWED as error:
        assert not valid, f"valid input refused: {error!r}"
        assert not isinstance(error, BlockObjectStoreError), error
        assert_unchanged(store, before)
        return
    assert valid, "invalid input accepted"
    assert_applied(store, outcome)
    store.close()


def test_put_blocks_with_torch_tensors():
    torch = pytest.importorskip("torch")
    store = populated()
    before = store.snapshot()
    for blocks in (
        torch.zeros(3, N, dtype=torch.uint8),  # wrong row count
        torch.zeros(2, N + 2, dtype=torch.uint8),  # wrong row size
        torch.zeros(2 * N, 2, dtype=torch.uint8).t(),  # not contiguous
        torch.tensor(1),  # 0-d
    ):
        with pytest.raises((TypeError, ValueError)):
            store.put_blocks(["t1", "t2"], blocks)
    assert_unchanged(store, before)
    store.put_blocks(["t1", "t2"], torch.full((2, N // 2), 1.5, dtype=torch.bfloat16))
    assert (
        store.get_concatenated(["t1"])
        == torch.full((N // 2,), 1.5, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )


# --------------------------------------------------------------------------- closed store


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put([object()]),
        lambda s: s.put(None),
        lambda s: s.put([], retain_keys=[1]),
        lambda s: s.put_blocks([1], None),
        lambda s: s.get_concatenated(None),
        lambda s: s.get_concatenated(["\ud800"]),
        lambda s: s.get_into([1], None),
        lambda s: s.get_array(["e1"], dtype="nope", shape_per_token=(1,)),
    ],
)
def test_a_closed_store_raises_closed_before_looking_at_arguments(call):
    store = populated()
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(store)


# --------------------------------------------------------------------------- BlockObject


@SETTINGS
@given(key=any_keys, payload=payloads)
def test_block_object_accepts_anything_and_never_crashes(key, payload):
    block = BlockObject(key, payload)
    assert block.key is key
    assert block.payload is payload
    for operation in (hash, repr, lambda b: b == BlockObject(key, payload), lambda b: b != 1):
        try:
            operation(block)
        except (TypeError, ValueError, UserError):
            pass
    if isinstance(payload, (bytes, type(None), int, float, str)) and type(key) is str:
        again = pickle.loads(pickle.dumps(block))
        assert again.key == key


def test_block_object_hash_of_an_unhashable_payload_raises_as_vllms_does():
    """vLLM's BlockObject is a frozen dataclass: hashing one whose payload is unhashable
    raises TypeError (the README promises the same equality and hash)."""
    with pytest.raises(TypeError):
        hash(BlockObject("k", bytearray(b"x")))
    assert hash(BlockObject("k", b"x")) == hash(BlockObject("k", b"x"))


@pytest.mark.parametrize("dtype", ["c16", "V16", "(2,)<f8"])
def test_zero_dimensional_buffer_of_the_right_size_is_a_valid_payload(dtype):
    """A 0-d numpy array of a 16-byte dtype is a C-contiguous buffer of 16 bytes."""
    payload = np.zeros((), dtype=[("x", dtype)] if dtype.startswith("(") else dtype)
    assert memoryview(payload).nbytes == N and memoryview(payload).c_contiguous
    store = populated()
    store.put([BlockObject("zero-d", payload)])
    assert store.get_concatenated(["zero-d"]) == bytes(N)
    store.check()


class BufferExporter:
    """An object exporting its buffer through ``__buffer__`` (Python 3.12+; earlier versions
    do not see it as a buffer at all)."""

    def __init__(self, data: bytearray | None) -> None:
        self.data = data

    def __buffer__(self, flags: int) -> memoryview:
        if self.data is None:
            raise UserError("__buffer__")
        return memoryview(self.data)

    def __release_buffer__(self, view: memoryview) -> None:
        view.release()


@pytest.mark.parametrize(
    "data", [None, bytearray(N - 1), bytearray(fill(3))], ids=["raises", "short", "valid"]
)
def test_payload_exporting_its_buffer_from_python(data):
    store = populated()
    before = store.snapshot()
    try:
        store.put([BlockObject("exported", BufferExporter(data))])
    except (TypeError, ValueError, UserError):
        assert data is None or len(data) != N or sys.version_info < (3, 12)
        assert_unchanged(store, before)
        return
    assert data is not None and len(data) == N
    assert store.get_concatenated(["exported"]) == fill(3)
    store.check()


# --------------------------------------------------------------------------- background writer


def writer_for(kind: str) -> tuple[BackgroundBlockObjectStore, BlockObjectStore]:
    store = populated()
    if kind == "python":
        # A method replaced on the instance keeps the store off the Rust writer.
        store.put = store.put  # type: ignore[method-assign]
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    return writer, store


def assert_publication_failure(error: BaseException) -> None:
    """A writer error: BlockObjectStoreError "publication failed" chained from an allowed
    cause, or a documented error raised at once by the caller's own thread."""
    if isinstance(error, BlockObjectStoreError) and "publication failed" in str(error):
        assert isinstance(error.__cause__, ALLOWED), repr(error.__cause__)
    else:
        assert isinstance(error, ALLOWED), repr(error)


@settings(SETTINGS, max_examples=max(EXAMPLES // 3, 10))
@given(
    kind=st.sampled_from(["native", "python"]),
    clean=st.booleans(),
    container=container_kinds,
    use_blocks=st.booleans(),
    data=st.data(),
)
def test_background_writer_with_hostile_input(kind, clean, container, use_blocks, data):
    items = data.draw(st.lists(batch_items(clean), max_size=4))
    retains, releases = key_lists(data, clean), key_lists(data, clean, releases=True)
    writer, store = writer_for(kind)
    before = store.snapshot()
    errors: list[BaseException] = []
    if use_blocks:
        keys = [data.draw(good_keys if clean else any_keys) for _ in range(len(items))]
        blocks = data.draw(blocks_for(len(keys)))
        valid = all(is_key(k) for k in keys) and blocks_ok(blocks, len(keys))
        objects = block_rows(keys, blocks) if valid else []
        empty = not keys
    else:
        objects = [item for item, _ in items]
        # The Python writer takes a list of the objects first: a raising __len__ fails there.
        failing = {"raising_iter", "raising_len"} if kind == "python" else {"raising_iter"}
        valid = container not in failing and all(ok for _, ok in items)
        empty = not items and container not in failing
    outcome = batch_outcome(before, objects if valid else [], retains, releases)
    valid = valid and outcome is not None
    if empty and not retains and not releases:
        outcome, valid = batch_outcome(before, [], [], []), True  # a no-op, whatever blocks is
    event(f"valid={valid}")
    try:
        if use_blocks:
            writer.put_blocks(keys, blocks, retain_keys=retains, release_keys=releases)
        else:
            writer.put(containers(objects, container), retain_keys=retains, release_keys=releases)
    except BaseException as error:
        errors.append(error)
    try:
        writer.get_concatenated([])  # waits for the queue; raises a latched error
    except BaseException as error:
        errors.append(error)
    for error in errors:
        assert_publication_failure(error)
    if valid:
        assert not errors, f"valid input refused: {errors!r}"
        assert_applied(store, outcome)
    else:
        assert errors, "invalid input accepted"
        assert_unchanged(store, before)
    try:
        writer.close()
    except BaseException as error:
        assert errors, f"close raised {error!r} though the writer had no error"
        assert_publication_failure(error)
    writer.close()  # idempotent, raises nothing the second time
    assert store.closed


@pytest.mark.parametrize("value", [0, -1, 2**70, 1.5, True, None, "2"], ids=repr)
def test_background_writer_refuses_bad_queue_bounds(value):
    store = populated()
    with pytest.raises((TypeError, ValueError, OverflowError)):
        BackgroundBlockObjectStore(store, max_pending_batches=value)
    store.check()
    store.close()


# --------------------------------------------------------------------------- victim policy


class RecordingPolicy:
    """Records the candidates it was offered and answers with ``choose(candidates, count)``."""

    def __init__(self, choose: Callable[[list[str], int], Any], hooks_return: Any = None) -> None:
        self.choose = choose
        self.hooks_return = hooks_return
        self.offered: list[str] | None = None
        self.removed: list[tuple[list[str], str]] = []

    def on_reference_change(self, key: str, old: int, new: int) -> Any:
        return self.hooks_return

    def select_victims(self, candidates: Any, count: int) -> Any:
        self.offered = list(candidates)
        return self.choose(self.offered, count)

    def on_remove(self, keys: list[str], reason: str) -> Any:
        self.removed.append((list(keys), reason))
        return self.hooks_return


def _raising_generator(keys: list[str]) -> Iterator[str]:
    yield from keys[:1]
    raise UserError("selection generator")


@st.composite
def selections(draw: st.DrawFn) -> Callable[[list[str], int], Any]:
    """How the policy answers: valid picks, garbage, and raising answers."""
    kind = draw(
        st.sampled_from(
            (
                "exact exact exact_set too_few too_many duplicate "
                "foreign garbage none raise raising_generator lying_len bytes_keys"
            ).split()
        )
    )
    extra = draw(st.sampled_from(["r1", "missing", "\ud800", "n1", 7, None]))
    garbage = draw(st.sampled_from([5, "e1", 1.5, b"e1", object(), {"e1": 1}, [[1]]]))
    pick = draw(st.randoms(use_true_random=False))

    def choose(candidates: list[str], count: int) -> Any:
        chosen = pick.sample(candidates, min(count, len(candidates)))
        if kind == "exact":
            return chosen
        if kind == "exact_set":
            return set(chosen)
        if kind == "too_few":
            return chosen[:-1]
        if kind == "too_many":
            return [*chosen, *(c for c in candidates if c not in chosen)][: count + 1]
        if kind == "duplicate":
            return [*chosen[:-1], chosen[0]] if count > 1 else [chosen[0], chosen[0]]
        if kind == "foreign":
            return [*chosen[:-1], extra]
        if kind == "garbage":
            return garbage
        if kind == "none":
            return None
        if kind == "raise":
            raise UserError("select_victims")
        if kind == "raising_generator":
            return _raising_generator(chosen)
        if kind == "lying_len":
            return LyingLen(chosen, 2**40)
        return [key.encode() for key in chosen]

    return choose


def selection_ok(selection: Any, candidates: list[str], count: int) -> bool:
    if selection is None:
        return False
    try:
        keys = list(iter(selection))  # iter(): a lying __len__ must not size the list
    except (TypeError, UserError):
        return False
    return (
        len(keys) == count
        and len(set(map(repr, keys))) == count
        and all(type(k) is str and k in candidates for k in keys)
    )


@SETTINGS
@given(
    choose=selections(),
    hooks_return=st.sampled_from([None, 1, "garbage", object(), float("nan")]),
    new=st.integers(1, 3),
    retain_new=st.booleans(),
)
def test_policy_answers_garbage_and_the_store_stays_consistent(
    choose, hooks_return, new, retain_new
):
    answers: list[Any] = []

    def recording_choose(candidates: list[str], count: int) -> Any:
        answer = choose(candidates, count)
        answers.append(answer)
        return answer

    policy = RecordingPolicy(recording_choose, hooks_return)
    store = BlockObjectStore(max_bytes=5 * N, object_nbytes=N, policy=policy)
    store.put([BlockObject(k, fill(i + 1)) for i, k in enumerate(["r1", "e1", "e2", "e3", "e4"])])
    store.put([], retain_keys=["r1"])
    before = store.snapshot()
    new_keys = [f"n{i}" for i in range(new)]
    try:
        store.put(
            [BlockObject(k, fill(40 + i)) for i, k in enumerate(new_keys)],
            retain_keys=new_keys if retain_new else (),
        )
    except (BlockObjectStoreError, UserError) as error:
        if isinstance(error, BlockObjectStoreError):
            assert "cannot retain" in str(error)
        # Refused: no victim evicted, no new key stored, new keys reported as rolled back.
        assert store.snapshot()["objects"] == before["objects"]
        if isinstance(error, BlockObjectStoreError):
            assert policy.removed == [(new_keys, "rollback")]
        store.check()
        assert not (answers and selection_ok(answers[0], policy.offered or [], new)), (
            f"a valid selection was refused: {error!r}"
        )
        return
    store.check()
    assert policy.offered is not None
    assert policy.offered == before["lru"]  # eligible keys, oldest first
    chosen = list(iter(answers[0]))
    assert selection_ok(chosen, policy.offered, new)
    after = store.snapshot()
    assert set(after["objects"]) == (set(before["objects"]) - set(chosen)) | set(new_keys)
    assert policy.removed == [(list(policy.removed[0][0]), "eviction")]
    assert sorted(policy.removed[0][0]) == sorted(chosen)
    store.close()


def test_candidates_are_invalid_after_select_victims_returns():
    kept: list[Any] = []

    def keep(candidates: Any, count: int) -> Any:
        kept.append(candidates)
        return candidates  # the walk ends before the store reads the answer

    policy = types.SimpleNamespace(
        on_reference_change=lambda *a: None,
        select_victims=keep,
        on_remove=lambda keys, reason: None,
    )
    store = BlockObjectStore(max_bytes=2 * N, object_nbytes=N, policy=policy)
    store.put([BlockObject("a", fill(1)), BlockObject("b", fill(2))])
    before = store.snapshot()
    with pytest.raises(BlockObjectStoreError, match="cannot retain"):
        store.put([BlockObject("c", fill(3))])
    assert store.snapshot()["objects"] == before["objects"]
    with pytest.raises(RuntimeError, match="only valid during"):
        next(kept[0])
    store.check()


def test_policy_exception_in_on_reference_change_rolls_back_new_keys():
    armed = []

    def on_reference_change(key: str, old: int, new: int) -> None:
        if armed:
            raise UserError(key)

    policy = types.SimpleNamespace(
        on_reference_change=on_reference_change,
        select_victims=lambda c, n: [next(c) for _ in range(n)],
        on_remove=lambda keys, reason: None,
    )
    store = BlockObjectStore(max_bytes=8 * N, object_nbytes=N, policy=policy)
    store.put([BlockObject(k, fill(i)) for i, k in enumerate(["a", "b", "c"])], retain_keys=["a"])
    before = store.snapshot()
    armed.append(True)
    with pytest.raises(UserError):
        store.put([BlockObject("new", fill(9)), BlockObject("b", fill(8))], retain_keys=["new"])
    after = store.snapshot()
    assert after["objects"] == before["objects"]  # new key rolled back, stored bytes kept
    store.check()


@pytest.mark.parametrize(
    "reenter",
    [
        lambda s: s.put([]),
        lambda s: s.put([BlockObject("x", fill(1))]),
        lambda s: s.get_concatenated(["a"]),
        lambda s: s.get_into(["a"], bytearray(N)),
        lambda s: s.stats(),
        lambda s: s.snapshot(),
        lambda s: s.check(),
        lambda s: s.num_slots,
    ],
)
def test_a_policy_calling_back_into_its_store_gets_an_error_not_a_deadlock(reenter):
    holder: list[BlockObjectStore] = []

    def on_reference_change(key: str, old: int, new: int) -> None:
        reenter(holder[0])

    policy = types.SimpleNamespace(
        on_reference_change=on_reference_change,
        select_victims=lambda c, n: None,
        on_remove=lambda keys, reason: None,
    )
    store = BlockObjectStore(max_bytes=4 * N, object_nbytes=N, policy=policy)
    holder.append(store)
    store.put([BlockObject("a", fill(1))])
    before = store.snapshot()
    with pytest.raises(BlockObjectStoreError, match="must not call back"):
        store.put([BlockObject("b", fill(2))], retain_keys=["b"])
    assert store.snapshot()["objects"] == before["objects"]
    store.check()
    assert store.get_concatenated(["a"]) == fill(1)  # the store still works


@pytest.mark.parametrize("kind", KINDS)
def test_a_policy_closing_its_store_leaves_it_consistent(kind):
    """A refused close() must not leave the store half closed: either it is closed (closed is
    True, puts raise "closed") or it is open and works. The variable store, whose refused put
    changes nothing, stays open and unchanged."""
    holder: list[Any] = []

    def on_reference_change(key: str, old: int, new: int) -> None:
        holder[0].close()

    policy = types.SimpleNamespace(
        on_reference_change=on_reference_change,
        select_victims=lambda c, n: None,
        on_remove=lambda keys, reason: None,
    )
    store = new_store(kind, policy, slots=4)
    holder.append(store)
    store.put([BlockObject("a", fill(1))])
    before = store.snapshot()
    with pytest.raises(BlockObjectStoreError, match="must not call back"):
        store.put([], retain_keys=["a"])
    if kind == "variable":
        assert not store.closed
        assert_unchanged(store, before)
    if store.closed:
        with pytest.raises(RuntimeError, match="closed"):
            store.get_concatenated(["a"])
    else:
        try:
            read = store.get_concatenated(["a"])
        except RuntimeError as error:
            pytest.fail(f"store.closed is False, yet a read raises {error!r}")
        assert read == fill(1)
    store.close()
    assert store.closed


# --------------------------------------------------------------------------- crash-prone input

PRELUDE = """
import sys
from aostore import (BackgroundBlockObjectStore, BlockObject, BlockObjectStore,
                     BlockObjectStoreError, VariableBlockObjectStore)
N = 16
store = STORE
store.put([BlockObject("a", b"a" * N)], retain_keys=["a"])
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
STORES = {
    "fixed": "BlockObjectStore(max_bytes=8 * N, object_nbytes=N)",
    "variable": "VariableBlockObjectStore(max_bytes=8 * N)",
}


def run_isolated(
    call: str, timeout: float = 60, kind: str = "fixed"
) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(PRELUDE).replace("STORE", STORES[kind]).replace("CALL", call)
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


# Calls both stores take, then the fixed store's own entry points.
LYING_CALLS = {
    "put-objects": 'store.put(LyingLen([BlockObject("b", b"b" * N)], HUGE))',
    "put-retains": 'store.put([], retain_keys=LyingLen(["a"], HUGE))',
    "put-releases": 'store.put([], release_keys=LyingLen(["a"], HUGE))',
    "get-keys": 'store.get_concatenated(LyingLen(["a"], HUGE))',
    "get-many": 'store.get_many(LyingLen(["a", "zz"], HUGE))',
    "contains": 'store.contains(LyingLen(["a"], HUGE))',
    "writer-put-objects": (
        "BackgroundBlockObjectStore(store, max_pending_batches=2)"
        '.put(LyingLen([BlockObject("b", b"b" * N)], HUGE))'
    ),
    "writer-put-retains": (
        "BackgroundBlockObjectStore(store, max_pending_batches=2)"
        '.put([], retain_keys=LyingLen(["a"], HUGE))'
    ),
}
FIXED_LYING_CALLS = {
    "get-into-keys": 'store.get_into(LyingLen(["a"], HUGE), bytearray(N))',
    "put-blocks-keys": 'store.put_blocks(LyingLen(["b"], HUGE), b"b" * N)',
}
HUGE_LEN_CALLS = {
    f"{kind}-{name}-len-{length}": (kind, call.replace("HUGE", length))
    for kind in KINDS
    for length in ("2**40", "sys.maxsize")
    for name, call in (LYING_CALLS | (FIXED_LYING_CALLS if kind == "fixed" else {})).items()
}


@pytest.mark.parametrize(("kind", "call"), list(HUGE_LEN_CALLS.values()), ids=list(HUGE_LEN_CALLS))
def test_a_lying_len_never_crashes_the_process(kind, call):
    """``__len__`` is only a size hint: an absurd one must not abort the process on a failed
    allocation or raise PanicException ("capacity overflow")."""
    result = run_isolated(call, kind=kind)
    assert result.returncode == 0, f"process died with {result.returncode}: {result.stderr[:1500]}"
    assert "survived" in result.stdout, result.stderr[:1500]


def test_a_policy_selection_with_a_lying_len_does_not_crash():
    call = """
    policy = type("P", (), {
        "on_reference_change": lambda self, *a: None,
        "select_victims": lambda self, c, n: LyingLen([next(c) for _ in range(n)], 2**40),
        "on_remove": lambda self, keys, reason: None,
    })()
    s = BlockObjectStore(max_bytes=2 * N, object_nbytes=N, policy=policy)
    s.put([BlockObject(k, b"x" * N) for k in ("p", "q", "r")])
    assert s.get_concatenated(["r"]) == b"x" * N
    s.check()
    """
    result = run_isolated(textwrap.indent(textwrap.dedent(call), "    ").strip())
    assert result.returncode == 0, result.stderr[:1500]


# A watchdog for a subprocess that might copy terabytes: it kills itself (exit code -9) long
# before it can take the machine's memory.
WATCHDOG = """
import os, signal, threading, time
def _watchdog():
    while True:
        with open("/proc/self/statm") as statm:
            if int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") > 1 << 30:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.002)
threading.Thread(target=_watchdog, daemon=True).start()
"""

OVERFLOW_SCRIPT = """
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError
try:
    store = BlockObjectStore(max_bytes=1 << 46, object_nbytes=1 << 46)  # one 64 TiB slot
except MemoryError:
    print("no address space")
    raise SystemExit(0)
# 2**18 keys of 2**46 bytes need 2**64 bytes: the size wraps to 0 in 64-bit arithmetic, and
# an empty buffer passes an unchecked length check. Three distinct keys do not fit in one slot,
# so a store that got this wrong refuses with "cannot retain" before it copies anything.
keys = ["a", "b"] + ["k"] * ((1 << 18) - 2)
before = store.snapshot()
try:
    WHO.put_blocks(keys, b"")
    WAIT
except (ValueError, OverflowError) as error:
    print("refused", type(error).__name__)
except BlockObjectStoreError as error:
    cause = error.__cause__
    if "publication failed" in str(error) and isinstance(cause, (ValueError, OverflowError)):
        print("refused", type(cause).__name__)
    else:
        print("wrong error", repr(error), repr(cause))
else:
    print("accepted")
assert store.snapshot() == before
"""


@pytest.mark.parametrize("who", ["store", "writer"])
def test_put_blocks_whose_size_overflows_64_bits_is_refused(who):
    """``len(keys) * object_nbytes`` must be checked: wrapped, it lets an empty buffer pass as
    2**64 bytes and the copy reads far outside it."""
    code = OVERFLOW_SCRIPT.replace("WHO", "store" if who == "store" else "writer").replace(
        "WAIT", "writer.get_concatenated([])" if who == "writer" else "pass"
    )
    if who == "writer":
        code = code.replace(
            "before = store.snapshot()",
            "before = store.snapshot()\n"
            "writer = BackgroundBlockObjectStore(store, max_pending_batches=1)",
        )
    env = {**os.environ, "RUST_BACKTRACE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", WATCHDOG + code], capture_output=True, text=True, timeout=60, env=env
    )
    if "no address space" in result.stdout:
        pytest.skip("this machine cannot map a 64 TiB arena")
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[:1500]}"
    assert result.stdout.startswith("refused"), result.stdout + result.stderr[:1500]


# --------------------------------------------------------------------------- prefault modes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefault", [True, False, "background"])
def test_prefault_modes(prefault, kind):
    store = new_store(kind, slots=1 << 16, prefault=prefault)
    payload = fill(3, N if kind == "fixed" else 3000)  # the variable store's spans many chunks
    store.put([BlockObject("a", payload)])
    assert store.get_concatenated(["a"]) == payload
    store.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prefault", ["now", 1, None, "True"], ids=repr)
def test_bad_prefault_is_a_value_error(prefault, kind):
    with pytest.raises(ValueError, match="prefault"):
        new_store(kind, slots=1 << 16, prefault=prefault)
