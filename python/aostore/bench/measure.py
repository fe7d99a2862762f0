"""The W3 replay's measurement: :func:`run` drives one store through the schedule of
``aostore.bench.replay`` as vLLM's worker drives it and records each put's wall time beside its
time on the thread's CPU, page faults and context switches (:class:`ReplayResult`), so a put the
machine stalled is told from the store's own work (:func:`is_stall`); :func:`compare` replays
each contender on a fresh store, and :func:`writer_floor` and :func:`put_floor_us` give the
memcpy floors the targets of docs/workloads.md compare against.
"""

from __future__ import annotations

import functools
import mmap
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aostore import BlockObject
from aostore.bench.contenders import Contender, aostore_contender, commit_pages, replica_contender
from aostore.bench.replay import POOL_ROWS, RolloutShape, Step, block_key


@dataclass
class ReplayResult:
    """Figures of one store over the whole replay."""

    name: str
    puts: int
    objects: int
    writer_seconds: float
    put_ns: list[int]
    read_seconds: float
    objects_read: int
    evictions: int
    label: str = ""
    # Each put's time on the calling thread's CPU (user and system, page faults included), read
    # just outside its wall-time window. A put whose wall time is far above it was off the CPU:
    # descheduled, or its virtual CPU taken by the host, which no store causes.
    cpu_ns: list[int] = field(default_factory=list)
    # Each put's page faults on the calling thread, read as ``cpu_ns`` is: a put that ran long on
    # the CPU with faults was committing memory (a huge page is zeroed, maybe compacted, first).
    faults: list[int] = field(default_factory=list)
    # Each put's context switches on the calling thread, read as ``faults`` is: voluntary (the
    # thread waited in the kernel) and involuntary (another task took its CPU). A put off its
    # CPU with neither lost its virtual CPU to the host (steal), which the guest cannot see.
    voluntary: list[int] = field(default_factory=list)
    involuntary: list[int] = field(default_factory=list)

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.put_ns), q)) / 1e3

    @property
    def worst_us(self) -> float:
        """The slowest single put."""
        return max(self.put_ns, default=0) / 1e3

    @property
    def worst_cpu_us(self) -> float:
        """The put that ran longest on the thread's CPU: the store's worst work, with the
        machine's stalls (the thread off its CPU) left out."""
        return max(self.cpu_ns, default=0) / 1e3

    def stalled(self, i: int) -> bool:
        """Whether put ``i`` was stalled by the machine: see :func:`is_stall`."""
        return bool(self.cpu_ns) and is_stall(self.put_ns[i], self.cpu_ns[i])

    @property
    def stalls(self) -> list[int]:
        """The puts the machine stalled, in order."""
        return [i for i in range(len(self.cpu_ns)) if self.stalled(i)]

    @property
    def store_ns(self) -> list[int]:
        """What the store did in each put: its wall time, or its time on the CPU where the
        machine stalled it (a stalled put's CPU time still holds its page faults)."""
        if not self.cpu_ns:
            return list(self.put_ns)
        return [
            cpu if is_stall(wall, cpu) else wall
            for wall, cpu in zip(self.put_ns, self.cpu_ns, strict=True)
        ]

    @property
    def worst_index(self) -> int:
        """The slowest put, by wall time."""
        return max(range(len(self.put_ns)), key=self.put_ns.__getitem__, default=0)

    @property
    def worst_store_index(self) -> int:
        """The slowest put by what the store did (:attr:`store_ns`)."""
        done = self.store_ns
        return max(range(len(done)), key=done.__getitem__, default=0)

    @property
    def worst_store_us(self) -> float:
        """The slowest put with the machine's stalls left out (:attr:`store_ns`)."""
        return max(self.store_ns, default=0) / 1e3

    @property
    def writer_store_seconds(self) -> float:
        """Writer time with the machine's stalls left out: the sum of :attr:`store_ns`."""
        return sum(self.store_ns) / 1e9

    def stall_cause(self, i: int) -> str:
        """Why put ``i`` was off its CPU, from its context switches."""
        if not self.involuntary or not self.voluntary:
            return "off its CPU"
        if self.involuntary[i]:
            return f"descheduled: {self.involuntary[i]} involuntary context switch(es)"
        if self.voluntary[i]:
            return f"waiting in the kernel: {self.voluntary[i]} voluntary context switch(es)"
        return "its virtual CPU taken by the host: no context switch"


STALL_MIN_NS = 100_000
"""A put with less than this much time off its CPU is never called stalled."""


def is_stall(wall_ns: int, cpu_ns: int) -> bool:
    """A put the machine stalled: at least a third of its wall time, and at least 0.1 ms, off
    the calling thread's CPU. The replay runs one thread and a store's put does its work on it,
    so that time is not the store's work: the thread was descheduled (another task had the
    CPU), its virtual CPU was taken by the host, or it waited in the kernel
    (:meth:`ReplayResult.stall_cause` tells which from its context switches)."""
    off = wall_ns - cpu_ns
    return off >= STALL_MIN_NS and 3 * off >= wall_ns


def pool(object_nbytes: int, seed: int = 0) -> np.ndarray:
    """Payload rows: random routed-expert-like bytes."""
    return np.random.default_rng(seed).integers(0, 128, (POOL_ROWS, object_nbytes), dtype=np.uint8)


