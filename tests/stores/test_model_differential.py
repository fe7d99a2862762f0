"""Differential test: both stores against their reference models (docs/guarantees.md,
docs/variable-store.md).

One hypothesis state machine drives a store and its model with the same calls: batches with
duplicate keys, retains, blind and balanced releases (so ``KeyError`` happens), re-puts of
referenced keys, capacity errors, malformed objects, and reads of present and missing keys.
After every step both must agree on the outcome (return value, or exception kind and the key
it names), on ``snapshot()`` and on the counters of ``stats()``, and ``check()`` must pass on
both. What differs between the stores is a ``Kind``:

* the fixed store (``aostore.BlockObjectStore`` against ``model.ModelStore``): 1-6 slots of
  1, 3 or 8 bytes, wrong-size payloads (``ValueError``), a refused put that keeps its count
  changes, and an eviction walk bounded by need + batch;
* the variable store (``aostore.VariableBlockObjectStore`` against
  ``model_variable.VariableModelStore``): up to 48 bytes in chunks of 1 to 8, objects of 0 to
  30 bytes whose re-puts change size, a refused put that changes nothing, an eviction walk
  that visits its victims only, and ``get_many``, ``get_optional`` and ``contains``.

The last tests run the same machine against deliberately broken models, to show the harness
finds each kind of bug.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import model
import model_variable as mv
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)


def as_buffer(raw: bytes, kind: str) -> Any:
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "numpy":
        return np.frombuffer(raw, dtype=np.uint8).copy()
    if kind == "memoryview":
        return memoryview(raw)
    return raw


class Outcome:
    """What one call did: a return value or an exception."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = call()
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # compared below (a Rust panic is a BaseException)
            self.error = error

    def describe(self) -> str:
        if self.error is None:
            return f"returned {self.value!r}"
        return f"raised {type(self.error).__name__}: {self.error}"


def error_kind(error: BaseException | None, store_error: type[BaseException]) -> str:
    """Classify an exception by the documented kinds, most specific first."""
    if error is None:
        return "ok"
    for name, kind in (
        ("KeyError", KeyError),
        ("ValueError", ValueError),
        ("TypeError", TypeError),
    ):
        if isinstance(error, kind):
            return name
    if isinstance(error, store_error):
        message = str(error)
        if "cannot retain the requested batch" in message:
            return "capacity"
        if "does not exist" in message:
            return "missing"
        return "store-error"
    return f"other:{type(error).__name__}"


# ---------------------------------------------------------------------------- the two kinds


class Kind:
    """What the machine needs to know about one store and its model."""

    name: str
    model: Any  # the model's module: its BlockObject and BlockObjectStoreError
    keys: tuple[str, ...]
    params: st.SearchStrategy[dict[str, Any]]  # the constructor's arguments
    sizes: st.SearchStrategy[int]  # payload sizes drawn for batches (the fixed store ignores them)
    malformed: tuple[str, ...]  # the kinds of malformed object put_malformed draws
    reads_many: bool  # whether get_many, get_optional and contains are compared

    def create(self, subject_store: Callable[..., Any], params: dict[str, Any]) -> tuple[Any, Any]:
        raise NotImplementedError

    def payload(self, machine: Any, key: str, version: int, size: int) -> bytes:
        raise NotImplementedError

    def malformed_payload(self, machine: Any, bad: str) -> Any:
        raise NotImplementedError

    def check_error(self, machine: Any, kind: str, subject: Outcome, what: str) -> None:
        """The store's own documented errors beyond KeyError and a missing key."""
        raise NotImplementedError

    def check_visits(self, machine: Any, step: dict[str, Any]) -> None:
        """The eviction walk's bound, after a put (``step`` is what ``do_put`` saw)."""
        raise NotImplementedError

    def compared_stats(self, reference_stats: dict[str, int]) -> tuple[str, ...]:
        raise NotImplementedError


# vLLM's routed-experts keys, which the stores hold as a prefix number and a binary digest: the
# same digest under two prefixes, and one spelled in uppercase (not a digest: kept as text).
ROUTED_KEY = "vllm-artifact/{}/{:064x}"


