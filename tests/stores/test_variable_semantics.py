"""The variable-size store by example: the vLLM branches' own uses, the byte budget, the
victim policy, garbage collection of a store and its policy, and threads."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import aostore
import pytest
from aostore import BlockObject, BlockObjectStoreError, VariableBlockObjectStore


def test_vllm_branch_rolls_back_references_after_failed_put():
    # As the vLLM branch's own test: the failed put's retain of "first" is undone too.
    store = VariableBlockObjectStore(max_bytes=4)
    store.put([BlockObject("first", b"1111")], retain_keys=["first"])
    with pytest.raises(BlockObjectStoreError, match="cannot retain"):
        store.put([BlockObject("second", b"2222")], retain_keys=["second", "first"])
    assert store.get_concatenated(["first"]) == b"1111"
    assert store.snapshot()["references"] == {"first": 1}
    store.put([], release_keys=["first"])
    store.put([BlockObject("third", b"3333")])
    assert store.snapshot()["objects"] == {"third": b"3333"}
    store.close()


def test_round_trip_of_a_logprob_sized_payload():
    payload = bytes(range(256)) * 12 + b"tail"
    store = VariableBlockObjectStore(max_bytes=len(payload) * 2)
    store.put([BlockObject("logprobs", payload)])
    assert store.get_concatenated(["logprobs"]) == payload
    store.check()
    store.close()


def test_re_put_replaces_bytes_and_size_referenced_or_not():
    store = VariableBlockObjectStore(max_bytes=64)
    store.put([BlockObject("held", b"a" * 10), BlockObject("free", b"b" * 10)])
    store.put([], retain_keys=["held"])
    store.put([BlockObject("held", b"A" * 30), BlockObject("free", b"B")])
    assert store.get_concatenated(["held", "free"]) == b"A" * 30 + b"B"
    assert store.stats()["stored_bytes"] == 31
    # The last block of a running request is re-published every decode step, growing.
    for step in range(1, 20):
        store.put([BlockObject("held", b"x" * step)])
        assert store.get_concatenated(["held"]) == b"x" * step
    store.check()
    store.close()


def test_eviction_frees_bytes_oldest_first_and_only_as_many_as_needed():
    store = VariableBlockObjectStore(max_bytes=100)
    store.put([BlockObject(k, b"." * n) for k, n in [("a", 30), ("b", 10), ("c", 40), ("d", 20)]])
    store.put([BlockObject("e", b"." * 35)])  # 135 > 100: a (30) and b (10) go
    assert store.snapshot()["lru"] == ["c", "d", "e"]
    store.get_concatenated(["c"])  # c moves to the tail
    store.put([BlockObject("f", b"." * 40)])  # 135 > 100: d (20) and e (35) go
    assert store.snapshot()["lru"] == ["c", "f"]
    assert store.stats()["evictions"] == 4
    store.check()
    store.close()


def test_chunks_round_each_object_up():
    store = VariableBlockObjectStore(max_bytes=64, chunk_nbytes=16)
    assert (store.chunk_nbytes, store.capacity_bytes) == (16, 64)
    store.put([BlockObject(k, b"." * 17) for k in "ab"])  # two chunks each
    store.put([BlockObject("c", b"")])  # no chunk at all
    assert store.stats()["used_bytes"] == 64
    store.put([BlockObject("d", b"x")])  # one chunk: a goes
    assert sorted(store.snapshot()["objects"]) == ["b", "c", "d"]
    store.check()
    store.close()


def test_default_chunk_keeps_small_stores_exact():
    assert VariableBlockObjectStore(max_bytes=4).chunk_nbytes == 1
    assert VariableBlockObjectStore(max_bytes=1 << 20).chunk_nbytes == 256
    assert VariableBlockObjectStore(max_bytes=100_000).chunk_nbytes == 16


def test_get_many_returns_offsets_and_missing_keys_once_per_occurrence():
    store = VariableBlockObjectStore(max_bytes=100)
    store.put([BlockObject("a", b"aaa"), BlockObject("z", b""), BlockObject("b", b"bb")])
    data, missing, offsets = store.get_many(["b", "gone", "a", "z", "gone", "b"])
    assert data == b"bbaaabb"
    assert missing == ["gone", "gone"]
    assert offsets == [0, 2, 2, 5, 5, 5, 7]
    assert store.get_many([]) == (b"", [], [0])
    store.close()


def test_get_many_moves_present_keys_only_and_contains_moves_nothing():
    store = VariableBlockObjectStore(max_bytes=100)
    store.put([BlockObject(k, k.encode()) for k in "abcd"])
    assert store.contains(["d", "a", "x"]) == [True, True, False]
    assert store.snapshot()["lru"] == ["a", "b", "c", "d"]
    store.get_many(["b", "x", "a"])
    assert store.snapshot()["lru"] == ["c", "d", "b", "a"]
    stats = store.stats()
    assert (stats["reads"], stats["read_misses"]) == (2, 1)
    store.close()


def test_attribute_assignment_and_repr():
    store = VariableBlockObjectStore(max_bytes=10)
    store.put = lambda *a, **k: None  # type: ignore[method-assign]
    assert "0 objects" in repr(store)
    store.close()
    assert "closed" in repr(store)


def test_exported_from_the_package():
    assert "VariableBlockObjectStore" in aostore.__all__
    assert issubclass(VariableBlockObjectStore, aostore._native.NativeVariableStore)
    assert not issubclass(VariableBlockObjectStore, aostore.BlockObjectStore)


# --------------------------------------------------------------------------- victim policy


class RecordingPolicy:
    """LRU order, recorded: reproduces the default victims."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        self.calls.append(("ref", key, old, new))

    def select_victims(self, candidates: Any, count: int) -> list[str] | None:
        chosen = [key for _, key in zip(range(count), candidates, strict=False)]
        self.calls.append(("select", count, tuple(chosen)))
        return chosen

    def on_remove(self, keys: list[str], *, reason: str) -> None:
        self.calls.append(("remove", tuple(keys), reason))


