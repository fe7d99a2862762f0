"""W3: replay an RL rollout's traffic against a store, as vLLM's worker drives it.

A seeded generator makes the rollout of the seed's benchmark without a GPU: ``prompts`` prompts
x ``samples`` samples, prompts of 200-1,200 tokens shared by their samples, outputs of
1k-16k tokens, 16-token blocks. Requests run as the engine schedules them (at most
``max_running``, admitted while their KV blocks fit in ``kv_blocks``); every step the worker
makes one ``put``: the data of the blocks that became full in the previous step, retains of
the block keys that appeared in this step (before their data), and the releases of requests
that finished, each request's keys in reverse. A finished request's routed experts are read
back (as vLLM returns them with the output) before its release.

A step schedules at most ``max_num_batched_tokens`` tokens, as vLLM's scheduler does: one for
each running request, then the prompts of the requests it admits (a prompt whose blocks a
running sample of it holds is a prefix-cache hit: only its last tokens are computed). The default,
16,384, is vLLM 0.33's for the seed's GB200 node; ``0`` lifts the bound (every request that
fits the KV cache is prefilled in its first step, as W3 did before).

Simplifications, written down: admission reserves a request's final KV size, so no request is
preempted; a prompt that does not fit what is left of a step's tokens waits for the next step
whole (vLLM would start it in chunks; prompts are at most 1,200 tokens, so a step holds at most
one prompt's tokens fewer). Writer time is the sum of ``put`` wall time, measured on the calling
thread (the same work a writer thread does).

Each store compared is a :class:`Contender`: aostore, vLLM's own store (when ``vllm`` is
importable; :func:`vllm_contender` imports it lazily) and the pure-Python replica of it
(``aostore.bench.baseline``), each with its own ``BlockObject`` and background writer classes.
"""

from __future__ import annotations

import functools
import heapq
import importlib
import mmap
import random
import resource
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aostore._native import BlockObject

BLOCK_TOKENS = 16
# Distinct payload rows; a block's bytes are row (block id % POOL_ROWS), so reads can be checked.
POOL_ROWS = 1024


@dataclass(frozen=True)
class RolloutShape:
    """The rollout: sizes from the seed's GLM-4.5-Air benchmark."""

    prompts: int = 64
    samples: int = 8
    prompt_tokens: tuple[int, int] = (200, 1200)
    output_tokens: tuple[int, int] = (1024, 16384)
    kv_blocks: int = 152_129
    store_factor: float = 1.1
    max_running: int = 512
    max_num_batched_tokens: int = 16_384
    object_nbytes: int = 5_888
    rollout_steps: int = 1
    seed: int = 0

    @property
    def store_slots(self) -> int:
        return int(self.kv_blocks * self.store_factor)


@dataclass
class _Request:
    prompt: int
    prompt_len: int
    out_len: int
    keys: list[int]  # block ids, prompt blocks first
    prompt_blocks: int

    @property
    def blocks(self) -> int:
        return len(self.keys)


@dataclass
class Step:
    """One worker ``put``: block ids to publish, retain and release."""

    publish: list[int] = field(default_factory=list)
    retain: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    reads: list[list[int]] = field(default_factory=list)


def block_key(block_id: int) -> str:
    """The store key of a block, shaped like vLLM's routed-experts keys (80 bytes)."""
    return f"vllm-artifact/0/{block_id * 0x9E3779B97F4A7C15 % (1 << 256):064x}"


def generate(shape: RolloutShape) -> list[Step]:
    """The worker's puts, step by step, for ``shape.rollout_steps`` rollouts."""
    rng = random.Random(shape.seed)
    steps: dict[int, Step] = defaultdict(Step)
    next_block = 0
    clock = 0
    for _ in range(shape.rollout_steps):
        requests: list[_Request] = []
        for prompt in range(shape.prompts):
            prompt_len = rng.randint(*shape.prompt_tokens)
            prompt_blocks = prompt_len // BLOCK_TOKENS
            shared = list(range(next_block, next_block + prompt_blocks))
            next_block += prompt_blocks
            for _ in range(shape.samples):
                out_len = rng.randint(*shape.output_tokens)
                own = (prompt_len + out_len) // BLOCK_TOKENS - prompt_blocks
                keys = shared + list(range(next_block, next_block + own))
                next_block += own
                requests.append(_Request(prompt, prompt_len, out_len, keys, prompt_blocks))
        clock = _schedule(shape, requests, steps, clock)
    return [steps[s] for s in sorted(steps)]


