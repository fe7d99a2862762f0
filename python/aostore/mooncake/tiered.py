"""``TieredBlockObjectStore``: the local aostore arena in front of Mooncake."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aostore import _buffers
from aostore._native import BlockObject
from aostore._reads import BufferReads
from aostore.errors import BlockObjectStoreError, ObjectMissingError
from aostore.mooncake.client import CallThread, MooncakeError
from aostore.mooncake.config import MooncakeConfig
from aostore.mooncake.publisher import Publisher
from aostore.mooncake.remote import MooncakeBlockObjectStore

__all__ = ["TieredBlockObjectStore", "put_and_report"]

logger = logging.getLogger("aostore")

_ON_PUBLISH_ERROR = ("retry", "raise")


def put_and_report(
    local: Any, method: str, *args: Any, keys: list[str], **options: Any
) -> list[str]:
    """Runs ``local.<method>(*args, **options)`` (``put`` or ``put_blocks``) and returns which
    of the put's distinct ``keys`` (in first-occurrence order) it wrote: stored new, or
    replaced (``grow``: a stored key nothing references). Those are published.

    The native stores do not report their writes yet, so this asks before the put
    (check-then-act, sound only under the tier's write lock). Once they do, this body becomes
    ``return getattr(local, method + "_reporting")(*args, **options)``.
    """
    written = keys
    if keys:
        stored = local.contains(keys)
        if getattr(local, "profile", "fail-closed") == "grow":
            counts = local.reference_counts(keys)
            written = [k for k, s, c in zip(keys, stored, counts, strict=True) if not s or c == 0]
        else:
            written = [key for key, s in zip(keys, stored, strict=True) if not s]
    getattr(local, method)(*args, **options)
    return written


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class TieredBlockObjectStore(BufferReads):
    """The local aostore arena in front of Mooncake.

    ``TieredBlockObjectStore(local, remote, *, max_pending_batches=8, keep_fetched=True,
    on_publish_error="retry", read_deadline_s=4.0, retry_backoff_s=0.5,
    retry_backoff_max_s=5.0, check_interval_s=1.0, max_unpublished_keys=65536,
    close_timeout_s=10.0)``: ``local`` is a ``BlockObjectStore`` (the hot tier, with its own
    eviction and reference counts), ``remote`` a ``MooncakeBlockObjectStore`` of the same
    ``object_nbytes``. The tiered store owns both: ``close`` closes them.

    - ``put``/``put_blocks`` apply to ``local`` at once (with its semantics and errors), then
      queue what the local tier wrote for Mooncake; a publisher thread publishes queued
      batches with ``MooncakeBlockObjectStore.publish`` (which overwrites), joining several
      into one. ``bytes`` payloads are published as they are, other buffers copied once.
      One value per key: the local tier decides and publication overwrites.
    - ``get_concatenated``/``get_into``/``get_array`` read ``local``; on a local miss they
      wait for this process's queued publications of the missing keys, then fetch them from
      Mooncake in one batch into a private buffer, all within ``read_deadline_s``. A key
      still queued at the deadline, recorded as unpublished, or that Mooncake does not give
      is a miss: ``ObjectMissingError`` (``does not exist``), as without the tier. When
      ``keep_fetched``, fetched objects go into ``local`` where it has room without growing.
      ``get_many``, ``get_optional`` and ``contains`` are the non-raising forms.
    - Faults: with ``on_publish_error="retry"`` (the default) no Mooncake fault reaches the
      caller: what fails or does not fit the queue is recorded (``unpublished_keys()``,
      ``stats()``) and republished from the local tier when the master answers again.
      ``"raise"`` latches the first publication error and raises it from the next call.
    - ``flush(timeout=None)`` waits until every queued batch is published or recorded, and,
      while the master answers, recorded keys still local are republished.
    - After ``fork()``, every call but ``stats()`` raises ``RuntimeError`` in the child.

    docs/mooncake.md has the rules in full (which write wins, faults, the options).
    """

    def __init__(
        self,
        local: Any,
        remote: MooncakeBlockObjectStore,
        *,
        max_pending_batches: int = 8,
        keep_fetched: bool = True,
        on_publish_error: str = "retry",
        read_deadline_s: float = 4.0,
        retry_backoff_s: float = 0.5,
        retry_backoff_max_s: float = 5.0,
        check_interval_s: float = 1.0,
        max_unpublished_keys: int = 65_536,
        close_timeout_s: float = 10.0,
    ) -> None:
        if isinstance(max_pending_batches, bool) or not isinstance(max_pending_batches, int):
            raise TypeError("max_pending_batches must be an int")
        if max_pending_batches < 1:
            raise ValueError("max_pending_batches must be at least 1")
        if on_publish_error not in _ON_PUBLISH_ERROR:
            raise ValueError(
                f"on_publish_error must be one of {_ON_PUBLISH_ERROR}, not {on_publish_error!r}"
            )
        if isinstance(max_unpublished_keys, bool) or not isinstance(max_unpublished_keys, int):
            raise TypeError("max_unpublished_keys must be an int")
        if max_unpublished_keys < 0:
            raise ValueError("max_unpublished_keys must not be negative")
        if local.object_nbytes != remote.object_nbytes:
            raise ValueError(
                f"local object_nbytes={local.object_nbytes} differs from the Mooncake store's "
                f"{remote.object_nbytes}"
            )
        self.local = local
        self.remote = remote
        self.object_nbytes: int = local.object_nbytes
        self.keep_fetched = keep_fetched
        self.on_publish_error = on_publish_error
        self.read_deadline_s = _positive("read_deadline_s", read_deadline_s)
        self.retry_backoff_s = _positive("retry_backoff_s", retry_backoff_s)
        self.retry_backoff_max_s = max(
            self.retry_backoff_s, _positive("retry_backoff_max_s", retry_backoff_max_s)
        )
        self.check_interval_s = _positive("check_interval_s", check_interval_s)
        self.close_timeout_s = _positive("close_timeout_s", close_timeout_s)
        self.max_unpublished_keys = max_unpublished_keys
        self._retry = on_publish_error == "retry"
        # Serializes the tier's writes to the local store (puts and kept fetches), so that the
        # publication queue's order is the order of the local writes, and a fetch is kept only
        # if no put wrote the key while the read was fetching it. Taken before the publisher's.
        self._write_lock = threading.Lock()
        self._reads_in_flight = 0
        self._written_during_reads: set[str] = set()
        self._reader = CallThread("aostore-mooncake-reader")
        self._stats = dict.fromkeys(
            (
                "puts",
                "queued_objects",
                "published_objects",
                "publish_batches",
                "reads",
                "local_hit_objects",
                "remote_hit_objects",
                "read_misses",
                "kept_objects",
                "not_kept_objects",
                "keep_failures",
                "dropped_objects",
                "publish_failures",
                "republished_objects",
                "outages",
                "master_restarts",
                "remote_read_failures",
                "unpublished_not_recorded",
            ),
            0,
        )
        self._publisher = Publisher(
            remote,
            local,
            self._write_lock,
            self._stats,
            retry=self._retry,
            max_pending_batches=max_pending_batches,
            max_unpublished_keys=max_unpublished_keys,
            retry_backoff_s=self.retry_backoff_s,
            retry_backoff_max_s=self.retry_backoff_max_s,
            check_interval_s=self.check_interval_s,
        )

    @classmethod
    def from_config(
        cls,
        config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        max_bytes: int,
        object_nbytes: int,
        max_pending_batches: int = 8,
        keep_fetched: bool = True,
        tier_options: Mapping[str, Any] | None = None,
        **local_options: Any,
    ) -> TieredBlockObjectStore:
        """A local ``BlockObjectStore(max_bytes=..., object_nbytes=..., **local_options)`` in
        front of ``MooncakeBlockObjectStore.from_config(config, object_nbytes=...)``;
        ``tier_options`` are further keyword arguments of the tier (``on_publish_error``,
        ``read_deadline_s``, ...). An unreachable master raises ``MooncakeError`` here."""
        from aostore._store import BlockObjectStore

        remote = MooncakeBlockObjectStore.from_config(config, object_nbytes=object_nbytes)
        try:
            local = BlockObjectStore(
                max_bytes=max_bytes, object_nbytes=object_nbytes, **local_options
            )
        except BaseException:
            remote.close()
            raise
        try:
            return cls(
                local,
                remote,
                max_pending_batches=max_pending_batches,
                keep_fetched=keep_fetched,
                **dict(tier_options or {}),
            )
        except BaseException:
            local.close()
            remote.close()
            raise

    @property
    def closed(self) -> bool:
        return self._publisher.worker.closed

    @property
    def num_slots(self) -> int:
        return int(self.local.num_slots)

    # -- writes --------------------------------------------------------------------------

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """``local.put(...)``, then queues what the local tier wrote for Mooncake."""
        self._check_usable()
        batch = list(objects)
        latest = {item.key: item.payload for item in batch}
        self._put_then_queue(
            "put", (batch,), latest, retain_keys, release_keys, lambda w: [latest[k] for k in w]
        )

    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: Any,
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """``local.put_blocks(...)``, then queues the rows the local tier wrote (one copy)."""
        self._check_usable()
        key_list = list(keys)
        n = self.object_nbytes
        host = _buffers.block_bytes(blocks, len(key_list), n)
        view = memoryview(host).cast("B") if key_list else memoryview(b"")
        last = {key: i for i, key in enumerate(key_list)}  # the last row of a key wins
        rows = {key: view[i * n : (i + 1) * n] for key, i in last.items()}

        def payloads(written: list[str]) -> Any:
            data = host if type(host) is bytes else _buffers.snapshot(host)
            if written == key_list:  # every row, once: sliced on the publisher thread
                return _buffers.Rows(data, n, len(key_list))
            flat = memoryview(data).cast("B")
            return [flat[last[key] * n : (last[key] + 1) * n] for key in written]

        self._put_then_queue(
            "put_blocks", (key_list, host), rows, retain_keys, release_keys, payloads
        )

    def _put_then_queue(
        self,
        method: str,
        args: tuple[Any, ...],
        latest: Mapping[str, Any],
        retain_keys: Iterable[str],
        release_keys: Iterable[str],
        payloads: Callable[[list[str]], Any],
    ) -> None:
        """The local put and the queueing of what it wrote, under the write lock."""
        with self._write_lock:
            try:
                written = put_and_report(
                    self.local,
                    method,
                    *args,
                    keys=list(latest),
                    retain_keys=retain_keys,
                    release_keys=release_keys,
                )
            except (TypeError, ValueError, KeyError):
                raise  # refused before anything changed
            except BaseException:
                self._queue_what_is_held(latest)
                raise
            self._stats["puts"] += 1
            if not written:
                return
            self._queue(written, payloads(written))

    def _queue(self, keys: list[str], payloads: Sequence[Any]) -> None:
        """Queues ``payloads`` (a private copy unless ``bytes``) under ``keys``; called under
        the write lock, right after the local put, so the queue's order is the local tier's."""
        if self._reads_in_flight:
            self._written_during_reads.update(keys)
        if not isinstance(payloads, _buffers.Rows):
            payloads = [p if type(p) is bytes else _buffers.snapshot(p) for p in payloads]
        self._publisher.enqueue(keys, payloads)

    def _queue_what_is_held(self, latest: Mapping[str, Any]) -> None:
        """After a local put raised past validation (a policy's exception, say): queues the
        keys the local tier holds with this put's bytes, so no local write is left
        unpublished. Never raises over the put's own error."""
        try:
            keys = list(latest)
            stored = [key for key, s in zip(keys, self.local.contains(keys), strict=True) if s]
            if not stored:
                return
            data, missing = self.local.get_many(stored)
            n = self.object_nbytes
            absent = set(missing)
            held = [key for key in stored if key not in absent]
            view = memoryview(data)
            same = [
                key
                for i, key in enumerate(held)
                if _buffers.same_bytes(view[i * n : (i + 1) * n], _buffers.snapshot(latest[key]))
            ]
            if same:
                self._queue(same, [latest[key] for key in same])
        except Exception as error:  # the put's own exception is the one to raise
            logger.warning("could not queue a failed put's objects for Mooncake: %s", error)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued batch is published or recorded as unpublished and, while
        the master answers, recorded keys that the local tier holds are republished; at most
        ``timeout`` seconds when given. True when that state was reached. Raises a latched
        error (``raise`` mode)."""
        self._check_open()
        return self._publisher.flush(timeout)

    def unpublished_keys(self) -> list[str]:
        """The keys recorded as unpublished (at most ``max_unpublished_keys``, oldest first):
        Mooncake may lack them or hold other bytes; ``stats()["unpublished_not_recorded"]``
        counts those that did not fit the record. A key leaves the record once published."""
        return self._publisher.unpublished_keys()

    # -- reads ---------------------------------------------------------------------------

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        """The payloads of ``keys`` in order, from the local store or else from Mooncake."""
        self._check_usable()
        key_list = list(keys)
        try:
            data: bytes = self.local.get_concatenated(key_list)
        except ObjectMissingError:
            out = bytearray(len(key_list) * self.object_nbytes)
            self._read_tiers(key_list, memoryview(out))
            return bytes(out)
        self._count_local_hit(len(key_list))
        return data

    def _check_readable(self) -> None:
        self._check_usable()

    def _read_into(self, keys: list[str], host: Any) -> None:
        try:
            self.local.get_into(keys, host)
        except ObjectMissingError:
            self._read_tiers(keys, _buffers.writable_view(host))
        else:
            self._count_local_hit(len(keys))

    def get_many(self, keys: Iterable[str]) -> tuple[bytes, list[str]]:
        """Never raises for a missing key: ``(data, missing)``, the payloads of the keys found
        in either tier concatenated in order, and the keys found in neither, once per
        occurrence, in order (as ``BlockObjectStore.get_many``). Misses locally are fetched
        from Mooncake within ``read_deadline_s``, as the raising reads do."""
        self._check_usable()
        key_list = list(keys)
        data, missing = self.local.get_many(key_list)
        if not missing:
            self._count_local_hit(len(key_list))
            return data, missing
        n = self.object_nbytes
        self._stats["reads"] += 1
        self._stats["local_hit_objects"] += len(key_list) - len(missing)
        fetched = self._fetch_remote(list(dict.fromkeys(missing)))
        if fetched and self.keep_fetched:
            with self._write_lock:
                self._keep(list(fetched), list(fetched.values()))
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

    def get_optional(self, key: str) -> bytes | None:
        """The payload of ``key`` from either tier, or ``None`` when neither has it."""
        data, missing = self.get_many([key])
        return None if missing else data

    def contains(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is in either tier (no read, no LRU move). For keys the local tier
        lacks, asks Mooncake within ``read_deadline_s``; a key recorded as unpublished, still
        queued at the deadline, or that Mooncake does not answer for, is ``False``."""
        self._check_usable()
        key_list = list(keys)
        found = self.local.contains(key_list)
        absent = list(dict.fromkeys(k for k, hit in zip(key_list, found, strict=True) if not hit))
        if not absent:
            return list(found)
        deadline = time.monotonic() + self.read_deadline_s
        unsettled = self._publisher.wait_unsettled(absent, deadline)
        ask = [key for key in absent if key not in unsettled]
        held: set[str] = set()
        if ask:
            answer = self._remote_call(
                lambda: self.remote.exists_unique(ask), deadline, "a Mooncake lookup"
            )
            if answer is not None:
                held = {key for key, there in zip(ask, answer, strict=True) if there}
        return [hit or key in held for key, hit in zip(key_list, found, strict=True)]

    def _count_local_hit(self, count: int) -> None:
        self._stats["reads"] += 1
        self._stats["local_hit_objects"] += count

    def _read_tiers(self, keys: list[str], view: memoryview) -> None:
        """The slow path: each key from the local store, the rest from Mooncake in one batch."""
        n = self.object_nbytes
        if view.nbytes != len(keys) * n:
            raise ValueError(
                f"out holds {view.nbytes} bytes, expected {len(keys)} x {n} = {len(keys) * n}"
            )
        self._stats["reads"] += 1
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"auxiliary output keys must be str, not {type(key).__name__}")
        first = _buffers.first_positions(keys)
        with self._write_lock:
            self._reads_in_flight += 1
        try:
            absent: list[str] = []
            for key, index in first.items():
                try:
                    self.local.get_into([key], view[index * n : (index + 1) * n])
                except ObjectMissingError:
                    absent.append(key)
            self._stats["local_hit_objects"] += len(first) - len(absent)
            fetched = self._fetch_remote(absent)
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
            if fetched and self.keep_fetched:
                with self._write_lock:
                    self._keep(list(fetched), list(fetched.values()))
        finally:
            with self._write_lock:
                self._reads_in_flight -= 1
                if not self._reads_in_flight:
                    self._written_during_reads.clear()
        _buffers.copy_duplicates(keys, first, view, n)

    def _remote_call(self, fn: Callable[[], Any], deadline: float, what: str) -> Any:
        """``fn()`` on the reader thread, waited for until ``deadline``; ``None`` when it
        failed or did not return in time (``retry`` mode; ``raise`` mode raises)."""
        try:
            done, result = self._reader.call(fn, deadline - time.monotonic())
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

    def _fetch_remote(self, absent: list[str]) -> dict[str, bytes | memoryview]:
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
        n = self.object_nbytes
        whole = memoryview(bytearray(len(ask) * n))
        targets = [whole[i * n : (i + 1) * n] for i in range(len(ask))]
        missing = self._remote_call(
            lambda: self.remote.read_unique(ask, targets), deadline, "a read from Mooncake"
        )
        if missing is None:
            return {}
        gone = set(missing)
        fetched = {key: targets[i] for i, key in enumerate(ask) if key not in gone}
        self._stats["remote_hit_objects"] += len(fetched)
        return dict(fetched)

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

    # -- the rest ------------------------------------------------------------------------

    def _check_open(self) -> None:
        worker = self._publisher.worker
        worker.check_process()
        if worker.closed:
            raise RuntimeError("auxiliary output store is closed")

    def _check_usable(self) -> None:
        self._check_open()
        self._publisher.worker.raise_if_failed()

    def stats(self) -> dict[str, int]:
        """The tier's counters, the local store's as ``local_*`` and Mooncake's as ``remote_*``.

        Tier counters: puts, queued/published objects, publish batches, pending batches,
        reads (calls), objects served locally and from Mooncake, read misses (calls that
        missed some key), objects kept locally after a fetch, fetched objects not kept and the
        reads that could not keep them. Faults: ``unpublished_objects`` (the record plus those
        beyond it), ``unpublished_recorded``, ``unpublished_not_recorded``,
        ``dropped_objects``, ``publish_failures``, ``republished_objects``, ``outages``,
        ``master_restarts``, ``remote_read_failures``, ``mooncake_down`` (1 during an
        outage); docs/mooncake.md ("Faults") says what each counts.
        """
        with self._publisher.cond:
            out = dict(self._stats)
        out.update(self._publisher.counts())
        if not self.closed:
            out.update({f"local_{k}": v for k, v in self.local.stats().items()})
        out.update({f"remote_{k}": v for k, v in self.remote.stats().items()})
        return out

    def close(self) -> None:
        """Publishes what is queued (within ``close_timeout_s``; the rest is recorded as
        unpublished), stops the publisher, closes both stores, then raises any latched error
        (``raise`` mode); idempotent. In a forked child it raises ``RuntimeError``."""
        self._publisher.worker.close(finish=self._close_stores, timeout=self.close_timeout_s)

    def _close_stores(self) -> None:
        publisher_alive = self._publisher.worker.alive
        stuck = publisher_alive or self._reader.stuck
        if publisher_alive:
            logger.warning(
                "aostore Mooncake tier: Mooncake did not take the queued publications within "
                "close_timeout_s=%s; %d keys stay unpublished",
                self.close_timeout_s,
                self._publisher.counts()["unpublished_objects"],
            )
        self._reader.stop()
        try:
            with self._write_lock:
                self.local.close()
        finally:
            if stuck:
                # A Mooncake call still waits on the master and holds the client: close it
                # when that call returns, without making this caller wait.
                threading.Thread(
                    target=self._close_remote, daemon=True, name="aostore-mooncake-close"
                ).start()
            else:
                self._close_remote()

    def _close_remote(self) -> None:
        try:
            self._publisher.remove_marker()
        finally:
            self.remote.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed>"
        return f"<{type(self).__name__} local={self.local!r} remote={self.remote!r}>"
