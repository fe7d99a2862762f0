"""Where an arena's rows go and which rows give way: the arena's books, with no file, lock or
clock of their own (:class:`~aostore.r3.arena.Arena` tells them what it learned).

The data is counted in pages. A slot's rows are one or more runs of pages, so any free pages
are room: rows never wait for a contiguous hole, and giving rows up always makes room (the
fifth review's arena gave up read rows one by one and still found no hole). The reader maps a
slot's runs contiguously (``MAP_FIXED``) and ``out=`` copies them in order; a slot is one run
unless the free pages are scattered. Runs are cut from the largest free run first, so scattered
rows stay few runs.

What gives way, in this order, only when free pages alone do not make room, and only as many
as make it (or none, when even all of them would not):

1. rows read, oldest read first (:meth:`read` tells it; :meth:`touch` sends a leased one to the
   back);
2. unread rows past their deadline, oldest expired first (:meth:`due` lists candidates; the
   arena confirms each against its record, which a renewal may have moved).

Unread rows before their deadline never give way, nor do reserved ones (written for an answer
that has not rendered them yet: :meth:`place` without a deadline, then :meth:`publish` or
:meth:`release`). Every operation costs O(1) or O(log n) in the
number of slots held (heaps with lazy deletion, ordered dicts); nothing walks the held slots
but :meth:`check`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

Run = tuple[int, int]
"""``(first page, pages)``."""


@dataclass
class _Held:
    runs: tuple[Run, ...]
    pages: int
    token: int  # this hold's, so a stale deadline in the heap is told apart


class Placement:
    """The books of ``pages`` pages of data and ``slots`` slots."""

    def __init__(self, pages: int, slots: int) -> None:
        if pages < 1 or slots < 1:
            raise ValueError(f"a placement of {pages} pages and {slots} slots")
        self.pages = pages
        self.slots = slots
        self.free_pages = pages
        self.evictable_pages = 0
        """Pages of rows that may give way (read, or unread past their deadline)."""
        self._free_slots: deque[int] = deque(range(slots))
        self._run_at: dict[int, int] = {0: pages}  # a free run's first page: its pages
        self._run_to: dict[int, int] = {pages: 0}  # a free run's end: its first page
        self._largest: list[tuple[int, int]] = [(-pages, 0)]  # (-pages, first), lazy
        self._held: dict[int, _Held] = {}
        self._reserved: set[int] = set()  # written, not yet published
        self._unread: dict[int, float] = {}  # slot: deadline, before it was found due
        self._deadlines: list[tuple[float, int, int]] = []  # (deadline, token, slot), lazy
        self._read: OrderedDict[int, None] = OrderedDict()
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._tokens = itertools.count(1)

    # Queries -----------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Slots holding rows."""
        return len(self._held)

    @property
    def held_pages(self) -> int:
        return self.pages - self.free_pages

    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def held_slots(self) -> list[int]:
        """The slots holding rows, reserved ones included."""
        return list(self._held)

    def is_reserved(self, slot: int) -> bool:
        return slot in self._reserved

    def runs(self, slot: int) -> tuple[Run, ...]:
        return self._held[slot].runs

    def pages_of(self, slot: int) -> int:
        return self._held[slot].pages

    def is_unread(self, slot: int) -> bool:
        return slot in self._unread

    def largest_run(self) -> int:
        """The pages of the largest free run."""
        while self._largest:
            pages, first = self._largest[0]
            if self._run_at.get(first) == -pages:
                return -pages
            heapq.heappop(self._largest)  # stale
        return 0

    def could_make_room(self, pages: int) -> bool:
        """Whether free pages and every row that may give way hold ``pages`` (leases unknown)."""
        if pages > self.pages:
            return False
        if not self._free_slots and not (self._read or self._expired):
            return False
        return self.free_pages + self.evictable_pages >= pages

    def candidates(self, limit: int) -> list[int]:
        """Up to ``limit`` slots that may give way, in the order they should."""
        return list(itertools.islice(itertools.chain(self._read, self._expired), limit))

    def due(self, now: float) -> Iterator[int]:
        """Unread slots whose deadline (as last told) is ``now`` or before, soonest first. The
        caller answers each with :meth:`expire`, :meth:`postpone` or :meth:`read`."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, token, slot = heapq.heappop(self._deadlines)
            held = self._held.get(slot)
            # Stale entries (released, read, or postponed since) are skipped.
            if held is not None and held.token == token and self._unread.get(slot) == deadline:
                yield slot

    # Changes -----------------------------------------------------------------------------

    def free_slot(self) -> int:
        """The next free slot (it stays free until :meth:`place`)."""
        return self._free_slots[0]

    def skip_slot(self) -> None:
        """Send the next free slot to the back (a reader holds its lock for a moment)."""
        self._free_slots.rotate(-1)

    def place(
        self, pages: int, deadline: float | None, *, one_run: bool = False
    ) -> tuple[int, tuple[Run, ...]]:
        """Hold ``pages`` pages of free space in :meth:`free_slot`, unread until ``deadline``
        (None: reserved until :meth:`publish`); its runs, in order (one with ``one_run``)."""
        if pages < 1:
            raise ValueError(f"rows take at least a page, not {pages}")
        if pages > self.free_pages or not self._free_slots:
            raise MemoryError(f"{pages} pages asked, {self.free_pages} free")
        if one_run and pages > self.largest_run():
            raise MemoryError(f"{pages} pages asked in one run, {self.largest_run()} the most")
        slot = self._free_slots.popleft()
        runs: list[Run] = []
        left = pages
        while left:
            first, free = self._take_largest()
            take = min(free, left)
            if take < free:
                self._add_run(first + take, free - take)
            runs.append((first, take))
            left -= take
        self.free_pages -= pages
        self._held[slot] = _Held(tuple(runs), pages, next(self._tokens))
        self._reserved.add(slot)
        if deadline is not None:
            self.publish(slot, deadline)
        return slot, self._held[slot].runs

    def publish(self, slot: int, deadline: float) -> None:
        """``slot``'s rows, reserved, are a reference's now: unread until ``deadline``."""
        if slot not in self._reserved:
            raise ValueError(f"slot {slot} is not reserved")
        self._reserved.remove(slot)
        self._unread[slot] = deadline
        heapq.heappush(self._deadlines, (deadline, self._held[slot].token, slot))

    def read(self, slot: int) -> None:
        """``slot``'s rows were read: they may give way from now on, after those read before."""
        if slot in self._unread:
            del self._unread[slot]
        elif slot in self._expired:
            del self._expired[slot]
            self.evictable_pages -= self._held[slot].pages
        else:
            return  # read already, or not held
        self._read[slot] = None
        self.evictable_pages += self._held[slot].pages

    def expire(self, slot: int) -> None:
        """``slot``'s unread rows are past their deadline: they may give way."""
        if slot in self._unread:
            del self._unread[slot]
            self._expired[slot] = None
            self.evictable_pages += self._held[slot].pages

    def postpone(self, slot: int, deadline: float) -> None:
        """``slot``'s unread rows last till ``deadline`` (a renewal), expired or not."""
        if slot in self._expired:
            del self._expired[slot]
            self.evictable_pages -= self._held[slot].pages
        elif slot not in self._unread:
            return
        self._unread[slot] = deadline
        heapq.heappush(self._deadlines, (deadline, self._held[slot].token, slot))

    def touch(self, slot: int) -> None:
        """``slot`` may give way but is leased: try it after the others."""
        for pool in (self._read, self._expired):
            if slot in pool:
                pool.move_to_end(slot)

    def release(self, slot: int) -> None:
        """``slot``'s rows are gone: its pages and the slot are free."""
        held = self._held.pop(slot)
        self._unread.pop(slot, None)
        self._reserved.discard(slot)
        for pool in (self._read, self._expired):
            if slot in pool:
                del pool[slot]
                self.evictable_pages -= held.pages
        for first, pages in held.runs:
            self._add_run(first, pages)
        self.free_pages += held.pages
        self._free_slots.append(slot)

    # Free runs ---------------------------------------------------------------------------

    def _take_largest(self) -> Run:
        while True:
            pages, first = self._largest[0]
            if self._run_at.get(first) == -pages:
                heapq.heappop(self._largest)
                del self._run_at[first], self._run_to[first - pages]
                return first, -pages
            heapq.heappop(self._largest)  # stale: that run was joined or taken

    def _add_run(self, first: int, pages: int) -> None:
        """A free run, joined with its free neighbours."""
        end = first + pages
        after = self._run_at.pop(end, None)
        if after is not None:
            del self._run_to[end + after]
            end += after
        before = self._run_to.pop(first, None)
        if before is not None:
            del self._run_at[before]
            first = before
        self._run_at[first] = end - first
        self._run_to[end] = first
        heapq.heappush(self._largest, (first - end, first))
        if (
            len(self._largest) > 4 * len(self._run_at) + 64
        ):  # stale entries: rebuild, O(1) amortized
            self._largest = [(-n, at) for at, n in self._run_at.items()]
            heapq.heapify(self._largest)

    # Books -------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the books."""
        extents = [(first, n, "free") for first, n in self._run_at.items()]
        extents += [(f, n, f"slot {s}") for s, h in self._held.items() for f, n in h.runs]
        extents.sort()
        at = 0
        for first, n, owner in extents:
            assert n > 0, f"an empty run ({owner})"
            assert first == at, f"pages {at} to {first} are neither free nor held ({owner})"
            at = first + n
        assert at == self.pages, f"the runs end at page {at}, not {self.pages}"
        free = sorted(self._run_at.items())
        for (a, n), (b, _) in itertools.pairwise(free):
            assert a + n != b, f"free runs at {a} and {b} are not joined"
        assert self._run_to == {a + n: a for a, n in self._run_at.items()}, "run ends"
        assert self.free_pages == sum(self._run_at.values()), "free pages"
        live = {(-n, a) for a, n in self._run_at.items()}
        assert live <= set(self._largest), "a free run missing from the largest-first heap"
        for slot, held in self._held.items():
            assert held.pages == sum(n for _, n in held.runs), f"slot {slot}'s pages"
        slots = list(self._free_slots) + list(self._held)
        assert sorted(slots) == list(range(self.slots)), "free and held slots"
        pools = [self._reserved, set(self._unread), set(self._read), set(self._expired)]
        assert sum(map(len, pools)) == len(self._held), "a held slot in no pool or in two"
        assert set().union(*pools) == set(self._held), "a pool's slot is not held"
        evictable = sum(self._held[s].pages for s in itertools.chain(self._read, self._expired))
        assert self.evictable_pages == evictable, "evictable pages"
        pending = set(self._deadlines)
        for slot, deadline in self._unread.items():
            entry = (deadline, self._held[slot].token, slot)
            assert entry in pending, f"slot {slot}'s deadline is not in the heap"