class Fixed(Kind):
    # A small alphabet against stores of 1-6 slots: duplicates, hits and evictions are common.
    name = "fixed"
    model = model
    keys = ("a", "b", "c", "d", "e", ROUTED_KEY.format(0, 0xABC), ROUTED_KEY.format(1, 0xABC))
    keys += (ROUTED_KEY.format(0, 0xABC).upper(),)
    params = st.fixed_dictionaries(
        {
            "slots": st.integers(1, 6),
            "nbytes": st.sampled_from([1, 3, 8]),
            "spare": st.integers(0, 7),
        }
    )
    sizes = st.just(0)
    malformed = ("short", "long", "empty", "int-key", "bytes-key", "int-payload", "strided")
    malformed += ("no-attrs",)
    reads_many = False
    # Counters whose meaning leaves no room for interpretation.
    COMPARED_STATS = (
        "capacity",
        "stored",
        "evictable",
        "free_slots",
        "objects_written",
        "bytes_written",
        "bytes_read",
        "capacity_errors",
    )

    def create(self, subject_store: Callable[..., Any], params: dict[str, Any]) -> tuple[Any, Any]:
        slots, nbytes, spare = params["slots"], params["nbytes"], params["spare"]
        max_bytes = slots * nbytes + spare % nbytes
        reference = model.ModelStore(max_bytes=max_bytes, object_nbytes=nbytes)
        subject = subject_store(max_bytes=max_bytes, object_nbytes=nbytes)
        assert subject.num_slots == reference.num_slots == slots
        assert subject.object_nbytes == nbytes
        return subject, reference

    def payload(self, machine: Any, key: str, version: int, size: int) -> bytes:
        """Distinct bytes for each (key, version): the first byte identifies the pair."""
        start = self.keys.index(key) * 16 + version * 4
        return bytes((start + i) % 256 for i in range(machine.reference.object_nbytes))

    def malformed_payload(self, machine: Any, bad: str) -> Any:
        n = machine.reference.object_nbytes
        if bad == "short":
            return b"x" * (n - 1) if n > 1 else b""
        if bad == "long":
            return b"x" * (n + 1)
        if bad == "empty":
            return b""
        if bad == "strided" and n > 1:  # one element is always contiguous
            return np.zeros(2 * n, dtype=np.uint8)[::2]
        if bad == "int-payload" or bad == "strided":
            return 12
        return b"x" * n

    def check_error(self, machine: Any, kind: str, subject: Outcome, what: str) -> None:
        if kind == "ValueError":
            # Only the malformed rule makes a wrong-size payload, always under "bad-key".
            assert "bad-key" in str(subject.error), (what, str(subject.error))
        elif kind == "capacity":
            expected = f"limit={machine.reference.num_slots} objects"
            assert expected in str(subject.error), (what, str(subject.error))
        elif kind == "store-error" or kind.startswith("other:"):
            raise AssertionError(f"{what}: undocumented error {subject.describe()}")

    def check_visits(self, machine: Any, step: dict[str, Any]) -> None:
        # The upstream report's bound: an evicting put visits at most need + len(batch) keys.
        what, reference, extra = step["what"], step["reference"], step["extra"]
        visits = step["visits"]
        batch_keys = {key for key, _, _ in step["batch"]}
        if extra is not None and isinstance(getattr(extra[1], "key", None), str):
            batch_keys.add(extra[1].key)
        need = len(set(step["before"]["objects"]) | batch_keys) - machine.reference.num_slots
        if (
            reference.error is not None
            and reference.error.__class__ is not model.BlockObjectStoreError
        ):
            assert visits == 0, f"{what}: rejected input still walked {visits} keys"
        else:
            assert visits <= max(need, 0) + (len(batch_keys) if need > 0 else 0), (
                f"{what}: eviction walk visited {visits} keys, need={need}"
            )

    def compared_stats(self, reference_stats: dict[str, int]) -> tuple[str, ...]:
        return self.COMPARED_STATS


