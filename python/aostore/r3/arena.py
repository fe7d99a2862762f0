"""The frontend's side: an arena of R3 rows in shared memory, and the references it hands out.

One arena per frontend process (the API server, or the ``LLM``/``AsyncLLM`` process), written
only by it: :meth:`Arena.deliver` copies a finished request's rows into a slot and returns the
reference that the response carries instead of them. The budget is reserved at start
(``posix_fallocate``), so a full ``/dev/shm`` is an error at start, not a SIGBUS later.

Which rows give way to new ones, in this order (docs/r3-reference.md):

1. free space;
2. rows already read whose lease has ended, oldest first (``evictions``);
3. rows unread past their deadline, with no lease (``expiries``).

An unread reference before its deadline is never given up, nor is a slot under a lease: rows
that do not fit go as rows (``fallbacks``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _format as fmt

__all__ = ["Arena", "ArenaStats"]


@dataclass
class ArenaStats:
    """What an arena did (counters since start) and holds now."""

    references: int = 0
    """References made."""
    bytes_held: int = 0
    """Bytes of rows held now (whole pages)."""
    slots_held: int = 0
    """References whose rows are held now."""
    evictions: int = 0
    """Read rows given up for new ones."""
    expiries: int = 0
    """Unread rows given up past their deadline."""
    leased_when_wanted: int = 0
    """Times a slot that could have been given up was under a reader's lease."""
    fallbacks: int = 0
    """Requests whose rows went as rows: they did not fit."""


