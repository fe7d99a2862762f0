"""``publish_routed_experts`` / ``materialize_routed_experts`` against a byte-level reference.

The reference below is the plain way to do it: one ``BlockObject(key, array.tobytes())`` per
full block, one ``put``, and ``np.frombuffer(get_concatenated(keys))`` to read. The helpers must
give the same stored bytes, references, results and errors on every kind of store: aostore's,
a background writer in front of it, and any duck-typed store (the fallback path).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from aostore import (
    BackgroundBlockObjectStore,
    BlockObject,
    BlockObjectStore,
    BlockObjectStoreError,
    ObjectMissingError,
)
from aostore._native import NativeStore
from aostore.routed_experts import (
    materialize_routed_experts,
    publish_routed_experts,
    routed_experts_keys,
)
from hypothesis import given, settings
from hypothesis import strategies as st

BLOCK = 4  # tokens per KV block
PER_TOKEN = (3, 2)  # layers x top-k
DTYPE = np.dtype(np.int16)
NBYTES = BLOCK * int(np.prod(PER_TOKEN)) * DTYPE.itemsize  # 48
SLOTS = 6

# --------------------------------------------------------------------------- the reference


def reference_publish(
    store: Any,
    *,
    batches: Sequence[tuple[Sequence[str], list[tuple[int, np.ndarray]]]],
    block_size: int,
    retain_keys: Sequence[str] = (),
    release_keys: Sequence[str] = (),
) -> None:
    objects = []
    for block_keys, blocks in batches:
        for block_start, array in blocks:
            if block_start < 0 or block_start % block_size != 0:
                raise ValueError("auxiliary output block start is not hash-block aligned")
            index = block_start // block_size
            if index >= len(block_keys):
                raise ValueError(
                    "auxiliary output block has no corresponding key: "
                    f"start={block_start}, index={index}, "
                    f"keys={len(block_keys)}, block_size={block_size}"
                )
            if array.shape[0] != block_size:
                raise ValueError("auxiliary output block length does not match hash block size")
            objects.append(BlockObject(block_keys[index], array.tobytes()))
    store.put(objects, retain_keys=retain_keys, release_keys=release_keys)


def reference_materialize(
    store: Any,
    aux_output_keys: list[str],
    *,
    shape_per_token: tuple[int, ...],
    dtype: np.dtype[Any],
) -> np.ndarray:
    if len(aux_output_keys) == 0:
        raise ValueError("routed-experts auxiliary output key list must not be empty")
    inner = getattr(store, "store", store)
    if isinstance(inner, NativeStore):
        # aostore's reads check dtype and shape before reading, so a bad one changes nothing
        # (vLLM's helper reads first); the reference follows aostore's contract there.
        size = len(aux_output_keys) * inner.object_nbytes
        np.empty(size, dtype=np.uint8).view(np.dtype(dtype)).reshape((-1, *shape_per_token))
    payload = store.get_concatenated(aux_output_keys)
    return np.frombuffer(payload, dtype=dtype).reshape((-1, *shape_per_token))


# --------------------------------------------------------------------------- stores


class DuckStore:
    """A store with only ``put``, ``get_concatenated`` and ``close``: no eviction, atomic puts."""

    def __init__(self, object_nbytes: int) -> None:
        self.object_nbytes = object_nbytes
        self.objects: dict[str, bytes] = {}
        self.references: Counter[str] = Counter()

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        staged = {}
        for obj in objects:
            payload = bytes(memoryview(obj.payload).cast("B"))
            if len(payload) != self.object_nbytes:
                raise ValueError(f"payload of {obj.key!r} holds {len(payload)} bytes")
            staged[obj.key] = payload
        references = self.references.copy()
        references.update(retain_keys)
        for key in release_keys:
            if references[key] == 0:
                raise KeyError(key)
            references[key] -= 1
        self.objects.update(staged)
        self.references = +references

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        return b"".join(self.objects[key] for key in keys)

    def close(self) -> None:
        self.objects.clear()


def aostore_store() -> BlockObjectStore:
    return BlockObjectStore(max_bytes=SLOTS * NBYTES, object_nbytes=NBYTES)


def contents(store: Any) -> Any:
    """Everything a put can change, after any queued background work."""
    if isinstance(store, BackgroundBlockObjectStore):
        try:
            store.get_concatenated([])  # waits for the writer
        except BlockObjectStoreError:
            pass
        store = store.store
    if isinstance(store, DuckStore):
        return store.objects, dict(store.references)
    return store.snapshot(), store.stats()


STORE_KINDS: dict[str, Callable[[], Any]] = {
    "aostore": aostore_store,
    "background": lambda: BackgroundBlockObjectStore(aostore_store(), max_pending_batches=2),
    "duck": lambda: DuckStore(NBYTES),
    "background-duck": lambda: BackgroundBlockObjectStore(DuckStore(NBYTES), max_pending_batches=2),
}


@pytest.fixture(params=list(STORE_KINDS))
def store_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """(store for the helpers, store for the reference), of one kind."""
    make = STORE_KINDS[request.param]
    pair = (make(), make())
    yield pair
    for store in pair:
        try:
            store.close()
        except BlockObjectStoreError:
            pass  # a background store re-raises the error a scenario provoked


# --------------------------------------------------------------------------- scenarios


def error_kind(error: BaseException) -> str:
    """The error's class name, aostore's typed miss read as the ``BlockObjectStoreError`` it
    subclasses (what vLLM's store raises, and what every ``except`` of vLLM catches)."""
    if isinstance(error, ObjectMissingError):
        assert isinstance(error, BlockObjectStoreError)
        return "BlockObjectStoreError"
    return type(error).__name__


def outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    try:
        result = call(*args, **kwargs)
    except Exception as error:
        cause = error.__cause__
        # A background writer wraps the store's error; its message depends on the store path.
        detail = str(error) if cause is None else None
        return ("error", error_kind(error), detail, type(cause).__name__ if cause else None)
    if result is None:
        return ("ok",)
    return ("array", result.dtype.str, result.shape, result.tobytes())


Step = tuple[str, dict[str, Any]]


def run_both(pair: tuple[Any, Any], steps: Sequence[Step]) -> list[tuple[Any, ...]]:
    """Runs each step with the helpers on one store and the reference on the other; every
    outcome and the stores' contents after every step must agree."""
    store, reference = pair
    outcomes = []
    for action, kwargs in steps:
        if action == "publish":
            got = outcome(publish_routed_experts, store, **kwargs)
            want = outcome(reference_publish, reference, **kwargs)
        else:
            got = outcome(materialize_routed_experts, store, **kwargs)
            want = outcome(reference_materialize, reference, **kwargs)
        if isinstance(store, BackgroundBlockObjectStore):
            # A writer's error is latched; whether the put that caused it already raises it
            # depends on the writer's timing (and aostore's Rust writer checks a put_blocks
            # batch's size at hand-over). By the next call both writers must have latched it.
            assert latched_cause(store) == latched_cause(reference), (action, kwargs)
            if got != want:
                assert {got, want} - {("ok",)} == {latched_error(store)}, (
                    action,
                    kwargs,
                    got,
                    want,
                )
        else:
            assert got == want, (action, kwargs)
        assert contents(store) == contents(reference)
        outcomes.append(got)
    return outcomes


def latched_cause(store: BackgroundBlockObjectStore) -> str | None:
    """The type of the error a background writer has latched, after waiting for it."""
    try:
        store.get_concatenated([])
    except BlockObjectStoreError as error:
        assert str(error) == "auxiliary output publication failed"
        return type(error.__cause__).__name__
    return None


def latched_error(store: BackgroundBlockObjectStore) -> tuple[Any, ...]:
    return ("error", "BlockObjectStoreError", None, latched_cause(store))


def capture(tokens: int, seed: int, dtype: Any = DTYPE) -> np.ndarray:
    """A capture buffer of routed-expert ids, one row per token."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, size=(tokens, *PER_TOKEN)).astype(dtype)


def publish(batches: Any, **kwargs: Any) -> Step:
    return ("publish", {"batches": batches, "block_size": BLOCK, **kwargs})


def read(keys: list[str], **kwargs: Any) -> Step:
    return (
        "read",
        {"aux_output_keys": keys, "shape_per_token": PER_TOKEN, "dtype": DTYPE, **kwargs},
    )


A = routed_experts_keys([b"\x01", b"\x02", b"\x03"], "ns")
B = routed_experts_keys([b"\xaa", b"\xbb"], "ns")
CAP_A = capture(3 * BLOCK, seed=1)
CAP_B = capture(2 * BLOCK + 3, seed=2)  # a partial tail block that is never published


def full(cap: np.ndarray, starts: Iterable[int]) -> list[tuple[int, np.ndarray]]:
    return [(s, cap[s : s + BLOCK]) for s in starts]


SCENARIOS: dict[str, list[Step]] = {
    "publish-then-read": [
        publish([(A, full(CAP_A, [0, 4, 8])), (B, full(CAP_B, [0, 4]))], retain_keys=A),
        read(A),
        read([B[1], A[0], B[1]]),
        read(A, dtype=np.dtype(np.uint8), shape_per_token=(12,)),
        publish([], release_keys=A[::-1]),
        read(B),
    ],
    "incremental-batches": [
        publish([(A[:1], full(CAP_A, [0]))], retain_keys=A[:1]),
        publish([(A[:2], full(CAP_A, [4]))], retain_keys=A[1:2]),
        publish([(A, full(CAP_A, [8]))], retain_keys=A[2:]),
        read(A),
    ],
    "duplicate-keys-last-wins": [
        publish([(A, full(CAP_A, [0, 4])), (A, [(0, CAP_B[0:4])])]),
        read(A[:2]),
    ],
    "non-contiguous-blocks": [
        publish([(A, [(0, CAP_A[0:4, :, ::-1]), (4, np.asfortranarray(CAP_A[4:8]))])]),
        publish([(B, [(0, CAP_A[::-1][0:4])])]),
        read(A[:2] + B[:1]),
    ],
    "mixed-dtypes-same-size": [
        # int32 x 1 expert and int16 x 2 experts per token: both 48 B per block.
        publish([(A, [(0, CAP_A[0:4]), (4, CAP_A[4:8, :, :1].astype(np.int32))])]),
        read(A[:2]),
    ],
    "misaligned-start": [
        publish([(A, full(CAP_A, [0])), (B, [(2, CAP_B[2:6])])], retain_keys=A[:1]),
        read(A[:1]),
    ],
    "negative-start": [publish([(A, [(-4, CAP_A[0:4])])])],
    "no-key-for-block": [
        publish([(A[:2], full(CAP_A, [0, 4, 8]))]),
        publish([([], full(CAP_A, [0]))]),
    ],
    "wrong-block-length": [
        publish([(A, full(CAP_A, [0])), (B, [(0, CAP_B[0:3])])]),
        publish([(B, [(4, CAP_B[4:11])])]),
    ],
    "wrong-payload-size": [
        publish([(A, [(0, CAP_A[0:4, :, :1])])]),  # 24 B, not 48 B: the store rejects it
        read(A[:1]),
    ],
    "empty-key-list": [publish([(A, full(CAP_A, [0]))]), read([])],
    "missing-key": [publish([(A, full(CAP_A, [0]))]), read([A[0], B[0]])],
    "unknown-release": [publish([(A, full(CAP_A, [0]))], release_keys=[B[0]])],
    "references-only": [
        publish([(A, full(CAP_A, [0, 4]))]),
        publish([], retain_keys=A[:2]),
        publish([], release_keys=A[:1]),
        read(A[:2]),
    ],
    "read-with-other-shape": [publish([(A, full(CAP_A, [0]))]), read(A[:1], shape_per_token=(5,))],
}


@pytest.mark.parametrize("steps", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_helpers_match_the_reference(store_pair, steps):
    run_both(store_pair, steps)


def test_scenarios_exercise_what_they_claim():
    """Guards the scenarios themselves: errors where meant, data where meant (on aostore)."""

    def run(name: str) -> list[tuple[Any, ...]]:
        pair = (aostore_store(), aostore_store())
        try:
            return run_both(pair, SCENARIOS[name])
        finally:
            for store in pair:
                store.close()

    assert run("publish-then-read")[1] == ("array", DTYPE.str, (12, *PER_TOKEN), CAP_A.tobytes())
    aligned = (
        "error",
        "ValueError",
        "auxiliary output block start is not hash-block aligned",
        None,
    )
    assert run("misaligned-start")[0] == aligned
    assert run("negative-start")[0] == aligned
    got = run("no-key-for-block")
    assert got[0][:2] == ("error", "ValueError") and "no corresponding key" in got[0][2]
    assert got[1][:2] == ("error", "ValueError") and "no corresponding key" in got[1][2]
    got = run("wrong-block-length")
    assert got[0][:2] == ("error", "ValueError") and "block length" in got[0][2]
    assert got[1][:2] == ("error", "ValueError") and "block length" in got[1][2]
    assert run("empty-key-list")[1][:2] == ("error", "ValueError")
    assert "must not be empty" in run("empty-key-list")[1][2]
    assert run("missing-key")[1][:2] == ("error", "BlockObjectStoreError")
    assert run("wrong-payload-size")[0][:2] == ("error", "ValueError")
    assert run("unknown-release")[0][:2] == ("error", "KeyError")
    assert run("mixed-dtypes-same-size")[1][0] == "array"
    assert run("read-with-other-shape")[1][:2] == ("error", "ValueError")


def test_materialize_returns_a_private_array():
    store = aostore_store()
    try:
        publish_routed_experts(store, batches=[(A, full(CAP_A, [0]))], block_size=BLOCK)
        first = materialize_routed_experts(store, A[:1], shape_per_token=PER_TOKEN, dtype=DTYPE)
        publish_routed_experts(
            store,
            batches=[
                (routed_experts_keys([bytes([i])], "x"), full(CAP_B, [0])) for i in range(SLOTS)
            ],
            block_size=BLOCK,
        )  # evicts A[0]
        with pytest.raises(BlockObjectStoreError, match="does not exist"):
            materialize_routed_experts(store, A[:1], shape_per_token=PER_TOKEN, dtype=DTYPE)
        np.testing.assert_array_equal(first, CAP_A[0:4])
    finally:
        store.close()


def test_routed_experts_keys():
    assert routed_experts_keys([b"\x00\xff", b""], "model-a") == [
        "vllm-artifact/model-a/00ff",
        "vllm-artifact/model-a/",
    ]
    assert routed_experts_keys([], "x") == []


# --------------------------------------------------------------------------- random sequences

block_steps = st.lists(
    st.tuples(
        st.integers(0, 3),  # which key list
        st.integers(-1, 4),  # block index (start = index * BLOCK, -1 for negative)
        st.sampled_from([BLOCK, BLOCK, BLOCK, BLOCK - 1]),  # block length
        st.integers(0, 2**16),  # data seed
    ),
    max_size=4,
)
KEY_LISTS = [A, B, A[:1], []]
ALL_KEYS = A + B


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["aostore", "background"]),
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("publish"),
                block_steps,
                st.lists(st.sampled_from(ALL_KEYS), max_size=3),
                st.lists(st.sampled_from(ALL_KEYS), max_size=3),
            ),
            st.tuples(st.just("read"), st.lists(st.sampled_from(ALL_KEYS), max_size=4)),
        ),
        max_size=6,
    ),
)
def test_random_sequences_match_the_reference(kind, ops):
    steps: list[Step] = []
    for op in ops:
        if op[0] == "read":
            steps.append(read(op[1]))
            continue
        _, blocks, retains, releases = op
        batches = []
        for which, index, length, seed in blocks:
            data = capture(length, seed)
            batches.append((KEY_LISTS[which], [(index * BLOCK, data)]))
        steps.append(publish(batches, retain_keys=retains, release_keys=releases))
    make = STORE_KINDS[kind]
    pair = (make(), make())
    try:
        run_both(pair, steps)
    finally:
        for store in pair:
            try:
                store.close()
            except BlockObjectStoreError:
                pass


# --------------------------------------------------------------------------- capture reuse


class GatedStore(BlockObjectStore):
    """An aostore store whose writes wait until the test opens the gate."""

    gate: threading.Event


def gated_store() -> GatedStore:
    store = GatedStore(max_bytes=SLOTS * NBYTES, object_nbytes=NBYTES)
    store.gate = threading.Event()
    for name in ("put", "put_blocks"):
        method = getattr(store, name)

        def gated(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            assert store.gate.wait(timeout=30), "gate never opened"
            return _method(*args, **kwargs)

        setattr(store, name, gated)
    return store


@pytest.mark.parametrize("inner", ["aostore", "duck"])
def test_background_publish_copies_the_capture_buffer(inner):
    """The engine reuses its capture buffer right after publish; the background writer runs
    later, so what it stores must be the bytes at publish time."""
    if inner == "aostore":
        store: Any = gated_store()
        gate = store.gate
    else:
        store = DuckStore(NBYTES)
        gate = threading.Event()
        original = store.put

        def gated_put(*args: Any, **kwargs: Any) -> None:
            assert gate.wait(timeout=30)
            original(*args, **kwargs)

        store.put = gated_put  # type: ignore[method-assign]
    background = BackgroundBlockObjectStore(store, max_pending_batches=4)
    try:
        buffer = capture(3 * BLOCK, seed=7)
        expected = buffer.copy()
        publish_routed_experts(background, batches=[(A, full(buffer, [0, 4, 8]))], block_size=BLOCK)
        buffer[:] = -1  # the next step's routing overwrites the capture buffer
        gate.set()
        got = materialize_routed_experts(background, A, shape_per_token=PER_TOKEN, dtype=DTYPE)
        np.testing.assert_array_equal(got, expected)
    finally:
        gate.set()
        background.close()


@pytest.mark.parametrize("wrap", ["native-writer", "python-writer"])
def test_background_put_blocks_takes_torch_tensors(wrap):
    torch = pytest.importorskip("torch")
    inner = aostore_store() if wrap == "native-writer" else gated_store()
    if isinstance(inner, GatedStore):
        inner.gate.set()
    background = BackgroundBlockObjectStore(inner, max_pending_batches=2)
    try:
        blocks = torch.from_numpy(capture(2 * BLOCK, seed=5)).reshape(2, BLOCK, *PER_TOKEN)
        background.put_blocks(A[:2], blocks.to(torch.int16).view(torch.bfloat16))
        array = background.get_array(A[:2], dtype=DTYPE, shape_per_token=PER_TOKEN)
        np.testing.assert_array_equal(array, blocks.reshape(-1, *PER_TOKEN).numpy())
    finally:
        background.close()


def test_background_put_blocks_round_trip():
    background = BackgroundBlockObjectStore(aostore_store(), max_pending_batches=2)
    try:
        blocks = capture(2 * BLOCK, seed=9).reshape(2, BLOCK, *PER_TOKEN)
        background.put_blocks(A[:2], blocks.copy(), retain_keys=A[:1])
        array = background.get_array(A[:2], dtype=DTYPE, shape_per_token=PER_TOKEN)
        np.testing.assert_array_equal(array, blocks.reshape(-1, *PER_TOKEN))
        out = np.empty_like(blocks)
        assert background.get_into(A[:2], out) is out
        np.testing.assert_array_equal(out, blocks)
        assert background.store.snapshot()["references"] == {A[0]: 1}
    finally:
        background.close()
