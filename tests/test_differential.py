"""Differential test: aostore.BlockObjectStore against the reference model (SPEC section 11).

A hypothesis state machine drives both stores with the same calls: batches with
duplicate keys, retains, balanced and unbalanced releases (so ``KeyError`` happens),
capacity errors, malformed objects, and reads of present and missing keys. After
every step both must agree on the outcome (return value, or exception kind and
the key it names), on ``snapshot()`` and on the unambiguous counters of
``stats()``, and ``check()`` must pass on both.

The last tests run the same machine against deliberately broken models, to show
the harness finds each kind of bug.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import model
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

# A small alphabet against stores of 1-6 slots: duplicates, hits and evictions are common.
KEYS = ("a", "b", "c", "d", "e", "f", "g", "h")
keys_st = st.sampled_from(KEYS)
versions_st = st.integers(0, 3)
batch_st = st.lists(st.tuples(keys_st, versions_st), max_size=5)

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


def payload_bytes(key: str, version: int, nbytes: int) -> bytes:
    """Distinct bytes for each (key, version): the first byte identifies the pair."""
    start = KEYS.index(key) * 16 + version * 4
    return bytes((start + i) % 256 for i in range(nbytes))


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


def comparison_machine(
    subject_store: Callable[..., Any],
    subject_error: type[BaseException],
    subject_object: Callable[[str, Any], Any],
) -> type[RuleBasedStateMachine]:
    """Build a state machine comparing ``subject_store`` with ``model.ModelStore``."""

    class StoreComparison(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.subject: Any = None
            self.reference: Any = None

        @initialize(
            slots=st.integers(1, 6),
            nbytes=st.sampled_from([1, 3, 8]),
            spare=st.integers(0, 7),
        )
        def create(self, slots: int, nbytes: int, spare: int) -> None:
            max_bytes = slots * nbytes + spare % nbytes
            self.nbytes = nbytes
            self.reference = model.ModelStore(max_bytes=max_bytes, object_nbytes=nbytes)
            self.subject = subject_store(max_bytes=max_bytes, object_nbytes=nbytes)
            assert self.subject.num_slots == self.reference.num_slots == slots
            assert self.subject.object_nbytes == nbytes

        # ------------------------------------------------------------ helpers

        def compare(self, subject: Outcome, reference: Outcome, what: str) -> None:
            kinds = (
                error_kind(subject.error, subject_error),
                error_kind(reference.error, model.BlockObjectStoreError),
            )
            assert kinds[0] == kinds[1], (
                f"{what}: aostore {subject.describe()}, model {reference.describe()}"
            )
            if kinds[0] == "ok":
                assert subject.value == reference.value, (
                    f"{what}: aostore {subject.describe()}, model {reference.describe()}"
                )
            elif kinds[0] == "ValueError":
                # Only the malformed rule makes a wrong-size payload, always under "bad-key".
                assert "bad-key" in str(subject.error), (what, str(subject.error))
            elif kinds[0] == "KeyError":
                assert subject.error.args == reference.error.args, what  # type: ignore[union-attr]
            elif kinds[0] == "capacity":
                expected = f"limit={self.reference.num_slots} objects"
                assert expected in str(subject.error), (what, str(subject.error))
            elif kinds[0] == "missing":
                assert "Increase aux_output_config.max_bytes" in str(subject.error), what
            elif kinds[0] == "store-error" or kinds[0].startswith("other:"):
                raise AssertionError(f"{what}: undocumented error {subject.describe()}")

        def objects(self, batch: list[tuple[str, int]], kind: str) -> tuple[list[Any], list[Any]]:
            subject_objects, reference_objects = [], []
            for key, version in batch:
                raw = payload_bytes(key, version, self.nbytes)
                subject_objects.append(subject_object(key, as_buffer(raw, kind)))
                reference_objects.append(model.BlockObject(key, raw))
            return subject_objects, reference_objects

        def do_put(
            self,
            batch: list[tuple[str, int]],
            retains: list[str],
            releases: list[str],
            kind: str = "bytes",
            extra: tuple[Any, Any] | None = None,
            position: int = 0,
        ) -> None:
            subject_objects, reference_objects = self.objects(batch, kind)
            if extra is not None:
                subject_objects.insert(position, extra[0])
                reference_objects.insert(position, extra[1])
            before = self.reference.snapshot()
            visits_before = self.subject.stats()["eviction_visits"]
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
            # The seed's bound: an evicting put visits at most need + len(batch) keys.
            visits = self.subject.stats()["eviction_visits"] - visits_before
            batch_keys = {key for key, _ in batch}
            if extra is not None and isinstance(getattr(extra[1], "key", None), str):
                batch_keys.add(extra[1].key)
            need = len(set(before["objects"]) | batch_keys) - self.reference.num_slots
            if (
                reference.error is not None
                and reference.error.__class__ is not model.BlockObjectStoreError
            ):
                assert visits == 0, f"{what}: rejected input still walked {visits} keys"
            else:
                assert visits <= max(need, 0) + (len(batch_keys) if need > 0 else 0), (
                    f"{what}: eviction walk visited {visits} keys, need={need}"
                )

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
            bad=st.sampled_from(
                [
                    "short",
                    "long",
                    "empty",
                    "int-key",
                    "bytes-key",
                    "int-payload",
                    "strided",
                    "no-attrs",
                ]
            ),
            position=st.integers(0, 5),
        )
        def put_malformed(self, batch, retains, bad, position):
            """One malformed object somewhere in an otherwise valid batch."""
            n = self.nbytes
            if bad == "short":
                bad_payload, key = b"x" * (n - 1) if n > 1 else b"", "bad-key"
            elif bad == "long":
                bad_payload, key = b"x" * (n + 1), "bad-key"
            elif bad == "empty":
                bad_payload, key = b"", "bad-key"
            elif bad == "strided" and n > 1:  # one element is always contiguous
                bad_payload, key = np.zeros(2 * n, dtype=np.uint8)[::2], "bad-key"
            else:
                bad_payload, key = b"x" * n, "bad-key"
            if bad == "int-payload" or (bad == "strided" and n == 1):
                bad_payload = 12
            if bad == "int-key":
                key = 5  # type: ignore[assignment]
            elif bad == "bytes-key":
                key = b"a"  # type: ignore[assignment]
            if bad == "no-attrs":
                extra = (("bad-key", bad_payload), ("bad-key", bad_payload))
            else:
                # A plain namespace: the store must validate whatever it is given.
                bad_object = types.SimpleNamespace(key=key, payload=bad_payload)
                extra = (bad_object, bad_object)
            position = min(position, len(batch))
            self.do_put(batch, retains, [], extra=extra, position=position)

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
            for name in COMPARED_STATS:
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


def test_aostore_against_reference():
    import aostore

    machine = comparison_machine(
        aostore.BlockObjectStore, aostore.BlockObjectStoreError, aostore.BlockObject
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
    [
        ReplacesStoredBytes,
        ReadDoesNotTouch,
        RollsBackCountsOnCapacityError,
        FirstPayloadWins,
        PartialReleaseBeforeKeyError,
    ],
)
def test_harness_detects_broken_model(broken):
    machine = comparison_machine(broken, model.BlockObjectStoreError, model.BlockObject)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=QUICK_HUNT)


def test_harness_accepts_the_model_itself():
    machine = comparison_machine(model.ModelStore, model.BlockObjectStoreError, model.BlockObject)
    run_state_machine_as_test(machine, settings=settings(QUICK_HUNT, max_examples=100))