def _schedule(
    shape: RolloutShape, requests: list[_Request], steps: dict[int, Step], start: int
) -> int:
    """Admits requests in order as KV room and the step's token budget allow; returns the step
    after the last release."""
    waiting = list(reversed(requests))
    finishing: list[tuple[int, int]] = []  # (release step, request index)
    reserved = 0
    running = 0
    samples_running: dict[int, int] = defaultdict(int)  # prompt -> its running samples
    published: set[int] = set()
    budget = shape.max_num_batched_tokens
    step = start
    last = start
    while waiting:
        while finishing and finishing[0][0] <= step:
            _, index = heapq.heappop(finishing)
            reserved -= requests[index].blocks
            running -= 1
            samples_running[requests[index].prompt] -= 1
        # Every running request decodes one token this step; prompts share what is left.
        tokens = running
        admitted = 0
        out_of_tokens = False
        while waiting and running < shape.max_running:
            request = waiting[-1]
            if reserved + request.blocks > shape.kv_blocks and running:
                break
            cost = _prefill_tokens(request, cached=samples_running[request.prompt] > 0)
            if budget and admitted and tokens + cost > budget:
                out_of_tokens = True
                break
            waiting.pop()
            tokens += cost
            admitted += 1
            reserved += request.blocks
            running += 1
            samples_running[request.prompt] += 1
            index = len(requests) - len(waiting) - 1
            release = _admit(request, step, steps, published)
            heapq.heappush(finishing, (release, index))
            last = max(last, release)
        if not waiting:
            break
        # Out of tokens, admission goes on in the next step; otherwise nothing else can start
        # until a running request releases its blocks.
        step = step + 1 if out_of_tokens else finishing[0][0]
    return last + 1


def _prefill_tokens(request: _Request, *, cached: bool) -> int:
    """The prompt tokens a request's prefill computes: all of them, or after a prefix-cache hit
    on its full prompt blocks only the rest (vLLM computes at least the last token)."""
    if not cached:
        return request.prompt_len
    hit = min(request.prompt_blocks * BLOCK_TOKENS, request.prompt_len - 1)
    return request.prompt_len - hit // BLOCK_TOKENS * BLOCK_TOKENS


def _admit(request: _Request, start: int, steps: dict[int, Step], published: set[int]) -> int:
    """Schedules one request from step ``start``; returns its release step."""
    prefill = steps[start]
    prompt_keys = request.keys[: request.prompt_blocks]
    prefill.retain.extend(prompt_keys)
    fresh = [k for k in prompt_keys if k not in published]
    published.update(fresh)
    steps[start + 1].publish.extend(fresh)
    for k in range(request.prompt_blocks, request.blocks):
        # Block k is full when token 16(k+1)-1 is generated, one token per step after prefill.
        full = start + 1 + BLOCK_TOKENS * (k + 1) - 1 - request.prompt_len
        steps[full].retain.append(request.keys[k])
        steps[full + 1].publish.append(request.keys[k])
    # The last token comes at step start + out_len; its block's data one step later, when the
    # request's routed experts are read for its output. The scheduler reports the finish in
    # the next step, whose put releases the keys.
    finish = start + request.out_len
    steps[finish + 1].reads.append(request.keys)
    steps[finish + 2].release.extend(reversed(request.keys))
    return finish + 2


VLLM_STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""vLLM's auxiliary-output store module: the store aostore replaces."""


def commit_pages(arena: mmap.mmap) -> None:
    """Commits every page of an mmap arena (in huge pages where the kernel allows), as
    aostore's ``prefault=True`` does, for stores that have no such option (vLLM's)."""
    madvise = getattr(arena, "madvise", None)
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if madvise is not None and huge is not None:
        madvise(huge)
    for offset in range(0, len(arena), mmap.PAGESIZE):
        arena[offset] = 0


@dataclass(frozen=True)
class Contender:
    """One store implementation a replay or benchmark measures, with the classes it ships.

    ``name`` keys results (``"aostore"``, ``"vllm"``, ``"replica"``); ``label`` is for people
    (``"vLLM 0.33.0"``). ``block_object(key, payload)`` makes a batch entry and
    ``background(store, max_pending_batches=n)`` a writer thread, both the implementation's own.
    """

    name: str
    label: str
    store_class: Any
    block_object: Any
    background: Any
    options: Mapping[str, Any] = field(default_factory=dict)
    takes_prefault: bool = True

    def build(self, *, max_bytes: int, object_nbytes: int, prefault: bool = False) -> Any:
        """A new store of ``max_bytes`` bytes of ``object_nbytes``-byte objects. ``prefault``
        commits the arena now: through the constructor where it has the option, otherwise
        by touching every page of the store's mmap arena (vLLM's ``_arena``)."""
        if self.takes_prefault:
            return self.store_class(
                max_bytes=max_bytes, object_nbytes=object_nbytes, prefault=prefault, **self.options
            )
        store = self.store_class(max_bytes=max_bytes, object_nbytes=object_nbytes, **self.options)
        if prefault:
            arena = getattr(store, "_arena", None)
            if not isinstance(arena, mmap.mmap):
                store.close()
                raise ValueError(f"{self.label}: cannot prefault a store without an mmap _arena")
            commit_pages(arena)
        return store