def test_policy_in_lru_order_evicts_as_the_default():
    policy = RecordingPolicy()
    with_policy = VariableBlockObjectStore(max_bytes=50, policy=policy)
    plain = VariableBlockObjectStore(max_bytes=50)
    for store in (with_policy, plain):
        store.put([BlockObject(k, b"." * 20) for k in "ab"], retain_keys=["a"])
        store.put([BlockObject("c", b"." * 15)])
        store.put([BlockObject("d", b"." * 20)], release_keys=["a"])
    assert with_policy.snapshot() == plain.snapshot()
    assert ("ref", "a", 0, 1) in policy.calls
    assert ("select", 1, ("b",)) in policy.calls
    assert ("remove", ("b",), "eviction") in policy.calls
    assert with_policy.policy is policy


def test_policy_is_asked_again_while_its_choice_frees_too_little():
    class SmallestFirst(RecordingPolicy):
        def __init__(self, sizes: dict[str, int]) -> None:
            super().__init__()
            self.sizes = sizes

        def select_victims(self, candidates: Any, count: int) -> list[str] | None:
            chosen = sorted(candidates, key=self.sizes.__getitem__)[:count]
            self.calls.append(("select", count, tuple(chosen)))
            return chosen

    sizes = {"big": 30, "small": 5, "mid": 10, "new": 40}
    policy = SmallestFirst(sizes)
    store = VariableBlockObjectStore(max_bytes=50, policy=policy)
    store.put([BlockObject(k, b"." * sizes[k]) for k in ("big", "small", "mid")])
    store.put([BlockObject("new", b"." * 40)])  # 85 > 50: 35 must go
    selects = [call for call in policy.calls if call[0] == "select"]
    # LRU would take "big" then "small": count 2; the policy picks the two smallest (15 bytes),
    # and is asked again for the rest.
    assert selects[0] == ("select", 2, ("small", "mid"))
    assert selects[1] == ("select", 1, ("big",))
    assert sorted(store.snapshot()["objects"]) == ["new"]
    store.check()


def test_policy_refusal_rolls_back_and_reports_the_undone_changes():
    class Refuses(RecordingPolicy):
        def select_victims(self, candidates: Any, count: int) -> list[str] | None:
            self.calls.append(("select", count))
            return None

    policy = Refuses()
    store = VariableBlockObjectStore(max_bytes=20, policy=policy)
    store.put([BlockObject("a", b"." * 15)])
    before = store.snapshot()
    policy.calls.clear()
    with pytest.raises(BlockObjectStoreError, match="cannot retain"):
        store.put([BlockObject("b", b"." * 10)], retain_keys=["b", "x"], release_keys=["x"])
    assert store.snapshot() == before
    assert policy.calls == [
        ("ref", "b", 0, 1),
        ("ref", "x", 0, 1),
        ("ref", "x", 1, 0),
        ("select", 1),
        ("remove", ("b",), "rollback"),
        ("ref", "x", 0, 1),
        ("ref", "x", 1, 0),
        ("ref", "b", 1, 0),
    ]
    store.check()