# Short keys, two logprob-like keys (about 120 bytes, with spaces, quotes and parentheses, held
# as a digest and a tail) and one of 170 bytes (on the heap).
LOGPROB_KEY = "vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{:064x}/{}"


class Variable(Kind):
    name = "variable"
    model = mv
    keys = ("a", "b", "c", "d", LOGPROB_KEY.format(0xABC, 17), LOGPROB_KEY.format(0xDEF, 9))
    keys += ("x" * 170,)
    params = st.fixed_dictionaries(
        {"max_bytes": st.integers(1, 48), "chunk": st.sampled_from([None, 1, 2, 3, 8])}
    )
    sizes = st.one_of(st.just(0), st.integers(1, 12), st.integers(13, 30))
    malformed = ("int-key", "bytes-key", "int-payload", "strided", "no-attrs")
    reads_many = True

    def create(self, subject_store: Callable[..., Any], params: dict[str, Any]) -> tuple[Any, Any]:
        max_bytes, chunk = params["max_bytes"], params["chunk"]
        if chunk is not None and chunk > max_bytes:
            chunk = None
        reference = mv.VariableModelStore(max_bytes=max_bytes, chunk_nbytes=chunk)
        subject = subject_store(max_bytes=max_bytes, chunk_nbytes=chunk)
        assert subject.chunk_nbytes == reference.chunk_nbytes
        return subject, reference

    def payload(self, machine: Any, key: str, version: int, size: int) -> bytes:
        """Distinct bytes per (key, version, size)."""
        start = self.keys.index(key) * 31 + version * 7 + size
        return bytes((start + i) % 256 for i in range(size))

    def malformed_payload(self, machine: Any, bad: str) -> Any:
        if bad == "int-payload":
            return 12
        if bad == "strided":
            return np.zeros(8, dtype=np.uint8)[::2]
        return b"xy"

    def check_error(self, machine: Any, kind: str, subject: Outcome, what: str) -> None:
        if kind == "capacity":
            expected = f"limit={machine.reference.capacity_bytes} bytes"
            assert expected in str(subject.error), (what, str(subject.error))
        elif kind != "TypeError":
            raise AssertionError(f"{what}: undocumented error {subject.describe()}")

    def check_visits(self, machine: Any, step: dict[str, Any]) -> None:
        # The walk visits victims only, never a referenced or protected key.
        if step["subject"].error is None:
            assert step["visits"] == step["evictions"], step["what"]

    def compared_stats(self, reference_stats: dict[str, int]) -> tuple[str, ...]:
        return tuple(reference_stats)


KINDS = {"fixed": Fixed(), "variable": Variable()}


# ---------------------------------------------------------------------------- the machine