def run(
    name: str,
    store: Any,
    steps: list[Step],
    rows: np.ndarray,
    *,
    as_bytes: bool,
    progress: Callable[[int, int], None] | None = None,
    block_object: Callable[[str, Any], Any] = BlockObject,
    label: str = "",
) -> ReplayResult:
    """Drives ``store`` through ``steps``. Payloads are ``bytes`` when ``as_bytes``, as vLLM's
    worker hands them to any store (its ``publish_routed_experts`` calls ``tobytes()`` outside
    the timed ``put``), or numpy rows (aostore's own helper) otherwise. Batch entries are made
    with ``block_object`` (the store's own ``BlockObject`` class), outside the timed ``put``.
    Writer time is the sum of ``put`` wall time, measured on the calling thread (the same work
    a writer thread does)."""
    payloads: list[Any] = [row.tobytes() for row in rows] if as_bytes else list(rows)
    keys: dict[int, str] = {}

    def key(block: int) -> str:
        text = keys.get(block)
        if text is None:
            text = keys[block] = block_key(block)
        return text

    put_ns: list[int] = []
    cpu_ns: list[int] = []
    faults: list[int] = []
    voluntary: list[int] = []
    involuntary: list[int] = []
    objects = 0
    read_ns = 0
    objects_read = 0
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns
    usage = resource.getrusage
    thread = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    width = rows.shape[1]
    for i, step in enumerate(steps):
        batch = [block_object(key(b), payloads[b % POOL_ROWS]) for b in step.publish]
        retains = [key(b) for b in step.retain]
        releases = [key(b) for b in step.release]
        f0 = usage(thread)
        c0 = cpu_clock()
        t0 = clock()
        store.put(batch, retain_keys=retains, release_keys=releases)
        t1 = clock()
        cpu_ns.append(cpu_clock() - c0)
        f1 = usage(thread)
        faults.append(f1.ru_minflt - f0.ru_minflt + f1.ru_majflt - f0.ru_majflt)
        voluntary.append(f1.ru_nvcsw - f0.ru_nvcsw)
        involuntary.append(f1.ru_nivcsw - f0.ru_nivcsw)
        put_ns.append(t1 - t0)
        objects += len(batch)
        for b in step.release:
            keys.pop(b, None)
        for request_keys in step.reads:
            wanted = [key(b) for b in request_keys]
            t0 = clock()
            data = store.get_concatenated(wanted)
            read_ns += clock() - t0
            objects_read += len(wanted)
            last = request_keys[-1]
            got = data[-width:]
            assert got == bytes(payloads[last % POOL_ROWS]), f"replay read mismatch at {last}"
        if progress is not None and (i % 512 == 0 or i == len(steps) - 1):
            progress(i + 1, len(steps))
    stats = store.stats() if hasattr(store, "stats") else {}
    return ReplayResult(
        name=name,
        puts=len(put_ns),
        objects=objects,
        writer_seconds=sum(put_ns) / 1e9,
        put_ns=put_ns,
        read_seconds=read_ns / 1e9,
        objects_read=objects_read,
        evictions=int(stats.get("evictions", -1)),
        label=label or name,
        cpu_ns=cpu_ns,
        faults=faults,
        voluntary=voluntary,
        involuntary=involuntary,
    )


def compare(
    shape: RolloutShape,
    steps: list[Step],
    rows: np.ndarray,
    *,
    prefault: bool,
    progress: Callable[[str, int, int], None] | None = None,
    stores: Sequence[Contender] | None = None,
) -> list[ReplayResult]:
    """Replays ``steps`` on a fresh store of each contender in turn (default: aostore and the
    pure-Python replica), all handed the ``bytes`` that vLLM's worker makes; one result each,
    in order. ``prefault`` commits each arena before the replay."""
    chosen = list(stores) if stores is not None else [aostore_contender(), replica_contender()]
    results = []
    for contender in chosen:
        store = contender.build(
            max_bytes=shape.store_slots * shape.object_nbytes,
            object_nbytes=shape.object_nbytes,
            prefault=prefault,
        )
        report = None if progress is None else functools.partial(progress, contender.label)
        try:
            results.append(
                run(
                    contender.name,
                    store,
                    steps,
                    rows,
                    as_bytes=True,
                    progress=report,
                    block_object=contender.block_object,
                    label=contender.label,
                )
            )
        finally:
            store.close()
    return results


def writer_floor(
    shape: RolloutShape, steps: Sequence[Step], rows: np.ndarray, prefault: bool
) -> float:
    """T5's memcpy floor, in seconds: numpy copying each step's published objects into an mmap
    arena of the store's size (fresh, or committed as ``prefault=True`` commits a store's),
    slot after slot and round again. Each step's batch is gathered untimed. (The same
    measurement as ``benches/bench.py``'s W3 floor.)"""
    slots, nbytes = shape.store_slots, shape.object_nbytes
    raw = mmap.mmap(-1, slots * nbytes)
    if prefault:
        commit_pages(raw)
    arena = np.frombuffer(raw, dtype=np.uint8).reshape(slots, nbytes)
    position = 0
    total = 0
    clock = time.perf_counter_ns
    for step in steps:
        if not step.publish:
            continue
        batch = rows[[b % POOL_ROWS for b in step.publish]]
        t0 = clock()
        done = 0
        while done < len(batch):
            n = min(len(batch) - done, slots - position)
            arena[position : position + n] = batch[done : done + n]
            done += n
            position = (position + n) % slots
        total += clock() - t0
    del arena
    raw.close()
    return total / 1e9


def put_floor_us(step: Step, rows: np.ndarray) -> float:
    """The memcpy floor of one put's objects, in µs: numpy copying them into the start of a
    committed arena, best of five. No store can put those bytes faster."""
    if not step.publish:
        return 0.0
    batch = rows[[b % POOL_ROWS for b in step.publish]]
    raw = mmap.mmap(-1, batch.nbytes)
    commit_pages(raw)
    arena = np.frombuffer(raw, dtype=np.uint8).reshape(batch.shape)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        arena[:] = batch
        best = min(best, (time.perf_counter_ns() - t0) / 1e3)
    del arena
    raw.close()
    return best
