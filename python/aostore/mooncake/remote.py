"""``MooncakeBlockObjectStore``: the aostore store API over a Mooncake Store cluster."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aostore import _buffers
from aostore._reads import BufferReads
from aostore.errors import ObjectMissingError
from aostore.mooncake.client import (
    RPC_FAIL,
    Client,
    MooncakeError,
    connect,
    describe_code,
)
from aostore.mooncake.config import MIB, MooncakeConfig

__all__ = ["MARKER_VALUE", "MooncakeBlockObjectStore"]

# The value of the marker object a tiered store keeps in Mooncake to notice a restarted
# (emptied) master.
MARKER_VALUE = b"aostore tiered store marker"


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"auxiliary output keys must be str, not {type(key).__name__}")
    return key


class MooncakeBlockObjectStore(BufferReads):
    """The aostore store API over a Mooncake Store cluster.

    ``MooncakeBlockObjectStore(client, *, object_nbytes, max_batch_bytes=4 MiB, key_prefix="",
    master_address="", close_client=True)`` wraps a connected
    ``mooncake.store.MooncakeDistributedStore``; ``MooncakeBlockObjectStore.from_config(config,
    object_nbytes=...)`` connects one. Keys are written as ``key_prefix + key``.

    - ``put(objects, *, retain_keys=(), release_keys=())`` and ``put_blocks(keys, blocks,
      ...)`` validate everything first (``TypeError``/``ValueError`` as the local store), keep
      the last payload of a key given twice, and write with ``put_batch`` in batches of at
      most ``max_batch_bytes``: Mooncake's rule, the first bytes written under a key stay. A
      batch that Mooncake refuses raises ``MooncakeError``; batches written before it stay
      written. Retains and releases are counted, nothing else (retention belongs to the
      deployment: docs/mooncake.md).
    - ``get_concatenated(keys)`` / ``get_into(keys, out)`` / ``get_array(...)`` read each key
      once with ``batch_get_buffer`` in bounded batches. A key that Mooncake does not hold
      raises ``ObjectMissingError`` (a ``BlockObjectStoreError``: ``does not exist``, naming
      the key); an unreachable master raises ``MooncakeError`` (within about 4 s of the master
      going away).
    - ``close()`` closes the client (when ``close_client``); idempotent. Afterwards every call
      raises ``RuntimeError`` (``closed``).

    One lock serializes the calls into the client (they share its local buffer); Mooncake
    releases the GIL while it works.
    """

    def __init__(
        self,
        client: Any,
        *,
        object_nbytes: int,
        max_batch_bytes: int = 4 * MIB,
        key_prefix: str = "",
        master_address: str = "",
        close_client: bool = True,
    ) -> None:
        if isinstance(object_nbytes, bool) or not isinstance(object_nbytes, int):
            raise TypeError("object_nbytes must be an int")
        if object_nbytes <= 0:
            raise ValueError("object size must be positive")
        if max_batch_bytes < object_nbytes:
            raise ValueError(
                f"max_batch_bytes={max_batch_bytes} must hold at least one object of "
                f"{object_nbytes} bytes (raise local_buffer_size)"
            )
        self._mc = Client(client, master_address=master_address, close_client=close_client)
        self.object_nbytes = object_nbytes
        #: The most objects per Mooncake call (``max_batch_bytes // object_nbytes``).
        self.batch_objects = max_batch_bytes // object_nbytes
        self.key_prefix = key_prefix
        self.master_address = master_address
        self._stats = dict.fromkeys(
            (
                "puts",
                "objects_written",
                "objects_unchanged",
                "bytes_written",
                "put_batches",
                "retains",
                "releases",
                "reads",
                "objects_read",
                "read_misses",
                "bytes_read",
                "get_batches",
            ),
            0,
        )

    @classmethod
    def from_config(
        cls,
        config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        object_nbytes: int,
    ) -> MooncakeBlockObjectStore:
        """Connects to Mooncake with ``connect(config)`` and wraps the client."""
        config = MooncakeConfig.coerce(config)
        if config.batch_bytes < object_nbytes:
            raise ValueError(
                f"a batch of {config.batch_bytes} bytes (half of local_buffer_size at most) "
                f"cannot hold one object of {object_nbytes} bytes; raise local_buffer_size"
            )
        return cls(
            connect(config),
            object_nbytes=object_nbytes,
            max_batch_bytes=config.batch_bytes,
            key_prefix=config.key_prefix,
            master_address=config.master_server_address,
        )

    @property
    def closed(self) -> bool:
        return self._mc.closed

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` behind this store."""
        return self._mc.raw

    def _names(self, keys: list[str]) -> list[str]:
        return [self.key_prefix + key for key in keys] if self.key_prefix else keys

    def _batches(self, count: int) -> range:
        return range(0, count, self.batch_objects)

    # -- writes --------------------------------------------------------------------------

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> None:
        """Writes ``objects`` (``.key`` and ``.payload``) to Mooncake; see the class doc."""
        self._mc.check_open()
        batch: dict[str, memoryview] = {}
        for item in objects:
            key = _check_key(item.key)
            batch[key] = _buffers.payload_view(key, item.payload, self.object_nbytes)
        self._put_checked(batch, retain_keys, release_keys)

    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: Any,
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> None:
        """Writes ``blocks[i]`` under ``keys[i]`` (an array, tensor or flat buffer of rows)."""
        self._mc.check_open()
        key_list = [_check_key(key) for key in keys]
        data = _buffers.block_bytes(blocks, len(key_list), self.object_nbytes)
        n = self.object_nbytes
        flat = memoryview(data).cast("B") if key_list else memoryview(b"")
        batch = {key: flat[i * n : (i + 1) * n] for i, key in enumerate(key_list)}
        self._put_checked(batch, retain_keys, release_keys)

    def _put_checked(
        self,
        batch: dict[str, memoryview],
        retain_keys: Iterable[str] | None,
        release_keys: Iterable[str] | None,
    ) -> None:
        retains = [_check_key(key) for key in retain_keys or ()]
        releases = [_check_key(key) for key in release_keys or ()]
        self._stats["puts"] += 1
        self._stats["retains"] += len(retains)
        self._stats["releases"] += len(releases)
        keys, payloads = list(batch), list(batch.values())
        for start in self._batches(len(keys)):
            chunk = keys[start : start + self.batch_objects]
            with self._mc.locked() as mc:
                code = mc.put_batch(self._names(chunk), payloads[start : start + len(chunk)])
            if code != 0:
                self._mc.raise_for_code(
                    f"put_batch of {len(chunk)} objects from {chunk[0]!r}", code
                )
            self._count_written(len(chunk))

    def _count_written(self, count: int) -> None:
        self._stats["put_batches"] += 1
        self._stats["objects_written"] += count
        self._stats["bytes_written"] += count * self.object_nbytes

    def publish(self, keys: Sequence[str], payloads: Sequence[Any]) -> None:
        """Makes Mooncake hold exactly ``payloads[i]`` under ``keys[i]`` (distinct, validated
        keys): the tiered store's publication, which overwrites.

        Per bounded batch: ``batch_is_exist``; the keys Mooncake holds are read back and
        compared; ``upsert_batch`` writes the absent keys and those whose bytes differ. A key
        that already holds the same bytes is not written again, so republishing a shared
        block (another engine computed the same prefix) never opens the window in which an
        overwritten key reads as missing. Raises ``MooncakeError`` as ``put`` does.
        """
        for start in self._batches(len(keys)):
            chunk = list(keys[start : start + self.batch_objects])
            values = list(payloads[start : start + len(chunk)])
            names = self._names(chunk)
            codes = self._exists(chunk, names)
            write = [i for i, code in enumerate(codes) if not code]
            present = [i for i, code in enumerate(codes) if code]
            if present:
                with self._mc.locked(reachable=False) as mc:
                    handles = mc.batch_get_buffer([names[i] for i in present])
                    try:
                        self._stats["get_batches"] += 1
                        for index, handle in zip(present, handles, strict=True):
                            if handle is None or not _buffers.same_bytes(handle, values[index]):
                                write.append(index)
                    finally:
                        del handles
                write.sort()
            self._stats["objects_unchanged"] += len(chunk) - len(write)
            if not write:
                continue
            with self._mc.locked() as mc:
                code = mc.upsert_batch([names[i] for i in write], [values[i] for i in write])
            if code != 0:
                self._mc.raise_for_code(
                    f"upsert_batch of {len(write)} objects from {chunk[write[0]]!r}", code
                )
            self._count_written(len(write))

    def _exists(self, chunk: list[str], names: list[str]) -> list[bool]:
        """``batch_is_exist`` of one batch; raises ``MooncakeError`` for a failed lookup."""
        with self._mc.locked() as mc:
            codes = mc.batch_is_exist(names)
        for key, code in zip(chunk, codes, strict=True):
            if code not in (0, 1):
                self._mc.raise_for_code(f"batch_is_exist of {key!r}", code)
        return [code == 1 for code in codes]

    # -- reads ---------------------------------------------------------------------------

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        """The payloads of ``keys`` in order (duplicates allowed; ``[]`` gives ``b""``)."""
        key_list = list(keys)
        out = bytearray(len(key_list) * self.object_nbytes)
        self._read_view(key_list, memoryview(out))
        return bytes(out)

    def _check_readable(self) -> None:
        self._mc.check_open()

    def _read_into(self, keys: list[str], host: Any) -> None:
        self._read_view(keys, _buffers.writable_view(host))

    def _read_view(self, keys: list[str], view: memoryview) -> None:
        self._mc.check_open()
        for key in keys:
            _check_key(key)
        n = self.object_nbytes
        if view.nbytes != len(keys) * n:
            raise ValueError(
                f"out holds {view.nbytes} bytes, expected {len(keys)} x {n} = {len(keys) * n}"
            )
        self._stats["reads"] += 1
        first = _buffers.first_positions(keys)
        unique = list(first)
        missing = self.read_unique(
            unique, [view[first[k] * n : (first[k] + 1) * n] for k in unique]
        )
        if missing:
            self._stats["read_misses"] += 1
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ObjectMissingError(
                f'auxiliary output object "{missing[0]}" does not exist in Mooncake{more}; '
                f"it was never published or Mooncake evicted it (retention belongs to the "
                f"Mooncake deployment)"
            )
        _buffers.copy_duplicates(keys, first, view, n)

    def read_unique(self, keys: Sequence[str], targets: Sequence[memoryview]) -> list[str]:
        """Reads distinct ``keys`` into ``targets`` (one ``object_nbytes`` view each).

        Returns the keys Mooncake does not hold (their targets are left as they were); raises
        ``MooncakeError`` when Mooncake cannot answer. For ``TieredBlockObjectStore``.
        """
        self._mc.check_open()
        missing: list[str] = []
        for start in self._batches(len(keys)):
            chunk = list(keys[start : start + self.batch_objects])
            part = targets[start : start + len(chunk)]
            absent = self._read_batch(chunk, part)
            if absent:
                missing.extend(self._resolve_absent(chunk, part, absent))
        self._stats["objects_read"] += len(keys) - len(missing)
        self._stats["bytes_read"] += (len(keys) - len(missing)) * self.object_nbytes
        return missing

    def exists_unique(self, keys: Sequence[str]) -> list[bool]:
        """Whether Mooncake holds each of the distinct ``keys`` (``batch_is_exist``, no read);
        raises ``MooncakeError`` when Mooncake cannot answer. For ``TieredBlockObjectStore``."""
        self._mc.check_open()
        found: list[bool] = []
        for start in self._batches(len(keys)):
            chunk = list(keys[start : start + self.batch_objects])
            found.extend(self._exists(chunk, self._names(chunk)))
        return found

    def marker_present(self, name: str) -> bool:
        """Whether Mooncake holds the tier's marker object ``name`` (a key outside the
        aostore key space); raises ``MooncakeError`` when Mooncake cannot answer."""
        return self._exists([f"the marker {name}"], [self.key_prefix + name])[0]

    def write_marker(self, name: str) -> None:
        """Writes the tier's small marker object ``name`` (``put_batch``); raises
        ``MooncakeError`` as ``put`` does."""
        with self._mc.locked() as mc:
            code = mc.put_batch([self.key_prefix + name], [MARKER_VALUE])
        if code != 0:
            self._mc.raise_for_code(f"put_batch of the marker {name!r}", code)

    def remove_marker(self, name: str) -> None:
        """Removes the marker, best effort (never raises)."""
        self._mc.remove_quietly(self.key_prefix + name)

    def _read_batch(self, chunk: list[str], targets: Sequence[memoryview]) -> list[int]:
        """One ``batch_get_buffer``; copies what came back; the positions that did not."""
        absent: list[int] = []
        with self._mc.locked() as mc:
            handles = mc.batch_get_buffer(self._names(chunk))
            try:
                self._stats["get_batches"] += 1
                for index, handle in enumerate(handles):
                    if handle is None:
                        absent.append(index)
                        continue
                    self._copy_out(chunk[index], handle, targets[index])
            finally:
                del handles
        return absent

    def _copy_out(self, key: str, handle: Any, target: memoryview) -> None:
        with memoryview(handle) as source:
            if source.nbytes != self.object_nbytes:
                raise MooncakeError(
                    f"Mooncake holds {source.nbytes} bytes under {key!r}, expected "
                    f"object_nbytes={self.object_nbytes} (another object size under the same "
                    f"key; use a key_prefix per object size)"
                )
            target[:] = _buffers.byte_view(source)

    def _resolve_absent(
        self, chunk: list[str], targets: Sequence[memoryview], absent: list[int]
    ) -> list[str]:
        """Tells misses from reads that failed (the local buffer was full, the master left)."""
        names = [self.key_prefix + chunk[index] for index in absent]
        # With the master gone, batch_get_buffer returns None at once but batch_is_exist
        # waits seconds for its RPC: ask the master's port first.
        self._mc.check_after_failure("a read returned nothing and the master's port is closed")
        with self._mc.locked(reachable=False) as mc:
            codes = mc.batch_is_exist(names)
        missing: list[str] = []
        for name, index, code in zip(names, absent, codes, strict=True):
            if code == 0:
                missing.append(chunk[index])
            elif code == 1:  # present, but the batch read did not return it: read it alone
                with self._mc.locked() as mc:
                    handle = mc.get_buffer(name)
                    if handle is None:
                        raise MooncakeError(
                            f"Mooncake holds {chunk[index]!r} but could not read it back"
                        )
                    self._copy_out(chunk[index], handle, targets[index])
                    del handle
            else:
                self._mc.check_after_failure(f"batch_is_exist failed with {describe_code(code)}")
                if code == RPC_FAIL:
                    raise self._mc.unreachable("the master did not answer")
                raise MooncakeError(
                    f"Mooncake could not look up {chunk[index]!r}: error {describe_code(code)}"
                )
        return missing

    # -- the rest ------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters: puts, objects/bytes written, objects that ``publish`` found unchanged, put
        batches, retains, releases, reads (calls), objects/bytes read, read misses (calls that
        raised ``does not exist``), get batches, and ``object_nbytes``."""
        return {"object_nbytes": self.object_nbytes, **self._stats}

    def close(self) -> None:
        """Closes the Mooncake client (when this store owns it); idempotent. In a forked child
        it raises ``RuntimeError`` (the client belongs to the parent)."""
        self._mc.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"master {self.master_address or '?'}"
        return f"<{type(self).__name__} {state}, objects of {self.object_nbytes} B>"
