"""The variable-size store against its reference model (SPEC sections 11 and 13).

A hypothesis state machine drives ``aostore.VariableBlockObjectStore`` and
``model_variable.VariableModelStore`` with the same calls: batches with duplicate keys whose
re-puts change size (referenced keys included), zero-byte objects, blind and balanced releases
(so ``KeyError`` happens), batches that cannot be held (which must change nothing, counts
included), eviction by bytes with chunk sizes of 1 to 8 bytes, malformed objects, reads,
``get_many``, ``get_optional`` and ``contains``. After every step both must agree on the
outcome, ``snapshot()`` and every counter of ``stats()``, and ``check()`` (keys, LRU and the
allocator) must pass.

The last tests run the machine against deliberately broken models, to show it finds each kind
of bug.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from typing import Any

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

# Short keys, two logprob-like keys (about 120 bytes, with spaces, quotes and parentheses, kept
# inline) and one of 170 bytes (past the inline capacity).
LOGPROB_KEY = "vllm-logprobs/v1/0/(temperature=1.0, 'top_k': 20)/{:064x}/{}"
KEYS = (
    "a",
    "b",
    "c",
    "d",
    LOGPROB_KEY.format(0xABC, 17),
    LOGPROB_KEY.format(0xDEF, 9),
    "x" * 170,
)
keys_st = st.sampled_from(KEYS)
sizes_st = st.one_of(st.just(0), st.integers(1, 12), st.integers(13, 30))
batch_st = st.lists(st.tuples(keys_st, st.integers(0, 3), sizes_st), max_size=5)


class Outcome:
    """What one call did: a return value or an exception."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = call()
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # compared by the machine (a Rust panic included)
            self.error = error

    def describe(self) -> str:
        if self.error is None:
            return f"returned {self.value!r}"
        return f"raised {type(self.error).__name__}: {self.error}"


def as_buffer(raw: bytes, kind: str) -> Any:
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "numpy":
        return np.frombuffer(raw, dtype=np.uint8).copy()
    if kind == "memoryview":
        return memoryview(raw)
    return raw


def payload_bytes(key: str, version: int, size: int) -> bytes:
    """Distinct bytes per (key, version, size)."""
    start = KEYS.index(key) * 31 + version * 7 + size
    return bytes((start + i) % 256 for i in range(size))


def error_kind(error: BaseException | None, store_error: type[BaseException]) -> str:
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


