"""A tiered store's reads from Mooncake: bounded by a deadline, into private buffers."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from aostore import _buffers
from aostore._native import BlockObject
from aostore.errors import BlockObjectStoreError, ObjectMissingError
from aostore.mooncake.client import CallThread, MooncakeError
from aostore.mooncake.publisher import Publisher
from aostore.mooncake.remote import MooncakeBlockObjectStore

__all__ = ["Fetcher"]

logger = logging.getLogger("aostore")


class Fetcher:
    """Fetches what the local tier lacks from Mooncake for a tiered store.

    Every Mooncake call runs on a ``CallThread`` and is waited for at most ``read_deadline_s``
    (the wait for this process's queued publications of the keys included); the bytes land in
    a private buffer, so a call given up on never writes into the caller's memory. Keys that
    Mooncake may hold with older bytes (queued or recorded by the publisher) are not asked
    for. Fetched objects are kept locally where the local tier has room without growing, and
    never for a key that a put wrote while the read was fetching (``note_written``).
    """

    def __init__(
        self,
        remote: MooncakeBlockObjectStore,
        local: Any,
        publisher: Publisher,
        write_lock: threading.Lock,
        stats: dict[str, int],
        *,
        read_deadline_s: float,
        retry: bool,
        keep_fetched: bool,
    ) -> None:
        self.remote = remote
        self.local = local
        self.read_deadline_s = read_deadline_s
        self.reader = CallThread("aostore-mooncake-reader")
        self._publisher = publisher
        self._write_lock = write_lock
        self._stats = stats
        self._retry = retry
        self._keep_fetched = keep_fetched
        self._reads_in_flight = 0
        self._written_during_reads: set[str] = set()

    def note_written(self, keys: Iterable[str]) -> None:
        """A put wrote ``keys`` (called under the write lock): not kept from a running fetch."""
        if self._reads_in_flight:
            self._written_during_reads.update(keys)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Brackets a read that may keep what it fetches."""
        with self._write_lock:
            self._reads_in_flight += 1
        try:
            yield
        finally:
            with self._write_lock:
                self._reads_in_flight -= 1
                if not self._reads_in_flight:
                    self._written_during_reads.clear()

    def read_tiers(self, keys: list[str], view: memoryview) -> None:
        """A raising read's slow path: each key from the local store, the rest from Mooncake
        in one batch; a key in neither raises ``ObjectMissingError``."""
        n = self.remote.object_nbytes
        if view.nbytes != len(keys) * n:
            raise ValueError(
                f"out holds {view.nbytes} bytes, expected {len(keys)} x {n} = {len(keys) * n}"
            )
        self._stats["reads"] += 1
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"auxiliary output keys must be str, not {type(key).__name__}")
        first = _buffers.first_positions(keys)
        with self.reading():
            absent: list[str] = []
            for key, index in first.items():
                try:
                    self.local.get_into([key], view[index * n : (index + 1) * n])
                except ObjectMissingError:
                    absent.append(key)
            self._stats["local_hit_objects"] += len(first) - len(absent)
            fetched = self.fetch(absent)
            missing = [key for key in absent if key not in fetched]
            if missing:
                self._stats["read_misses"] += 1
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise ObjectMissingError(
                    f'auxiliary output object "{missing[0]}" does not exist in the local store '
                    f"or in Mooncake{more}; it was evicted from both, never published, or "
                    f"Mooncake could not give it within read_deadline_s. Increase "
                    f"aux_output_config.max_bytes or Mooncake's memory when a KV cache hit "
                    f"needs it."
                )
            for key, payload in fetched.items():
                index = first[key]
                view[index * n : (index + 1) * n] = payload
            self.keep(fetched)
        _buffers.copy_duplicates(keys, first, view, n)

    def fill_in(
        self, key_list: list[str], data: bytes, missing: list[str]
    ) -> tuple[bytes, list[str]]:
        """``get_many``'s slow path: ``data`` and ``missing`` from the local tier, completed
        from Mooncake; the keys found in neither, once per occurrence."""
        n = self.remote.object_nbytes
        self._stats["reads"] += 1
        self._stats["local_hit_objects"] += len(key_list) - len(missing)
        fetched = self.fetch(list(dict.fromkeys(missing)))
        self.keep(fetched)
        gone = set(missing)
        out = bytearray()
        local_view = memoryview(data)
        at = 0
        still: list[str] = []
        for key in key_list:
            if key not in gone:
                out += local_view[at * n : (at + 1) * n]
                at += 1
            elif key in fetched:
                out += fetched[key]
            else:
                still.append(key)
        if still:
            self._stats["read_misses"] += 1
        return bytes(out), still

    def held(self, absent: list[str]) -> set[str]:
        """Which of the distinct ``absent`` keys Mooncake holds (no read), within the deadline;
        a key queued, recorded or not answered for counts as not held."""
        deadline = time.monotonic() + self.read_deadline_s
        unsettled = self._publisher.wait_unsettled(absent, deadline)
        ask = [key for key in absent if key not in unsettled]
        if not ask:
            return set()
        answer = self._call(lambda: self.remote.exists_unique(ask), deadline, "a Mooncake lookup")
        if answer is None:
            return set()
        return {key for key, there in zip(ask, answer, strict=True) if there}

    def _call(self, fn: Callable[[], Any], deadline: float, what: str) -> Any:
        """``fn()`` on the reader thread, waited for until ``deadline``; ``None`` when it
        failed or did not return in time (``retry`` mode; ``raise`` mode raises)."""
        try:
            done, result = self.reader.call(fn, deadline - time.monotonic())
        except MooncakeError as error:
            self._stats["remote_read_failures"] += 1
            if not self._retry:
                raise
            self._publisher.warn_once(
                "%s failed (%s); served as a miss, as without the tier", what, error
            )
            return None
        if done:
            self._publisher.read_succeeded()
            return result
        self._stats["remote_read_failures"] += 1
        if not self._retry:
            raise MooncakeError(
                f"{what} did not complete within read_deadline_s={self.read_deadline_s} "
                f"(the Mooncake master at {self.remote.master_address or '?'} is stalled or "
                f"a previous call still waits on it)"
            )
        self._publisher.warn_once(
            "%s did not complete within read_deadline_s=%s (the master is stalled?); "
            "served as a miss, as without the tier",
            what,
            self.read_deadline_s,
        )
        return None

    def fetch(self, absent: list[str]) -> dict[str, bytes | memoryview]:
        """Fetches the distinct ``absent`` keys from Mooncake into a private buffer, within
        ``read_deadline_s`` (the wait for queued publications included): the payloads of the
        keys fetched. Keys that Mooncake may hold with other bytes are not asked for."""
        if not absent:
            return {}
        deadline = time.monotonic() + self.read_deadline_s
        unsettled = self._publisher.wait_unsettled(absent, deadline)
        ask = [key for key in absent if key not in unsettled]
        if not ask:
            return {}
        n = self.remote.object_nbytes
        whole = memoryview(bytearray(len(ask) * n))
        targets = [whole[i * n : (i + 1) * n] for i in range(len(ask))]
        missing = self._call(
            lambda: self.remote.read_unique(ask, targets), deadline, "a read from Mooncake"
        )
        if missing is None:
            return {}
        gone = set(missing)
        fetched = {key: targets[i] for i, key in enumerate(ask) if key not in gone}
        self._stats["remote_hit_objects"] += len(fetched)
        return dict(fetched)

    def keep(self, fetched: Mapping[str, Any]) -> None:
        """Keeps fetched objects in the local tier (when ``keep_fetched``), under the write
        lock; see ``_keep``."""
        if fetched and self._keep_fetched:
            with self._write_lock:
                self._keep(list(fetched), list(fetched.values()))

    def _keep(self, absent: list[str], targets: Sequence[Any]) -> None:
        """Puts fetched objects in the local tier where it has room without growing: free slots
        plus evictable objects. Skipped: keys stored meanwhile or written by a put while the
        read was fetching (Mooncake may not have had those bytes yet), and whatever does not
        fit. Called under the write lock. A read never allocates and never fails here."""
        try:
            candidates = [
                (key, target)
                for key, target, stored in zip(
                    absent, targets, self.local.contains(absent), strict=True
                )
                if not stored and key not in self._written_during_reads
            ]
            stats = self.local.stats()
            room = min(int(stats["free_slots"]) + int(stats["evictable"]), len(candidates))
            # The last ones when not all fit (the local tier keeps the most recent).
            keep = candidates[len(candidates) - room :] if room > 0 else []
            self._stats["not_kept_objects"] += len(absent) - len(keep)
            if not keep:
                return
            self.local.put([BlockObject(key, target) for key, target in keep])
            self._stats["kept_objects"] += len(keep)
        except BlockObjectStoreError as error:  # a policy refused the victims, say
            self._stats["keep_failures"] += 1
            logger.debug("keeping objects fetched from Mooncake failed: %s", error)
        except Exception as error:  # a policy's own exception: the read still succeeds
            self._stats["keep_failures"] += 1
            logger.warning("keeping objects fetched from Mooncake failed: %r", error)
