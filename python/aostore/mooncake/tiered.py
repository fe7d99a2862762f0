"""``TieredBlockObjectStore``: the local aostore arena in front of Mooncake."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aostore import _buffers
from aostore._reads import BufferReads
from aostore.errors import ObjectMissingError
from aostore.mooncake.config import MooncakeConfig
from aostore.mooncake.fetch import Fetcher
from aostore.mooncake.publisher import Publisher
from aostore.mooncake.remote import MooncakeBlockObjectStore

__all__ = ["TieredBlockObjectStore"]

logger = logging.getLogger("aostore")

_ON_PUBLISH_ERROR = ("retry", "raise")
# The tier's counters (``stats()``); the publisher and the fetcher count into the same dict.
_COUNTERS = """
puts queued_objects published_objects publish_batches reads local_hit_objects
remote_hit_objects read_misses kept_objects not_kept_objects keep_failures
dropped_objects publish_failures republished_objects outages master_restarts
remote_read_failures unpublished_not_recorded
""".split()


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
        self._stats = dict.fromkeys(_COUNTERS, 0)
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
        self._fetcher = Fetcher(
            remote,
            local,
            self._publisher,
            self._write_lock,
            self._stats,
            read_deadline_s=self.read_deadline_s,
            retry=self._retry,
            keep_fetched=keep_fetched,
        )
        self._reader = self._fetcher.reader

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
                # The local store says which keys it stored (new, or replaced): those publish.
                report = getattr(self.local, method + "_reporting")
                written = report(*args, retain_keys=retain_keys, release_keys=release_keys)
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
        self._fetcher.note_written(keys)
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
            self._fetcher.read_tiers(key_list, memoryview(out))
            return bytes(out)
        self._count_local_hit(len(key_list))
        return data

    def _check_readable(self) -> None:
        self._check_usable()

    def _read_into(self, keys: list[str], host: Any) -> None:
        try:
            self.local.get_into(keys, host)
        except ObjectMissingError:
            self._fetcher.read_tiers(keys, _buffers.writable_view(host))
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
        return self._fetcher.fill_in(key_list, data, missing)

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
        held = self._fetcher.held(absent)
        return [hit or key in held for key, hit in zip(key_list, found, strict=True)]

    def _count_local_hit(self, count: int) -> None:
        self._stats["reads"] += 1
        self._stats["local_hit_objects"] += count

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
