"""A writer thread in front of a store, so the engine thread never waits for a put."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from aostore import _buffers
from aostore._native import NativeStore, NativeVariableStore, NativeWriter
from aostore._reads import BufferReads
from aostore._store import BlockObjectStore
from aostore._variable import VariableBlockObjectStore
from aostore._worker import QueueWorker
from aostore.errors import is_missing


class _Store(Protocol):
    def put(
        self,
        objects: Sequence[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None: ...

    def get_concatenated(self, keys: Sequence[str]) -> bytes: ...

    def close(self) -> None: ...


# (store method, positional arguments, retain keys, release keys)
_Update = tuple[str, tuple[Any, ...], tuple[str, ...], tuple[str, ...]]


class _PythonWriter:
    """A Python writer thread, for stores that the Rust writer cannot drive: a ``QueueWorker``
    that applies one update at a time and latches the first error."""

    def __init__(self, store: _Store, max_pending_batches: int) -> None:
        self._store = store
        self._worker: QueueWorker[_Update] = QueueWorker(
            self._apply,
            max_pending=max_pending_batches,
            name="aostore-writer",
            what="background writer",
        )

    @property
    def closed(self) -> bool:
        return self._worker.closed

    def _apply(self, updates: list[_Update]) -> None:
        for method, args, retains, releases in updates:
            getattr(self._store, method)(*args, retain_keys=retains, release_keys=releases)

    def put(
        self, objects: list[Any], *, retain_keys: tuple[str, ...], release_keys: tuple[str, ...]
    ) -> None:
        self._worker.submit(("put", (objects,), retain_keys, release_keys))

    def put_blocks(
        self,
        keys: list[str],
        blocks: Any,
        *,
        retain_keys: tuple[str, ...],
        release_keys: tuple[str, ...],
    ) -> None:
        self._worker.submit(("put_blocks", (keys, blocks), retain_keys, release_keys))

    def wait(self) -> None:
        self._worker.wait()

    def close(self) -> None:
        self._worker.close(finish=self._store.close)


# The methods the Rust writer calls in the core directly, per native store class; any other
# definition of them (on the instance or on a subclass) must be honoured, so the store then
# gets the Python writer.
_CORE_METHODS: dict[type, dict[str, set[Any]]] = {
    NativeStore: {
        name: {inspect.getattr_static(cls, name) for cls in (NativeStore, BlockObjectStore)}
        for name in ("put", "put_blocks")
    },
    NativeVariableStore: {
        "put": {
            inspect.getattr_static(cls, "put")
            for cls in (NativeVariableStore, VariableBlockObjectStore)
        }
    },
}


def _native_eligible(store: object) -> bool:
    """Whether the Rust writer can drive ``store``: an aostore store, fixed or variable-size,
    without a Python policy, whose writing methods are aostore's own (not replaced on the
    instance, as a test's mocks are, nor overridden by a subclass)."""
    base = next((cls for cls in _CORE_METHODS if isinstance(store, cls)), None)
    if base is None or getattr(store, "policy", None) is not None:
        return False
    own = _CORE_METHODS[base]
    if any(name in getattr(store, "__dict__", {}) for name in own):
        return False
    return all(inspect.getattr_static(type(store), name) in own[name] for name in own)


