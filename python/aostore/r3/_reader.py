"""The trainer's side: read R3 rows by reference (``aostore.r3.fetch``).

Forks (docs/r3-reference.md, "Forks"): a reader's leases are its process's alone. They are
locks on an open of the arena that only this process's descriptor table holds: views are mapped
through another open, which holds no lock, so a forked child that inherits the mappings keeps
no lease of the parent's alive, and the child closes its copy of the parent's descriptor. At a
fork the child gets an open of its own, already holding a read lock on every slot the parent
leased then: its inherited views keep their rows under its own leases, which its releases and
its exit end, and the parent's leases end with the parent's alone. A reader's Python lock is
made anew in the child.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from .._native import copy_pages
from . import errors, leases, offnode
from . import format as fmt
from .arena import remove_if_dead

DEFAULT_RENEWAL = 600.0
OWNER_ENV = "AOSTORE_R3_OWNER"
"""The uid of the frontend's user, for a reader of another user (default: the reader's)."""
LIVENESS_POLL = 1.0
"""Seconds between looks at whether the frontends of the arenas a reader holds open still
live (the arenas of a batch are looked at on every fetch)."""


@dataclass
class ReaderStats:
    """What a reader did (counters since it opened)."""

    fetches: int = 0
    references: int = 0
    """References read (rows strings not counted)."""
    bytes: int = 0
    """Bytes of rows returned from arenas."""
    misses: int = 0
    """References whose rows were gone."""
    leases: int = 0
    """Slots leased now (views alive)."""
    arenas_let_go: int = 0
    """Arenas closed because their frontend was gone."""
    offnode_references: int = 0
    """Distinct references of other nodes read through Mooncake."""
    offnode_bytes: int = 0
    """Bytes read through Mooncake (headers included)."""
    offnode_marks_failed: int = 0
    """Batches whose reads the read channel could not tell the frontend (their rows stay
    until their deadline)."""


STREAM_FROM = 32 << 20
"""``out=`` batches of at least this many bytes are copied past the cache (more than a
last-level cache holds: the caller's next read of them misses it either way)."""

_MAP_FIXED = 0x10  # Linux, x86-64 and aarch64 (the mmap module does not export it)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]

Run = tuple[int, int]
_Key = tuple[bytes, int, int, int]
"""A reference's arena, slot, generation and the bytes of its rows."""


class _OpenArena:
    """One arena as a reader sees it: an open that maps (the slot table, written for the read
    flag and renewals; views; ``out=`` copies) and an open that holds this process's leases,
    which nothing maps."""

    def __init__(self, arena: bytes, owner: int) -> None:
        self.path = fmt.path(arena)
        fd = leases.open_arena_file(self.path, owner)
        lock_fd = -1
        try:
            header = self._header(fd, arena)
            self.slots = int(header["slots"])
            self.data_offset = int(header["data_offset"])
            self.data_size = int(header["data_size"])
            self.pages = self.data_size // fmt.PAGE
            table = mmap.mmap(
                fd,
                self.data_offset,
                mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE,
            )
            lock_fd = leases.reopen(fd)
        except BaseException:
            if lock_fd >= 0:
                os.close(lock_fd)
            os.close(fd)
            raise
        self.fd = fd
        self.lock_fd = lock_fd
        self.child_fd = -1  # an open made at a fork, for the child's leases
        self.table = table
        self.records = np.frombuffer(table, fmt.SLOT, self.slots, int(header["slots_offset"]))
        capacity = int(header["log_capacity"])
        self.log = np.frombuffer(table, fmt.LOG_ENTRY, capacity, int(header["log_offset"]))
        self.log_tail = np.frombuffer(table, "<u8", 1, fmt.LOG_TAIL)
        self.runs = np.frombuffer(table, fmt.RUN, self.pages, int(header["runs_offset"]))
        self.leased: dict[int, int] = {}
        self.closed = False
        self._rows: memoryview | None = None

    def _header(self, fd: int, arena: bytes) -> np.ndarray:
        """The header, checked against the reference and the file: nothing it names lies past
        the file's end (a mapping there would be a SIGBUS, not an error)."""
        raw = os.pread(fd, fmt.HEADER.itemsize, 0)
        if len(raw) < fmt.HEADER.itemsize:
            raise errors.ReferenceGone(f"{self.path} is cut short: not an R3 arena")
        header: np.ndarray = np.frombuffer(raw, fmt.HEADER)[0]
        if header["magic"] != fmt.MAGIC:
            raise errors.ReferenceGone(f"{self.path} is not an R3 arena")
        version = int(header["version"])
        if version != fmt.ARENA_VERSION:
            raise errors.ForeignReference(
                f"its R3 arena is of format {version}; this aostore reads format "
                f"{fmt.ARENA_VERSION} (the frontend and the reader run different aostore "
                "releases)"
            )
        if fmt.ident(header["arena"]) != arena:
            raise errors.ReferenceGone(f"{self.path} is not that reference's arena")
        slots, capacity = int(header["slots"]), int(header["log_capacity"])
        offsets = [int(header[name]) for name in ("slots_offset", "log_offset", "runs_offset")]
        data_offset, data_size = int(header["data_offset"]), int(header["data_size"])
        ends = [
            offsets[0] + slots * fmt.SLOT.itemsize,
            offsets[1] + capacity * fmt.LOG_ENTRY.itemsize,
            offsets[2] + data_size // fmt.PAGE * fmt.RUN.itemsize,
        ]
        well_formed = (
            int(header["slot_size"]) == fmt.SLOT.itemsize
            and 0 < slots <= 1 << 16
            and 0 < capacity <= 1 << 16
            and fmt.PAGE <= offsets[0]
            and ends[0] <= offsets[1]
            and ends[1] <= offsets[2]
            and ends[2] <= data_offset
            and all(o % fmt.PAGE == 0 for o in (*offsets, data_offset, data_size))
            and data_offset + data_size <= os.fstat(fd).st_size
        )
        if not well_formed:
            raise errors.ReferenceGone(f"{self.path}'s header does not describe an R3 arena")
        return header

    def alive(self) -> bool:
        """Whether the arena's frontend holds its liveness lock."""
        return leases.held_by_another(self.lock_fd, leases.LIVE)

    def rows(self) -> memoryview:
        """Every slot's bytes, mapped once for ``out=`` copies (read-only; pages are mapped as
        they are first read and stay mapped for later batches)."""
        if self._rows is None:
            self._rows = memoryview(
                mmap.mmap(
                    self.fd,
                    self.data_size,
                    mmap.MAP_SHARED,
                    mmap.PROT_READ,
                    offset=self.data_offset,
                )
            )
        return self._rows

    def take(self, slot: int, generation: int, nbytes: int) -> tuple[Run, ...]:
        """Lease ``slot`` if it still holds that generation's rows; their page runs."""
        if slot >= self.slots:
            raise errors.ForeignReference(f"a malformed aostore reference: slot {slot}")
        if not leases.lock(self.lock_fd, slot, leases.READ):
            # The frontend holds it: it is giving these rows up, or writing others there.
            raise errors.ReferenceGone("its rows are gone: the frontend gave the slot up")
        record = self.records[slot]
        try:
            if int(record["generation"]) != generation:
                raise errors.ReferenceGone(
                    "its rows are gone: read and evicted for newer ones, or expired unread"
                )
            if int(record["nbytes"]) != nbytes:
                raise errors.ForeignReference("a malformed aostore reference: its rows' size")
            runs = self._runs_of(record, nbytes)
        except BaseException:
            if slot not in self.leased:
                leases.lock(self.lock_fd, slot, leases.UNLOCK)
            raise
        self.leased[slot] = self.leased.get(slot, 0) + 1
        return runs

    def _runs_of(self, record: np.ndarray, nbytes: int) -> tuple[Run, ...]:
        """A slot's page runs from the run table, each checked to lie in the data."""
        want = max(1, -(-nbytes // fmt.PAGE))
        count, page = int(record["runs"]), int(record["page"])
        runs: list[Run] = []
        total = 0
        for _ in range(min(count, want)):
            if page >= self.pages:
                break
            entry = self.runs[page]
            pages = int(entry["pages"])
            if pages == 0 or page + pages > self.pages:
                break
            runs.append((page, pages))
            total += pages
            page = int(entry["next"])
        if total != want or len(runs) != count or page != fmt.NO_RUN:
            raise errors.ReferenceGone("its arena's slot table is not the frontend's")
        return tuple(runs)

    def mark_read(self, taken: list[tuple[int, int]]) -> None:
        """Set the read flag of the ``(slot, generation)`` pairs first read now, and tell the
        frontend through the read log (so read rows can make room without it looking at every
        slot). The log's lock is only tried: a reader never waits long on another; an entry
        left out only delays when those rows may go (their deadline)."""
        first = []
        for slot, generation in taken:
            record = self.records[slot]
            if not record["read"]:
                record["read"] = 1
                first.append((slot, generation))
        if not first:
            return
        for _ in range(100):
            if leases.lock_byte(self.lock_fd, leases.LOG, leases.WRITE):
                break
            time.sleep(0.0001)
        else:
            return
        try:
            tail = int(self.log_tail[0])
            capacity = len(self.log)
            for slot, generation in first:
                entry = self.log[tail % capacity]
                entry["slot"] = slot
                entry["generation"] = generation
                tail += 1
            self.log_tail[0] = tail
        finally:
            leases.lock_byte(self.lock_fd, leases.LOG, leases.UNLOCK)

    def give_back(self, slot: int) -> None:
        count = self.leased.pop(slot) - 1
        if count:
            self.leased[slot] = count
        elif self.lock_fd >= 0:
            leases.lock(self.lock_fd, slot, leases.UNLOCK)
        if self.closed and not self.leased:
            self._close_locks()

    def close(self) -> None:
        """Close the arena's mappings and files. Leases of views still alive last until those
        views go (their rows must not change under them)."""
        if self.closed:
            return
        self.closed = True
        del self.records, self.log, self.log_tail, self.runs
        _close_mapping(self.table)
        if self._rows is not None:
            mapped = self._rows.obj
            self._rows.release()
            _close_mapping(mapped)  # type: ignore[arg-type]
            self._rows = None
        os.close(self.fd)
        self.fd = -1
        if not self.leased:
            self._close_locks()

    def _close_locks(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    # Forks (the module's docstring) ------------------------------------------------------

    def before_fork(self) -> None:
        """In the parent, before a fork: an open for the child, leasing what this one does."""
        if self.leased and self.lock_fd >= 0:
            self.child_fd = leases.reopen(self.lock_fd)
            for slot in self.leased:
                # The parent's read lock stands on each: a read lock of the child's is granted.
                leases.lock(self.child_fd, slot, leases.READ)

    def after_fork_in_parent(self) -> None:
        if self.child_fd >= 0:
            os.close(self.child_fd)  # the child's copy alone holds its leases
            self.child_fd = -1

    def after_fork_in_child(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # the parent's leases: not this process's to end or keep
            self.lock_fd = -1
        if self.child_fd >= 0:
            self.lock_fd, self.child_fd = self.child_fd, -1
        elif not self.closed:
            try:
                self.lock_fd = leases.reopen(self.fd)
            except OSError:
                self.closed = True  # unusable here: the reader opens it anew when asked
        if self.lock_fd < 0:
            self.leased.clear()


def _end_leases(mappings: list[tuple[mmap.mmap, Any]]) -> None:
    """Unmap each view's mapping and end its lease; a mapping still viewed through another
    buffer keeps its lease until that view goes (its finalizer ends it then)."""
    for mapped, finalizer in mappings:
        try:
            mapped.close()
        except BufferError:
            continue
        finalizer()


def _close_mapping(mapped: mmap.mmap) -> None:
    """Unmap now, or when the last view of it goes (one kept by a caught exception's frame)."""
    try:
        mapped.close()
    except BufferError:
        pass


def _map_runs(arena: _OpenArena, runs: tuple[Run, ...], length: int) -> mmap.mmap:
    """A read-only mapping of ``length`` bytes of a slot's rows, its runs laid side by side
    (one mapping of the file for one run; for several, a reservation with each run mapped over
    its part, ``MAP_FIXED``: closing the reservation unmaps them all)."""
    flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
    if len(runs) == 1:
        first = runs[0][0]
        return mmap.mmap(
            arena.fd,
            max(length, 1),
            flags,
            mmap.PROT_READ,
            offset=arena.data_offset + first * fmt.PAGE,
        )
    total = sum(pages for _, pages in runs) * fmt.PAGE
    region = mmap.mmap(-1, total, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ)
    try:
        base = np.frombuffer(region, np.uint8).ctypes.data
        at = 0
        for first, pages in runs:
            address = base + at
            got = _libc.mmap(
                address,
                pages * fmt.PAGE,
                mmap.PROT_READ,
                flags | _MAP_FIXED,
                arena.fd,
                arena.data_offset + first * fmt.PAGE,
            )
            if got != address:
                error = ctypes.get_errno()
                raise OSError(error, f"mapping a run of R3 rows: {os.strerror(error)}")
            at += pages * fmt.PAGE
    except BaseException:
        region.close()
        raise
    return region


def _parts(rows: memoryview, runs: tuple[Run, ...], start: int, end: int) -> list[memoryview]:
    """The bytes ``start:end`` of a slot's rows, as slices of the arena's data, run by run."""
    parts = []
    at = 0
    for first, pages in runs:
        size = pages * fmt.PAGE
        a, b = max(start, at), min(end, at + size)
        if a < b:
            parts.append(rows[first * fmt.PAGE + a - at : first * fmt.PAGE + b - at])
        at += size
    return parts


class Fetched(Sequence[np.ndarray]):
    """The rows of a batch of references, in order: read-only views on the frontend's shared
    memory, each leased while this process lives, until :meth:`release` or until no array of
    the batch is left; or, with ``out=``, views of the caller's buffer (no lease)."""

    def __init__(self, arrays: list[np.ndarray], mappings: list[tuple[mmap.mmap, Any]]) -> None:
        self._arrays: list[np.ndarray] | None = arrays
        self._mappings = mappings  # (mapping, the finalizer that ends its lease)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[np.ndarray]: ...
    def __getitem__(self, index: int | slice) -> np.ndarray | Sequence[np.ndarray]:
        return self._live()[index]

    def __len__(self) -> int:
        return len(self._live())

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._live())

    @property
    def released(self) -> bool:
        return self._arrays is None

    def release(self) -> None:
        """End the batch's leases now. Every array of the batch must be dropped first (a view
        outlives no lease): otherwise ``BufferError``, and nothing changes."""
        arrays = self._live()
        # Each array is held by this list and getrefcount's argument; a view of it holds it
        # too (its base).
        held = [i for i in range(len(arrays)) if sys.getrefcount(arrays[i]) > 2]
        if held:
            raise BufferError(
                f"arrays {held[:8]} of this batch are still referenced (or viewed): drop them "
                "before release(), or fetch with out= to keep rows"
            )
        del arrays
        self._end()

    def _end(self) -> None:
        self._arrays = None
        _end_leases(self._mappings)
        self._mappings = []

    def __enter__(self) -> Fetched:
        return self

    def __exit__(self, *_: Any) -> None:
        if self._arrays is not None:
            self._end()

    def _live(self) -> list[np.ndarray]:
        if self._arrays is None:
            raise ValueError("this batch was released")
        return self._arrays


class Reader:
    """Reads R3 rows by reference, from this node's arenas and, with a Mooncake client
    configured, other nodes'; ``aostore.r3.fetch`` uses one per process. ``owner``: the uid of
    the frontend's user (default ``AOSTORE_R3_OWNER``, else this process's): an arena's file of
    any other user is refused. ``mooncake``: this reader's Mooncake client config (a
    ``MooncakeConfig``, a mapping or a JSON file's path; default ``AOSTORE_R3_MOONCAKE``;
    ``local_hostname`` required), for other nodes' references; without one they are
    ``OtherNode``. ``publish_wait``: seconds an off-node read waits for an object not in
    Mooncake yet whose arena's marker is (its publication in flight)."""

    def __init__(
        self,
        owner: int | None = None,
        *,
        mooncake: Any = None,
        publish_wait: float = offnode.PUBLISH_WAIT,
    ) -> None:
        if owner is None:
            owner = int(os.environ.get(OWNER_ENV, os.getuid()))
        self.owner = owner
        config = offnode.reader_config(mooncake)
        self._offnode = None if config is None else offnode.OffNodeReader(config, wait=publish_wait)
        self._arenas: dict[bytes, _OpenArena] = {}
        self._lock = threading.RLock()
        self._polled = time.monotonic()
        self.stats = ReaderStats()
        self.closed = False
        _readers.add(self)

    def fetch(
        self,
        references: Sequence[Any],
        *,
        start: int | Sequence[int] | None = None,
        out: np.ndarray | None = None,
    ) -> Fetched:
        """The rows of ``references`` (each the HTTP field's string, or the array
        ``CompletionOutput.routed_experts`` holds; vLLM's rows in either form are read too),
        from row ``start`` on (one for all, or one each; default: all rows). ``start`` counts
        the rows of the reference as vLLM sent them: row 0 is vLLM's first row, the token
        ``routed_experts_prompt_start`` of the sequence where vLLM sets that above 0. With
        ``out``, copied into it (every row of the batch in order, its shape and dtype exactly)
        and not leased; a batch that fails leaves ``out``'s contents undefined (other nodes'
        rows are read straight into it)."""
        if isinstance(references, (str, np.ndarray)):
            raise TypeError("references is a sequence of references (a list of one for one)")
        items = [fmt.parse(value) for value in references]
        starts = self._starts(start, len(items))
        plans = [self._plan(item, first) for item, first in zip(items, starts, strict=True)]
        if out is not None:
            _check_out(out, plans)
        # The batch's distinct references, each with its first place: a reference repeated is
        # leased and read once, and viewed (or copied) at each of its places.
        keys: list[_Key | None] = []
        far: list[bool] = []  # another node's (the same key may be both: a reference moved)
        distinct: dict[_Key, int] = {}  # this node's
        remote: dict[_Key, int] = {}  # other nodes', read through Mooncake
        here = leases.boot_id()
        unseen: dict[bytes, bool] = {}  # this node's arenas this process cannot see
        for index, (item, (dtype, shape, first)) in enumerate(zip(items, plans, strict=True)):
            is_far = item.dtype.names is not None and fmt.ident(item["boot"]) != here
            if not is_far and item.dtype.names is not None and self._offnode is not None:
                # This node's, in a /dev/shm this process does not share (another container):
                # through Mooncake too.
                ident = fmt.ident(item["arena"])
                if ident not in unseen:
                    unseen[ident] = ident not in self._arenas and not os.path.exists(
                        fmt.path(ident)
                    )
                is_far = unseen[ident]
            far.append(is_far)
            if item.dtype.names is None:
                keys.append(None)
                continue
            row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            key = (
                fmt.ident(item["arena"]),
                int(item["slot"]),
                int(item["generation"]),
                (first + shape[0]) * row,
            )
            keys.append(key)
            (remote if far[-1] else distinct).setdefault(key, index)
        got: dict[_Key, np.ndarray] = {}
        if remote:
            if self.closed:
                raise ValueError("this reader is closed")
            # Before any lease here: a failure there leaves nothing taken.
            assert self._offnode is not None  # _plan refused them otherwise
            got = self._offnode.read(remote, _places(out, plans, keys, remote))
            self.stats.offnode_references += len(got)
            self.stats.offnode_bytes += sum(offnode.HEADER.itemsize + k[3] for k in got)
        with self._lock:
            if self.closed:
                raise ValueError("this reader is closed")
            self._poll()
            opened: dict[bytes, _OpenArena] = {}
            taken: dict[_Key, tuple[Run, ...]] = {}
            try:
                # Every lease of the batch, of every arena, before any byte is read.
                for key, index in distinct.items():
                    ident, slot, generation, nbytes = key
                    try:
                        arena = opened.get(ident)
                        if arena is None:
                            arena = opened[ident] = self._open(ident)
                        taken[key] = arena.take(slot, generation, nbytes)
                    except errors.ReferenceGone as gone:
                        self.stats.misses += 1
                        raise errors.ReferenceGone(str(gone), index) from None
            except BaseException:
                for ident, slot, _, _ in taken:
                    opened[ident].give_back(slot)
                raise
            for ident, arena in opened.items():
                # Only once every lease of the batch is taken.
                arena.mark_read([(key[1], key[2]) for key in taken if key[0] == ident])
            if got and self._offnode is not None and not self._offnode.mark_read(list(got)):
                self.stats.offnode_marks_failed += 1
            self.stats.fetches += 1
            self.stats.references += sum(key is not None for key in keys)
            self._count_leases()
        mappings: list[tuple[mmap.mmap, Any]] = []
        arrays = self._read(opened, items, plans, keys, far, taken, got, out, mappings)
        return Fetched(arrays, mappings)

    def renew(self, references: Sequence[Any], seconds: float = DEFAULT_RENEWAL) -> None:
        """Keep unread references' rows at least ``seconds`` more (read ones are the readers':
        their leases keep them)."""
        if not (seconds > 0 and seconds < float("inf")):
            raise ValueError(f"renew by a positive, finite number of seconds, not {seconds}")
        items = [fmt.parse(value) for value in references]
        here = leases.boot_id()
        far: dict[tuple[bytes, int, int], int] = {}  # renewed through Mooncake
        for index, item in enumerate(items):
            if item.dtype.names is None:
                continue
            ident = fmt.ident(item["arena"])
            elsewhere = fmt.ident(item["boot"]) != here
            if elsewhere and self._offnode is None:
                raise errors.OtherNode(
                    "renew of a reference from another node (or an earlier boot of this one): "
                    f"set {offnode.SETTING} (a Mooncake client config) to renew it through "
                    "Mooncake"
                )
            unseen = ident not in self._arenas and not os.path.exists(fmt.path(ident))
            if elsewhere or (self._offnode is not None and unseen):
                far.setdefault((ident, int(item["slot"]), int(item["generation"])), index)
        if far:
            if self.closed:
                raise ValueError("this reader is closed")
            assert self._offnode is not None
            self._offnode.renew(far, seconds)
        with self._lock:
            if self.closed:
                raise ValueError("this reader is closed")
            self._poll()
            for index, item in enumerate(items):
                if item.dtype.names is None:
                    continue
                if (fmt.ident(item["arena"]), int(item["slot"]), int(item["generation"])) in far:
                    continue
                arena = self._open(fmt.ident(item["arena"]))
                slot = int(item["slot"])
                if slot >= arena.slots:
                    raise errors.ForeignReference(f"a malformed aostore reference: slot {slot}")
                if not leases.lock(arena.lock_fd, slot, leases.READ):
                    raise errors.ReferenceGone(
                        "its rows are gone: the frontend gave the slot up", index
                    )
                try:
                    record = arena.records[slot]
                    if int(record["generation"]) != int(item["generation"]):
                        self.stats.misses += 1
                        raise errors.ReferenceGone("its rows are gone: evicted or expired", index)
                    record["deadline"] = max(float(record["deadline"]), fmt.now() + seconds)
                finally:
                    if slot not in arena.leased:
                        leases.lock(arena.lock_fd, slot, leases.UNLOCK)

    @property
    def reads_other_nodes(self) -> bool:
        """Whether this reader has a Mooncake client for other nodes' references."""
        return self._offnode is not None

    def close(self) -> None:
        """Close every arena this reader opened; fetching again is an error. Views still alive
        keep their leases until they go."""
        with self._lock:
            self.closed = True
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()
            if self._offnode is not None:
                self._offnode.close()

    def _open(self, arena: bytes) -> _OpenArena:
        """The arena, opened once; ``ReferenceGone`` if its frontend is gone (and then this
        reader lets go of it: a restarted frontend's old arena pins nothing here)."""
        opened = self._arenas.get(arena)
        if opened is None or opened.closed:
            opened = self._arenas[arena] = _OpenArena(arena, self.owner)
        if not opened.alive():
            self._let_go(arena)
            raise errors.ReferenceGone(
                "its R3 arena's frontend is gone (it exited or restarted): its rows went with it"
            )
        return opened

    def _poll(self) -> None:
        """Let go of the arenas whose frontend is gone, at most once a :data:`LIVENESS_POLL`."""
        now = time.monotonic()
        if now - self._polled < LIVENESS_POLL:
            return
        self._polled = now
        for arena, opened in list(self._arenas.items()):
            if not opened.alive():
                self._let_go(arena)

    def _let_go(self, arena: bytes) -> None:
        opened = self._arenas.pop(arena)
        opened.close()
        remove_if_dead(opened.path)  # the frontend was killed: its file pins the budget
        self.stats.arenas_let_go += 1

    def _count_leases(self) -> None:
        self.stats.leases = sum(len(a.leased) for a in self._arenas.values())

    @staticmethod
    def _starts(start: int | Sequence[int] | None, n: int) -> list[int | None]:
        if start is None or isinstance(start, (int, np.integer)):
            return [None if start is None else int(start)] * n
        starts = [int(s) for s in start]
        if len(starts) != n:
            raise ValueError(f"{len(starts)} starts for {n} references")
        return list(starts)

    def _plan(
        self, item: np.ndarray, start: int | None
    ) -> tuple[np.dtype[Any], tuple[int, ...], int]:
        """The rows' dtype, their shape from ``start`` on, and the first row to read."""
        if item.dtype.names is None:
            dtype, shape, token_start = item.dtype, item.shape, 0
        else:
            if self._offnode is None and fmt.ident(item["boot"]) != leases.boot_id():
                raise errors.OtherNode(
                    "a reference from another node (or an earlier boot of this one): its rows "
                    f"are in that node's shared memory; set {offnode.SETTING} (a Mooncake "
                    "client config) to read them through Mooncake"
                )
            dtype, shape = fmt.rows_of(item)
            token_start = int(item["token_start"])
        first = 0
        if start is not None:
            first = start - token_start
            if not 0 <= first <= shape[0]:
                raise ValueError(
                    f"start {start} is outside the rows ({token_start} to "
                    f"{token_start + shape[0]}; start counts rows as vLLM sent them, row 0 being "
                    "its first, not tokens of the prompt)"
                )
        return dtype, (shape[0] - first, *shape[1:]), first

    def _read(
        self,
        opened: dict[bytes, _OpenArena],
        items: list[np.ndarray],
        plans: list[tuple[np.dtype[Any], tuple[int, ...], int]],
        keys: list[_Key | None],
        far: list[bool],
        taken: dict[_Key, tuple[Run, ...]],
        got: dict[_Key, np.ndarray],
        out: np.ndarray | None,
        mappings: list[tuple[mmap.mmap, Any]],
    ) -> list[np.ndarray]:
        arrays: list[np.ndarray] = []
        mapped: dict[_Key, mmap.mmap] = {}  # each distinct reference's mapping (views)
        at = 0
        try:
            for item, (dtype, shape, first), key, remote in zip(
                items, plans, keys, far, strict=True
            ):
                row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
                if key is None:
                    rows = item[first:]
                    if out is not None:
                        out[at : at + shape[0]] = rows
                        rows = out[at : at + shape[0]]
                    arrays.append(rows)
                    at += shape[0]
                    continue
                if remote:  # another node's, read through Mooncake
                    rows = got[key][first * row : key[3]].view(dtype).reshape(shape)
                    if out is not None:
                        if rows.ctypes.data != out[at:].ctypes.data:  # not read in place
                            out[at : at + shape[0]] = rows
                        rows = out[at : at + shape[0]]
                    else:
                        rows.flags.writeable = False
                    arrays.append(rows)
                    self.stats.bytes += shape[0] * row
                    at += shape[0]
                    continue
                arena, runs, length = opened[key[0]], taken[key], key[3]
                if out is not None:
                    view = out[at : at + shape[0]]
                    into = view.reshape(-1).view(np.uint8)
                    # Through a mapping (os.preadv copied a 512-sample batch at 2.6x a memcpy of
                    # its bytes: a kernel copy a page at a time), streaming past the cache when
                    # the batch is larger than a cache holds (1.4x; a 6 MB sample streamed was
                    # 2.5x a memcpy into cache).
                    parts = _parts(arena.rows(), runs, first * row, length)
                    copy_pages(parts, len(into), into, stream=out.nbytes >= STREAM_FROM)
                    arrays.append(view)
                else:
                    region = mapped.get(key)
                    if region is None:
                        region = mapped[key] = _map_runs(arena, runs, length)
                        # The lease ends with the mapping: at release(), or when no view of any
                        # of its places is left.
                        finalizer = weakref.finalize(region, self._give_back, arena, key[1])
                        mappings.append((region, finalizer))
                    arrays.append(np.ndarray(shape, dtype, buffer=region, offset=first * row))
                self.stats.bytes += shape[0] * row
                at += shape[0]
        except BaseException:
            # A batch that fails part way (a mapping refused: ENOMEM) keeps no lease.
            del arrays
            _end_leases(mappings)
            raise
        finally:
            # Copies' leases (and those of references not mapped before a failure) end now.
            for key in taken:
                if key not in mapped:
                    self._give_back(opened[key[0]], key[1])
        with self._lock:
            self._count_leases()
        return arrays

    def _give_back(self, arena: _OpenArena, slot: int) -> None:
        with self._lock:
            if slot in arena.leased:
                arena.give_back(slot)
            self._count_leases()

    # Forks (the module's docstring) ------------------------------------------------------

    def _before_fork(self) -> None:
        self._lock.acquire()
        for arena in self._arenas.values():
            try:
                arena.before_fork()
            except OSError:  # no descriptor left: the child's views then have no lease
                arena.child_fd = -1

    def _after_fork_in_parent(self) -> None:
        for arena in self._arenas.values():
            arena.after_fork_in_parent()
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.RLock()  # the parent's may have been held by another thread
        for arena in self._arenas.values():
            arena.after_fork_in_child()
        self._count_leases()


_readers: weakref.WeakSet[Reader] = weakref.WeakSet()
_forking: list[Reader] = []


_process_reader: Reader | None = None


def process_reader() -> Reader:
    """This process's reader (what :func:`fetch` and :func:`renew` use; a forked child keeps
    using it, with leases of its own)."""
    global _process_reader
    if _process_reader is None or _process_reader.closed:
        _process_reader = Reader()
    return _process_reader


def _before_fork() -> None:
    _forking[:] = list(_readers)
    for reader in _forking:
        reader._before_fork()


def _after_fork_in_parent() -> None:
    for reader in _forking:
        reader._after_fork_in_parent()
    _forking.clear()


def _after_fork_in_child() -> None:
    for reader in _forking:
        reader._after_fork_in_child()
    _forking.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


def _places(
    out: np.ndarray | None,
    plans: list[tuple[np.dtype[Any], tuple[int, ...], int]],
    keys: list[_Key | None],
    remote: dict[_Key, int],
) -> dict[_Key, np.ndarray]:
    """Where in ``out`` each reference read through Mooncake may land as it is read: at its
    first place, when that place wants all its rows (a later ``start`` is copied after)."""
    if out is None:
        return {}
    places: dict[_Key, np.ndarray] = {}
    at = 0
    for index, ((_, shape, first), key) in enumerate(zip(plans, keys, strict=True)):
        if key is not None and remote.get(key) == index and first == 0:
            places[key] = out[at : at + shape[0]].reshape(-1).view(np.uint8)
        at += shape[0]
    return places


def _check_out(out: Any, plans: list[tuple[np.dtype[Any], tuple[int, ...], int]]) -> None:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out= is a numpy array, not {type(out).__name__}")
    if not plans:
        raise ValueError("out= for a batch of no references")
    dtypes = {dtype for dtype, _, _ in plans}
    rows = {shape[1:] for _, shape, _ in plans}
    if len(dtypes) > 1 or len(rows) > 1:
        raise ValueError("out= for rows of several dtypes or row shapes: fetch them apart")
    dtype, row = dtypes.pop(), rows.pop()
    want = (sum(shape[0] for _, shape, _ in plans), *row)
    if out.dtype != dtype or out.shape != want:
        raise ValueError(f"out= is {out.dtype} {out.shape}; the batch's rows are {dtype} {want}")
    if not out.flags.writeable or not out.flags.c_contiguous:
        raise ValueError("out= must be writable and C-contiguous")
