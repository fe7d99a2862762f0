"""The trainer's side: read R3 rows by reference (``aostore.r3.fetch``)."""

from __future__ import annotations

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
from . import _format as fmt

DEFAULT_RENEWAL = 600.0


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


STREAM_FROM = 32 << 20
"""``out=`` batches of at least this many bytes are copied past the cache (more than a
last-level cache holds: the caller's next read of them misses it either way)."""


class _OpenArena:
    """One arena as a reader sees it: its file (whose open holds this process's leases), its
    slot table (written for the read flag and renewals) and each leased slot's count."""

    def __init__(self, arena: bytes) -> None:
        path = fmt.path(arena)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise fmt.ReferenceGone(
                "its R3 arena is not in this node's /dev/shm: its frontend exited or restarted, "
                "or this process does not share the frontend's /dev/shm (same container, or "
                "--ipc=host)"
            ) from None
        except PermissionError:
            owner = _owner(path)
            raise PermissionError(
                f"the R3 arena {path} is readable by its user only (uid {owner}); this process "
                f"runs as uid {os.getuid()}: read as the frontend's user"
            ) from None
        try:
            raw = os.pread(fd, fmt.HEADER.itemsize, 0)
            header = np.frombuffer(raw, fmt.HEADER)[0]
            if header["magic"] != fmt.MAGIC or fmt.ident(header["arena"]) != arena:
                raise fmt.ReferenceGone("its R3 arena's file is not that arena's")
            self.slots = int(header["slots"])
            self.data_offset = int(header["data_offset"])
            self.data_size = int(header["data_size"])
            if os.fstat(fd).st_size < self.data_offset + self.data_size:
                raise fmt.ReferenceGone("its R3 arena's file is cut short")
            table = mmap.mmap(
                fd,
                self.data_offset,
                mmap.MAP_SHARED,
                mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.table = table
        self.records = np.frombuffer(table, fmt.SLOT, self.slots, int(header["slots_offset"]))
        self.leased: dict[int, int] = {}
        self._rows: memoryview | None = None

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

    def take(self, slot: int, generation: int, nbytes: int) -> int:
        """Lease ``slot`` if it still holds that generation's rows; their offset."""
        if slot >= self.slots:
            raise fmt.ForeignReference(f"a malformed aostore reference: slot {slot}")
        if not fmt.lock(self.fd, slot, fmt.READ):
            # The frontend holds it: it is giving these rows up, or writing others there.
            raise fmt.ReferenceGone("its rows are gone: the frontend gave the slot up")
        record = self.records[slot]
        try:
            if int(record["generation"]) != generation:
                raise fmt.ReferenceGone(
                    "its rows are gone: read and evicted for newer ones, or expired unread"
                )
            if int(record["nbytes"]) != nbytes:
                raise fmt.ForeignReference("a malformed aostore reference: its rows' size")
            offset = int(record["offset"])
            if offset % fmt.PAGE or offset + nbytes > self.data_size:
                # Mapped past the file's end, a read would be a SIGBUS, not an error.
                raise fmt.ReferenceGone("its arena's slot table is not the frontend's")
            record["read"] = 1
        except BaseException:
            if slot not in self.leased:
                fmt.lock(self.fd, slot, fmt.UNLOCK)
            raise
        self.leased[slot] = self.leased.get(slot, 0) + 1
        return offset

    def give_back(self, slot: int) -> None:
        count = self.leased.pop(slot) - 1
        if count:
            self.leased[slot] = count
        elif self.fd >= 0:
            fmt.lock(self.fd, slot, fmt.UNLOCK)

    def close(self) -> None:
        """Close the file: the kernel drops every lease this process holds on the arena."""
        if self.fd >= 0:
            del self.records
            self.table.close()
            if self._rows is not None:
                mapped = self._rows.obj
                self._rows.release()
                mapped.close()  # type: ignore[attr-defined]
                self._rows = None
            os.close(self.fd)
            self.fd = -1
            self.leased.clear()


def _owner(path: str) -> int | str:
    try:
        return os.stat(path).st_uid
    except OSError:
        return "unknown"


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
        for mapped, finalizer in self._mappings:
            try:
                mapped.close()
            except BufferError:  # a view through another buffer: the lease waits for it
                continue
            finalizer()
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
    """Reads R3 rows by reference, from this node's arenas; ``aostore.r3.fetch`` uses one per
    process."""

    def __init__(self) -> None:
        self._arenas: dict[bytes, _OpenArena] = {}
        self._lock = threading.RLock()
        self.stats = ReaderStats()
        self.closed = False

    def fetch(
        self,
        references: Sequence[Any],
        *,
        start: int | Sequence[int] | None = None,
        out: np.ndarray | None = None,
    ) -> Fetched:
        """The rows of ``references`` (each the HTTP field's string, or the array
        ``CompletionOutput.routed_experts`` holds; vLLM's rows in either form are read too),
        from token ``start`` on (one for all, or one each; default: all rows). With ``out``,
        copied into it (every row of the batch in order, its shape and dtype exactly) and not
        leased."""
        if isinstance(references, (str, np.ndarray)):
            raise TypeError("references is a sequence of references (a list of one for one)")
        items = [fmt.parse(value) for value in references]
        starts = self._starts(start, len(items))
        plans = [self._plan(item, first) for item, first in zip(items, starts, strict=True)]
        arenas = {fmt.ident(item["arena"]) for item in items if item.dtype.names is not None}
        if len(arenas) > 1:
            raise fmt.MixedArenas(
                f"a batch with references of {len(arenas)} arenas: fetch each arena's apart"
            )
        if out is not None:
            _check_out(out, plans)
        with self._lock:
            if self.closed:
                raise ValueError("this reader is closed")
            arena = self._open(arenas.pop()) if arenas else None
            taken: list[tuple[int, int]] = []  # (slot, offset)
            try:
                for item, _plan in zip(items, plans, strict=True):
                    if item.dtype.names is None:
                        continue
                    assert arena is not None
                    dtype, shape = fmt.rows_of(item)
                    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                    slot = int(item["slot"])
                    taken.append((slot, arena.take(slot, int(item["generation"]), nbytes)))
            except fmt.ReferenceGone:
                self.stats.misses += 1
                for slot, _ in taken:
                    arena.give_back(slot)  # type: ignore[union-attr]
                raise
            except BaseException:
                for slot, _ in taken:
                    arena.give_back(slot)  # type: ignore[union-attr]
                raise
            self.stats.fetches += 1
            self.stats.references += len(taken)
            self.stats.leases = sum(len(a.leased) for a in self._arenas.values())
        mappings: list[tuple[mmap.mmap, Any]] = []
        arrays = self._read(arena, items, plans, taken, out, mappings)
        return Fetched(arrays, mappings)

    def renew(self, references: Sequence[Any], seconds: float = DEFAULT_RENEWAL) -> None:
        """Keep unread references' rows at least ``seconds`` more (read ones are the readers':
        their leases keep them)."""
        if not seconds > 0:
            raise ValueError(f"renew by a positive number of seconds, not {seconds}")
        items = [fmt.parse(value) for value in references]
        with self._lock:
            for item in items:
                if item.dtype.names is None:
                    continue
                arena = self._open(fmt.ident(item["arena"]))
                slot = int(item["slot"])
                if slot >= arena.slots:
                    raise fmt.ForeignReference(f"a malformed aostore reference: slot {slot}")
                if not fmt.lock(arena.fd, slot, fmt.READ):
                    raise fmt.ReferenceGone("its rows are gone: the frontend gave the slot up")
                try:
                    record = arena.records[slot]
                    if int(record["generation"]) != int(item["generation"]):
                        self.stats.misses += 1
                        raise fmt.ReferenceGone("its rows are gone: evicted or expired")
                    record["deadline"] = max(float(record["deadline"]), time.time() + seconds)
                finally:
                    if slot not in arena.leased:
                        fmt.lock(arena.fd, slot, fmt.UNLOCK)

    def close(self) -> None:
        """Close every arena this reader opened (their leases end); fetching again is an
        error."""
        with self._lock:
            self.closed = True
            for arena in self._arenas.values():
                arena.close()
            self._arenas.clear()

    def _open(self, arena: bytes) -> _OpenArena:
        opened = self._arenas.get(arena)
        if opened is None:
            opened = self._arenas[arena] = _OpenArena(arena)
        return opened

    @staticmethod
    def _starts(start: int | Sequence[int] | None, n: int) -> list[int | None]:
        if start is None or isinstance(start, (int, np.integer)):
            return [None if start is None else int(start)] * n
        starts = [int(s) for s in start]
        if len(starts) != n:
            raise ValueError(f"{len(starts)} starts for {n} references")
        return list(starts)

    @staticmethod
    def _plan(item: np.ndarray, start: int | None) -> tuple[np.dtype[Any], tuple[int, ...], int]:
        """The rows' dtype, their shape from ``start`` on, and the first row to read."""
        if item.dtype.names is None:
            dtype, shape, token_start = item.dtype, item.shape, 0
        else:
            if fmt.ident(item["boot"]) != fmt.boot_id():
                raise fmt.OtherNode(
                    "a reference from another node (or an earlier boot of this one): its rows "
                    "are in that node's shared memory"
                )
            dtype, shape = fmt.rows_of(item)
            token_start = int(item["token_start"])
        first = 0
        if start is not None:
            first = start - token_start
            if not 0 <= first <= shape[0]:
                raise ValueError(
                    f"start {start} is outside the rows (tokens {token_start} to "
                    f"{token_start + shape[0]})"
                )
        return dtype, (shape[0] - first, *shape[1:]), first

    def _read(
        self,
        arena: _OpenArena | None,
        items: list[np.ndarray],
        plans: list[tuple[np.dtype[Any], tuple[int, ...], int]],
        taken: list[tuple[int, int]],
        out: np.ndarray | None,
        mappings: list[tuple[mmap.mmap, Any]],
    ) -> list[np.ndarray]:
        arrays: list[np.ndarray] = []
        leases = iter(taken)
        at = 0
        for item, (dtype, shape, first) in zip(items, plans, strict=True):
            row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            if item.dtype.names is None:
                rows = item[first:]
                if out is not None:
                    out[at : at + shape[0]] = rows
                    rows = out[at : at + shape[0]]
                arrays.append(rows)
                at += shape[0]
                continue
            assert arena is not None
            slot, offset = next(leases)
            length = (first + shape[0]) * row
            if out is not None:
                view = out[at : at + shape[0]]
                try:
                    into = view.reshape(-1).view(np.uint8)
                    start = offset + first * row
                    # Through a mapping (os.preadv copied a 512-sample batch at 2.6x a memcpy of
                    # its bytes: a kernel copy a page at a time), streaming past the cache when
                    # the batch is larger than a cache holds (1.4x; a 6 MB sample streamed was
                    # 2.5x a memcpy into cache).
                    source = arena.rows()[start : offset + length]
                    copy_pages([source], len(into), into, stream=out.nbytes >= STREAM_FROM)
                finally:
                    with self._lock:
                        arena.give_back(slot)
                arrays.append(view)
            else:
                mapped = mmap.mmap(
                    arena.fd,
                    max(length, 1),
                    mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    mmap.PROT_READ,
                    offset=arena.data_offset + offset,
                )
                # The lease ends with the mapping: at release(), or when no view is left.
                mappings.append((mapped, weakref.finalize(mapped, self._give_back, arena, slot)))
                arrays.append(np.ndarray(shape, dtype, buffer=mapped, offset=first * row))
            self.stats.bytes += shape[0] * row
            at += shape[0]
        with self._lock:
            self.stats.leases = sum(len(a.leased) for a in self._arenas.values())
        return arrays

    def _give_back(self, arena: _OpenArena, slot: int) -> None:
        with self._lock:
            if arena.fd >= 0 and slot in arena.leased:
                arena.give_back(slot)
            self.stats.leases = sum(len(a.leased) for a in self._arenas.values())


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