def comparison_machine(
    kind: Kind,
    subject_store: Callable[..., Any],
    subject_error: type[BaseException],
    subject_object: Callable[[str, Any], Any],
) -> type[RuleBasedStateMachine]:
    """Build a state machine comparing ``subject_store`` with ``kind``'s model."""
    keys_st = st.sampled_from(kind.keys)
    batch_st = st.lists(st.tuples(keys_st, st.integers(0, 3), kind.sizes), max_size=5)

    class StoreComparison(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.subject: Any = None
            self.reference: Any = None

        @initialize(params=kind.params)
        def create(self, params: dict[str, Any]) -> None:
            self.subject, self.reference = kind.create(subject_store, params)

        # ------------------------------------------------------------ helpers

        def compare(self, subject: Outcome, reference: Outcome, what: str) -> None:
            kinds = (
                error_kind(subject.error, subject_error),
                error_kind(reference.error, kind.model.BlockObjectStoreError),
            )
            assert kinds[0] == kinds[1], (
                f"{what}: aostore {subject.describe()}, model {reference.describe()}"
            )
            if kinds[0] == "ok":
                assert subject.value == reference.value, (
                    f"{what}: aostore {subject.describe()}, model {reference.describe()}"
                )
            elif kinds[0] == "KeyError":
                assert subject.error.args == reference.error.args, what  # type: ignore[union-attr]
            elif kinds[0] == "missing":
                assert "Increase aux_output_config.max_bytes" in str(subject.error), what
            else:
                kind.check_error(self, kinds[0], subject, what)

        def do_put(
            self,
            batch: list[tuple[str, int, int]],
            retains: list[str],
            releases: list[str],
            buffer: str = "bytes",
            extra: tuple[Any, Any] | None = None,
            position: int = 0,
        ) -> None:
            subject_objects, reference_objects = [], []
            for key, version, size in batch:
                raw = kind.payload(self, key, version, size)
                subject_objects.append(subject_object(key, as_buffer(raw, buffer)))
                reference_objects.append(kind.model.BlockObject(key, raw))
            if extra is not None:
                subject_objects.insert(position, extra[0])
                reference_objects.insert(position, extra[1])
            before = self.reference.snapshot()
            stats_before = self.subject.stats()
            reference = Outcome(
                lambda: self.reference.put(
                    reference_objects, retain_keys=list(retains), release_keys=list(releases)
                )
            )
            subject = Outcome(
                lambda: self.subject.put(
                    subject_objects, retain_keys=tuple(retains), release_keys=tuple(releases)
                )
            )
            what = f"put({batch}, retain_keys={retains}, release_keys={releases})"
            self.compare(subject, reference, what)
            stats = self.subject.stats()
            step = {
                "what": what,
                "batch": batch,
                "extra": extra,
                "before": before,
                "subject": subject,
                "reference": reference,
                "visits": stats["eviction_visits"] - stats_before["eviction_visits"],
                "evictions": stats["evictions"] - stats_before["evictions"],
            }
            kind.check_visits(self, step)

        # ------------------------------------------------------------ rules

        @rule(
            batch=batch_st,
            retains=st.lists(keys_st, max_size=4),
            releases=st.lists(keys_st, max_size=3),
            buffer=st.sampled_from(["bytes", "bytearray", "numpy", "memoryview"]),
        )
        def put_any(self, batch, retains, releases, buffer):
            """Releases drawn blindly: many calls raise KeyError and must change nothing."""
            self.do_put(batch, retains, releases, buffer)

        @rule(batch=batch_st, retains=st.lists(keys_st, max_size=4), data=st.data())
        def put_balanced(self, batch, retains, data):
            """Releases drawn from what is referenced, counting this call's retains."""
            available = Counter(self.reference.snapshot()["references"]) + Counter(retains)
            pool = sorted(available.elements())
            releases = data.draw(st.permutations(pool)) if pool else []
            count = data.draw(st.integers(0, len(releases)))
            self.do_put(batch, retains, list(releases[:count]))

        @precondition(lambda self: self.reference.snapshot()["references"])
        @rule(data=st.data(), size=kind.sizes, version=st.integers(0, 3))
        def replace_referenced(self, data, size, version):
            """A running request re-publishes a block it holds (at a new size, if it may)."""
            key = data.draw(st.sampled_from(sorted(self.reference.snapshot()["references"])))
            self.do_put([(key, version, size)], [], [])

        @precondition(lambda self: self.reference.snapshot()["references"])
        @rule(data=st.data())
        def finish_request(self, data):
            """Release every reference of some keys, in reverse order, as a request ends."""
            references = self.reference.snapshot()["references"]
            chosen = data.draw(
                st.lists(st.sampled_from(sorted(references)), min_size=1, unique=True)
            )
            releases = [key for key in chosen for _ in range(references[key])]
            self.do_put([], [], list(reversed(releases)))

        @rule(
            batch=batch_st,
            retains=st.lists(keys_st, max_size=2),
            bad=st.sampled_from(kind.malformed),
            position=st.integers(0, 5),
        )
        def put_malformed(self, batch, retains, bad, position):
            """One malformed object somewhere in an otherwise valid batch."""
            key: Any = "bad-key"
            if bad == "int-key":
                key = 5
            elif bad == "bytes-key":
                key = b"a"
            bad_payload = kind.malformed_payload(self, bad)
            if bad == "no-attrs":
                extra = ((key, bad_payload), (key, bad_payload))
            else:
                # A plain namespace: the store must validate whatever it is given.
                loose = types.SimpleNamespace(key=key, payload=bad_payload)
                extra = (loose, loose)
            self.do_put(batch, retains, [], extra=extra, position=min(position, len(batch)))

        def compare_read(self, method: str, *args: Any) -> None:
            shown = ", ".join(map(repr, args))
            self.compare(
                Outcome(lambda: getattr(self.subject, method)(*args)),
                Outcome(lambda: getattr(self.reference, method)(*args)),
                f"{method}({shown})",
            )

        @rule(keys=st.lists(keys_st, max_size=4))
        def read_any(self, keys):
            self.compare_read("get_concatenated", list(keys))

        @precondition(lambda self: self.reference.snapshot()["objects"])
        @rule(data=st.data())
        def read_stored(self, data):
            stored = sorted(self.reference.snapshot()["objects"])
            keys = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=4))
            self.compare_read("get_concatenated", keys)

        @precondition(lambda self: kind.reads_many)
        @rule(keys=st.lists(keys_st, max_size=5))
        def read_many(self, keys):
            self.compare_read("get_many", list(keys))

        @precondition(lambda self: kind.reads_many)
        @rule(key=keys_st)
        def read_optional(self, key):
            self.compare_read("get_optional", key)

        @precondition(lambda self: kind.reads_many)
        @rule(keys=st.lists(keys_st, max_size=5))
        def ask_contains(self, keys):
            self.compare_read("contains", list(keys))

        # ------------------------------------------------------------ invariants

        @invariant()
        def same_state(self):
            if self.subject is None:
                return
            self.subject.check()
            self.reference.check()
            expected = self.reference.snapshot()
            actual = self.subject.snapshot()
            assert actual["lru"] == expected["lru"], (actual["lru"], expected["lru"])
            assert actual["references"] == expected["references"]
            assert actual["objects"] == expected["objects"]
            subject_stats, reference_stats = self.subject.stats(), self.reference.stats()
            for name in kind.compared_stats(reference_stats):
                assert subject_stats[name] == reference_stats[name], (
                    name,
                    subject_stats[name],
                    reference_stats[name],
                )

        def teardown(self) -> None:
            if self.subject is not None:
                self.subject.close()
                self.reference.close()

    return StoreComparison


