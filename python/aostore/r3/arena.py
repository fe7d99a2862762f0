"""The frontend's side: an arena of R3 rows in shared memory, and the references it hands out.

One arena per frontend process (the API server, or the ``LLM``/``AsyncLLM`` process), written
only by it: :meth:`Arena.deliver` copies a finished request's rows into a slot and returns the
reference that the response carries instead of them. The budget is reserved at start
(``posix_fallocate``), so a full ``/dev/shm`` is an error at start, not a SIGBUS later.

The file is made unnamed (``O_TMPFILE``) and linked under its name only once complete, with
the frontend's liveness lock already held (:mod:`.leases`): a sweep removes only arenas whose
lock it can take, i.e. whose frontend is gone, whatever PID namespace either runs in; a
frontend killed while it starts leaves nothing.

Which rows give way to new ones is :mod:`.placement`'s (free pages, then read rows, oldest read
first, then unread rows past their deadline; only as many as make room, or none). An unread
reference before its deadline is never given up, nor is a slot under a lease: rows that do not
fit go as rows (``fallbacks``). A finish never waits on a reader: a slot whose lock a reader
holds is passed over (``leased_when_wanted``, ``slots_busy``).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import multiprocessing.util
import os
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import errors, leases
from . import format as fmt
from .placement import Placement, Run

__all__ = ["Arena", "ArenaStats", "Reservation", "sweep_stale"]

TRIES = 64
"""The most slots' locks one finish tries, to give rows up or to find a free slot: a finish's
cost stays bounded however many readers lease what it would give up (the leased ones go to the
back of the line)."""


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
    slots_busy: int = 0
    """Times a free slot was passed over because a reader held its lock for a moment."""
    fallbacks: int = 0
    """Requests whose rows went as rows: they did not fit."""


def _pages(nbytes: int) -> int:
    """Pages that hold ``nbytes`` (rows of no bytes take one: every slot has a run)."""
    return max(1, -(-nbytes // fmt.PAGE))


def _span(count: int, itemsize: int) -> int:
    return _pages(count * itemsize) * fmt.PAGE


_arenas: weakref.WeakSet[Arena] = weakref.WeakSet()


class Arena:
    """An arena of ``budget`` bytes of rows in ``/dev/shm``; unread references last ``ttl``
    seconds unless renewed."""

    def __init__(self, budget: int, ttl: float, *, setting: str = "budget") -> None:
        if budget < fmt.PAGE:
            raise ValueError(f"{setting}={budget}: an arena needs at least {fmt.PAGE} bytes")
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ValueError(
                f"an unread reference's lifetime must be a positive number of seconds, not {ttl}"
            )
        pages = budget // fmt.PAGE
        budget = pages * fmt.PAGE
        self.ttl = float(ttl)
        self.id = secrets.token_bytes(16)
        self.path = fmt.path(self.id)
        slots = int(min(1 << 16, max(64, budget // (16 * 1024))))
        slots_offset = fmt.PAGE
        log_offset = slots_offset + _span(slots, fmt.SLOT.itemsize)
        runs_offset = log_offset + _span(slots, fmt.LOG_ENTRY.itemsize)
        data_offset = runs_offset + _span(pages, fmt.RUN.itemsize)
        size = data_offset + budget
        sweep_stale()
        fd = _unnamed(size, setting, budget)
        live = -1
        try:
            # Mapped now, every page (about 0.3 s a GiB, once): a finish then copies its rows
            # without a page fault every 4 KiB, which tripled the copy's cost.
            self._map = mmap.mmap(
                fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE
            )
            _write_header(
                self._map,
                arena=self.id,
                slots=slots,
                slots_offset=slots_offset,
                log_offset=log_offset,
                runs_offset=runs_offset,
                data_offset=data_offset,
                data_size=budget,
            )
            # The liveness lock, on an open of its own that nothing maps (a mapping inherited
            # by a forked child would keep it, and the arena alive, after this process died).
            live = leases.reopen(fd)
            if not leases.lock_byte(live, leases.LIVE, leases.WRITE):
                raise OSError("the new R3 arena's liveness lock is taken")
            _name(fd, self.path)  # complete: now it has a name
        except BaseException:
            if live >= 0:
                os.close(live)
            if hasattr(self, "_map"):
                self._map.close()
            os.close(fd)
            raise
        self._fd = fd
        self._live = live
        self._pid = os.getpid()
        self._slots = np.frombuffer(self._map, fmt.SLOT, slots, slots_offset)
        self._log = np.frombuffer(self._map, fmt.LOG_ENTRY, slots, log_offset)
        self._log_tail = np.frombuffer(self._map, "<u8", 1, fmt.LOG_TAIL)
        self._runs = np.frombuffer(self._map, fmt.RUN, pages, runs_offset)
        self._data = np.frombuffer(self._map, np.uint8, budget, data_offset)
        self._lock = threading.Lock()
        self._withdrawn: deque[int] = deque()  # reservations let go, freed at the next finish
        self._generation = 0
        self._seen = 0  # read-log entries learned
        self._books = Placement(pages, slots)
        self.counts = ArenaStats()
        self.closed = False
        self.offnode: Any = None
        """An ``offnode.Publisher``: told of every reference made and every slot given up."""
        # A frontend that exits without close() removes its arena too, including one whose
        # process multiprocessing ends with os._exit (vLLM's API servers); one killed leaves it
        # to the next sweep.
        self._removal = multiprocessing.util.Finalize(
            self, _remove, args=(self.path, self._pid), exitpriority=0
        )
        _arenas.add(self)

    def deliver(self, rows: np.ndarray, token_start: int = 0) -> np.ndarray | None:
        """Copy ``rows`` into a slot and return their reference, or None when they do not fit
        (counted: the caller sends them as rows)."""
        rows = np.asarray(rows)

        def write(targets: list[np.ndarray]) -> None:  # called once dtype and shape are checked
            source = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
            at = 0
            for target in targets:
                target[...] = source[at : at + len(target)]
                at += len(target)

        return self.deliver_written(rows.dtype, rows.shape, write, token_start)

    def deliver_written(
        self,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        write: Callable[[list[np.ndarray]], None],
        token_start: int = 0,
    ) -> np.ndarray | None:
        """:meth:`deliver` for rows that ``write`` puts straight into the slot: it is given
        the slot's bytes as a list of ``uint8`` arrays (its page runs in order, exactly as many
        bytes as the rows have; one array unless the free pages were scattered) and fills
        them, so rows held in pieces (the frontend's pages) are copied once, not joined
        first."""
        dtype, nbytes = _checked(dtype, shape)
        with self._lock:
            self._usable()
            written = self._write(nbytes, write, fmt.now() + self.ttl)
            if written is None:
                self.counts.fallbacks += 1
                return None
            self.counts.references += 1
            if self.offnode is not None:
                self.offnode.published(written[0], self._generation, nbytes)
            return fmt.make_reference(
                self.id, written[0], self._generation, dtype, shape, token_start
            )

    def reserve(
        self,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        write: Callable[[list[np.ndarray]], None],
    ) -> tuple[Reservation, np.ndarray] | None:
        """Write rows into a slot now and make their reference later, if ever: for rows an
        answer may or may not carry (over HTTP, only vLLM's serving code knows). ``write`` as
        for :meth:`deliver_written`, given one array (a reservation is one run of pages, so the
        frontend sees it as one array of rows). The reservation and the rows (read-only, in
        the arena's memory: the reservation does not hold them, so their holder may let a
        weak reference say when they go); None when no run of pages holds the rows (the caller
        then keeps rows of its own, and delivers them if an answer renders them). A reserved
        slot never gives way; :meth:`Reservation.withdraw` frees it."""
        dtype, nbytes = _checked(dtype, shape)
        with self._lock:
            self._usable()
            written = self._write(nbytes, write, None)
            if written is None:
                return None
            slot, runs = written
            start = runs[0][0] * fmt.PAGE
            rows = self._data[start : start + nbytes].view(dtype).reshape(shape)
            rows.flags.writeable = False
            return Reservation(self, slot, dtype, shape), rows

    def _write(
        self, nbytes: int, write: Callable[[list[np.ndarray]], None], deadline: float | None
    ) -> tuple[int, tuple[Run, ...]] | None:
        """Under the arena's lock: room made, a free slot locked, ``nbytes`` of rows written by
        ``write`` and the slot's record stored (its generation the next one, unread until
        ``deadline``; or, with None, 0: reserved, one run, unread by any reference until
        published). The slot and its runs; None when the rows find no room or no slot."""
        books, need = self._books, _pages(nbytes)
        self._learn()
        if deadline is None:  # a reservation: one run, so the frontend sees one array
            roomy = books.largest_run() >= need and books.has_free_slot()
            if not roomy and not (self._room(need) and books.largest_run() >= need):
                return None
        elif not (books.free_pages >= need and books.has_free_slot()) and not self._room(need):
            return None
        if not self._lock_free_slot():
            return None
        slot, runs = books.place(need, deadline, one_run=deadline is None)
        try:
            try:
                write(self._targets(runs, nbytes))
            except BaseException:
                books.release(slot)  # its generation is still 0: nothing to undo
                raise
            generation = 0
            if deadline is not None:
                self._generation += 1
                generation = self._generation
            self._link(runs)
            # One store of the whole record, under the slot's write lock: no reader sees it
            # before the lock is let go.
            record = (generation, runs[0][0], nbytes, deadline or 0.0, 0, len(runs), (0, 0))
            self._slots[slot] = record
        finally:
            leases.lock(self._fd, slot, leases.UNLOCK)
        return slot, runs

    def _publish(self, reservation: Reservation, token_start: int) -> np.ndarray | None:
        with self._lock:
            if self.closed:
                return None
            slot = reservation.slot
            deadline = fmt.now() + self.ttl
            self._generation += 1
            # The rows and the record's other fields are final: a reader with a stale
            # reference to this slot sees generation 0 or this one, never its own.
            self._slots["deadline"][slot] = deadline
            self._slots["generation"][slot] = self._generation
            self._books.publish(slot, deadline)
            self.counts.references += 1
            if self.offnode is not None:
                self.offnode.published(slot, self._generation, int(self._slots["nbytes"][slot]))
            return fmt.make_reference(
                self.id, slot, self._generation, reservation.dtype, reservation.shape, token_start
            )

    def _usable(self) -> None:
        if self.closed:
            raise errors.R3Error("the R3 arena is closed")
        if os.getpid() != self._pid:
            raise errors.R3Error(
                "this R3 arena belongs to the process that made it, not to a forked child"
            )
        self._release_withdrawn()

    def _release_withdrawn(self) -> None:
        """Free the slots of reservations let go since (queued: never freed from the garbage
        collector's callback, which may run under this lock)."""
        while self._withdrawn:
            self._books.release(self._withdrawn.popleft())

    def stats(self) -> dict[str, int]:
        """:class:`ArenaStats` as a mapping: the shape ``aostore.metrics.register_store``
        exports. Counters only: a scrape costs the same however many slots are held (asking the
        kernel which are leased is :meth:`leases`)."""
        with self._lock:
            if not self.closed:
                self._release_withdrawn()
            self.counts.slots_held = self._books.held
            self.counts.bytes_held = self._books.held_pages * fmt.PAGE
            return dataclasses.asdict(self.counts)

    def leases(self) -> int:
        """The slots held now that a reader leases: one ``fcntl`` a slot held, outside the
        lock a finish needs (a figure for tests and debugging, not for every scrape)."""
        with self._lock:
            if self.closed:
                return 0
            held = self._books.held_slots()
        return sum(1 for slot in held if not self.closed and leases.leased(self._fd, slot))

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the arena's books (its
        placement's, and the slot table against them)."""
        with self._lock:
            self._books.check()
            held_slots = set(self._books.held_slots())
            for slot in range(len(self._slots)):
                record = self._slots[slot]
                held = slot in held_slots
                published = held and not self._books.is_reserved(slot)
                assert (int(record["generation"]) != 0) == published, f"slot {slot}'s generation"
                if held:
                    runs = self._books.runs(slot)
                    assert int(record["page"]) == runs[0][0], f"slot {slot}'s first page"
                    assert int(record["runs"]) == len(runs), f"slot {slot}'s runs"
                    assert _pages(int(record["nbytes"])) == self._books.pages_of(slot), slot

    def close(self) -> None:
        """Remove the arena: every reference to it is gone from now on."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            del self._slots, self._log, self._log_tail, self._runs, self._data
            try:
                self._map.close()
            except BufferError:  # a view kept by a caught exception's frame: unmapped with it
                pass
            if os.getpid() == self._pid:
                self._removal()
            os.close(self._fd)
            if self._live >= 0:
                os.close(self._live)
                self._live = -1

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # Placement -------------------------------------------------------------------------------

    def _learn(self) -> None:
        """Tell the books what readers did since the last finish: the slots read first (the
        read log), and which unread slots are due (their deadline, as renewals moved it)."""
        books = self._books
        tail = int(self._log_tail[0])
        capacity = len(self._log)
        if tail - self._seen > capacity:
            # Readers outran the log (more first reads than slots since the last finish): the
            # read flags say it all.
            for slot in np.flatnonzero(self._slots["read"]).tolist():
                if books.is_unread(slot) and int(self._slots[slot]["generation"]):
                    books.read(slot)
        else:
            for at in range(self._seen, tail):
                entry = self._log[at % capacity]
                slot = int(entry["slot"])
                # An entry is a hint: the record, written before it, has the last word.
                if (
                    slot < len(self._slots)
                    and books.is_unread(slot)
                    and int(self._slots[slot]["generation"]) == int(entry["generation"])
                    and self._slots[slot]["read"]
                ):
                    books.read(slot)
        self._seen = tail
        now = fmt.now()
        for slot in list(books.due(now)):
            record = self._slots[slot]
            if record["read"]:
                books.read(slot)
            elif float(record["deadline"]) > now:
                books.postpone(slot, float(record["deadline"]))
            else:
                books.expire(slot)

    def _room(self, need: int) -> bool:
        """Give up rows until ``need`` pages and a slot are free: only rows that may go, only
        as many as make the room, or none (when the room cannot be made, nothing changes)."""
        books = self._books
        if not books.could_make_room(need):
            return False
        chosen: list[int] = []
        room, now = books.free_pages, fmt.now()
        for slot in books.candidates(TRIES):
            if not leases.lock(self._fd, slot, leases.WRITE):
                self.counts.leased_when_wanted += 1
                books.touch(slot)
                continue
            record = self._slots[slot]
            if not record["read"] and float(record["deadline"]) > now:  # renewed meanwhile
                leases.lock(self._fd, slot, leases.UNLOCK)
                books.postpone(slot, float(record["deadline"]))
                continue
            chosen.append(slot)
            room += books.pages_of(slot)
            if room >= need:
                break
        if room < need:
            for slot in chosen:
                leases.lock(self._fd, slot, leases.UNLOCK)
            return False
        for slot in chosen:
            record = self._slots[slot]
            if record["read"]:
                self.counts.evictions += 1
            else:
                self.counts.expiries += 1
            if self.offnode is not None:
                self.offnode.given_up(slot, int(record["generation"]))
            record["generation"] = 0  # no reference matches it from here
            leases.lock(self._fd, slot, leases.UNLOCK)
            books.release(slot)
        return True

    def _lock_free_slot(self) -> bool:
        """Take the write lock of the next free slot, passing over any a reader holds for the
        moment (one with a stale reference, between its lock and its look at the generation:
        stopped there, it must not stop this finish)."""
        books = self._books
        for _ in range(TRIES):
            if leases.lock(self._fd, books.free_slot(), leases.WRITE):
                return True
            self.counts.slots_busy += 1
            books.skip_slot()
        return False

    def _targets(self, runs: tuple[Run, ...], nbytes: int) -> list[np.ndarray]:
        targets = []
        for first, pages in runs:
            take = min(pages * fmt.PAGE, nbytes)
            targets.append(self._data[first * fmt.PAGE : first * fmt.PAGE + take])
            nbytes -= take
        return targets

    def _link(self, runs: tuple[Run, ...]) -> None:
        """Write the run table's entries for ``runs`` (the reader follows them)."""
        for i, (first, pages) in enumerate(runs):
            self._runs[first] = (pages, runs[i + 1][0] if i + 1 < len(runs) else fmt.NO_RUN)

    def _after_fork_in_child(self) -> None:
        # The child must not keep this arena alive after its frontend dies, nor use its books.
        if self._live >= 0:
            os.close(self._live)
            self._live = -1
        self._lock = threading.Lock()


def _write_header(mapped: mmap.mmap, **fields: Any) -> None:
    header = np.frombuffer(mapped, fmt.HEADER, 1)
    header["magic"] = fmt.MAGIC
    header["version"] = fmt.ARENA_VERSION
    header["slot_size"] = fmt.SLOT.itemsize
    header["boot"] = fmt.as_field(leases.boot_id())
    header["log_capacity"] = fields["slots"]
    for name, value in fields.items():
        header[name] = fmt.as_field(value) if isinstance(value, bytes) else value


def _name(fd: int, path: str) -> None:
    """Link the unnamed file ``fd`` at ``path`` (``linkat`` with ``AT_SYMLINK_FOLLOW`` through
    ``/proc/self/fd``, which ``os.link`` uses only when given a directory descriptor)."""
    directory = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


class Reservation:
    """Rows written into a slot whose reference is not made yet (:meth:`Arena.reserve`)."""

    def __init__(
        self, arena: Arena, slot: int, dtype: np.dtype[Any], shape: tuple[int, ...]
    ) -> None:
        self.arena = arena
        self.slot = slot
        self.dtype = dtype
        self.shape = shape
        self._reference: np.ndarray | None = None
        self._withdrawn = False

    def publish(self, token_start: int = 0) -> np.ndarray | None:
        """The rows' reference (the same one if asked again), unread from now until the TTL;
        None once withdrawn, or when the arena is closed."""
        if self._reference is None and not self._withdrawn:
            self._reference = self.arena._publish(self, token_start)
        return self._reference

    def withdraw(self) -> None:
        """Let the slot go unpublished. Safe from any thread, a garbage collection's callback
        included: the slot is freed at the arena's next finish (never under its lock here)."""
        if self._reference is None and not self._withdrawn:
            self._withdrawn = True
            self.arena._withdrawn.append(self.slot)


def _checked(dtype: Any, shape: tuple[int, ...]) -> tuple[np.dtype[Any], int]:
    """The rows' dtype and bytes, or ``TypeError``/``ValueError`` for rows no arena takes."""
    dtype = np.dtype(dtype)
    refused = fmt.rows_refused(dtype, shape)
    if refused is not None:
        raise refused
    return dtype, dtype.itemsize * math.prod(shape)


def _unnamed(size: int, setting: str, budget: int) -> int:
    """An unnamed file of ``size`` bytes reserved in :data:`fmt.DIRECTORY`."""
    fd = os.open(fmt.DIRECTORY, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        os.close(fd)
        raise OSError(
            error.errno,
            f"cannot reserve {size:,} bytes in {fmt.DIRECTORY} for the R3 arena "
            f"({setting}={budget:,}): {error.strerror}. Lower {setting}, or give the "
            f"container more shared memory (docs/r3-reference.md)",
        ) from None
    return fd


def _after_fork_in_child() -> None:
    for arena in list(_arenas):
        arena._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    own): those whose liveness lock can be taken. Their references are gone either way.
    Returns how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(fmt.DIRECTORY) if n.startswith(fmt.PREFIX)]
    except OSError:
        return 0
    for name in names:
        if remove_if_dead(os.path.join(fmt.DIRECTORY, name)):
            removed += 1
    return removed


def remove_if_dead(path: str) -> bool:
    """Unlink the arena at ``path`` if it is this user's and its frontend is gone."""
    try:
        fd = leases.open_arena_file(path, os.getuid())
    except (errors.R3Error, OSError):
        return False  # gone, not a file, or another user's: not ours to remove
    try:
        if not leases.lock_byte(fd, leases.LIVE, leases.WRITE):
            return False  # its frontend lives (in whatever PID namespace)
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