class BackgroundBlockObjectStore(BufferReads):
    """Applies ``put`` calls to ``store`` on one background thread, in call order.

    ``put`` queues the update (blocking while ``max_pending_batches`` are queued) and returns.
    The first error the writer meets is latched: later updates are skipped, and the next
    ``put``, ``get_concatenated`` or ``close`` raises ``BlockObjectStoreError`` chained from it.
    ``get_concatenated`` first waits for every queued put. ``close`` drains the queue, stops
    the thread, closes ``store`` once and raises any latched error; it is idempotent.

    ``store`` may be any object with ``put``, ``get_concatenated`` and ``close``. An aostore store,
    fixed or variable-size (without a Python policy, and with aostore's own ``put``/``put_blocks``)
    gets a writer thread in Rust that never takes the GIL: the engine thread only hands the batch
    over. With
    an aostore store, argument errors (a key that is not ``str``, a payload that is not a
    buffer) are latched at once and raised from that ``put``; other stores see them when the
    writer applies the batch.

    Payload lifetime, as in vLLM: ``put`` keeps a reference to each payload (and, for a buffer
    such as a ``bytearray`` or numpy array, its export, which keeps it from resizing) until the
    writer has applied the batch; the Rust writer then releases them at once (on the main
    thread, through the interpreter's pending calls) or at the next call. The writer copies
    the bytes when it applies the batch, so bytes written into a payload buffer after ``put``
    returns may land in the store: hand over a buffer you no longer write, or ``bytes``.
    The same holds for ``put_blocks``'s ``blocks``. A torch tensor given to ``put_blocks`` is
    held (tensor and storage) until it is applied; ``set_()`` on it afterwards is harmless,
    while ``resize_()`` that reallocates its storage before a read or ``close()`` is a caller
    error (torch frees the old memory in place).

    After ``fork()``, a child that uses a writer created by the parent gets ``RuntimeError``
    (the writer's thread exists only in the parent); ``close()`` may be called from several
    threads, and each returns once the store is closed.
    """

    def __init__(self, store: _Store, *, max_pending_batches: int) -> None:
        if isinstance(max_pending_batches, bool) or not isinstance(max_pending_batches, int):
            raise TypeError("max_pending_batches must be an int")
        if max_pending_batches < 1:
            raise ValueError("max_pending_batches must be at least 1")
        self._store = store
        self._writer: NativeWriter | _PythonWriter
        if _native_eligible(store):
            self._writer = NativeWriter(store, max_pending_batches)  # type: ignore[arg-type]
            # The engine thread calls the Rust writer's put directly, without a Python frame in
            # between (about 1 µs of a put's 3-5 on this project's VM); `put` below is the same
            # call, for anyone who looks the method up on the class.
            self.put = self._writer.put  # type: ignore[method-assign]
        else:
            self._writer = _PythonWriter(store, max_pending_batches)

    @property
    def store(self) -> Any:
        """The store the writer applies updates to."""
        return self._store

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """Queues one update; a no-op when all three arguments are empty."""
        if type(self._writer) is NativeWriter:
            # The Rust writer records the batch before returning (keys, payload views and their
            # owners), so nothing needs copying here.
            self._writer.put(objects, retain_keys=retain_keys, release_keys=release_keys)
            return
        batch = list(objects)
        retains = tuple(retain_keys)
        releases = tuple(release_keys)
        if not batch and not retains and not releases:
            return
        if self._writer.closed:
            raise RuntimeError("auxiliary output store is closed")
        self._writer.put(batch, retain_keys=retains, release_keys=releases)

    def put_blocks(
        self,
        keys: Iterable[str],
        blocks: Any,
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        """Queues ``store.put_blocks``. The writer reads ``blocks`` later: the caller must not
        modify it until a read or ``close()`` has waited for the queue."""
        key_list = list(keys)
        retains = tuple(retain_keys)
        releases = tuple(release_keys)
        if not key_list and not retains and not releases:
            return
        if self._writer.closed:
            raise RuntimeError("auxiliary output store is closed")
        object_nbytes = getattr(self._store, "object_nbytes", None)
        if isinstance(self._writer, NativeWriter) and object_nbytes:
            # The Rust writer reads plain buffers: a tensor becomes its host bytes here (a CUDA
            # tensor is copied to the host once, on the caller's thread). The numpy view's base
            # is a tensor of its own over the same storage, so ``set_()`` on the caller's
            # tensor leaves the memory the writer reads alive.
            blocks = _buffers.host_rows(blocks, len(key_list), object_nbytes)
        self._writer.put_blocks(key_list, blocks, retain_keys=retains, release_keys=releases)

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        """Waits for queued puts, then reads ``keys`` from the store."""
        self._writer.wait()
        return self._store.get_concatenated(keys)

    def _check_readable(self) -> None:
        """Waits for queued puts (raising a latched error)."""
        self._writer.wait()

    def _read_into(self, keys: list[str], host: Any) -> None:
        get_into = getattr(self._store, "get_into", None)
        if get_into is not None:
            get_into(keys, host)
            return
        data = self._store.get_concatenated(keys)
        view = _buffers.writable_view(host)
        if view.nbytes != len(data):
            raise ValueError(f"out holds {view.nbytes} bytes, the payloads {len(data)}")
        view[:] = data

    def _array_nbytes(self, count: int) -> int | None:
        nbytes = getattr(self._store, "object_nbytes", None)
        if nbytes is None or not hasattr(self._store, "get_into"):
            return None  # objects of any size, or a store that reads only whole bytes
        return count * int(nbytes)

    def flush(self) -> None:
        """Waits until every queued update is applied; raises a latched error, if any."""
        self._writer.wait()

    def get_optional(self, key: str) -> bytes | None:
        """Waits for queued puts, then the payload of ``key``, or ``None`` when it is not
        stored (no error, no LRU move for a miss)."""
        self._writer.wait()
        store = self._store
        get_optional = getattr(store, "get_optional", None)
        if get_optional is not None:
            result: bytes | None = get_optional(key)
            return result
        get_many = getattr(store, "get_many", None)
        if get_many is not None:
            # The fixed store returns (data, missing), the variable one (data, missing, offsets).
            data, missing = get_many([key])[:2]
            return None if missing else bytes(data)
        try:
            return bytes(store.get_concatenated([key]))
        except Exception as error:
            # A store without non-raising reads (vLLM's, a test double): its miss means None;
            # anything else propagates.
            if is_missing(error):
                return None
            raise

    def get_many(self, keys: Sequence[str]) -> Any:
        """Waits for queued puts, then ``store.get_many(keys)``: the payloads of the stored keys,
        concatenated in order, and the list of keys that are not stored (no error); the
        variable-size store adds each key's offset into the bytes (see its docstring)."""
        self._writer.wait()
        return self._store.get_many(keys)  # type: ignore[attr-defined]

    def contains(self, keys: Sequence[str]) -> Any:
        """Waits for queued puts, then ``store.contains(keys)`` (no LRU move)."""
        self._writer.wait()
        return self._store.contains(keys)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Drains, stops the writer, closes the store once; raises any latched error."""
        self._writer.close()
