"""The victim policy hook (docs/semantics.md, victim policy): vLLM's ``ExpertCachePolicy`` contract.

A policy has ``on_reference_change(key, old, new)``, ``select_victims(candidates, count)`` and
``on_remove(keys, reason)``. These tests hold ``aostore.BlockObjectStore`` to that contract:
choices honoured, candidates lazy and in LRU order, every invalid selection refused with
``cannot retain`` and its new keys rolled back, a raising policy surfaced unchanged with the
store consistent, no deadlock when a policy calls back into its store, and no Python at all
on the eviction path without a policy.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts import TIMEOUT as SCRIPT_TIMEOUT

aostore = pytest.importorskip("aostore")
BlockObject = aostore.BlockObject
Error = aostore.BlockObjectStoreError

Chooser = Callable[[Iterator[str], int], Any]


def oldest(candidates: Iterator[str], count: int) -> list[str]:
    return [next(candidates) for _ in range(count)]


def newest(candidates: Iterator[str], count: int) -> list[str]:
    return list(candidates)[-count:]


class Recorder:
    """A policy that records every call and delegates the choice to ``choose``."""

    def __init__(self, choose: Chooser = oldest) -> None:
        self.choose = choose
        self.calls: list[tuple[Any, ...]] = []
        self.candidates: list[Any] = []  # the iterators handed to select_victims
        self.seen: list[list[str]] = []  # what a choose that lists them saw

    def on_reference_change(self, key: str, old: int, new: int) -> None:
        self.calls.append(("ref", key, old, new))

    def select_victims(self, candidates: Iterator[str], count: int) -> Any:
        self.calls.append(("select", count))
        self.candidates.append(candidates)
        return self.choose(candidates, count)

    def on_remove(self, keys: Any, reason: str) -> None:
        self.calls.append(("remove", sorted(keys), reason))

    def removed(self, reason: str) -> list[list[str]]:
        return [call[1] for call in self.calls if call[0] == "remove" and call[2] == reason]


def obj(key: str, nbytes: int = 4) -> Any:
    return BlockObject(key, (key.encode() * nbytes)[:nbytes].ljust(nbytes, b"."))


def store_with(policy: Any, slots: int, nbytes: int = 4, **kwargs: Any) -> Any:
    return aostore.BlockObjectStore(
        max_bytes=slots * nbytes, object_nbytes=nbytes, policy=policy, **kwargs
    )


@pytest.fixture
def stores() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for store in made:
        store.close()


def test_policy_attribute(stores: list[Any]) -> None:
    policy = Recorder()
    stores.append(store_with(policy, 2))
    stores.append(store_with(None, 2))
    assert stores[0].policy is policy
    assert stores[1].policy is None


def test_honoured_choice_of_newest_candidates(stores: list[Any]) -> None:
    policy = Recorder(newest)
    store = store_with(policy, 4)
    stores.append(store)
    store.put([obj(k) for k in "abcd"])
    store.put([obj("e")])
    assert set(store.snapshot()["objects"]) == set("abce")
    assert store.snapshot()["lru"] == list("abce")
    assert policy.removed("eviction") == [["d"]]
    store.put([obj("f"), obj("g")])
    assert set(store.snapshot()["objects"]) == set("abfg")
    assert policy.removed("eviction") == [["d"], ["c", "e"]]
    assert store.stats()["evictions"] == 3
    store.check()


@pytest.mark.parametrize("wrap", [tuple, iter, lambda keys: (k for k in keys)])
def test_any_iterable_selection_is_honoured(stores: list[Any], wrap: Callable[..., Any]) -> None:
    policy = Recorder(lambda c, n: wrap(newest(c, n)))
    store = store_with(policy, 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    store.put([obj("x"), obj("y")])
    assert set(store.snapshot()["objects"]) == {"a", "x", "y"}
    store.check()


def test_candidates_in_lru_order_without_referenced_or_kept_batch_keys(
    stores: list[Any],
) -> None:
    def listing(candidates: Iterator[str], count: int) -> list[str]:
        seen = list(candidates)
        policy.seen.append(seen)
        return seen[:count]

    policy = Recorder(listing)
    store = store_with(policy, 6)
    stores.append(store)
    store.put([obj(k) for k in "abcdef"], retain_keys=["b", "y"])  # y: referenced, not stored
    store.get_concatenated(["a"])  # LRU: c d e f a
    assert store.snapshot()["lru"] == list("cdefa")
    # Batch x (new), c (stored, kept) and y (new, released here: eligible); b released: eligible.
    store.put([obj("x"), obj("c"), obj("y")], release_keys=["y", "b"])
    assert policy.seen == [["d", "e", "f", "a", "y", "b"]]
    assert policy.calls[-2] == ("select", 2)  # |a..f, x, y| - 6
    assert policy.removed("eviction") == [["d", "e"]]
    assert set(store.snapshot()["objects"]) == {"a", "b", "c", "f", "x", "y"}
    store.check()


def test_candidates_are_a_lazy_iterator(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 2_000)
    stores.append(store)
    store.put([obj(f"k{i}") for i in range(2_000)])
    visits = store.stats()["eviction_visits"]
    store.put([obj("new")])
    candidates = policy.candidates[-1]
    assert not isinstance(candidates, (list, tuple, set, dict))
    assert iter(candidates) is candidates
    # Only the one candidate the policy took was produced, not all 2,000.
    assert store.stats()["eviction_visits"] - visits <= 2
    assert "k0" not in store.snapshot()["objects"]


def test_candidates_are_invalid_after_select_victims_returns(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    store.put([obj("d")])
    stale = policy.candidates[-1]
    with pytest.raises(RuntimeError):
        next(stale)
    with pytest.raises(RuntimeError):
        list(stale)

    # Nor does it come back to life during a later select_victims.
    outcome: list[Any] = []

    def use_stale(candidates: Iterator[str], count: int) -> list[str]:
        try:
            outcome.append(next(stale))
        except RuntimeError as error:
            outcome.append(type(error))
        return oldest(candidates, count)

    policy.choose = use_stale
    store.put([obj("e")])
    assert len(outcome) == 1
    assert isinstance(outcome[0], type)
    assert issubclass(outcome[0], RuntimeError)
    store.check()


# The batch in test_invalid_selection_is_refused asks for 2 victims among b, d, e
# (a and r referenced, c a kept batch key, x and y new batch keys).
INVALID_SELECTIONS: dict[str, Chooser] = {
    "None": lambda c, n: None,
    "not iterable": lambda c, n: 42,
    "too few": lambda c, n: ["b"],
    "empty": lambda c, n: [],
    "too many": lambda c, n: ["b", "d", "e"],
    "duplicate": lambda c, n: ["b", "b"],
    "referenced stored key": lambda c, n: ["b", "a"],
    "referenced key not stored": lambda c, n: ["b", "r"],
    "new batch key": lambda c, n: ["b", "x"],
    "kept stored batch key": lambda c, n: ["b", "c"],
    "unknown key": lambda c, n: ["b", "nope"],
    "int item": lambda c, n: ["b", 7],
    "bytes item": lambda c, n: ["b", b"d"],
    "None item": lambda c, n: ["b", None],
}


@pytest.mark.parametrize("choose", INVALID_SELECTIONS.values(), ids=INVALID_SELECTIONS.keys())
def test_invalid_selection_is_refused_and_rolled_back(stores: list[Any], choose: Chooser) -> None:
    policy = Recorder(choose)
    store = store_with(policy, 5)
    stores.append(store)
    store.put([obj(k) for k in "abcde"], retain_keys=["a", "r"])
    before = store.snapshot()["objects"]
    policy.calls.clear()
    with pytest.raises(Error, match="cannot retain"):
        store.put([obj("x"), obj("y"), obj("c")])
    assert ("select", 2) in policy.calls
    assert policy.removed("rollback") == [["x", "y"]]
    assert policy.removed("eviction") == []
    assert store.snapshot()["objects"] == before
    store.check()
    # The store still works, and the same put succeeds with a valid choice.
    policy.choose = oldest
    store.put([obj("x"), obj("y"), obj("c")])
    assert set(store.snapshot()["objects"]) == {"a", "c", "e", "x", "y"}
    store.check()


def test_select_victims_not_called_when_too_few_are_eligible(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 2)
    stores.append(store)
    store.put([obj("a"), obj("b")], retain_keys=["a"])
    policy.calls.clear()
    with pytest.raises(Error, match="cannot retain"):
        store.put([obj("x"), obj("y")])
    assert not [call for call in policy.calls if call[0] == "select"]
    assert policy.removed("rollback") == [["x", "y"]]
    assert set(store.snapshot()["objects"]) == {"a", "b"}
    store.check()


def test_on_remove_eviction_after_evicting(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    policy.calls.clear()
    store.put([obj("x"), obj("y")], retain_keys=["b"])
    # The victims a and c, once, after they were chosen; the batch was then stored.
    assert policy.calls == [("ref", "b", 0, 1), ("select", 2), ("remove", ["a", "c"], "eviction")]
    assert set(store.snapshot()["objects"]) == {"b", "x", "y"}
    # Without eviction there is no on_remove call.
    store.put([], release_keys=["b"])
    assert policy.calls[-1] == ("ref", "b", 1, 0)
    store.check()


def test_on_reference_change_order_and_counts(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 2)
    stores.append(store)
    store.put([obj("s")], retain_keys=["a"])
    policy.calls.clear()
    store.put([obj("t"), obj("u")], retain_keys=["a", "b", "a"], release_keys=["b", "a"])
    refs = [call for call in policy.calls if call[0] == "ref"]
    assert refs == [
        ("ref", "a", 1, 2),
        ("ref", "b", 0, 1),
        ("ref", "a", 2, 3),
        ("ref", "b", 1, 0),
        ("ref", "a", 3, 2),
    ]
    # Every reference change is reported before victims are chosen and removed.
    kinds = [call[0] for call in policy.calls]
    assert kinds == ["ref"] * 5 + ["select", "remove"]
    assert store.snapshot()["references"] == {"a": 2}


def test_bad_input_calls_no_hook(stores: list[Any]) -> None:
    policy = Recorder(oldest)
    store = store_with(policy, 1)
    stores.append(store)
    store.put([obj("a")])
    policy.calls.clear()
    with pytest.raises(KeyError):
        store.put([obj("b")], retain_keys=["x"], release_keys=["x", "x"])
    with pytest.raises(TypeError):
        store.put([obj("b")], retain_keys=[1])
    with pytest.raises(ValueError):
        store.put([BlockObject("b", b"toolong")])
    assert policy.calls == []
    store.check()


class Boom(Exception):
    pass


@pytest.mark.parametrize("hook", ["on_reference_change", "select_victims", "on_remove"])
def test_raising_policy_surfaces_its_exception(stores: list[Any], hook: str) -> None:
    error = Boom(hook)

    class Raising(Recorder):
        armed = False

        def on_reference_change(self, key: str, old: int, new: int) -> None:
            super().on_reference_change(key, old, new)
            if self.armed and hook == "on_reference_change":
                raise error

        def select_victims(self, candidates: Iterator[str], count: int) -> Any:
            chosen = super().select_victims(candidates, count)
            if self.armed and hook == "select_victims":
                raise error
            return chosen

        def on_remove(self, keys: Any, reason: str) -> None:
            super().on_remove(keys, reason)
            if self.armed and hook == "on_remove" and reason == "eviction":
                raise error

    policy = Raising(oldest)
    store = store_with(policy, 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"], retain_keys=["a"])
    policy.armed = True
    with pytest.raises(Boom) as raised:
        store.put([obj("x")], retain_keys=["b"])
    assert raised.value is error
    store.check()
    objects = set(store.snapshot()["objects"])
    if hook == "on_remove":  # the eviction was done when on_remove ran
        assert objects == {"a", "b", "x"}
    else:  # the new key was rolled back
        assert "x" not in objects
        assert objects <= {"a", "b", "c"}
    policy.armed = False
    store.put([obj("y")])
    assert "y" in store.snapshot()["objects"]
    store.check()


def test_policy_raising_while_iterating_candidates(stores: list[Any]) -> None:
    def half_then_raise(candidates: Iterator[str], count: int) -> list[str]:
        next(candidates)
        raise Boom("midway")

    store = store_with(Recorder(half_then_raise), 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    with pytest.raises(Boom, match="midway"):
        store.put([obj("x")])
    assert set(store.snapshot()["objects"]) == set("abc")
    store.check()


def test_rollback_notification_that_raises_keeps_store_consistent(stores: list[Any]) -> None:
    class Policy(Recorder):
        def on_remove(self, keys: Any, reason: str) -> None:
            super().on_remove(keys, reason)
            raise Boom(reason)

    store = store_with(Policy(lambda c, n: None), 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    with pytest.raises((Boom, Error)):
        store.put([obj("x")])
    assert set(store.snapshot()["objects"]) == set("abc")
    store.check()


@pytest.mark.parametrize("hook", ["on_reference_change", "select_victims", "on_remove"])
def test_policy_calling_back_into_its_store_gets_an_error(stores: list[Any], hook: str) -> None:
    errors: list[BaseException | None] = []

    class Reentrant(Recorder):
        def reenter(self) -> None:
            for call in (
                lambda: store.put([obj("z")]),
                lambda: store.put([], retain_keys=["q"]),
                lambda: store.get_concatenated(["a"]),
            ):
                try:
                    call()
                    errors.append(None)
                except BaseException as error:
                    errors.append(error)

        def on_reference_change(self, key: str, old: int, new: int) -> None:
            super().on_reference_change(key, old, new)
            if hook == "on_reference_change":
                self.reenter()

        def select_victims(self, candidates: Iterator[str], count: int) -> Any:
            if hook == "select_victims":
                self.reenter()
            return super().select_victims(candidates, count)

        def on_remove(self, keys: Any, reason: str) -> None:
            super().on_remove(keys, reason)
            if hook == "on_remove":
                self.reenter()

    store = store_with(Reentrant(oldest), 2)
    stores.append(store)
    store.put([obj("a"), obj("b")])
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            store.put([obj("c")], retain_keys=["a"])
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "a policy calling back into its store deadlocked"
    assert outcome == [None]  # the policy swallowed the errors; the outer put went through
    assert len(errors) == 3
    assert all(isinstance(error, Error) for error in errors), errors
    store.check()
    assert set(store.snapshot()["objects"]) == {"a", "c"}


def test_no_python_runs_on_the_eviction_path_without_a_policy(stores: list[Any]) -> None:
    store = aostore.BlockObjectStore(max_bytes=1_000 * 8, object_nbytes=8)
    stores.append(store)
    store.put([obj(f"k{i}", 8) for i in range(1_000)], retain_keys=[f"k{i}" for i in range(500)])
    batch = [obj(f"n{i}", 8) for i in range(64)]
    package = str(Path(aostore.__file__).parent)
    python_calls: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not frame.f_code.co_filename.startswith(package):
            python_calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    evictions = store.stats()["evictions"]
    sys.setprofile(profiler)
    try:
        store.put(batch, retain_keys=["k0"], release_keys=["k0", "k1"])
    finally:
        sys.setprofile(None)
    assert store.stats()["evictions"] - evictions == 64
    assert python_calls == []
    store.check()


# -- Both stores: what a policy raises, and what it costs -------------------------------------


def make_either(kind: str, policy: Any, slots: int, nbytes: int = 4) -> Any:
    """A fixed store of ``slots`` objects, or a variable store of the same bytes (exact bytes:
    a small store counts in 1-byte chunks), both holding ``slots`` objects of ``nbytes``."""
    if kind == "fixed":
        return store_with(policy, slots, nbytes)
    return aostore.VariableBlockObjectStore(max_bytes=slots * nbytes, policy=policy)


KINDS = ["fixed", "variable"]


class Selection:
    """An iterable selection whose iteration raises after ``good`` keys."""

    def __init__(self, keys: list[str], good: int, where: str) -> None:
        self.keys, self.good, self.where = keys, good, where

    def __iter__(self) -> Iterator[str]:
        if self.where == "__iter__":
            raise Boom("from __iter__")
        for i, key in enumerate(self.keys):
            if i == self.good:
                raise Boom("from __next__")
            yield key


@pytest.mark.parametrize("where", ["__iter__", "__next__", "generator"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_while_reading_the_selection_is_the_policys(
    stores: list[Any], kind: str, where: str
) -> None:
    # Raised while aostore iterated what select_victims returned, it used to come out as
    # "cannot retain the requested batch", hiding the policy's bug.
    def choose(candidates: Iterator[str], count: int) -> Any:
        keys = [next(candidates) for _ in range(count)]
        if where == "generator":

            def lazy() -> Iterator[str]:
                yield keys[0]
                raise Boom("from a generator")

            return lazy()
        return Selection(keys, 1, where)

    store = make_either(kind, Recorder(choose), 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    before = store.snapshot()
    with pytest.raises(Boom, match="from"):
        store.put([obj("x"), obj("y")])
    assert store.snapshot() == before
    store.check()


@pytest.mark.parametrize("kind", KINDS)
def test_a_lazy_selection_over_the_candidates_is_honoured(stores: list[Any], kind: str) -> None:
    # A generator over the candidates is read while they are still valid.
    def lazy(candidates: Iterator[str], count: int) -> Iterator[str]:
        return (key for _, key in zip(range(count), candidates, strict=False))

    store = make_either(kind, Recorder(lazy), 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    store.put([obj("x"), obj("y")])
    assert set(store.snapshot()["objects"]) == {"c", "x", "y"}
    store.check()


@pytest.mark.parametrize("kind", KINDS)
def test_an_on_remove_eviction_that_raises_leaves_the_put_applied_and_counted(
    stores: list[Any], kind: str
) -> None:
    class Raising(Recorder):
        def on_remove(self, keys: Any, reason: str) -> None:
            super().on_remove(keys, reason)
            raise Boom(reason)

    store = make_either(kind, Raising(oldest), 3)
    stores.append(store)
    store.put([obj(k) for k in "abc"])
    puts = store.stats()["puts"]
    with pytest.raises(Boom, match="eviction"):
        store.put([obj("x")])
    # One outcome, consistently: applied (a evicted, x stored), counted, and the error raised.
    assert set(store.snapshot()["objects"]) == {"b", "c", "x"}
    assert store.stats()["puts"] == puts + 1
    store.check()


def per_key_seconds(kind: str, keys: int, phase: str) -> float:
    """The best of five puts of ``keys`` retains (or releases) with a policy, per key."""
    best = float("inf")
    for _ in range(5):
        store = make_either(kind, Recorder(oldest), 4)
        names = [f"key-{i}" for i in range(keys)]
        try:
            if phase == "release":
                store.put([], retain_keys=names)
            start = time.perf_counter()
            if phase == "retain":
                store.put([], retain_keys=names)
            else:  # vLLM's worker on a generation reset: every held key in one put
                store.put([], release_keys=names)
            best = min(best, time.perf_counter() - start)
        finally:
            store.close()
    return best / keys


@pytest.mark.parametrize("phase", ["retain", "release"])
@pytest.mark.parametrize("kind", KINDS)
def test_reference_changes_with_a_policy_cost_linear_time(kind: str, phase: str) -> None:
    # Each change is replayed to the policy with its old and new count; finding a key's count
    # by a scan of the call's changes made that quadratic (per key 3 us at 2,000 keys, 18 us at
    # 16,000: 6x). Per-key cost at two sizes, in one run: 8x the keys may not cost 4x per key.
    # Linear code measures 1.1-2.7x on the 2-core VM (the larger key table misses cache more),
    # and up to 3.1x while other work shares the cores, hence the margin.
    small, large = 2_000, 16_000
    ratio = per_key_seconds(kind, large, phase) / per_key_seconds(kind, small, phase)
    assert ratio < 4.0, f"per-key cost grew {ratio:.1f}x from {small} to {large} keys"


# -------------------------------------------------------------------- a policy waiting on a thread


def test_a_policy_waiting_on_a_thread_that_uses_its_store_gets_an_error_not_a_deadlock():
    n = 64
    results: list[object] = []

    class Waiting:
        def on_reference_change(self, key: str, old: int, new: int) -> None:
            pass

        def on_remove(self, keys: list[str], reason: str) -> None:
            pass

        def select_victims(self, candidates: Any, count: int) -> list[str]:
            chosen = [next(candidates) for _ in range(count)]

            def read() -> None:
                try:
                    results.append(store_with_policy.get_concatenated(["a"]))
                except Error as error:
                    results.append(error)

            helper = threading.Thread(target=read)
            helper.start()
            helper.join(SCRIPT_TIMEOUT)
            results.append("joined" if not helper.is_alive() else "still blocked")
            return chosen

    def fill(value: int) -> bytes:
        return bytes([value]) * n

    store_with_policy = aostore.BlockObjectStore(max_bytes=2 * n, object_nbytes=n, policy=Waiting())
    store_with_policy.put([BlockObject("a", fill(1)), BlockObject("b", fill(2))])
    started = time.monotonic()
    store_with_policy.put([BlockObject("c", fill(3))])
    elapsed = time.monotonic() - started
    assert results[-1] == "joined", results
    assert isinstance(results[0], Error), results
    assert "victim policy" in str(results[0])
    assert elapsed < SCRIPT_TIMEOUT
    assert store_with_policy.get_concatenated(["b", "c"]) == fill(2) + fill(3)
    store_with_policy.check()
    store_with_policy.close()