def _pages(nbytes: int) -> int:
    return max(fmt.PAGE, -(-nbytes // fmt.PAGE) * fmt.PAGE)


class Arena:
    """An arena of ``budget`` bytes of rows in ``/dev/shm``; unread references last ``ttl``
    seconds unless renewed."""

    def __init__(self, budget: int, ttl: float, *, setting: str = "budget") -> None:
        if budget < fmt.PAGE:
            raise ValueError(f"{setting}={budget}: an arena needs at least {fmt.PAGE} bytes")
        if not ttl > 0:
            raise ValueError(f"an unread reference's lifetime must be positive, not {ttl}")
        budget = budget // fmt.PAGE * fmt.PAGE
        self.ttl = float(ttl)
        self.id = secrets.token_bytes(16)
        self.path = fmt.path(self.id)
        slots = int(min(1 << 16, max(64, budget // (16 * 1024))))
        slots_offset = fmt.PAGE
        data_offset = slots_offset + _pages(slots * fmt.SLOT.itemsize)
        size = data_offset + budget
        sweep_stale()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as error:
                raise OSError(
                    error.errno,
                    f"cannot reserve {size:,} bytes in {fmt.DIRECTORY} for the R3 arena "
                    f"({setting}={budget:,}): {error.strerror}. Lower {setting}, or give the "
                    f"container more shared memory (docs/r3-reference.md)",
                ) from None
            # Mapped now, every page (about 0.3 s a GiB, once): a finish then copies its rows
            # without a page fault every 4 KiB, which tripled the copy's cost.
            self._map = mmap.mmap(
                fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        header = np.frombuffer(self._map, fmt.HEADER, 1)[0]
        header["magic"] = fmt.MAGIC
        header["version"] = fmt.VERSION
        header["slot_size"] = fmt.SLOT.itemsize
        header["arena"] = fmt.as_field(self.id)
        header["boot"] = fmt.as_field(fmt.boot_id())
        header["owner_pid"] = os.getpid()
        header["owner_start"] = fmt.process_start(os.getpid())
        header["slots"] = slots
        header["slots_offset"] = slots_offset
        header["data_offset"] = data_offset
        header["data_size"] = budget
        self._slots = np.frombuffer(self._map, fmt.SLOT, slots, slots_offset)
        self._data = np.frombuffer(self._map, np.uint8, budget, data_offset)
        self._lock = threading.Lock()
        self._generation = 0
        self._free_slots = list(range(slots - 1, -1, -1))
        self._free: list[tuple[int, int]] = [(0, budget)]  # (offset, size), by offset
        self._held: OrderedDict[int, tuple[int, int]] = OrderedDict()  # slot: extent, oldest first
        self.counts = ArenaStats()
        self.closed = False
        # A frontend that exits without close() removes its arena too (its rows are gone
        # either way); one killed leaves it to the next frontend's sweep.
        self._removal = weakref.finalize(self, _remove, self.path, os.getpid())

    def deliver(self, rows: np.ndarray, token_start: int = 0) -> np.ndarray | None:
        """Copy ``rows`` into a slot and return their reference, or None when they do not fit
        (counted: the caller sends them as rows)."""
        rows = np.asarray(rows)

        def write(target: np.ndarray) -> None:  # called once the dtype and shape are checked
            target[...] = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)

        return self.deliver_written(rows.dtype, rows.shape, write, token_start)

    def deliver_written(
        self,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        write: Callable[[np.ndarray], None],
        token_start: int = 0,
    ) -> np.ndarray | None:
        """:meth:`deliver` for rows that ``write`` puts straight into the slot: it is given
        the slot's bytes (``uint8``, exactly as many as the rows have) and fills them, so rows
        held in pieces (the frontend's pages) are copied once, not joined first."""
        dtype = np.dtype(dtype)
        if dtype.hasobject or dtype.names is not None or not shape:
            raise TypeError(f"rows are a numeric array, not {dtype} {shape}")
        if len(shape) > fmt.MAX_DIMS:
            raise ValueError(
                f"rows of {len(shape)} dimensions: a reference holds at most {fmt.MAX_DIMS}"
            )
        nbytes = dtype.itemsize * math.prod(shape)
        with self._lock:
            if self.closed:
                raise fmt.R3Error("the R3 arena is closed")
            placed = self._place(_pages(nbytes))
            if placed is None:
                self.counts.fallbacks += 1
                return None
            slot, offset, size = placed
            # The slot's lock is ours while it changes: a reader with its old reference waits
            # or sees the new generation, never a half-written slot.
            # A free slot has no lease; a reader with a stale reference may hold its lock for
            # the moment it takes to see that (so wait for it).
            fmt.lock(self._fd, slot, fmt.WRITE, wait=True)
            try:
                # A free slot's generation is 0, which no reference has: no reader takes these
                # rows while they are written.
                record = self._slots[slot]
                try:
                    write(self._data[offset : offset + nbytes])
                except BaseException:
                    self._free_extent(slot, offset, size)
                    raise
                self._generation += 1
                record["offset"] = offset
                record["nbytes"] = nbytes
                record["deadline"] = time.time() + self.ttl
                record["read"] = 0
                record["generation"] = self._generation
            finally:
                fmt.lock(self._fd, slot, fmt.UNLOCK)
            self._held[slot] = (offset, size)
            self.counts.references += 1
            self.counts.slots_held += 1
            self.counts.bytes_held += size
            return fmt.make_reference(self.id, slot, self._generation, dtype, shape, token_start)

    def stats(self) -> dict[str, int]:
        """:class:`ArenaStats` as a mapping, with ``leases``: the slots held now that a reader
        leases (each asked of the kernel: a scrape costs one ``fcntl`` per slot held). The
        shape ``aostore.metrics.register_store`` exports."""
        with self._lock:
            figures = dataclasses.asdict(self.counts)
            leases = 0
            if not self.closed:
                for slot in self._held:
                    if fmt.leased(self._fd, slot):
                        leases += 1
            figures["leases"] = leases
            return figures

    def close(self) -> None:
        """Remove the arena: every reference to it is gone from now on."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            del self._slots, self._data
            self._map.close()
            os.close(self._fd)
            self._removal()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # Placement -------------------------------------------------------------------------------

    def _place(self, size: int) -> tuple[int, int, int] | None:
        """A slot and ``size`` bytes at an offset, giving up old rows as the module says."""
        if size > len(self._data):
            return None
        while True:
            offset = self._fit(size)
            if offset is not None and self._free_slots:
                return self._free_slots.pop(), offset, size
            if not self._give_up_one():
                return None

    def _fit(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def _give_up_one(self) -> bool:
        """Give up the oldest rows that may go (read ones first, then expired unread ones);
        False when none may."""
        now = time.time()
        for wanted in ("read", "expired"):
            for slot in self._held:
                record = self._slots[slot]
                if wanted == "read" and not record["read"]:
                    continue
                if wanted == "expired" and (record["read"] or record["deadline"] > now):
                    continue
                if not fmt.lock(self._fd, slot, fmt.WRITE):
                    self.counts.leased_when_wanted += 1
                    continue
                try:
                    # Under the lock: a renewal may have moved the deadline on.
                    if wanted == "expired" and record["deadline"] > now:
                        continue
                    record["generation"] = 0  # no reference matches it from here
                finally:
                    fmt.lock(self._fd, slot, fmt.UNLOCK)
                if wanted == "read":
                    self.counts.evictions += 1
                else:
                    self.counts.expiries += 1
                self._release(slot)
                return True
        return False

    def _release(self, slot: int) -> None:
        offset, size = self._held.pop(slot)
        self.counts.slots_held -= 1
        self.counts.bytes_held -= size
        self._free_extent(slot, offset, size)

    def _free_extent(self, slot: int, offset: int, size: int) -> None:
        """Put ``slot`` and its extent back among the free ones (joined with its neighbours)."""
        self._free_slots.append(slot)
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # Join it with its neighbours.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            size += self._free.pop(i + 1)[1]
            self._free[i] = (offset, size)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            before = self._free.pop(i - 1)
            self._free[i - 1] = (before[0], before[1] + size)


def _remove(path: str, owner: int) -> None:
    """Unlink an arena's file, in the process that made it only (a forked child that exits
    must not take its parent's arena)."""
    if os.getpid() == owner:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def sweep_stale() -> int:
    """Remove this user's arenas whose frontend is gone (killed before it could remove its
    own); their references are gone either way. Returns how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(fmt.DIRECTORY) if n.startswith(fmt.PREFIX)]
    except OSError:
        return 0
    for name in names:
        full = os.path.join(fmt.DIRECTORY, name)
        try:
            if os.stat(full).st_uid != os.getuid():
                continue
            with open(full, "rb") as file:
                header = np.frombuffer(file.read(fmt.HEADER.itemsize), fmt.HEADER)[0]
        except (OSError, ValueError):
            continue
        if header["magic"] != fmt.MAGIC:
            continue
        pid, start = int(header["owner_pid"]), int(header["owner_start"])
        if fmt.ident(header["boot"]) == fmt.boot_id() and fmt.process_start(pid) == start != 0:
            continue  # its frontend lives
        try:
            os.unlink(full)
            removed += 1
        except OSError:
            pass
    return removed