@pytest.mark.parametrize("where", ["on_reference_change", "select_victims"])
def test_policy_exception_propagates_and_changes_nothing(where):
    def boom(*_: Any, **__: Any) -> None:
        raise LookupError("policy broke")

    policy = RecordingPolicy()
    store = VariableBlockObjectStore(max_bytes=20, policy=policy)
    store.put([BlockObject("a", b"." * 15)])
    before = store.snapshot()
    setattr(policy, where, boom)
    with pytest.raises(LookupError, match="policy broke"):
        store.put([BlockObject("b", b"." * 10)], retain_keys=["b"])
    assert store.snapshot() == before
    store.check()


@pytest.mark.parametrize("choice", [["nope"], ["a", "a"], [], ["b"], 5, [7]], ids=repr)
def test_invalid_selection_refuses_the_put(choice):
    class Picks(RecordingPolicy):
        def select_victims(self, candidates: Any, count: int) -> Any:
            return choice

    store = VariableBlockObjectStore(max_bytes=20, policy=Picks())
    store.put([BlockObject("a", b"." * 15)])
    before = store.snapshot()
    with pytest.raises(BlockObjectStoreError, match="cannot retain"):
        store.put([BlockObject("b", b"." * 10)])
    assert store.snapshot() == before
    store.check()


def test_policy_calling_back_into_its_store_gets_an_error_not_a_deadlock():
    class CallsBack(RecordingPolicy):
        store: Any = None

        def on_reference_change(self, key: str, old: int, new: int) -> None:
            self.store.contains([key])

    policy = CallsBack()
    store = VariableBlockObjectStore(max_bytes=20, policy=policy)
    policy.store = store
    with pytest.raises(BlockObjectStoreError, match="must not call back"):
        store.put([], retain_keys=["a"])
    assert store.snapshot()["references"] == {}
    store.check()


def test_candidates_expire_with_the_call():
    kept: list[Any] = []

    class Keeps(RecordingPolicy):
        def select_victims(self, candidates: Any, count: int) -> list[str] | None:
            kept.append(candidates)
            return super().select_victims(candidates, count)

    store = VariableBlockObjectStore(max_bytes=10, policy=Keeps())
    store.put([BlockObject("a", b"." * 10)])
    store.put([BlockObject("b", b"." * 10)])
    with pytest.raises(RuntimeError, match="only valid during"):
        next(kept[0])


def test_a_store_and_its_policy_in_a_cycle_are_collected():
    class Holder(RecordingPolicy):
        store: Any = None

    policy = Holder()
    store = VariableBlockObjectStore(max_bytes=10, policy=policy)
    policy.store = store
    watch = weakref.ref(policy)
    del store, policy
    gc.collect()
    assert watch() is None


# --------------------------------------------------------------------------- threads


def test_threads_never_tear_a_read():
    store = VariableBlockObjectStore(max_bytes=64 << 10)
    keys = [f"k{i}" for i in range(40)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        try:
            for step in range(400):
                key = keys[(seed * 7 + step) % len(keys)]
                fill = (seed + step) % 251
                size = 100 + (seed * 131 + step * 37) % 3_000
                store.put([BlockObject(key, bytes([fill]) * size)])
        except BaseException as error:
            errors.append(error)

    def reader() -> None:
        try:
            while not stop.is_set():
                data, _, offsets = store.get_many(keys)
                for i, key in enumerate(keys):
                    chunk = data[offsets[i] : offsets[i + 1]]
                    assert len(set(chunk)) <= 1, f"torn read of {key}"
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads + readers:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    assert not errors, errors[0]
    store.check()
    store.close()


def test_get_optional_and_the_background_wrapper():
    from aostore import BackgroundBlockObjectStore

    store = VariableBlockObjectStore(max_bytes=100)
    store.put([BlockObject("a", b"xyz"), BlockObject("b", b"")])
    assert (store.get_optional("a"), store.get_optional("b"), store.get_optional("c")) == (
        b"xyz",
        b"",
        None,
    )
    assert store.stats()["read_misses"] == 1
    with pytest.raises(TypeError):
        store.get_optional(5)  # type: ignore[arg-type]
    writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
    writer.put([BlockObject("c", b"12345")], retain_keys=["c"])
    assert writer.get_optional("c") == b"12345"
    assert writer.get_optional("zz") is None
    writer.flush()
    writer.close()
    assert store.closed
