"""The tiered store's publisher: what goes to Mooncake, and the record of what could not.

A ``QueueWorker`` publishes queued puts (several coalesced into one batch of bytes). With
``retry`` (the default) a fault never reaches the engine: what fails or does not fit the queue
is recorded as unpublished, the master is probed with backoff and through a marker object (a
restarted master lost it), and recorded keys the local tier still holds are republished. With
``raise`` the first error is latched. docs/mooncake.md ("Faults") has the promises.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from aostore._worker import QueueWorker
from aostore.mooncake.remote import MooncakeBlockObjectStore

__all__ = ["Publisher"]

logger = logging.getLogger("aostore")

_OVERLOAD_WARNING_INTERVAL_S = 60
_FILTER_BITS = 1 << 20  # keys recorded unpublished beyond the record: 128 KiB of bits


class _Item:
    """A queued publication: keys, their payloads, and the sequence number of the put."""

    __slots__ = ("keys", "payloads", "seq")

    def __init__(self, seq: int, keys: list[str], payloads: Sequence[Any]) -> None:
        self.seq = seq
        self.keys = keys
        self.payloads = payloads


class Publisher:
    """Publishes what a tiered store's local tier wrote; records what it could not.

    ``stats`` is the tier's counter dict (this adds its publication and fault counters there).
    ``write_lock`` is the tier's lock over local writes: a republication reads the local tier
    under it. All state is under ``cond`` (the worker's), which readers wait on.
    """

    def __init__(
        self,
        remote: MooncakeBlockObjectStore,
        local: Any,
        write_lock: threading.Lock,
        stats: dict[str, int],
        *,
        retry: bool,
        max_pending_batches: int,
        max_unpublished_keys: int,
        retry_backoff_s: float,
        retry_backoff_max_s: float,
        check_interval_s: float,
    ) -> None:
        self.remote = remote
        self.local = local
        self._write_lock = write_lock
        self._stats = stats
        self._retry = retry
        self._max_pending = max_pending_batches
        self.max_unpublished_keys = max_unpublished_keys
        self._backoff_min = retry_backoff_s
        self._backoff_max = retry_backoff_max_s
        self._check_interval = check_interval_s
        self._n = remote.object_nbytes
        self._batch_bytes = remote.batch_objects * remote.object_nbytes
        # Keys queued or being published (reads wait for them); the record of unpublished keys
        # (key -> [sequence number of the write it stands for, local tier found to lack it]);
        # the keys published lately (republished after a master restart).
        self._pending: dict[str, int] = {}
        self._seq = 0
        self._record: dict[str, list[Any]] = {}
        self._filter = bytearray(_FILTER_BITS // 8)
        self._backlog = False
        self._published: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.outage_since: float | None = None
        self._warned = False
        self._overload_warned = 0.0
        self._marker = f"__aostore_tier__/{os.getpid()}-{uuid.uuid4().hex}"
        self._marker_written = False
        # The publisher thread's own timing (only it reads and writes these).
        self._backoff = retry_backoff_s
        self._next_probe = 0.0
        self._next_check = time.monotonic() + check_interval_s
        self.worker: QueueWorker[_Item] = QueueWorker(
            self._apply,
            max_pending=max_pending_batches,
            name="aostore-mooncake-publisher",
            what="tiered store",
            latch_errors=not retry,
            take=self._take,
            on_skip=self._skip,
            idle_due=self._idle_due if retry else None,
            idle=self._idle if retry else None,
        )
        self.cond = self.worker.cond

    # -- the caller's side ------------------------------------------------------------------

    def enqueue(self, keys: list[str], payloads: Sequence[Any]) -> None:
        """Queues one publication, or records it as unpublished when the queue is full (in
        ``retry`` mode, or with an error latched; ``raise`` mode waits for room). Called
        under the tier's write lock, so the queue's order is the local tier's."""
        with self.cond:
            if self.worker.closed:
                raise RuntimeError("auxiliary output store is closed")
            self._seq += 1
            item = _Item(self._seq, keys, payloads)
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1
            wait = not self._retry and self.worker.error is None
            queued = False
            try:
                queued = self.worker.submit(item, wait_for_room=wait)
            finally:
                if not queued:
                    self._unpend(keys)
            if queued:
                self._stats["queued_objects"] += len(keys)
                return
            self._stats["dropped_objects"] += len(keys)
            self._record_keys(keys, item.seq)
            now = time.monotonic()
            if self._warned or now < self._overload_warned:
                return  # one WARNING per outage or overload
            self._warned = True
            self._overload_warned = now + _OVERLOAD_WARNING_INTERVAL_S
            logger.warning(
                "aostore Mooncake tier: the Mooncake publication queue is full (%d batches; "
                "Mooncake is down, stalled or slower than the engine): puts go on locally and "
                "what does not fit is recorded as unpublished, to be republished from the local "
                "tier when the publisher catches up (logged at most every %d s)",
                self._max_pending,
                _OVERLOAD_WARNING_INTERVAL_S,
            )

    def wait_unsettled(self, keys: list[str], deadline: float) -> set[str]:
        """Waits (until ``deadline``) for this process's queued publications of ``keys``; the
        keys that Mooncake may not hold with this process's bytes afterwards: still queued,
        or recorded as unpublished."""
        with self.cond:
            while any(key in self._pending for key in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.worker.alive:
                    break
                self.cond.wait(remaining)
            self.worker.raise_if_failed()
            return {key for key in keys if key in self._pending or self._unsettled(key)}

    def flush(self, timeout: float | None) -> bool:
        """Waits until the queue is published or recorded and, while the master answers,
        recorded keys that the local tier holds are republished."""
        return self.worker.wait(
            timeout,
            also=lambda: self._backlog and self.outage_since is None and self.worker.error is None,
        )

    def unpublished_keys(self) -> list[str]:
        with self.cond:
            return list(self._record)

    def counts(self) -> dict[str, int]:
        """The publisher's gauges, for the tier's ``stats()``."""
        with self.cond:
            beyond = self._stats["unpublished_not_recorded"]
            return {
                "pending_batches": self.worker.pending,
                "unpublished_recorded": len(self._record),
                "unpublished_objects": len(self._record) + beyond,
                "mooncake_down": int(self.outage_since is not None),
            }

    def warn_once(self, message: str, *args: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("aostore Mooncake tier: " + message, *args)

    def read_succeeded(self) -> None:
        """A read from Mooncake worked: the next fault warns again, unless one is still on."""
        if self._warned and self.outage_since is None and not self._record:
            self._warned = False

    def remove_marker(self) -> None:
        if self._marker_written and self.outage_since is None:
            self.remote.remove_marker(self._marker)

    # -- the record of unpublished keys (under cond) ----------------------------------------

    def _unpend(self, keys: Iterable[str]) -> None:
        pending = self._pending
        for key in keys:
            left = pending[key] - 1
            if left:
                pending[key] = left
            else:
                del pending[key]

    def _record_keys(self, keys: Iterable[str], seq: int) -> None:
        """Records ``keys`` as unpublished as of write ``seq`` (the record keeps the latest)."""
        record = self._record
        for key in keys:
            entry = record.get(key)
            if entry is not None:
                if seq > entry[0]:
                    entry[0] = seq
                    entry[1] = False  # a newer write: worth republishing again
            elif len(record) < self.max_unpublished_keys:
                record[key] = [seq, False]
            else:
                bit = hash(key) % _FILTER_BITS
                self._filter[bit >> 3] |= 1 << (bit & 7)
                self._stats["unpublished_not_recorded"] += 1
        if self._retry:
            self._backlog = True

    def _unsettled(self, key: str) -> bool:
        """Whether Mooncake may hold other bytes than this process last wrote under ``key``
        (it is recorded as unpublished, or may be among the keys beyond the record)."""
        if key in self._record:
            return True
        if self._stats["unpublished_not_recorded"]:
            bit = hash(key) % _FILTER_BITS
            return bool(self._filter[bit >> 3] & (1 << (bit & 7)))
        return False

    def _settled(self, keys: Iterable[str], seq: int) -> None:
        """``keys`` were published with bytes as of write ``seq``: drops their older records."""
        record = self._record
        published = self._published
        bound = max(self.max_unpublished_keys, 1)
        for key in keys:
            entry = record.get(key)
            if entry is not None and entry[0] < seq:
                del record[key]
            published[key] = None
            published.move_to_end(key)
            if len(published) > bound:
                published.popitem(last=False)

    def _release(self, items: list[_Item], published: bool) -> None:
        """The end of queued items: settled when published, else recorded."""
        with self.cond:
            for item in items:
                self._unpend(item.keys)
                if published:
                    self._settled(item.keys, item.seq)
                else:
                    self._record_keys(item.keys, item.seq)
            self.cond.notify_all()

    def _skip(self, items: list[_Item]) -> None:
        self._release(items, False)

    # -- the publisher thread ---------------------------------------------------------------

    def _take(self, queue: collections.deque[_Item]) -> list[_Item]:
        """Up to one batch of bytes from the queue (at least one item)."""
        items = [queue.popleft()]
        count = len(items[0].keys)
        while queue and count * self._n < self._batch_bytes:
            item = queue.popleft()
            items.append(item)
            count += len(item.keys)
        return items

    def _apply(self, items: list[_Item]) -> None:
        if self.outage_since is not None:  # retry mode, Mooncake down
            if self.worker.stopping or time.monotonic() < self._next_probe or not self._recover():
                self._release(items, False)  # recorded, republished when it is back
                return
        if not self._publish_items(items):
            self._next_probe = time.monotonic() + self._backoff

    def _idle_due(self) -> float:
        down = self.outage_since is not None
        if self._backlog and not down:
            return 0.0
        return (self._next_probe if down else self._next_check) - time.monotonic()

    def _idle(self) -> None:
        if self.outage_since is not None and not self._recover():
            return
        if self._backlog:
            if not self._republish_some():
                self._next_probe = time.monotonic() + self._backoff
            return
        self._next_check = time.monotonic() + self._check_interval  # is the master there?
        if not self._probe():
            self._next_probe = time.monotonic() + self._backoff

    def _recover(self) -> bool:
        """During an outage: probes the master; ends the outage when it answers."""
        if not self._probe():
            self._backoff = min(self._backoff * 2, self._backoff_max)
            self._next_probe = time.monotonic() + self._backoff
            return False
        since = self.outage_since
        self.outage_since = None
        self._warned = False
        self._backoff = self._backoff_min
        self._next_check = time.monotonic() + self._check_interval
        if since is not None:
            logger.info(
                "aostore Mooncake tier: the master answers again after %.1f s; republishing "
                "what the local tier still holds of %d unpublished keys",
                time.monotonic() - since,
                len(self._record),
            )
        return True

    def _fault(self, what: str, error: BaseException) -> None:
        """A publication fault: logged (``raise``) or the start of an outage (``retry``)."""
        self._stats["publish_failures"] += 1
        if not self._retry:
            logger.error("publishing auxiliary outputs to Mooncake failed: %s", error)
            return
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            self._stats["outages"] += 1
            self.warn_once(
                "%s failed (%s); inference goes on with the local tier, what cannot be "
                "published is recorded as unpublished (stats()['unpublished_objects']) and "
                "republished from the local tier when the master answers again",
                what,
                error,
            )

    def _probe(self) -> bool:
        """Asks the master for the tier's marker (and writes it when absent). A marker that was
        written and is gone means a master that lost its data: what this tier published
        lately is recorded as unpublished, to be republished from the local tier."""
        try:
            if not self.remote.marker_present(self._marker):
                if self._marker_written:
                    self._stats["master_restarts"] += 1
                    with self.cond:
                        lost = list(self._published)
                        self._published.clear()
                        self._seq += 1
                        self._record_keys(lost, self._seq)
                    logger.warning(
                        "aostore Mooncake tier: the Mooncake master lost this tier's objects "
                        "(restarted?); republishing what the local tier still holds of the "
                        "%d keys published lately",
                        len(lost),
                    )
                    self._marker_written = False  # once per loss, even if the write fails
                self.remote.write_marker(self._marker)
                self._marker_written = True
        except Exception as error:
            self._fault("checking the master", error)
            return False
        return True

    def _publish_items(self, items: list[_Item]) -> bool:
        # Every queued key was written by the local tier, in the order of the queue (puts
        # enqueue under the write lock): the last payload of a key is what the local tier
        # holds, and publication overwrites what Mooncake had.
        unique: dict[str, Any] = {}
        for item in items:
            unique.update(zip(item.keys, item.payloads, strict=True))
        try:
            self.remote.publish(list(unique), list(unique.values()))
        except BaseException as error:
            self._release(items, False)
            self._fault(f"publishing {len(unique)} objects", error)
            if not self._retry:
                raise  # latched by the worker
            return False
        with self.cond:
            self._release(items, True)
            self._stats["published_objects"] += len(unique)
            self._stats["publish_batches"] += 1
        if self._retry and not self._marker_written:
            self._probe()
        return True

    def _republish_some(self) -> bool:
        """Republishes up to one batch of recorded keys that the local tier holds, with the
        bytes it holds; marks those it lacks (they stay recorded). False on a fault."""
        limit = max(1, self._batch_bytes // self._n)
        with self._write_lock:  # no put between the look at the record and the local read
            with self.cond:
                keys = [key for key, entry in self._record.items() if not entry[1]][:limit]
                if not keys:
                    self._backlog = False
                    self.cond.notify_all()
                    return True
                self._seq += 1
                seq = self._seq
            try:
                data, missing = self.local.get_many(keys)
            except Exception as error:  # the local store closed under us
                logger.debug("reading the local tier to republish failed: %s", error)
                with self.cond:
                    self._backlog = False
                    self.cond.notify_all()
                return True
        absent = set(missing)
        held = [key for key in keys if key not in absent]
        n = self._n
        view = memoryview(data)
        payloads = [view[i * n : (i + 1) * n] for i in range(len(held))]
        if held:
            try:
                self.remote.publish(held, payloads)
            except BaseException as error:
                self._fault(f"republishing {len(held)} objects", error)
                return False
        with self.cond:
            for key in absent:
                entry = self._record.get(key)
                if entry is not None and entry[0] < seq:
                    entry[1] = True  # evicted locally: stays recorded, not retried
            self._settled(held, seq)
            self._stats["republished_objects"] += len(held)
        return True
