"""One Python queue writer: a thread that applies queued items in order.

The background store's Python writer and the Mooncake tier's publisher are both a
``QueueWorker``; each chooses how items are taken (one at a time, or coalesced) and what an
error does (latched and raised to the caller, or handed back to be recorded and retried).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from aostore.errors import BlockObjectStoreError

__all__ = ["QueueWorker", "fork_generation"]

logger = logging.getLogger("aostore")

T = TypeVar("T")

# Bumped in a forked child: threads (a worker's, Mooncake's client's) exist only in the process
# that started them.
_generation = 0


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """How many ``fork()`` calls led to this process (0 in the process that imported aostore)."""
    return _generation


def _take_one(queue: collections.deque[T]) -> list[T]:
    return [queue.popleft()]


class QueueWorker(Generic[T]):
    """A bounded queue of items and the one thread that applies them, in order.

    - ``apply(items)`` runs on the thread, on what ``take(queue)`` removed from the queue (by
      default one item; a user may coalesce several).
    - Errors: with ``latch_errors`` the first exception ``apply`` raises is latched: later
      items are skipped, and ``submit``, ``wait`` and ``close`` raise ``BlockObjectStoreError``
      ("publication failed") chained from it. Without it, the error goes to ``on_failure``
      and the worker goes on (the user records what failed and retries). ``on_failure(items,
      error)`` is called in both modes, ``on_skip(items)`` for items never applied (after a
      latch, or still queued when ``close`` gave up).
    - ``idle_due()``: seconds until the user's idle work is due (``None``: none); ``idle()``
      then runs on the thread while the queue is empty.
    - ``close`` lets the thread apply what is queued, stops it, runs ``finish`` (closing what
      the items were applied to) and raises a latched error; a second closer on another thread
      waits until the first is done, a close from inside the first returns at once.
    - ``cond`` is the condition all state is kept under; a user passes its own to keep its
      state under the same lock. In a forked child every call raises ``RuntimeError``.
    """

    def __init__(
        self,
        apply: Callable[[list[T]], None],
        *,
        max_pending: int,
        name: str,
        what: str,
        latch_errors: bool = True,
        take: Callable[[collections.deque[T]], list[T]] = _take_one,
        on_failure: Callable[[list[T], BaseException], None] | None = None,
        on_skip: Callable[[list[T]], None] | None = None,
        idle_due: Callable[[], float | None] | None = None,
        idle: Callable[[], None] | None = None,
        cond: threading.Condition | None = None,
    ) -> None:
        self._apply = apply
        self._max_pending = max_pending
        self._what = what
        self._latch = latch_errors
        self._take = take
        self._on_failure = on_failure
        self._on_skip = on_skip
        self._idle_due = idle_due
        self._idle = idle
        self.cond = cond if cond is not None else threading.Condition()
        self._queue: collections.deque[T] = collections.deque()
        self._busy = False
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._closer: int | None = None
        self._close_done = threading.Event()
        self._generation = _generation
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    # -- state (read under ``cond`` by users that share it) -------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def stopping(self) -> bool:
        """Whether ``close`` has begun: the thread applies what is queued, then ends."""
        return self._stopping

    @property
    def error(self) -> BaseException | None:
        """The latched error (``latch_errors``), if any."""
        return self._error

    @property
    def pending(self) -> int:
        """Items queued and not taken yet."""
        return len(self._queue)

    @property
    def idle_now(self) -> bool:
        """Nothing queued and nothing being applied."""
        return not self._queue and not self._busy

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check_process(self) -> None:
        if self._generation != _generation:
            raise RuntimeError(
                f"this aostore {self._what} was created in the parent process before fork(); "
                f"its thread does not exist here: create a new store in the child"
            )

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise BlockObjectStoreError("auxiliary output publication failed") from self._error

    # -- the caller's side ----------------------------------------------------------------

    def submit(self, item: T, *, wait_for_room: bool = True) -> bool:
        """Queues ``item``; False when the queue is full and not ``wait_for_room``. The closed
        check and the append are one step under ``cond``, which ``close`` takes, so nothing
        lands behind the thread's last look at the queue."""
        self.check_process()
        with self.cond:
            if self._closed:
                raise RuntimeError("auxiliary output store is closed")
            self.raise_if_failed()
            if len(self._queue) >= self._max_pending:
                if not wait_for_room:
                    return False
                while len(self._queue) >= self._max_pending and not self._closed:
                    self.cond.wait()
                if self._closed:
                    raise RuntimeError("auxiliary output store is closed")
            self._queue.append(item)
            self.cond.notify_all()
        self.raise_if_failed()
        return True

    def wait(self, timeout: float | None = None, *, also: Callable[[], bool] | None = None) -> bool:
        """Waits until nothing is queued or being applied (and ``also()``, under ``cond``, is
        false), at most ``timeout`` seconds; True when that state was reached. Raises a
        latched error."""
        self.check_process()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.idle_now or (also is not None and also()):
                if not self._thread.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self.cond.wait(remaining)
            done = self.idle_now
        self.raise_if_failed()
        return done

    def close(self, finish: Callable[[], None] | None = None, timeout: float | None = None) -> bool:
        """Applies what is queued (at most ``timeout`` seconds; the rest goes to ``on_skip``),
        stops the thread, runs ``finish``, raises a latched error. True when the thread
        ended in time. Idempotent; see the class docstring for concurrent closers."""
        self.check_process()
        me = threading.get_ident()
        with self.cond:
            first = not self._closed
            self._closed = True
            self._stopping = True
            if first:
                self._closer = me
            self.cond.notify_all()
        if not first:
            # A close in progress on another thread: wait for it and raise what it raises. A
            # finished one (idempotent) or our own, re-entered: return at once.
            if self._closer != me and not self._close_done.is_set():
                self._close_done.wait()
                self.raise_if_failed()
            return not self._thread.is_alive()
        try:
            self._thread.join(timeout)
            ended = not self._thread.is_alive()
            if not ended:
                with self.cond:
                    left = list(self._queue)
                    self._queue.clear()
                    if left and self._on_skip is not None:
                        self._on_skip(left)
                    self.cond.notify_all()
            if finish is not None:
                finish()
        finally:
            self._close_done.set()
        self.raise_if_failed()
        return ended

    # -- the thread -----------------------------------------------------------------------

    def _next(self) -> list[T] | None:
        """The next items, ``[]`` for idle work, ``None`` to stop. Under ``cond``."""
        self._busy = False
        self.cond.notify_all()
        while not self._queue and not self._stopping:
            due = self._idle_due() if self._idle_due is not None else None
            if due is not None and due <= 0:
                return []
            self.cond.wait(due)
        if not self._queue:
            return None
        items = self._take(self._queue)
        self._busy = True
        self.cond.notify_all()  # room in the queue
        return items

    def _run(self) -> None:
        while True:
            with self.cond:
                items = self._next()
            if items is None:
                return
            if not items:
                if self._idle is not None:
                    self._idle()
                continue
            if self._error is not None:
                if self._on_skip is not None:
                    with self.cond:
                        self._on_skip(items)
                continue
            try:
                self._apply(items)
            except BaseException as error:  # latched, or handed back to be recorded
                if self._latch:
                    self._error = error
                elif self._on_failure is None:
                    logger.warning(
                        "aostore %s: applying queued items failed: %r", self._what, error
                    )
                if self._on_failure is not None:
                    self._on_failure(items, error)
            finally:
                # The items' payloads are not needed any more: release them now, not when the
                # next items replace this frame's variable.
                items = None
