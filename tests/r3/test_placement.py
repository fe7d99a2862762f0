"""The arena's placement (``aostore.r3.placement``) against a plain model: which slots hold how
many pages, in which state, and the order in which they may give way; its books checked after
every step (``Placement.check``)."""

from __future__ import annotations

import pytest
from aostore.r3.placement import Placement
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

PAGES, SLOTS = 40, 12


class PlacementModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.books = Placement(PAGES, SLOTS)
        self.pages: dict[int, int] = {}  # slot: pages held
        self.unread: dict[int, float] = {}  # slot: deadline
        self.reserved: set[int] = set()
        self.read_order: list[int] = []
        self.expired_order: list[int] = []

    def free(self) -> int:
        return PAGES - sum(self.pages.values())

    def evictable(self) -> int:
        return sum(self.pages[s] for s in self.read_order + self.expired_order)

    def _forget(self, slot: int) -> None:
        self.unread.pop(slot, None)
        self.reserved.discard(slot)
        for order in (self.read_order, self.expired_order):
            if slot in order:
                order.remove(slot)

    @rule(
        pages=st.integers(1, 18),
        deadline=st.none() | st.integers(0, 20),
        one_run=st.booleans(),
    )
    def place(self, pages: int, deadline: int | None, one_run: bool) -> None:
        """Rows placed unread until ``deadline``, or reserved (None)."""
        fits = pages <= self.free() and len(self.pages) < SLOTS
        if one_run:
            fits = fits and pages <= self.books.largest_run()
        told = None if deadline is None else float(deadline)
        if not fits:
            with pytest.raises(MemoryError):
                self.books.place(pages, told, one_run=one_run)
            return
        slot, runs = self.books.place(pages, told, one_run=one_run)
        assert slot not in self.pages and sum(n for _, n in runs) == pages
        assert len(runs) == 1 or not one_run
        self.pages[slot] = pages
        if told is None:
            self.reserved.add(slot)
        else:
            self.unread[slot] = told

    @precondition(lambda self: self.reserved)
    @rule(data=st.data(), deadline=st.integers(0, 20))
    def publish(self, data: st.DataObject, deadline: int) -> None:
        slot = data.draw(st.sampled_from(sorted(self.reserved)))
        self.books.publish(slot, float(deadline))
        self.reserved.remove(slot)
        self.unread[slot] = float(deadline)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.pages)))
        self.books.read(slot)
        if slot in self.read_order or slot in self.reserved:
            return  # read already; a reserved slot has no reference to read it by
        self._forget(slot)
        self.read_order.append(slot)

    @rule(now=st.integers(0, 20), data=st.data())
    def due(self, now: int, data: st.DataObject) -> None:
        want = sorted((d, s) for s, d in self.unread.items() if d <= now)
        got = list(self.books.due(float(now)))
        assert sorted(got) == sorted(s for _, s in want)
        assert [self.unread[s] for s in got] == sorted(self.unread[s] for s in got)
        for slot in got:
            if data.draw(st.booleans()):
                self.books.expire(slot)
                self._forget(slot)
                self.expired_order.append(slot)
            else:
                later = float(now + data.draw(st.integers(1, 10)))
                self.books.postpone(slot, later)
                self.unread[slot] = later

    @precondition(lambda self: self.expired_order)
    @rule(data=st.data(), by=st.integers(1, 10))
    def renewed_after_expiry(self, data: st.DataObject, by: int) -> None:
        slot = data.draw(st.sampled_from(self.expired_order))
        self.books.postpone(slot, 20.0 + by)
        self._forget(slot)
        self.unread[slot] = 20.0 + by

    @precondition(lambda self: self.read_order or self.expired_order)
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self.read_order + self.expired_order))
        self.books.touch(slot)
        order = self.read_order if slot in self.read_order else self.expired_order
        order.remove(slot)
        order.append(slot)

    @precondition(lambda self: self.pages)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.pages)))
        self.books.release(slot)
        del self.pages[slot]
        self._forget(slot)

    @rule(pages=st.integers(1, 50), limit=st.integers(0, 15))
    def ask(self, pages: int, limit: int) -> None:
        order = self.read_order + self.expired_order
        assert self.books.candidates(limit) == order[:limit]
        slot_free = len(self.pages) < SLOTS
        room = (
            pages <= PAGES
            and (slot_free or bool(order))
            and self.free() + self.evictable() >= pages
        )
        assert self.books.could_make_room(pages) == room

    @invariant()
    def books_agree(self) -> None:
        self.books.check()
        assert self.books.free_pages == self.free()
        assert self.books.evictable_pages == self.evictable()
        assert self.books.held == len(self.pages)
        free_runs = self.books._run_at.values()
        assert self.books.largest_run() == max(free_runs, default=0)


TestPlacementModel = PlacementModel.TestCase
TestPlacementModel.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_check_names_a_broken_invariant() -> None:
    books = Placement(8, 4)
    slot, _ = books.place(3, 1.0)
    books.check()
    books.free_pages += 1
    with pytest.raises(AssertionError, match="free pages"):
        books.check()
    books.free_pages -= 1
    books._held[slot].runs = ((0, 2),)
    with pytest.raises(AssertionError, match="neither free nor held"):
        books.check()


def test_scattered_free_pages_make_room_in_few_runs_largest_first() -> None:
    books = Placement(10, 10)
    slots = [books.place(1, 0.0)[0] for _ in range(10)]
    for slot in slots[0:2] + slots[5:9]:  # free runs of 2 and 4 pages
        books.release(slot)
    _, runs = books.place(5, 0.0)
    assert runs == ((5, 4), (0, 1))  # the largest run first, then what is left
    books.check()
    with pytest.raises(ValueError):
        Placement(0, 1)
    with pytest.raises(ValueError):
        books.place(0, 0.0)