FULL_RUN = settings(
    max_examples=2000,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.parametrize("kind", list(KINDS))
def test_store_against_reference(kind):
    import aostore

    store = aostore.BlockObjectStore if kind == "fixed" else aostore.VariableBlockObjectStore
    machine = comparison_machine(
        KINDS[kind], store, aostore.BlockObjectStoreError, aostore.BlockObject
    )
    run_state_machine_as_test(machine, settings=FULL_RUN)


# ---------------------------------------------------------------------------- the harness has teeth


class ReplacesStoredBytes(model.ModelStore):
    """Bug: re-putting an unreferenced stored key overwrites its bytes."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        objects = list(objects)
        before = self.snapshot()
        super().put(objects, retain_keys=retain_keys, release_keys=release_keys)
        for obj in objects:
            if obj.key in before["objects"] and obj.key not in before["references"]:
                self._objects[obj.key] = bytes(memoryview(obj.payload))


class ReadDoesNotTouch(model.ModelStore):
    """Bug: reads do not move keys to the LRU tail."""

    def get_concatenated(self, keys):
        order = list(self._lru)
        result = super().get_concatenated(keys)
        self._lru.clear()
        self._lru.update(dict.fromkeys(order))
        return result


class RollsBackCountsOnCapacityError(model.ModelStore):
    """Bug: a capacity error undoes the call's reference changes and moves."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        references, lru = dict(self._references), list(self._lru)
        try:
            super().put(objects, retain_keys=retain_keys, release_keys=release_keys)
        except model.BlockObjectStoreError:
            self._references = references
            self._lru.clear()
            self._lru.update(dict.fromkeys(lru))
            raise


class FirstPayloadWins(model.ModelStore):
    """Bug: deduplication keeps the first payload instead of the last."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        objects = list(objects)
        seen: set[Any] = set()
        first = []
        for obj in objects:
            key = getattr(obj, "key", None)
            if isinstance(key, str) and key in seen:
                continue
            seen.add(key)
            first.append(obj)
        super().put(first, retain_keys=retain_keys, release_keys=release_keys)


class PartialReleaseBeforeKeyError(model.ModelStore):
    """Bug: releases before the unreferenced one are applied when KeyError is raised."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        releases = list(release_keys)
        try:
            super().put(objects, retain_keys=retain_keys, release_keys=releases)
        except KeyError as error:
            for key in releases[: releases.index(error.args[0])]:
                if self._references.get(key, 0) > 0:
                    super().put([], release_keys=[key])
            raise


class KeepsCountsOnCapacityError(mv.VariableModelStore):
    """Bug (the fixed store's rule): a refused put keeps its count changes."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        try:
            super().put(objects, retain_keys=retain_keys, release_keys=release_keys)
        except mv.BlockObjectStoreError:
            retains, releases = list(retain_keys or ()), list(release_keys or ())
            if retains or releases:
                super().put([], retain_keys=retains, release_keys=releases)
                self._stats["puts"] -= 1
                self._stats["retains"] -= len(retains)
                self._stats["releases"] -= len(releases)
            raise


class KeepsReferencedBytes(mv.VariableModelStore):
    """Bug: a re-put of a referenced key keeps its old payload."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        objects = list(objects)
        held = {k: v for k, v in self._objects.items() if k in self._references}
        super().put(objects, retain_keys=retain_keys, release_keys=release_keys)
        for key, payload in held.items():
            if key in self._objects:
                self._objects[key] = payload


class EvictsOneTooMany(mv.VariableModelStore):
    """Bug: eviction frees one more evictable key than it needs."""

    def put(self, objects, *, retain_keys=(), release_keys=()):
        evictions = self._stats["evictions"]
        super().put(objects, retain_keys=retain_keys, release_keys=release_keys)
        if self._stats["evictions"] > evictions and self._lru:
            victim = next(iter(self._lru))
            del self._lru[victim]
            del self._objects[victim]


class ExactBytesIgnoringChunks(mv.VariableModelStore):
    """Bug: capacity counted in bytes, not whole chunks."""

    def _chunks(self, nbytes: int) -> int:
        return nbytes if self.chunk_nbytes == 1 else nbytes / self.chunk_nbytes  # type: ignore[return-value]


BROKEN = {
    "fixed": [
        ReplacesStoredBytes,
        ReadDoesNotTouch,
        RollsBackCountsOnCapacityError,
        FirstPayloadWins,
        PartialReleaseBeforeKeyError,
    ],
    "variable": [
        KeepsCountsOnCapacityError,
        KeepsReferencedBytes,
        EvictsOneTooMany,
        ExactBytesIgnoringChunks,
    ],
}
MODELS = {"fixed": model.ModelStore, "variable": mv.VariableModelStore}

QUICK_HUNT = settings(
    max_examples=1000,
    stateful_step_count=25,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    ("kind", "broken"),
    [(kind, broken) for kind, models in BROKEN.items() for broken in models],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_harness_detects_broken_model(kind, broken):
    module = KINDS[kind].model
    machine = comparison_machine(
        KINDS[kind], broken, module.BlockObjectStoreError, module.BlockObject
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=QUICK_HUNT)


@pytest.mark.parametrize("kind", list(KINDS))
def test_harness_accepts_the_model_itself(kind):
    module = KINDS[kind].model
    machine = comparison_machine(
        KINDS[kind], MODELS[kind], module.BlockObjectStoreError, module.BlockObject
    )
    run_state_machine_as_test(machine, settings=settings(QUICK_HUNT, max_examples=100))
