"""Profile ``grow`` (docs/semantics.md, profile grow): aostore against ``model_grow``, vLLM
0.33.0's semantics.

The stateful test drives ``BlockObjectStore(..., profile="grow")`` and ``model_grow.GrowModel``
with the same calls (duplicate keys, retains, balanced releases, re-puts that replace bytes,
growth, reads of stored and missing keys) and requires the same results and exceptions, the
same ``snapshot()`` and ``num_slots``, and ``check()`` to hold after every step.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import model_grow
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from scripts import run_script

aostore = pytest.importorskip("aostore")
BlockObject = aostore.BlockObject

KEYS = [f"k{i}" for i in range(8)]
key_strategy = st.sampled_from(KEYS)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", what)``, comparable across the two implementations."""
    try:
        return ("ok", call())
    except KeyError as error:
        return ("error", ("KeyError", error.args))
    except (aostore.BlockObjectStoreError, model_grow.BlockObjectStoreError) as error:
        return ("error", ("BlockObjectStoreError", "does not exist" in str(error)))
    except RuntimeError as error:
        return ("error", ("RuntimeError", "closed" in str(error)))


class GrowMachine(RuleBasedStateMachine):
    """aostore profile ``grow`` and the model, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self.store: Any = None
        self.model: model_grow.GrowModel | None = None
        self.serial = 0
        self.nbytes = 1

    @initialize(slots=st.integers(1, 4), nbytes=st.integers(1, 5), spare=st.integers(0, 4))
    def create(self, slots: int, nbytes: int, spare: int) -> None:
        max_bytes = slots * nbytes + spare % nbytes  # a remainder that is not a whole slot
        self.nbytes = nbytes
        self.store = aostore.BlockObjectStore(
            max_bytes=max_bytes, object_nbytes=nbytes, profile="grow"
        )
        self.model = model_grow.GrowModel(max_bytes=max_bytes, object_nbytes=nbytes)
        assert self.store.profile == "grow"

    def payload(self) -> bytes:
        """A payload unlike the previous ones, so a kept or replaced object is told apart."""
        self.serial += 1
        return bytes((self.serial * 7 + i) % 256 for i in range(self.nbytes))

    def both(self, call: Callable[[Any], Any]) -> tuple[str, Any]:
        assert self.model is not None
        got = outcome(lambda: call(self.store))
        want = outcome(lambda: call(self.model))
        assert got == want
        return got

    @rule(data=st.data(), keys=st.lists(key_strategy, max_size=6))
    def put(self, data: st.DataObject, keys: list[str]) -> None:
        """A batch with duplicates, retains, and releases the store can honour."""
        assert self.model is not None
        objects = [BlockObject(key, self.payload()) for key in keys]
        retains = data.draw(st.lists(key_strategy, max_size=4), label="retains")
        held = sorted((Counter(self.model.references) + Counter(retains)).elements())
        picks = (
            data.draw(
                st.lists(st.integers(0, len(held) - 1), unique=True, max_size=len(held)),
                label="releases",
            )
            if held
            else []
        )
        releases = [held[i] for i in picks]
        result = self.both(lambda s: s.put(objects, retain_keys=retains, release_keys=releases))
        assert result == ("ok", None)  # profile grow never refuses a batch

    @rule(data=st.data())
    def release_everything(self, data: st.DataObject) -> None:
        """A finishing request: every held reference released, in a drawn order."""
        assert self.model is not None
        held = list(Counter(self.model.references).elements())
        releases = data.draw(st.permutations(held))
        assert self.both(lambda s: s.put([], release_keys=releases)) == ("ok", None)

    @precondition(lambda self: self.model is not None and len(self.model.references) < len(KEYS))
    @rule(data=st.data(), keys=st.lists(key_strategy, max_size=3))
    def release_unreferenced(self, data: st.DataObject, keys: list[str]) -> None:
        """A release of a key that is not referenced: ``KeyError`` and nothing changes."""
        assert self.model is not None
        free = [key for key in KEYS if key not in self.model.references]
        bad = data.draw(st.sampled_from(free))
        objects = [BlockObject(key, self.payload()) for key in keys]
        before = self.model.snapshot()
        got = self.both(lambda s: s.put(objects, retain_keys=keys[:1], release_keys=[bad]))
        if keys[:1] == [bad]:  # retained in the same call: legal
            assert got == ("ok", None)
        else:
            assert got == ("error", ("KeyError", (bad,)))
            assert self.store.snapshot() == before

    @rule(keys=st.lists(st.one_of(key_strategy, st.just("missing")), max_size=5))
    def read(self, keys: list[str]) -> None:
        got = self.both(lambda s: s.get_concatenated(keys))
        if got[0] == "error":
            assert got[1] == ("BlockObjectStoreError", True)

    @invariant()
    def agree(self) -> None:
        model = self.model
        if model is None:
            return
        self.store.check()
        assert self.store.snapshot() == model.snapshot()
        assert self.store.num_slots == model.num_slots
        stats = self.store.stats()
        assert stats["capacity"] == model.num_slots
        assert stats["stored"] == len(model.objects)
        assert stats["referenced"] == len(model.references)
        assert stats["evictable"] == len(model.lru)
        assert stats["free_slots"] == model.num_slots - len(model.objects)
        assert stats["growths"] == model.growths
        assert stats["evictions"] == model.evictions

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()


@pytest.fixture
def quiet_aostore_log() -> Iterator[None]:
    """Growth warnings are expected by the thousand here; keep them out of the report."""
    logger = logging.getLogger("aostore")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.usefixtures("quiet_aostore_log")
def test_grow_matches_vllm_model() -> None:
    examples = int(os.environ.get("AOSTORE_GROW_EXAMPLES", "2000"))
    run_state_machine_as_test(
        GrowMachine,
        settings=settings(
            max_examples=max(examples, 2000),
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )


def grow_store(slots: int, nbytes: int = 4, **kwargs: Any) -> Any:
    return aostore.BlockObjectStore(
        max_bytes=slots * nbytes, object_nbytes=nbytes, profile="grow", **kwargs
    )


def test_growth_at_least_doubles_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    store = grow_store(3)
    keys = [f"g{i}" for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="aostore"):
        store.put([BlockObject(k, k.encode().ljust(4, b".")) for k in keys], retain_keys=keys)
    assert store.num_slots >= 6
    assert store.stats()["capacity"] == store.num_slots
    assert store.stats()["growths"] == 1
    warnings = [r for r in caplog.records if r.name == "aostore" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    # A batch larger than twice the arena grows to hold all of it.
    more = [f"h{i}" for i in range(3 * store.num_slots)]
    store.put([BlockObject(k, b"hhhh") for k in more], retain_keys=more)
    assert store.num_slots >= len(keys) + len(more)
    store.check()
    store.close()


@pytest.mark.parametrize(
    ("slots", "stored", "batch", "grown"),
    [
        (1, 1, 2, 2),  # evicts the 1 stored, needs 2: max(2, 2 * 1)
        (4, 4, 5, 8),  # evicts 4, needs 5: doubled
        (2, 2, 5, 5),  # evicts 2, needs 5: more than doubled
    ],
)
def test_growth_size_matches_vllm(slots: int, stored: int, batch: int, grown: int) -> None:
    # vLLM 0.33 grows to max(objects kept after eviction, 2 * num_slots).
    store = grow_store(slots)
    store.put([BlockObject(f"old{i}", b"oooo") for i in range(stored)])
    store.put([BlockObject(f"new{i}", b"nnnn") for i in range(batch)])
    assert store.stats()["evictions"] == stored
    assert store.num_slots == grown
    store.check()
    store.close()


def test_growth_evicts_evictable_keys_first() -> None:
    store = grow_store(4)
    store.put([BlockObject(k, k.encode() * 4) for k in "abcd"], retain_keys=["a", "b"])
    store.put([BlockObject(k, k.encode() * 4) for k in "xyz"], retain_keys=["x", "y", "z"])
    snapshot = store.snapshot()
    assert set(snapshot["objects"]) == {"a", "b", "x", "y", "z"}  # c and d evicted, then grew
    assert store.num_slots == 8
    assert store.stats()["evictions"] == 2
    store.check()
    store.close()


def test_live_objects_survive_growth_byte_exact() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(3)
    nbytes = 5_888  # not a multiple of the page size: slots straddle pages
    store = grow_store(5, nbytes)
    expected: dict[str, bytes] = {}
    for round_ in range(6):  # several growths in a row
        keys = [f"r{round_}-{i}" for i in range(store.num_slots + 1)]
        payloads = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in keys]
        store.put(
            [BlockObject(k, p) for k, p in zip(keys, payloads, strict=True)], retain_keys=keys
        )
        expected.update((k, p.tobytes()) for k, p in zip(keys, payloads, strict=True))
        store.check()
        assert store.get_concatenated(list(expected)) == b"".join(expected.values())
    assert store.stats()["growths"] == 6
    assert store.snapshot()["objects"] == expected
    store.close()


def test_reput_of_referenced_stored_key_keeps_bytes() -> None:
    store = grow_store(4)
    store.put([BlockObject("a", b"old!")], retain_keys=["a"])
    store.put([BlockObject("a", b"new!")])
    assert store.get_concatenated(["a"]) == b"old!"
    store.close()


def test_reput_of_unreferenced_stored_key_replaces_bytes_and_moves_to_tail() -> None:
    store = grow_store(4)
    store.put([BlockObject("a", b"old!"), BlockObject("b", b"bbbb")])
    store.put([BlockObject("a", b"new!")])
    assert store.get_concatenated(["a"]) == b"new!"
    assert store.snapshot()["lru"] == ["b", "a"]
    assert store.stats()["objects_written"] == 3
    store.check()
    store.close()


def test_reput_of_key_retained_in_the_same_call_replaces_bytes() -> None:
    # Unreferenced when the call starts: replaced, even though the call retains it.
    store = grow_store(4)
    store.put([BlockObject("a", b"old!")])
    store.put([BlockObject("a", b"new!")], retain_keys=["a"])
    assert store.get_concatenated(["a"]) == b"new!"
    assert store.snapshot()["references"] == {"a": 1}
    store.check()
    store.close()


def test_missing_key_message_has_no_max_bytes_hint() -> None:
    store = grow_store(2)
    store.put([BlockObject("here", b"1234")])
    with pytest.raises(aostore.BlockObjectStoreError) as error:
        store.get_concatenated(["here", "gone"])
    assert "does not exist" in str(error.value)
    assert "max_bytes" not in str(error.value)
    store.close()


def test_grow_never_raises_cannot_retain() -> None:
    store = grow_store(1)
    for i in range(10):
        store.put([BlockObject(f"k{i}", b"kkkk")], retain_keys=[f"k{i}"])
    assert store.stats()["stored"] == 10
    assert store.stats()["capacity_errors"] == 0
    store.check()
    store.close()


def test_model_validates_releases_before_changing_anything() -> None:
    # The one documented difference from vLLM, in the model as in aostore.
    for impl in (
        model_grow.GrowModel(max_bytes=8, object_nbytes=4),
        grow_store(2),
    ):
        impl.put([make_object("a")], retain_keys=["a"])
        before = impl.snapshot()
        with pytest.raises(KeyError):
            impl.put([make_object("b")], retain_keys=["a"], release_keys=["a", "a", "z"])
        assert impl.snapshot() == before
        impl.close()


def make_object(key: str) -> Any:
    return BlockObject(key, key.encode() * 4)


# --------------------------------------------------------------------------- a refused growth


def test_a_refused_grow_put_keeps_a_replaced_object_with_its_old_bytes():
    # k2 is stored and unreferenced, so the put replaces it; the arena cannot double under the
    # address-space limit, so the put is refused: k2 must still be there with its old bytes.
    out = run_script(
        """
        import resource

        def vm():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")

        NBYTES = 16 << 20
        store = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES, profile="grow")
        old = [np.full(NBYTES, i, dtype=np.uint8) for i in range(4)]
        store.put([BlockObject(f"k{i}", old[i]) for i in range(4)], retain_keys=["k0", "k1"])
        limit = vm() + (48 << 20)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        new = np.full(NBYTES, 9, dtype=np.uint8)
        batch = [BlockObject("k2", new)] + [BlockObject(f"n{i}", new) for i in range(4)]
        keys = [b.key for b in batch]
        try:
            store.put(batch, retain_keys=keys)
        except MemoryError:
            print("refused")
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # room to read back
        store.check()
        assert store.get_concatenated(["k2"]) == old[2].tobytes(), "k2 lost or replaced"
        assert store.stats()["stored"] == 4
        print("kept")
        """,
        timeout=120,
    )
    assert out.split() == ["refused", "kept"]


def test_a_grow_put_that_cannot_map_its_arena_changes_nothing_and_calls_no_hook():
    # The put retains its new keys and must double the full arena; under the address-space
    # limit the larger arena cannot be mapped. MemoryError, and the store (references, LRU,
    # counters) and the policy are as before: no retain kept, no hook called.
    out = run_script(
        """
        import resource

        class Recorder:
            def __init__(self):
                self.calls = []
            def on_reference_change(self, key, old, new):
                self.calls.append(("ref", key, old, new))
            def select_victims(self, candidates, count):
                self.calls.append(("select", count))
                return [next(candidates) for _ in range(count)]
            def on_remove(self, keys, reason):
                self.calls.append(("remove", sorted(keys), reason))

        def vm():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")

        NBYTES = 16 << 20
        policy = Recorder()
        store = BlockObjectStore(
            max_bytes=4 * NBYTES, object_nbytes=NBYTES, profile="grow", policy=policy
        )
        payload = np.full(NBYTES, 1, dtype=np.uint8)
        store.put([BlockObject(f"k{i}", payload) for i in range(4)], retain_keys=["k0", "k1"])
        store.put([], release_keys=["k1"], retain_keys=["k2"])
        policy.calls.clear()
        before = (store.snapshot(), store.stats(), store.num_slots)
        limit = vm() + (48 << 20)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        batch = [BlockObject(f"n{i}", payload) for i in range(4)]
        try:
            store.put(batch, retain_keys=[b.key for b in batch] + ["k3"], release_keys=["k0"])
        except MemoryError as error:
            print("refused", "could not map" in str(error))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        store.check()
        print("unchanged", (store.snapshot(), store.stats(), store.num_slots) == before)
        print("hooks", len(policy.calls))
        # The same put fits once the limit is lifted, and grows as vLLM's does.
        store.put(batch, retain_keys=[b.key for b in batch] + ["k3"], release_keys=["k0"])
        print("grown", store.num_slots, store.stats()["referenced"])
        """,
        timeout=120,
    )
    assert out.split() == ["refused", "True", "unchanged", "True", "hooks", "0", "grown", "8", "6"]