def aostore_contender(profile: str = "fail-closed") -> Contender:
    """aostore's store with ``profile``; ``"grow"`` is what the vLLM plugin builds for 0.33."""
    from aostore._background import BackgroundBlockObjectStore
    from aostore._store import BlockObjectStore

    return Contender(
        name="aostore",
        label="aostore",
        store_class=BlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
        options={"profile": profile},
    )


def plugin_contender() -> Contender:
    """aostore's store as vLLM builds its store once the aostore plugin is in: the class the
    plugin installs for vLLM 0.33 (``profile="grow"``), called as vLLM's worker calls it, with
    ``max_bytes`` and ``object_nbytes`` only (so whatever arena defaults it has apply).
    ``build(prefault=True)`` is refused: use :func:`aostore_contender` for that."""
    from aostore._background import BackgroundBlockObjectStore
    from aostore.vllm_plugin import GrowBlockObjectStore

    return Contender(
        name="aostore",
        label="aostore",
        store_class=GrowBlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
        takes_prefault=False,
    )


def replica_contender() -> Contender:
    """The pure-Python replica of vLLM's store (``aostore.bench.baseline``), behind aostore's Python
    writer thread (the same queue-and-thread design as vLLM's)."""
    from aostore._background import BackgroundBlockObjectStore
    from aostore.bench.baseline import PythonBlockObjectStore

    return Contender(
        name="replica",
        label="replica",
        store_class=PythonBlockObjectStore,
        block_object=BlockObject,
        background=BackgroundBlockObjectStore,
    )


def vllm_contender() -> tuple[Contender | None, str]:
    """vLLM's own store, imported now; ``(None, why)`` when vLLM cannot be imported.

    If the aostore plugin already replaced the module's classes, vLLM's originals (which the
    plugin keeps on the module) are used; a module that holds no vLLM class is refused.
    """
    try:
        module = importlib.import_module(VLLM_STORE_MODULE)
    except ModuleNotFoundError as error:
        if error.name == "vllm":
            return None, "not installed"
        if error.name is not None and VLLM_STORE_MODULE.startswith(error.name):
            return None, f"not usable (this vLLM has no {VLLM_STORE_MODULE})"
        return None, f"not importable ({type(error).__name__}: {error})"
    except Exception as error:  # vLLM's import can fail in many ways (torch, CUDA libraries)
        return None, f"not importable ({type(error).__name__}: {error})"
    names = ("BlockObjectStore", "BlockObject", "BackgroundBlockObjectStore")
    originals = getattr(module, "__aostore_originals__", None) or {}
    classes = {name: originals.get(name) or getattr(module, name, None) for name in names}
    for name, value in classes.items():
        if value is None or not getattr(value, "__module__", "").startswith("vllm"):
            return None, f"not usable ({VLLM_STORE_MODULE}.{name} is not vLLM's)"
    try:
        from importlib.metadata import version

        release = version("vllm")
    except Exception:
        release = str(getattr(importlib.import_module("vllm"), "__version__", "?"))
    return (
        Contender(
            name="vllm",
            label=f"vLLM {release}",
            store_class=classes["BlockObjectStore"],
            block_object=classes["BlockObject"],
            background=classes["BackgroundBlockObjectStore"],
            takes_prefault=False,
        ),
        "",
    )


def contenders(*, vllm: bool = True, profile: str = "fail-closed") -> tuple[list[Contender], str]:
    """aostore, vLLM's store (when ``vllm`` and importable) and the replica, in that order;
    with why vLLM is missing (``""`` when it is there)."""
    found, why = vllm_contender() if vllm else (None, "not requested")
    chosen = [aostore_contender(profile)]
    if found is not None:
        chosen.append(found)
    chosen.append(replica_contender())
    return chosen, why


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
    with ``block_object`` (the store's own ``BlockObject`` class), outside the timed ``put``."""
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