def comparison_machine(
    subject_store: Callable[..., Any],
    subject_error: type[BaseException],
    subject_object: Callable[[str, Any], Any],
) -> type[RuleBasedStateMachine]:
    """A state machine comparing ``subject_store`` with ``model_variable.VariableModelStore``."""

    class VariableComparison(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.subject: Any = None
            self.reference: Any = None

        @initialize(
            max_bytes=st.integers(1, 48),
            chunk=st.sampled_from([None, 1, 2, 3, 8]),
        )
        def create(self, max_bytes: int, chunk: int | None) -> None:
            if chunk is not None and chunk > max_bytes:
                chunk = None
            self.reference = mv.VariableModelStore(max_bytes=max_bytes, chunk_nbytes=chunk)
            self.subject = subject_store(max_bytes=max_bytes, chunk_nbytes=chunk)
            assert self.subject.chunk_nbytes == self.reference.chunk_nbytes

        def compare(self, subject: Outcome, reference: Outcome, what: str) -> None:
            kinds = (
                error_kind(subject.error, subject_error),
                error_kind(reference.error, mv.BlockObjectStoreError),
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
            elif kinds[0] == "capacity":
                expected = f"limit={self.reference.capacity_bytes} bytes"
                assert expected in str(subject.error), (what, str(subject.error))
            elif kinds[0] == "missing":
                assert "Increase aux_output_config.max_bytes" in str(subject.error), what
            elif kinds[0] != "TypeError":
                raise AssertionError(f"{what}: undocumented error {subject.describe()}")

        def do_put(
            self,
            batch: list[tuple[str, int, int]],
            retains: list[str],
            releases: list[str],
            kind: str = "bytes",
            extra: tuple[Any, Any] | None = None,
            position: int = 0,
        ) -> None:
            subject_objects, reference_objects = [], []
            for key, version, size in batch:
                raw = payload_bytes(key, version, size)
                subject_objects.append(subject_object(key, as_buffer(raw, kind)))
                reference_objects.append(mv.BlockObject(key, raw))
            if extra is not None:
                subject_objects.insert(position, extra[0])
                reference_objects.insert(position, extra[1])
            visits_before = self.subject.stats()["eviction_visits"]
            evictions_before = self.subject.stats()["evictions"]
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
            # The walk visits victims only, never a referenced or protected key.
            stats = self.subject.stats()
            visits = stats["eviction_visits"] - visits_before
            if subject.error is None:
                assert visits == stats["evictions"] - evictions_before, what

        # ------------------------------------------------------------ rules

        @rule(
            batch=batch_st,
            retains=st.lists(keys_st, max_size=4),
            releases=st.lists(keys_st, max_size=3),
            kind=st.sampled_from(["bytes", "bytearray", "numpy", "memoryview"]),
        )
        def put_any(self, batch, retains, releases, kind):
            """Releases drawn blindly: many calls raise KeyError and must change nothing."""
            self.do_put(batch, retains, releases, kind)

        @rule(batch=batch_st, retains=st.lists(keys_st, max_size=4), data=st.data())
        def put_balanced(self, batch, retains, data):
            """Releases drawn from what is referenced, counting this call's retains."""
            available = Counter(self.reference.snapshot()["references"]) + Counter(retains)
            pool = sorted(available.elements())
            releases = data.draw(st.permutations(pool)) if pool else []
            count = data.draw(st.integers(0, len(releases)))
            self.do_put(batch, retains, list(releases[:count]))

        @precondition(lambda self: self.reference.snapshot()["references"])
        @rule(data=st.data(), size=sizes_st, version=st.integers(0, 3))
        def replace_referenced(self, data, size, version):
            """A running request re-publishes a block it holds, at a new size."""
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
            bad=st.sampled_from(["int-key", "bytes-key", "int-payload", "strided", "no-attrs"]),
            position=st.integers(0, 5),
        )
        def put_malformed(self, batch, retains, bad, position):
            """One malformed object somewhere in an otherwise valid batch: TypeError."""
            key: Any = "bad-key"
            payload: Any = b"xy"
            if bad == "int-key":
                key = 5
            elif bad == "bytes-key":
                key = b"a"
            elif bad == "int-payload":
                payload = 12
            elif bad == "strided":
                payload = np.zeros(8, dtype=np.uint8)[::2]
            if bad == "no-attrs":
                extra = ((key, payload), (key, payload))
            else:
                loose = types.SimpleNamespace(key=key, payload=payload)
                extra = (loose, loose)
            self.do_put(batch, retains, [], extra=extra, position=min(position, len(batch)))

        @rule(keys=st.lists(keys_st, max_size=4))
        def read_any(self, keys):
            self.compare(
                Outcome(lambda: self.subject.get_concatenated(list(keys))),
                Outcome(lambda: self.reference.get_concatenated(list(keys))),
                f"get_concatenated({keys})",
            )

        @precondition(lambda self: self.reference.snapshot()["objects"])
        @rule(data=st.data())
        def read_stored(self, data):
            stored = sorted(self.reference.snapshot()["objects"])
            keys = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=4))
            self.compare(
                Outcome(lambda: self.subject.get_concatenated(keys)),
                Outcome(lambda: self.reference.get_concatenated(keys)),
                f"get_concatenated({keys})",
            )

        @rule(keys=st.lists(keys_st, max_size=5))
        def read_many(self, keys):
            self.compare(
                Outcome(lambda: self.subject.get_many(list(keys))),
                Outcome(lambda: self.reference.get_many(list(keys))),
                f"get_many({keys})",
            )

        @rule(key=keys_st)
        def read_optional(self, key):
            self.compare(
                Outcome(lambda: self.subject.get_optional(key)),
                Outcome(lambda: self.reference.get_optional(key)),
                f"get_optional({key!r})",
            )

        @rule(keys=st.lists(keys_st, max_size=5))
        def ask_contains(self, keys):
            self.compare(
                Outcome(lambda: self.subject.contains(list(keys))),
                Outcome(lambda: self.reference.contains(list(keys))),
                f"contains({keys})",
            )

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
            for name, value in reference_stats.items():
                assert subject_stats[name] == value, (name, subject_stats[name], value)

        def teardown(self) -> None:
            if self.subject is not None:
                self.subject.close()
                self.reference.close()

    return VariableComparison


FULL_RUN = settings(
    max_examples=2000,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_variable_store_against_reference():
    import aostore

    machine = comparison_machine(
        aostore.VariableBlockObjectStore, aostore.BlockObjectStoreError, aostore.BlockObject
    )
    run_state_machine_as_test(machine, settings=FULL_RUN)


# ---------------------------------------------------------------------------- the harness has teeth


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


QUICK_HUNT = settings(
    max_examples=1000,
    stateful_step_count=25,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    "broken",
    [KeepsCountsOnCapacityError, KeepsReferencedBytes, EvictsOneTooMany, ExactBytesIgnoringChunks],
)
def test_harness_detects_broken_model(broken):
    machine = comparison_machine(broken, mv.BlockObjectStoreError, mv.BlockObject)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=QUICK_HUNT)


def test_harness_accepts_the_model_itself():
    machine = comparison_machine(mv.VariableModelStore, mv.BlockObjectStoreError, mv.BlockObject)
    run_state_machine_as_test(machine, settings=settings(QUICK_HUNT, max_examples=100))
