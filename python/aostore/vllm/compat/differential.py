"""A short scripted differential between vLLM's store class and the one the plugin installs.

The vLLM plugin's class-by-class gate proves signatures; this proves behaviour. On a vLLM that
the plugin does not recognize by content, it runs one fixed script (:data:`SCRIPT`) through
vLLM's store and through aostore's, each call on both, and reports the first difference:

- a call that raises in one store and not in the other;
- a call that raises in both where aostore's exception is not an instance of the class vLLM
  code would catch: vLLM's exception class, or the class the swap puts in its place
  (``errors`` maps vLLM's ``BlockObjectStoreError`` to aostore's);
- a call that succeeds in both with a different result (``get_concatenated``'s bytes);
- after a call that succeeds in both, a different state: the keys stored and their bytes,
  each key's reference count, ``num_slots`` and the eviction order.

State after a call that raised is not compared (vLLM 0.33.0's ``put`` changes state before it
raises ``KeyError``, aostore changes nothing), nor are messages. The script stops at the first
call that raises in both; what follows it is never run.

**How state is observed**: by behaviour only, through the calls both stores have (``put``,
``get_concatenated``, ``close`` and the ``num_slots`` attribute), never through private
attributes, which differ from one vLLM to the next (vLLM 0.32.0 keeps one ``_lru`` of every
key, 0.33.0 ``_slots``, ``_lru`` and ``_references``, aostore a Rust table). Reads and
releases change the state they observe (a read moves a key to the LRU tail), so each
observation runs on fresh stores that first replay the script up to the call observed:

- *stored keys, bytes and eviction order*: for ``j = 0 .. num_slots``, replay, put ``j`` new
  unreferenced filler keys one call each, then read every key the script names (and the
  fillers) one at a time: which keys are still there after ``j`` fillers, and their bytes.
  ``j = 0`` gives the stored keys and bytes, each later ``j`` the next victim in eviction order
  (a refusal of a filler in a fail-closed store is an outcome compared like any other);
- *reference counts*: for each key the script names, replay, then release it one call at a
  time until a release raises (at most :data:`MAX_COUNT` times): the count, and that a release
  of an unreferenced key raises (a store that ignores it never raises);
- *closed*: replay the whole script, then ``close()`` twice, a ``put`` and a read.

The script is a few dozen calls on a 4-slot store of 4-byte objects; with the replays about
1,500 calls on each side, a few milliseconds in all. This module imports nothing of aostore:
the stores, the object class and the error mapping come in as arguments.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_COUNT", "SCRIPT", "Call", "Verdict", "differential"]

OBJECT_NBYTES = 4
MAX_BYTES = 16  # 4 slots
MAX_COUNT = 4
"""Releases tried per key when reading its reference count (no count in the script exceeds 2)."""
NEVER = "never"
"""A key the script never stores or retains."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the script: ``put`` (objects as ``(key, byte)``: the payload is that byte
    ``OBJECT_NBYTES`` times), ``get`` (``get_concatenated(keys)``) or ``close``."""

    op: str
    objects: tuple[tuple[str, int], ...] = ()
    retain: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.op == "get":
            return f"get_concatenated({list(self.keys)})"
        if self.op == "close":
            return "close()"
        parts = [str([key for key, _ in self.objects])]
        if self.retain:
            parts.append(f"retain_keys={list(self.retain)}")
        if self.release:
            parts.append(f"release_keys={list(self.release)}")
        return f"put({', '.join(parts)})"


def _put(
    objects: Sequence[tuple[str, int]] = (),
    retain: Sequence[str] = (),
    release: Sequence[str] = (),
) -> Call:
    return Call("put", tuple(objects), tuple(retain), tuple(release))


def _get(*keys: str) -> Call:
    return Call("get", keys=keys)


SCRIPT: tuple[Call, ...] = (
    _put([("a", 1), ("b", 2), ("a", 3)], retain=["a"]),  # a duplicate: the last payload wins
    _put([("c", 4)], retain=["c", "c"]),  # a count of 2
    _put([("d", 5)]),  # the store is full: a, c referenced; b, d evictable
    _put([("b", 6)]),  # a re-put of a stored unreferenced key (grow: new bytes)
    _put(retain=["e"], release=["c"]),  # a retain before the key is stored; 2 -> 1
    _get("d", "a", "d"),  # duplicate reads; the read moves d to the LRU tail
    _put([("e", 7), ("f", 8)], retain=["f"], release=["e", "f"]),  # evicts two
    _put(release=["a"]),  # a released: to the LRU tail
    _put([("g", 9)], retain=["g"], release=["c"]),  # evicts one
    _put([("h", 10), ("i", 11), ("j", 12), ("k", 13), ("l", 14)], retain="hijkl"),  # refused/grows
    _put([("g", 15)]),  # a re-put of a referenced key: its bytes stay
    _put(release=["h", "i"]),
    _get("g", "h", "l"),
    _put([("m", 16), ("n", 17)], release=["g"]),
)
"""The calls, in order. In a fail-closed store the tenth is refused (and the script ends
there); in a store that grows, it grows."""

# Calls tried on their own after each step that succeeds in both (each on fresh stores): they
# should raise, so nothing after them is compared.
_PROBES: tuple[Call, ...] = (
    _put(release=[NEVER]),  # a release of a key never referenced
    _put([("p", 18)], release=[NEVER]),  # the same beside an object
    _put(retain=["q"], release=["q", "q"]),  # one release too many, counting this call's retain
    _get("a", NEVER),  # a read of a key that is not stored
)
# After which calls the probes run (and after the last call that succeeds).
_PROBED_AFTER = frozenset({1, 3, 7, 9})
_AFTER_CLOSE: tuple[Call, ...] = (
    Call("close"),
    Call("close"),
    _put([("z", 19)]),
    _get("a"),
)


@dataclasses.dataclass
class Verdict:
    """What the differential found."""

    difference: str | None = None
    """The first difference, in words; ``None``: none found."""
    failed: str | None = None
    """Why the differential itself could not run (a store that cannot be built, a step that
    fails outside the stores' calls); ``None``: it ran."""
    calls: int = 0
    """Store calls made, both sides together."""
    seconds: float = 0.0
    """How long it took."""

    @property
    def same(self) -> bool:
        """Whether it ran and found no difference."""
        return self.difference is None and self.failed is None


class _Failed(Exception):
    """The differential itself could not go on."""


# An outcome: ("ok", value) or ("raised", exception).
_Outcome = tuple[str, Any]


class _Side:
    """One store class, driven by the script."""

    def __init__(self, name: str, factory: Callable[..., Any], make_object: Callable[..., Any]):
        self.name = name
        self.factory = factory
        self.make_object = make_object
        self.calls = 0

    def build(self) -> Any:
        try:
            return self.factory(max_bytes=MAX_BYTES, object_nbytes=OBJECT_NBYTES)
        except Exception as error:
            raise _Failed(
                f"cannot build {self.name}(max_bytes={MAX_BYTES}, object_nbytes={OBJECT_NBYTES}): "
                f"{type(error).__name__}: {error}"
            ) from error

    def call(self, store: Any, call: Call) -> _Outcome:
        self.calls += 1
        try:
            if call.op == "put":
                objects = [
                    self.make_object(key, bytes([byte]) * OBJECT_NBYTES)
                    for key, byte in call.objects
                ]
                result = store.put(objects, retain_keys=call.retain, release_keys=call.release)
            elif call.op == "get":
                result = bytes(store.get_concatenated(list(call.keys)))
            else:
                result = store.close()
        except Exception as error:
            return "raised", error
        return "ok", result

    def replay(self, store: Any, calls: Sequence[Call]) -> None:
        for call in calls:
            kind, value = self.call(store, call)
            if kind != "ok":  # it succeeded before, on a store built the same way
                raise _Failed(
                    f"{self.name}: {call} raised {type(value).__name__} on a replay where it had "
                    "returned (the store is not deterministic)"
                )

    def num_slots(self, store: Any) -> _Outcome:
        try:
            return "ok", int(store.num_slots)
        except Exception as error:
            return "raised", error


def _close(store: Any) -> None:
    try:
        store.close()
    except Exception:
        pass


def _show(outcome: _Outcome) -> str:
    kind, value = outcome
    if kind == "raised":
        return f"raises {type(value).__name__}"
    if value is None:
        return "returns"
    return f"returns {value!r}"


def _differ(theirs: _Outcome, ours: _Outcome, errors: Mapping[type, type]) -> str | None:
    """How ``ours`` differs from ``theirs`` (``None``: the same), in words."""
    if theirs[0] != ours[0]:
        return f"{_show(theirs)} in vLLM's, {_show(ours)} in aostore's"
    if theirs[0] == "raised":
        expected = type(theirs[1])
        expected = errors.get(expected, expected)
        if not isinstance(ours[1], expected):
            return (
                f"raises {type(theirs[1]).__name__} in vLLM's, {type(ours[1]).__name__} in "
                f"aostore's, which is not a {expected.__module__}.{expected.__qualname__}"
            )
        return None
    if theirs[1] != ours[1]:
        return f"{_show(theirs)} in vLLM's, {_show(ours)} in aostore's"
    return None


_Labels = Callable[[], Sequence[str]]


class _Run:
    def __init__(self, theirs: _Side, ours: _Side, errors: Mapping[type, type]):
        self.sides = (theirs, ours)
        self.errors = errors
        self.keys = sorted(
            {key for call in SCRIPT for key, _ in call.objects}
            | {key for call in SCRIPT for key in (*call.retain, *call.release, *call.keys)}
        )
        self.reads = [_get(key) for key in self.keys]
        self.releases = [_put(release=[key]) for key in self.keys]
        self.fillers = [_put([(f"filler-{index}", 100 + index)]) for index in range(64)]
        self.filler_reads = [_get(f"filler-{index}") for index in range(64)]

    def each(self, prefix: Sequence[Call], then: Callable[[_Side, Any], list[_Outcome]]) -> Any:
        """``then(side, store)`` on fresh stores of both sides that replayed ``prefix``."""
        results = []
        for side in self.sides:
            store = side.build()
            try:
                side.replay(store, prefix)
                results.append(then(side, store))
            finally:
                _close(store)
        return results

    def compare(
        self, where: str, labels: _Labels, theirs: list[_Outcome], ours: list[_Outcome]
    ) -> str | None:
        """The first difference between the two outcome lists, in words; the labels name
        each outcome's call (computed only when there is a difference)."""
        for index, (mine, other) in enumerate(zip(theirs, ours, strict=False)):
            gap = _differ(mine, other, self.errors)
            if gap:
                names = labels()
                label = names[index] if index < len(names) else ""
                return f"{where}: {label} {gap}" if label else f"{where}: {gap}"
        if len(theirs) != len(ours):  # a sequence that stopped early on one side only
            return f"{where}: vLLM's made {len(theirs)} calls, aostore's {len(ours)}"
        return None

    def observe(self, prefix: Sequence[Call], where: str) -> str | None:
        """Compares the state both stores reach after ``prefix`` (see the module docstring)."""

        def release(side: _Side, store: Any) -> list[_Outcome]:
            seen: list[_Outcome] = []
            for call in self.releases:
                for _ in range(MAX_COUNT + 1):
                    seen.append(side.call(store, call))
                    if seen[-1][0] != "ok":
                        break
            return seen

        theirs, ours = self.each(prefix, release)
        gap = self.compare(where, lambda: self._count_labels(theirs), theirs, ours)
        if gap:
            return gap
        referenced = self._referenced(theirs)

        def read(side: _Side, store: Any) -> list[_Outcome]:
            return [side.num_slots(store)] + [side.call(store, call) for call in self.reads]

        theirs, ours = self.each(prefix, read)
        gap = self.compare(where, lambda: ["num_slots", *map(str, self.reads)], theirs, ours)
        if gap:
            return gap
        slots = theirs[0][1] if theirs[0][0] == "ok" else 0
        stored = {key for key, seen in zip(self.keys, theirs[1:], strict=True) if seen[0] == "ok"}
        # Enough fillers to fill the free slots, then to evict every unreferenced key.
        fillers = min(max(0, int(slots) - len(stored)) + len(stored - referenced), 64)
        for count in range(1, fillers + 1):
            puts = self.fillers[:count]
            reads = self.reads + self.filler_reads[:count]

            def fill(
                side: _Side, store: Any, puts: list[Call] = puts, reads: list[Call] = reads
            ) -> list[_Outcome]:
                seen: list[_Outcome] = []
                for call in puts:
                    seen.append(side.call(store, call))
                    if seen[-1][0] != "ok":
                        return seen
                return seen + [side.call(store, call) for call in reads]

            theirs, ours = self.each(prefix, fill)
            labels = lambda puts=puts, reads=reads: [*map(str, puts), *map(str, reads)]  # noqa: E731
            gap = self.compare(f"{where}, then {count} filler put(s)", labels, theirs, ours)
            if gap:
                return gap
        return None

    def _count_labels(self, seen: list[_Outcome]) -> list[str]:
        """Labels for the release sequence as vLLM's store ran it (one key after another)."""
        labels: list[str] = []
        index = 0
        for key, call in zip(self.keys, self.releases, strict=True):
            for attempt in range(MAX_COUNT + 1):
                if index >= len(seen):
                    return labels
                labels.append(f"release {attempt + 1} of '{key}' ({call})")
                index += 1
                if seen[index - 1][0] != "ok":
                    break
        return labels

    def _referenced(self, seen: list[_Outcome]) -> set[str]:
        """The keys with a reference count, from vLLM's release sequence."""
        referenced: set[str] = set()
        index = 0
        for key in self.keys:
            for _ in range(MAX_COUNT + 1):
                if index >= len(seen):
                    return referenced
                index += 1
                if seen[index - 1][0] != "ok":
                    break
                referenced.add(key)
        return referenced

    def one(self, prefix: Sequence[Call], call: Call) -> Any:
        """``call``'s outcome on fresh stores of both sides that replayed ``prefix``."""

        def run(side: _Side, store: Any) -> list[_Outcome]:
            return [side.call(store, call)]

        return self.each(prefix, run)

    def run(self) -> str | None:
        done: list[Call] = []
        for number, call in enumerate(SCRIPT, start=1):
            where = f"{call} (call {number} of the script)"
            theirs, ours = self.one(done, call)
            gap = self.compare(where, list, theirs, ours)
            if gap:
                return gap
            if theirs[0][0] == "raised":
                break  # raised in both: nothing after it is compared
            done.append(call)
            gap = self.observe(done, f"after {call} (call {number} of the script)")
            if gap:
                return gap
            if number not in _PROBED_AFTER and number != len(SCRIPT):
                continue
            for probe in _PROBES:
                theirs, ours = self.one(done, probe)
                gap = self.compare(f"{probe} after call {number} of the script", list, theirs, ours)
                if gap:
                    return gap
        theirs, ours = self.each(
            done, lambda side, store: [side.call(store, call) for call in _AFTER_CLOSE]
        )
        labels = lambda: [str(call) for call in _AFTER_CLOSE]  # noqa: E731
        return self.compare(f"after call {len(done)} of the script", labels, theirs, ours)


def differential(
    theirs: Callable[..., Any],
    ours: Callable[..., Any],
    *,
    make_object: Callable[[str, bytes], Any],
    errors: Mapping[type, type] | None = None,
    names: tuple[str, str] = ("vLLM's store", "aostore's store"),
) -> Verdict:
    """Runs :data:`SCRIPT` through ``theirs`` (vLLM's store class, or any factory called as
    ``theirs(max_bytes=..., object_nbytes=...)``) and ``ours``; objects are
    ``make_object(key, payload)``. ``errors`` maps vLLM's exception classes to the classes the
    swap installs in their place. Never raises for a store's behaviour: a store that cannot be
    built, or any other failure of the differential itself, is reported in ``failed``."""
    started = time.perf_counter()
    sides = (_Side(names[0], theirs, make_object), _Side(names[1], ours, make_object))
    verdict = Verdict()
    try:
        verdict.difference = _Run(sides[0], sides[1], dict(errors or {})).run()
    except _Failed as error:
        verdict.failed = str(error)
    except Exception as error:
        verdict.failed = f"{type(error).__name__}: {error}"
    verdict.calls = sides[0].calls + sides[1].calls
    verdict.seconds = time.perf_counter() - started
    return verdict
