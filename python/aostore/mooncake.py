"""Mooncake Store as a shared tier behind aostore (SPEC section 8).

Two stores with the aostore API:

- ``MooncakeBlockObjectStore``: objects live in a Mooncake Store cluster; ``put`` writes them
  with ``put_batch`` and reads use ``batch_get_buffer``, both in batches bounded in bytes. A
  key that Mooncake does not hold raises ``BlockObjectStoreError`` naming the key (``does not
  exist``): misses fail closed, as in the local store.
- ``TieredBlockObjectStore(local, remote)``: the local aostore arena is the hot tier and
  Mooncake the shared one. Puts land in the local store at once and are published to Mooncake
  by a writer thread in batches; a local miss is fetched from Mooncake in one batch per call
  (and kept locally by default, where the local tier has room without growing); only a miss in
  both raises ``does not exist``. Another engine process with its own tiered store reads what
  this one published. Which write wins: see "One value per key" below.

Setup comes from a small config (``MooncakeConfig.from_dict`` / ``from_file``, JSON) and
``connect(config)``. Nothing is imported from Mooncake until a store is connected, so
``import aostore.mooncake`` works without the package; connecting without it raises
``ImportError`` naming the pip package. An unreachable master raises ``MooncakeError`` after
``connect_timeout_s`` instead of Mooncake's own minute and a half of retries.

Retention. aostore's retains and releases are local reference counts: they keep a running
request's blocks from eviction in *this* process. Mooncake has no such counts, so the Mooncake
store accepts ``retain_keys``/``release_keys`` (validated as strings and counted in ``stats()``)
and does nothing else with them. How long Mooncake keeps an object is the deployment's choice:
the master evicts when its segments pass the high watermark (``--eviction_high_watermark_ratio``,
default 0.9), a key just read holds a lease (``--default_kv_lease_ttl``, 10 s) and objects
live in the memory segments that clients mount, so they go when the client that holds their
segment leaves. Give engines ``global_segment_size=0`` and run the pool in dedicated segment
holders (``mooncake_client --global_segment_size=...``) when published data must outlive
engine processes.

One value per key (SPEC section 8). ``MooncakeBlockObjectStore`` on its own is Mooncake's
semantics: the first bytes written under a key stay (a ``put`` of a key Mooncake holds keeps
them). ``TieredBlockObjectStore`` has one rule for both tiers: **the local tier decides and
publication overwrites; the latest write through the tier wins.** Exactly the objects a put
makes the local tier write (a new key, a key re-put after it was evicted locally, and under
``grow`` a stored unreferenced key whose bytes the re-put replaces) are published, and the
publisher makes Mooncake hold those bytes: ``upsert_batch`` for the keys Mooncake lacks or holds
with other bytes (a key it holds with the same bytes is left alone). A put that the local tier
does not write (a stored key under ``fail-closed``, a referenced one under ``grow``) keeps its
bytes in both tiers and publishes nothing. Puts enqueue under one lock, in the order of their
local writes, and the publisher keeps the last payload of a key across the batches it joins.
So in the process that wrote it, every read of a key returns one value, before and after a
local eviction: a read that misses locally first waits for this process's queued
publications, then reads Mooncake. A fetched object is kept locally only if no put wrote the
key while it was being fetched. The put path never waits for Mooncake: the lookup, compare and
upsert run on the publisher thread (per batch, one ``batch_is_exist`` RPC more than a plain
``put_batch``, and a read-back of the keys Mooncake already holds).

What the rule does not give across processes (there is no invalidation between engines):
another engine keeps serving the copy its local tier holds (what it put, or kept from a fetch
before the overwrite) until it evicts it, and a read in another engine that runs while a key
is being overwritten can find the key missing (``upsert_batch`` is not atomic for readers:
is_exist 0 or no buffer during the write) and fails closed with ``does not exist``. Only keys
re-put with different bytes are overwritten, so a shared block that engines recompute with
the same bytes never opens that window.

Faults (``on_publish_error="retry"``, the default): once a tier runs, no Mooncake fault reaches
its caller. Publications that fail or do not fit the bounded queue are recorded as unpublished
(``unpublished_keys()``, ``stats()``), the publisher probes the master with backoff and
republishes what the local tier still holds; a restarted (empty) master is noticed through a
marker object and what the tier published lately is republished or recorded. A read that
misses locally waits at most ``read_deadline_s`` (queued publications included), fetches on a
helper thread into a private buffer, and is otherwise a miss; a key that Mooncake may hold
with older bytes (recorded, or still queued) is never read from it. ``"raise"`` is the old
fatal mode. ``docs/mooncake.md`` has the promises and the figures measured against a real
master.

The Mooncake API used, as found in ``mooncake-transfer-engine-non-cuda==0.3.13.post1``
(``mooncake.store.MooncakeDistributedStore``; the calls below release the GIL while they
wait, except ``close``):

- ``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
  rdma_devices, master_server_addr) -> int``, 0 on success. With an unreachable master it
  retries 20 times over about 90 s, then returns -1: ``connect`` probes the master first.
  ``MC_TCP_BIND_ADDRESS`` must name the address to advertise (read at ``setup``), or the TCP
  transport advertises the machine's LAN address.
- ``put_batch(keys: list[str], values: list[Buffer]) -> int``: 0, or a negative error code for
  the whole batch (no key of a failed batch is stored). The values are staged in the client's
  local buffer (``local_buffer_size``): a batch larger than it fails with -600, so batches
  here stay under half of it. A key given twice keeps its first value; an existing key keeps
  its bytes and still returns 0 (also in a batch that mixes new and existing keys; readers
  meanwhile never miss it). -200 (``NO_AVAILABLE_HANDLE``): no mounted segment has room.
- ``upsert_batch(keys, values) -> int``: the same, but an existing key gets the new bytes
  (another client reads them right after; also for a key read within its lease, and with
  another size). A key given twice keeps its first value. Not atomic for concurrent readers:
  while a key is rewritten, ``batch_get_buffer`` gives ``None`` and ``is_exist`` can say 0;
  no torn bytes were seen. About as fast as ``put_batch`` for new keys. ``upsert`` is the
  single-key form.
- A SIGSTOP'ed master (its port still accepts connections) makes every RPC wait 30 s, then
  fail with -901 (``RPC_TIMEOUT``); after SIGCONT pending calls complete. A master restarted
  on the same ports starts empty; a segment holder mounts its segment on it again within about
  a second (``put_batch``/``upsert_batch`` give -200 until then), and clients reconnect.
- ``batch_get_buffer(keys: list[str]) -> list[BufferHandle | None]``: one handle per key
  (``ptr()``, ``size()``, buffer protocol; the memory sits in the local buffer until the handle
  is freed). ``None`` for a missing key, and also for a key that did not fit in the local
  buffer, and for every key when the master is gone. A key repeated in one call returns wrong
  bytes for some positions, so reads here pass each key once.
- ``get_buffer(key) -> BufferHandle | None``; ``get(key) -> bytes`` returns ``b""`` for a
  missing key (not an error), hence not used.
- ``is_exist(key) -> int`` and ``batch_is_exist(keys) -> list[int]``: 1 present, 0 absent,
  negative on error (-900 ``RPC_FAIL`` after about 4 s when the master is gone). Used here to
  tell a miss from a failed read.
- ``remove(key, force=False) -> int``: -706 (``OBJECT_HAS_LEASE``) for a key read within the
  lease; ``force=True`` skips the lease. -704 (``OBJECT_NOT_FOUND``) for a missing key.
  ``batch_remove(keys, force=False) -> list[int]``: the same per key. Not used (remove then
  put would open a window in which the key is missing for every reader, and fails under a
  lease without ``force``).
- ``health_check() -> int``: 0 healthy, 1 closed, 2 master unreachable; a local flag (under
  1 µs), set within about a second of the master going away, but only in a client that
  mounts a segment (with ``global_segment_size=0`` it stays 0). Checked before every batch;
  besides it, after a failed call this store probes the master's RPC port (refused at once
  when the master is gone) and latches the outcome, so a dead master costs at most one of
  Mooncake's ~4 s RPC timeouts, then every call fails at once.
- ``close() -> int``: unmounts the client's segment and stops it (about 1 s). With the
  master gone, a client that mounts a segment can take 15 s (its unmount RPC retries,
  holding the GIL); with ``global_segment_size=0`` it does not wait on the master.

The master: ``mooncake_master --rpc_address=127.0.0.1 --rpc_port=P
--enable_http_metadata_server=true --http_metadata_server_port=Q --metrics_host=127.0.0.1
--metrics_port=R`` (ready about a second later), metadata server
``http://127.0.0.1:Q/metadata``; or ``metadata_server="P2PHANDSHAKE"`` without the HTTP
metadata server (all clients and holders of one cluster must use the same metadata mode: a
P2P client cannot reach a segment registered over HTTP). A segment holder:
``mooncake_client --host=127.0.0.1 --port=S --global_segment_size=1GB
--master_server_address=127.0.0.1:P --metadata_server=...``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import ipaddress
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

from aostore import _buffers as _tensors
from aostore._native import BlockObject, BlockObjectStoreError

__all__ = [
    "MOONCAKE_PIP_PACKAGE",
    "MooncakeBlockObjectStore",
    "MooncakeConfig",
    "MooncakeError",
    "TieredBlockObjectStore",
    "connect",
]

logger = logging.getLogger("aostore")

#: The pinned PyPI package that provides ``mooncake.store`` (CPU and TCP only; it needs
#: Debian's ``libibverbs1`` at run time).
MOONCAKE_PIP_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"

_MIB = 1 << 20

# Error codes that Mooncake returns, as seen from its Python client.
_ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
_RPC_FAIL = -900
_PROBE_TIMEOUT_S = 1.0
# The value of the marker object a tiered store keeps in Mooncake to notice a restarted
# (emptied) master.
_MARKER_VALUE = b"aostore tiered store marker"

# Bumped in a forked child: a tiered store's threads (and Mooncake's client threads) exist only
# in the process that started them.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


class MooncakeError(BlockObjectStoreError):
    """Mooncake could not be reached, or refused a put or a read (not a plain miss)."""


def _code(code: int) -> str:
    return f"{code} ({_ERROR_NAMES.get(code, 'unknown error')})"


def _parse_size(name: str, value: object) -> int:
    """An ``int`` number of bytes, or a string such as ``"64MB"``/``"1 GiB"`` (powers of 1024,
    as Mooncake reads them)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes, not {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match.group(1)) << (10 * _UNITS[match.group(2)[:1].lower()])
    else:
        raise ValueError(f"{name} must be a number of bytes or a size like '64MB', not {value!r}")
    if size < 0:
        raise ValueError(f"{name} must not be negative, got {size}")
    return size


@dataclasses.dataclass(frozen=True)
class MooncakeConfig:
    """How to reach a Mooncake Store cluster.

    The keys are those of the ``mooncake.json`` files that vLLM's Mooncake connectors read,
    plus aostore's own:

    - ``master_server_address``: ``"host:port"`` of ``mooncake_master`` (required).
    - ``metadata_server``: ``"http://host:port/metadata"`` (the master's HTTP metadata
      server), ``"P2PHANDSHAKE"`` (the default: no metadata server) or an etcd address.
    - ``local_hostname``: the address this client advertises (default ``"127.0.0.1"``: one
      machine; set this host's address for several). With ``protocol="tcp"``, ``connect``
      also sets ``MC_TCP_BIND_ADDRESS`` to it when that variable is unset and it is an IP.
    - ``global_segment_size``: bytes this client adds to the pool (default 0: the pool comes
      from segment holders; objects in a client's segment go when the client closes).
    - ``local_buffer_size``: the client's staging buffer for transfers (default 16 MiB).
    - ``protocol`` (``"tcp"``) and ``device_name`` (RDMA devices, ``""``).
    - ``connect_timeout_s``: how long ``connect`` waits for the master (default 10 s).
    - ``max_batch_bytes``: the most payload bytes per ``put_batch``/``batch_get_buffer``
      (default 4 MiB; capped at half of ``local_buffer_size``).
    - ``key_prefix``: prepended to every key in Mooncake (a namespace per model; default "").

    Sizes take an ``int`` or a string such as ``"64MB"``.
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 * _MIB
    protocol: str = "tcp"
    device_name: str = ""
    connect_timeout_s: float = 10.0
    max_batch_bytes: int = 4 * _MIB
    key_prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("master_server_address", "metadata_server", "local_hostname", "protocol"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        for name in ("device_name", "key_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        _split_address(self.master_server_address)
        for name in ("global_segment_size", "local_buffer_size", "max_batch_bytes"):
            object.__setattr__(self, name, _parse_size(name, getattr(self, name)))
        if self.local_buffer_size <= 0:
            raise ValueError("local_buffer_size must be positive")
        if self.max_batch_bytes <= 0:
            raise ValueError("max_batch_bytes must be positive")
        timeout = self.connect_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"connect_timeout_s must be a positive number, got {timeout!r}")

    @property
    def batch_bytes(self) -> int:
        """The batch bound in effect: ``max_batch_bytes``, at most half the local buffer."""
        return max(1, min(self.max_batch_bytes, self.local_buffer_size // 2))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> MooncakeConfig:
        """A config from a mapping; unknown keys raise ``ValueError`` (a typo never passes)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"a Mooncake config must be a mapping, not {type(values).__name__}")
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"unknown Mooncake config keys {unknown}; known keys are {sorted(names)}"
            )
        if "master_server_address" not in values:
            raise ValueError("a Mooncake config needs master_server_address ('host:port')")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeConfig:
        """A config from a JSON file holding one object."""
        text = Path(path).read_text(encoding="utf-8")
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a Mooncake config must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def coerce(
        cls, config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str]
    ) -> MooncakeConfig:
        """``config`` itself, or a config from a mapping or a JSON file's path."""
        if isinstance(config, MooncakeConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        return cls.from_file(config)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"master_server_address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _import_store_class() -> Any:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as error:
        raise ImportError(
            f"aostore.mooncake needs Mooncake: pip install '{MOONCAKE_PIP_PACKAGE}' "
            f"(on Debian/Ubuntu it also needs: apt-get install libibverbs1). "
            f"Importing mooncake.store failed: {error}"
        ) from error
    return module.MooncakeDistributedStore


def _wait_for_port(what: str, host: str, port: int, deadline: float) -> None:
    """Connects to ``host:port`` until it answers or ``deadline`` (monotonic) passes."""
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MooncakeError(
                f"the Mooncake {what} at {host}:{port} is unreachable ({last}); is "
                f"mooncake_master running there? (gave up after the connect timeout)"
            )
        try:
            socket.create_connection((host, port), timeout=min(1.0, remaining)).close()
            return
        except OSError as error:
            last = error
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def connect(config: MooncakeConfig | Mapping[str, Any] | str | os.PathLike[str]) -> Any:
    """A ``mooncake.store.MooncakeDistributedStore`` set up from ``config``.

    ``config`` is a ``MooncakeConfig``, a mapping or a JSON file's path. Raises ``ImportError``
    naming the pip package when Mooncake is not installed, and ``MooncakeError`` when the
    master (or the HTTP metadata server) does not answer within ``connect_timeout_s`` or
    ``setup`` fails.
    """
    config = MooncakeConfig.coerce(config)
    store_class = _import_store_class()
    if config.protocol == "tcp" and "MC_TCP_BIND_ADDRESS" not in os.environ:
        try:
            ipaddress.ip_address(config.local_hostname)
        except ValueError:
            pass
        else:
            os.environ["MC_TCP_BIND_ADDRESS"] = config.local_hostname
    deadline = time.monotonic() + config.connect_timeout_s
    host, port = _split_address(config.master_server_address)
    _wait_for_port("master", host, port, deadline)
    metadata = re.match(r"^https?://([^/:]+|\[[^\]]+\]):(\d+)", config.metadata_server)
    if metadata:
        _wait_for_port(
            "HTTP metadata server", metadata.group(1).strip("[]"), int(metadata.group(2)), deadline
        )
    client = store_class()
    code = client.setup(
        config.local_hostname,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
        config.protocol,
        config.device_name,
        config.master_server_address,
    )
    if code != 0:
        raise MooncakeError(
            f"Mooncake setup failed with {_code(code)} (master {config.master_server_address}, "
            f"metadata {config.metadata_server}, protocol {config.protocol})"
        )
    logger.info(
        "connected to Mooncake master %s (metadata %s, segment %d B, buffer %d B)",
        config.master_server_address,
        config.metadata_server,
        config.global_segment_size,
        config.local_buffer_size,
    )
    return client


def _check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"auxiliary output keys must be str, not {type(key).__name__}")
    return key


def _payload_view(key: str, payload: object, object_nbytes: int) -> memoryview:
    """A flat byte view of ``payload``; raises the store's ``TypeError``/``ValueError``."""
    if _tensors.is_tensor(payload):
        payload = _tensors.block_bytes(payload.reshape(1, -1), 1, object_nbytes)  # type: ignore[attr-defined]
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"payload of {key!r} must be a C-contiguous buffer, not {type(payload).__name__}"
        ) from None
    _tensors.refuse_object_references(view, f"payload of {key!r}")
    if not view.c_contiguous:
        raise TypeError(f"payload of {key!r} must be a C-contiguous buffer")
    if view.nbytes != object_nbytes:
        raise ValueError(
            f"payload of {key!r} holds {view.nbytes} bytes, expected object_nbytes={object_nbytes}"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class MooncakeBlockObjectStore:
    """The aostore store API over a Mooncake Store cluster.

    ``MooncakeBlockObjectStore(client, *, object_nbytes, max_batch_bytes=4 MiB, key_prefix="",
    master_address="", close_client=True)`` wraps a connected
    ``mooncake.store.MooncakeDistributedStore``; ``MooncakeBlockObjectStore.from_config(config,
    object_nbytes=...)`` connects one. Keys are written as ``key_prefix + key``.

    - ``put(objects, *, retain_keys=(), release_keys=())`` and ``put_blocks(keys, blocks,
      ...)`` validate everything first (``TypeError``/``ValueError`` as the local store), keep
      the last payload of a key given twice, and write with ``put_batch`` in batches of at
      most ``max_batch_bytes``. A batch that Mooncake refuses raises ``MooncakeError``;
      batches written before it stay written. Retains and releases are counted, nothing
      else (see the module docstring: retention belongs to the deployment).
    - ``get_concatenated(keys)`` / ``get_into(keys, out)`` / ``get_array(...)`` read each key
      once with ``batch_get_buffer`` in bounded batches. A key that Mooncake does not hold
      raises ``BlockObjectStoreError`` (``does not exist``, naming the key); an unreachable
      master raises ``MooncakeError`` (within about 4 s of the master going away).
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
        max_batch_bytes: int = 4 * _MIB,
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
        self._client = client
        self.object_nbytes = object_nbytes
        self._batch_objects = max_batch_bytes // object_nbytes
        self.key_prefix = key_prefix
        self.master_address = master_address
        self._close_client = close_client
        self._lock = threading.Lock()
        self._closed = False
        self._master_down = False
        self._generation = _fork_generation
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
        return self._closed

    @property
    def client(self) -> Any:
        """The ``MooncakeDistributedStore`` behind this store."""
        return self._client

    # -- writes --------------------------------------------------------------------------

    def put(
        self,
        objects: Iterable[Any],
        *,
        retain_keys: Iterable[str] | None = (),
        release_keys: Iterable[str] | None = (),
    ) -> None:
        """Writes ``objects`` (``.key`` and ``.payload``) to Mooncake; see the class doc."""
        self._check_open()
        batch: dict[str, memoryview] = {}
        for item in objects:
            key = _check_key(item.key)
            batch[key] = _payload_view(key, item.payload, self.object_nbytes)
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
        self._check_open()
        key_list = [_check_key(key) for key in keys]
        data = _tensors.block_bytes(blocks, len(key_list), self.object_nbytes)
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
        self._write(list(batch), list(batch.values()))

    def _write(self, keys: Sequence[str], payloads: Sequence[Any]) -> None:
        """``put_batch`` in bounded batches; ``keys`` are distinct and validated."""
        step = self._batch_objects
        for start in range(0, len(keys), step):
            chunk = keys[start : start + step]
            names = [self.key_prefix + key for key in chunk] if self.key_prefix else list(chunk)
            values = list(payloads[start : start + step])
            with self._lock:
                self._check_open()
                self._check_reachable()
                code = self._client.put_batch(names, values)
            if code != 0:
                self._raise_for_code(f"put_batch of {len(chunk)} objects from {chunk[0]!r}", code)
            self._stats["put_batches"] += 1
            self._stats["objects_written"] += len(chunk)
            self._stats["bytes_written"] += len(chunk) * self.object_nbytes

    def publish(self, keys: Sequence[str], payloads: Sequence[Any]) -> None:
        """Makes Mooncake hold exactly ``payloads[i]`` under ``keys[i]`` (distinct, validated
        keys): the tiered store's publication, which overwrites. For ``TieredBlockObjectStore``.

        Per bounded batch: ``batch_is_exist``; the keys Mooncake holds are read back and
        compared; ``upsert_batch`` writes the absent keys and those whose bytes differ. A key
        that already holds the same bytes is not written again, so republishing a shared
        block (another engine computed the same prefix) never opens the window in which an
        overwritten key reads as missing. Raises ``MooncakeError`` as ``put`` does.
        """
        step = self._batch_objects
        for start in range(0, len(keys), step):
            chunk = list(keys[start : start + step])
            values = list(payloads[start : start + step])
            names = [self.key_prefix + key for key in chunk] if self.key_prefix else chunk
            with self._lock:
                self._check_open()
                self._check_reachable()
                codes = self._client.batch_is_exist(names)
            for key, code in zip(chunk, codes, strict=True):
                if code not in (0, 1):
                    self._raise_for_code(f"batch_is_exist of {key!r}", code)
            write = [i for i, code in enumerate(codes) if code == 0]
            present = [i for i, code in enumerate(codes) if code == 1]
            if present:
                with self._lock:
                    self._check_open()
                    handles = self._client.batch_get_buffer([names[i] for i in present])
                    try:
                        self._stats["get_batches"] += 1
                        for index, handle in zip(present, handles, strict=True):
                            if handle is None or not _same_bytes(handle, values[index]):
                                write.append(index)
                    finally:
                        del handles
                write.sort()
            self._stats["objects_unchanged"] += len(chunk) - len(write)
            if not write:
                continue
            with self._lock:
                self._check_open()
                self._check_reachable()
                code = self._client.upsert_batch(
                    [names[i] for i in write], [values[i] for i in write]
                )
            if code != 0:
                self._raise_for_code(
                    f"upsert_batch of {len(write)} objects from {chunk[write[0]]!r}", code
                )
            self._stats["put_batches"] += 1
            self._stats["objects_written"] += len(write)
            self._stats["bytes_written"] += len(write) * self.object_nbytes

    # -- reads ---------------------------------------------------------------------------

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        """The payloads of ``keys`` in order (duplicates allowed; ``[]`` gives ``b""``)."""
        key_list = list(keys)
        out = bytearray(len(key_list) * self.object_nbytes)
        self._get_into_view(key_list, memoryview(out))
        return bytes(out)

    def get_into(self, keys: Iterable[str], out: Any) -> Any:
        """Writes the payloads of ``keys``, concatenated, into ``out`` and returns ``out``."""
        self._check_open()
        host, pending = _tensors.writable_host_bytes(out)
        self._get_into_view(list(keys), _writable_view(host))
        _tensors.finish_device_copy(pending)
        return out

    def get_array(self, keys: Sequence[str], *, dtype: Any, shape_per_token: Sequence[int]) -> Any:
        """A new numpy array of the payloads of ``keys``, shape ``(-1, *shape_per_token)``."""
        import numpy as np

        key_list = list(keys)
        out = np.empty(len(key_list) * self.object_nbytes, dtype=np.uint8)
        self._get_into_view(key_list, out.data)
        return out.view(np.dtype(dtype)).reshape((-1, *shape_per_token))

    def _get_into_view(self, keys: list[str], view: memoryview) -> None:
        self._check_open()
        for key in keys:
            _check_key(key)
        n = self.object_nbytes
        if view.nbytes != len(keys) * n:
            raise ValueError(
                f"out holds {view.nbytes} bytes, expected {len(keys)} x {n} = {len(keys) * n}"
            )
        self._stats["reads"] += 1
        first: dict[str, int] = {}
        for index, key in enumerate(keys):
            first.setdefault(key, index)
        unique = list(first)
        missing = self.read_unique(
            unique, [view[first[k] * n : (first[k] + 1) * n] for k in unique]
        )
        if missing:
            self._stats["read_misses"] += 1
            raise BlockObjectStoreError(
                f'auxiliary output object "{missing[0]}" does not exist in Mooncake'
                f"{' (and ' + str(len(missing) - 1) + ' more)' if len(missing) > 1 else ''}; "
                f"it was never published or Mooncake evicted it (retention belongs to the "
                f"Mooncake deployment)"
            )
        _copy_duplicates(keys, first, view, n)

    def read_unique(self, keys: Sequence[str], targets: Sequence[memoryview]) -> list[str]:
        """Reads distinct ``keys`` into ``targets`` (one ``object_nbytes`` view each).

        Returns the keys Mooncake does not hold (their targets are left as they were); raises
        ``MooncakeError`` when Mooncake cannot answer. For ``TieredBlockObjectStore``.
        """
        self._check_open()
        missing: list[str] = []
        step = self._batch_objects
        for start in range(0, len(keys), step):
            chunk = list(keys[start : start + step])
            absent = self._read_batch(chunk, targets[start : start + step])
            if absent:
                missing.extend(self._resolve_absent(chunk, targets[start : start + step], absent))
        self._stats["objects_read"] += len(keys) - len(missing)
        self._stats["bytes_read"] += (len(keys) - len(missing)) * self.object_nbytes
        return missing

    def exists_unique(self, keys: Sequence[str]) -> list[bool]:
        """Whether Mooncake holds each of the distinct ``keys`` (``batch_is_exist``, no read);
        raises ``MooncakeError`` when Mooncake cannot answer. For ``TieredBlockObjectStore``."""
        self._check_open()
        found: list[bool] = []
        step = self._batch_objects
        for start in range(0, len(keys), step):
            chunk = list(keys[start : start + step])
            names = [self.key_prefix + key for key in chunk] if self.key_prefix else chunk
            with self._lock:
                self._check_open()
                self._check_reachable()
                codes = self._client.batch_is_exist(names)
            for key, code in zip(chunk, codes, strict=True):
                if code not in (0, 1):
                    self._raise_for_code(f"batch_is_exist of {key!r}", code)
            found.extend(code == 1 for code in codes)
        return found

    def marker_present(self, name: str) -> bool:
        """Whether Mooncake holds the tier's marker object ``name`` (a key outside the
        aostore key space); raises ``MooncakeError`` when Mooncake cannot answer."""
        with self._lock:
            self._check_open()
            self._check_reachable()
            code = self._client.batch_is_exist([self.key_prefix + name])[0]
        if code not in (0, 1):
            self._raise_for_code(f"batch_is_exist of the marker {name!r}", code)
        return bool(code == 1)

    def write_marker(self, name: str) -> None:
        """Writes the tier's small marker object ``name`` (``put_batch``); raises
        ``MooncakeError`` as ``put`` does."""
        with self._lock:
            self._check_open()
            self._check_reachable()
            code = self._client.put_batch([self.key_prefix + name], [_MARKER_VALUE])
        if code != 0:
            self._raise_for_code(f"put_batch of the marker {name!r}", code)

    def remove_marker(self, name: str) -> None:
        """Removes the marker, best effort (never raises)."""
        remove = getattr(self._client, "remove", None)
        if remove is None:
            return
        try:
            with self._lock:
                if self._closed or self._master_down:
                    return
                remove(self.key_prefix + name, True)
        except Exception as error:  # a marker left behind costs a few bytes in Mooncake
            logger.debug("removing the tier's Mooncake marker failed: %s", error)

    def _read_batch(self, chunk: list[str], targets: Sequence[memoryview]) -> list[int]:
        """One ``batch_get_buffer``; copies what came back; the positions that did not."""
        names = [self.key_prefix + key for key in chunk] if self.key_prefix else chunk
        absent: list[int] = []
        with self._lock:
            self._check_open()
            self._check_reachable()
            handles = self._client.batch_get_buffer(names)
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
            target[:] = source if source.format == "B" and source.ndim == 1 else source.cast("B")

    def _resolve_absent(
        self, chunk: list[str], targets: Sequence[memoryview], absent: list[int]
    ) -> list[str]:
        """Tells misses from reads that failed (the local buffer was full, the master left)."""
        names = [self.key_prefix + chunk[index] for index in absent]
        # With the master gone, batch_get_buffer returns None at once but batch_is_exist
        # waits seconds for its RPC: ask the master's port first.
        self._check_after_failure("a read returned nothing and the master's port is closed")
        with self._lock:
            self._check_open()
            codes = self._client.batch_is_exist(names)
        missing: list[str] = []
        for name, index, code in zip(names, absent, codes, strict=True):
            if code == 0:
                missing.append(chunk[index])
            elif code == 1:  # present, but the batch read did not return it: read it alone
                with self._lock:
                    self._check_reachable()
                    handle = self._client.get_buffer(name)
                    if handle is None:
                        raise MooncakeError(
                            f"Mooncake holds {chunk[index]!r} but could not read it back"
                        )
                    self._copy_out(chunk[index], handle, targets[index])
                    del handle
            else:
                self._check_after_failure(f"batch_is_exist failed with {_code(code)}")
                if code == _RPC_FAIL:
                    self._master_down = True
                    raise self._unreachable("the master did not answer")
                raise MooncakeError(
                    f"Mooncake could not look up {chunk[index]!r}: error {_code(code)}"
                )
        return missing

    # -- the rest ------------------------------------------------------------------------

    def _check_process(self) -> None:
        if self._generation != _fork_generation:
            raise RuntimeError(
                "this aostore Mooncake store was created in the parent process before fork(); "
                "its Mooncake client's threads do not exist here: connect a new store in the child"
            )

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")

    def _unreachable(self, detail: str) -> MooncakeError:
        where = f" at {self.master_address}" if self.master_address else ""
        return MooncakeError(
            f"the Mooncake master{where} is unreachable ({detail}); auxiliary outputs cannot be "
            f"read from or published to Mooncake"
        )

    def _master_answers(self) -> bool:
        """Whether the master's RPC port accepts a connection (refused at once when the master
        process is gone; at most ``_PROBE_TIMEOUT_S``). True when the address is unknown."""
        if not self.master_address:
            return True
        host, port = _split_address(self.master_address)
        try:
            socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def _check_reachable(self) -> None:
        """Raises at once when the master is known to be gone.

        Mooncake's ``health_check`` flag, and this store's own latch, set when a call failed
        and the master's port did not answer: while it is set each call probes the port first
        (so a master that comes back is used again) instead of waiting on Mooncake's retries.
        """
        health = getattr(self._client, "health_check", None)
        code = health() if health is not None else 0
        if code == 1:
            raise MooncakeError("the Mooncake client is closed or was never set up")
        if code == 2 or self._master_down:
            if not self._master_answers():
                self._master_down = True
                raise self._unreachable("its port refuses connections")
            self._master_down = False

    def _check_after_failure(self, detail: str) -> None:
        """After a failed call: raises the unreachable error when the master does not answer."""
        if not self._master_answers():
            self._master_down = True
            raise self._unreachable(detail)

    def _raise_for_code(self, what: str, code: int) -> None:
        self._check_after_failure(f"{what} failed with {_code(code)}")
        if code == _RPC_FAIL:
            raise self._unreachable(f"{what} failed with {_code(code)}")
        hint = ""
        if code == -200:
            hint = (
                "; no mounted segment has room: Mooncake evicts at its high watermark, "
                "otherwise mount more memory (global_segment_size > 0 or a mooncake_client "
                "segment holder)"
            )
        elif code == -600:
            hint = "; the batch may not fit in the client's local_buffer_size"
        raise MooncakeError(f"Mooncake {what} failed with {_code(code)}{hint}")

    def stats(self) -> dict[str, int]:
        """Counters: puts, objects/bytes written, objects that ``publish`` found unchanged, put
        batches, retains, releases, reads (calls), objects/bytes read, read misses (calls that
        raised ``does not exist``), get batches, and ``object_nbytes``."""
        return {"object_nbytes": self.object_nbytes, **self._stats}

    def close(self) -> None:
        """Closes the Mooncake client (when this store owns it); idempotent. In a forked child
        it raises ``RuntimeError`` (the client belongs to the parent)."""
        self._check_process()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._close_client:
                code = self._client.close()
                if code not in (0, None):
                    logger.warning("Mooncake client close returned %s", _code(code))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"master {self.master_address or '?'}"
        return f"<{type(self).__name__} {state}, objects of {self.object_nbytes} B>"


def _writable_view(host: Any) -> memoryview:
    try:
        view = memoryview(host)
    except TypeError:
        raise TypeError(
            f"out must be a writable buffer, numpy array or tensor, not {type(host).__name__}"
        ) from None
    if view.readonly:
        raise TypeError("out must be writable")
    if not view.c_contiguous:
        raise ValueError("out must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _same_bytes(handle: Any, payload: Any) -> bool:
    """Whether a Mooncake buffer handle holds exactly the bytes of ``payload``."""
    with memoryview(handle) as held, memoryview(payload) as mine:
        a = held if held.format == "B" and held.ndim == 1 else held.cast("B")
        b = mine if mine.format == "B" and mine.ndim == 1 else mine.cast("B")
        # Compared as bytes: memoryview's own == walks item by item (about 25x slower).
        return a.nbytes == b.nbytes and a.tobytes() == (
            payload if type(payload) is bytes else b.tobytes()
        )


def _copy_duplicates(keys: list[str], first: dict[str, int], view: memoryview, n: int) -> None:
    """Fills each repeated key's position from its first occurrence."""
    if len(first) == len(keys):
        return
    for index, key in enumerate(keys):
        source = first[key]
        if source != index:
            view[index * n : (index + 1) * n] = view[source * n : (source + 1) * n]


class _Rows(Sequence[memoryview]):
    """The rows of one flat buffer as a sequence of views, sliced when read (by the
    publisher thread, not the caller's)."""

    def __init__(self, data: bytes, row_nbytes: int, count: int) -> None:
        self._view = memoryview(data)
        self._n = row_nbytes
        self._count = count

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> memoryview: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[memoryview]: ...
    def __getitem__(self, index: int | slice) -> memoryview | Sequence[memoryview]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if not -self._count <= index < self._count:
            raise IndexError(index)
        index %= self._count
        return self._view[index * self._n : (index + 1) * self._n]


class _Job:
    """One call for a :class:`_CallThread`; the caller waits for ``done``."""

    __slots__ = ("abandoned", "done", "error", "fn", "result")

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.abandoned = False


class _CallThread:
    """Runs calls into Mooncake one at a time on a daemon thread, so that a caller can give up
    after a deadline while the call goes on (Mooncake's own timeouts are 30 s per RPC). A call
    given up on leaves the thread ``stuck`` until it returns: later callers then give up at
    once instead of queueing behind it. The thread is started on first use; a daemon, so a
    call that never returns does not keep the interpreter from exiting."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned: _Job | None = None

    @property
    def stuck(self) -> bool:
        job = self._abandoned
        return job is not None and not job.done.is_set()

    def call(self, fn: Any, timeout: float) -> tuple[bool, Any]:
        """``(True, fn())`` when ``fn`` returned within ``timeout`` seconds (its exception is
        raised here), ``(False, None)`` when it did not or the thread is stuck."""
        with self._lock:
            if self.stuck:
                return False, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            job = _Job(fn)
            self._jobs.put(job)
        if not job.done.wait(max(0.0, timeout)):
            with self._lock:
                job.abandoned = True
                if not job.done.is_set():
                    self._abandoned = job
                    return False, None
        if job.error is not None:
            raise job.error
        return True, job.result

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if not job.abandoned:
                    job.result = job.fn()
            except BaseException as error:  # handed to the caller, if it still waits
                job.error = error
            finally:
                job.fn = None
                job.done.set()

    def stop(self) -> None:
        """Lets the thread end once its current call returns; does not wait for it."""
        with self._lock:
            if self._thread is not None:
                self._jobs.put(None)


_ON_PUBLISH_ERROR = ("retry", "raise")
_OVERLOAD_WARNING_INTERVAL_S = 60
_FILTER_BITS = 1 << 20  # keys recorded unpublished beyond the record: 128 KiB of bits


class _Item:
    """A queued publication: keys, their payloads, and the sequence number of the put."""

    __slots__ = ("keys", "payloads", "seq")

    def __init__(self, seq: int, keys: list[str], payloads: Sequence[Any]) -> None:
        self.seq = seq
        self.keys = keys
        self.payloads = payloads


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class TieredBlockObjectStore:
    """The local aostore arena in front of Mooncake.

    ``TieredBlockObjectStore(local, remote, *, max_pending_batches=8, keep_fetched=True,
    on_publish_error="retry", read_deadline_s=4.0, retry_backoff_s=0.5,
    retry_backoff_max_s=5.0, check_interval_s=1.0, max_unpublished_keys=65536,
    close_timeout_s=10.0)``: ``local`` is a ``BlockObjectStore`` (the hot tier, with its own
    eviction and reference counts), ``remote`` a ``MooncakeBlockObjectStore`` of the same
    ``object_nbytes``. The tiered store owns both: ``close`` closes them.

    - ``put``/``put_blocks`` apply to ``local`` at once (with its semantics and errors,
      retains and releases included), then queue what the local tier wrote for Mooncake. A
      publisher thread publishes queued batches with ``MooncakeBlockObjectStore.publish``
      (``upsert_batch`` of what Mooncake lacks or holds with other bytes), joining several
      into one when they are queued together. Payloads that are ``bytes`` are published as
      they are, other buffers are copied once at put time (the caller may reuse them).
    - Faults, ``on_publish_error="retry"`` (the default): no Mooncake fault reaches the
      caller. The queue holds ``max_pending_batches``; a put never waits for room: what does
      not fit (Mooncake down, stalled, or slower than the engine) is recorded as unpublished
      instead of queued. A failed batch is recorded as unpublished too; the publisher then
      probes the master with backoff (``retry_backoff_s`` doubling up to
      ``retry_backoff_max_s``), recording what is queued meanwhile, and once the master
      answers it republishes every recorded key that the local tier still holds (with the
      bytes it holds). A key evicted meanwhile stays recorded. ``unpublished_keys()`` lists
      the record (at most ``max_unpublished_keys``; ``stats()`` counts the keys beyond it).
      An idle publisher checks the master every ``check_interval_s`` through a marker object
      of its own: a master that lost it (restarted, so empty) makes the tier republish what
      it published that the local tier still holds, and record the rest as unpublished. One
      WARNING per outage, one INFO line when it ends.
    - ``on_publish_error="raise"``: the first publication error is latched (later
      publications are recorded as unpublished and skipped) and the next ``put``, read,
      ``flush`` or ``close`` raises ``BlockObjectStoreError`` (``publication failed``)
      chained from it; a put waits for room in a full queue; a read that Mooncake fails or
      does not answer within the deadline raises ``MooncakeError``.
    - ``get_concatenated``/``get_into``/``get_array`` read ``local``; on a local miss they
      wait for this process's queued publications of the keys the local tier lacks, then
      fetch them from Mooncake in one batch (bounded in bytes) into a private buffer, all
      within ``read_deadline_s``; the bytes reach the caller only when the fetch completed.
      A key still queued at the deadline, recorded as unpublished, or that Mooncake does not
      give (absent, down, stalled past the deadline) is a miss: ``BlockObjectStoreError``
      (``does not exist``, naming the key), as without the tier. When ``keep_fetched``, what
      was fetched goes into ``local`` as far as it has room without growing (free slots plus
      evictable objects; the rest are counted in ``not_kept_objects``): a read never makes a
      ``grow`` arena grow. ``get_many``, ``get_optional`` and ``contains`` are the
      non-raising forms, as on the local stores.
    - One value per key: the local tier decides and publication overwrites (the module
      docstring has the rule). No read returns bytes that Mooncake may hold from before a
      later unpublished write: such keys are misses until republished.
    - ``flush(timeout=None)`` waits until every queued batch is published or recorded as
      unpublished, and, while the master answers, until recorded keys that are still local
      have been republished.
    - After ``fork()``, every call but ``stats()`` raises ``RuntimeError`` in the child (the
      publisher exists only in the parent).
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
        self._max_pending = max_pending_batches
        self._batch_bytes = remote._batch_objects * remote.object_nbytes
        self._generation = _fork_generation
        self._error: BaseException | None = None
        self._closed = False
        # Serializes the tier's writes to the local store (puts and kept fetches), so that the
        # publication queue's order is the order of the local writes, and a fetch is kept only
        # if no put wrote the key while the read was fetching it. Taken before ``_cond``.
        self._write_lock = threading.Lock()
        self._reads_in_flight = 0
        self._written_during_reads: set[str] = set()
        # The publisher's state, under ``_cond``: the queue, the keys queued or being
        # published (reads wait for them), the record of unpublished keys (key -> the
        # sequence number of the write it stands for, and whether the local tier was found
        # to lack it), the keys published lately (republished after a master restart).
        self._cond = threading.Condition()
        self._queue: collections.deque[_Item] = collections.deque()
        self._pending: dict[str, int] = {}
        self._busy = False
        self._stopping = False
        self._seq = 0
        self._record: dict[str, list[Any]] = {}
        self._beyond = 0
        self._filter = bytearray(_FILTER_BITS // 8)
        self._backlog = False
        self._published: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._outage_since: float | None = None
        self._warned = False
        self._overload_warned = 0.0
        self._marker = f"__aostore_tier__/{os.getpid()}-{uuid.uuid4().hex}"
        self._marker_written = False
        self._reader = _CallThread("aostore-mooncake-reader")
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
        self._thread = threading.Thread(
            target=self._publish_loop, daemon=True, name="aostore-mooncake-publisher"
        )
        self._thread.start()

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
        return self._closed

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
        latest: dict[str, Any] = {}
        for item in batch:
            latest[item.key] = item.payload
        with self._write_lock:
            publish = self._written_by_put(list(latest))
            try:
                self.local.put(batch, retain_keys=retain_keys, release_keys=release_keys)
            except (TypeError, ValueError, KeyError):
                raise  # refused before anything changed
            except BaseException:
                self._publish_what_was_written(latest, publish)
                raise
            self._stats["puts"] += 1
            keys = [key for key, write in zip(latest, publish, strict=True) if write]
            if keys:
                self._publish(keys, [latest[key] for key in keys])

    def _written_by_put(self, keys: list[str]) -> list[bool]:
        """Which of a put's distinct keys the local tier will write, i.e. store new or replace:
        those are published (and overwrite Mooncake), so Mooncake gets the bytes the local tier
        holds. A key the local tier already stores keeps its bytes (``fail-closed``: objects
        are immutable; ``grow``: unless nothing references it) and is not published again."""
        if not keys:
            return []
        stored = self.local.contains(keys)
        if getattr(self.local, "profile", "fail-closed") == "grow":
            counts = self.local.reference_counts(keys)
            return [not s or c == 0 for s, c in zip(stored, counts, strict=True)]
        return [not s for s in stored]

    def _publish(self, keys: list[str], payloads: Sequence[Any]) -> None:
        """Queues ``payloads`` (a private copy unless ``bytes``) under ``keys``; called under
        the write lock, right after the local put, so the queue's order is the local tier's."""
        if self._reads_in_flight:
            self._written_during_reads.update(keys)
        self._enqueue(
            keys,
            [payload if type(payload) is bytes else _snapshot(payload) for payload in payloads],
        )

    def _publish_what_was_written(self, latest: Mapping[str, Any], publish: list[bool]) -> None:
        """After a local put raised past validation (a policy's exception, say): publishes the
        keys the local tier holds with this put's bytes anyway, so no local write is left
        unpublished. Never raises over the put's own error."""
        try:
            keys = [key for key, write in zip(latest, publish, strict=True) if write]
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
                if view[i * n : (i + 1) * n].tobytes() == _snapshot(latest[key])
            ]
            if same:
                self._publish(same, [latest[key] for key in same])
        except Exception as error:  # the put's own exception is the one to raise
            logger.warning("could not queue a failed put's objects for Mooncake: %s", error)

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
        host = _tensors.block_bytes(blocks, len(key_list), self.object_nbytes)
        last = {key: i for i, key in enumerate(key_list)}  # the last row of a key wins
        n = self.object_nbytes
        with self._write_lock:
            publish = self._written_by_put(list(last))
            try:
                self.local.put_blocks(
                    key_list, host, retain_keys=retain_keys, release_keys=release_keys
                )
            except (TypeError, ValueError, KeyError):
                raise
            except BaseException:
                view = memoryview(host).cast("B")
                by_key = {key: view[i * n : (i + 1) * n] for key, i in last.items()}
                self._publish_what_was_written(by_key, publish)
                raise
            self._stats["puts"] += 1
            rows = [last[key] for key, write in zip(last, publish, strict=True) if write]
            if not rows:
                return
            data = host if type(host) is bytes else _snapshot(host)
            written = [key_list[i] for i in rows]
            if self._reads_in_flight:
                self._written_during_reads.update(written)
            if len(rows) == len(key_list):
                self._enqueue(key_list, _Rows(data, n, len(key_list)))
            else:
                view = memoryview(data).cast("B")
                self._enqueue(written, [view[i * n : (i + 1) * n] for i in rows])

    def _enqueue(self, keys: list[str], payloads: Sequence[Any]) -> None:
        """Queues one publication, or records it as unpublished when the queue is full (in
        ``retry`` mode; ``raise`` mode waits for room). Called under the write lock. The
        closed check and the enqueue are one step under ``_cond``, which ``close`` takes, so
        nothing lands behind the publisher's last look at the queue."""
        with self._cond:
            if self._closed:
                raise RuntimeError("auxiliary output store is closed")
            self._seq += 1
            seq = self._seq
            if len(self._queue) >= self._max_pending:
                if self._retry or self._error is not None:
                    self._stats["dropped_objects"] += len(keys)
                    self._record_keys(keys, seq)
                    now = time.monotonic()
                    if self._warned or now < self._overload_warned:
                        return  # one WARNING per outage or overload
                    self._warned = True
                    self._overload_warned = now + _OVERLOAD_WARNING_INTERVAL_S
                    logger.warning(
                        "aostore Mooncake tier: the Mooncake publication queue is full (%d "
                        "batches; Mooncake is down, stalled or slower than the engine): puts go "
                        "on locally and what does "
                        "not fit is recorded as unpublished, to be republished from the local "
                        "tier when the publisher catches up (logged at most every %d s)",
                        self._max_pending,
                        _OVERLOAD_WARNING_INTERVAL_S,
                    )
                    return
                while len(self._queue) >= self._max_pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise RuntimeError("auxiliary output store is closed")
            self._queue.append(_Item(seq, keys, payloads))
            for key in keys:
                self._pending[key] = self._pending.get(key, 0) + 1
            self._stats["queued_objects"] += len(keys)
            self._cond.notify_all()

    # -- the record of unpublished keys (under _cond) -------------------------------------

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

    def _warn_once(self, message: str, *args: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("aostore Mooncake tier: " + message, *args)

    def unpublished_keys(self) -> list[str]:
        """The keys recorded as unpublished (at most ``max_unpublished_keys``, oldest first):
        Mooncake may lack them or hold other bytes; ``stats()["unpublished_not_recorded"]``
        counts those that did not fit the record. A key leaves the record once published."""
        with self._cond:
            return list(self._record)

    # -- the publisher ---------------------------------------------------------------------

    def _take(self) -> list[_Item]:
        """Up to one batch of bytes from the queue (at least one item). Under ``_cond``."""
        items = [self._queue.popleft()]
        count = len(items[0].keys)
        while self._queue and count * self.object_nbytes < self._batch_bytes:
            item = self._queue.popleft()
            items.append(item)
            count += len(item.keys)
        return items

    def _release(self, items: list[_Item], published: bool) -> None:
        """The end of queued items: settled when published, else recorded. Under ``_cond``."""
        pending = self._pending
        for item in items:
            for key in item.keys:
                left = pending[key] - 1
                if left:
                    pending[key] = left
                else:
                    del pending[key]
            if published:
                self._settled(item.keys, item.seq)
            else:
                self._record_keys(item.keys, item.seq)
        self._cond.notify_all()

    def _publish_loop(self) -> None:
        backoff = self.retry_backoff_s
        next_probe = 0.0
        next_check = time.monotonic() + self.check_interval_s
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._queue and not self._stopping:
                    if not self._retry:  # raise mode: only the queue wakes the publisher
                        self._cond.wait()
                        continue
                    down = self._outage_since is not None
                    if self._backlog and not down:
                        break
                    now = time.monotonic()
                    wake = next_probe if down else next_check
                    if now >= wake:
                        break
                    self._cond.wait(wake - now)
                if not self._queue and self._stopping:
                    return
                items = self._take() if self._queue else []
                down = self._outage_since is not None
                self._busy = bool(items) or (self._backlog and not down)
            if self._error is not None:  # raise mode, latched: nothing is published any more
                with self._cond:
                    self._release(items, False)
                continue
            if down:
                if self._stopping or time.monotonic() < next_probe:
                    with self._cond:  # Mooncake is down: recorded, republished when it is back
                        self._release(items, False)
                    continue
                if not self._probe():
                    backoff = min(backoff * 2, self.retry_backoff_max_s)
                    next_probe = time.monotonic() + backoff
                    with self._cond:
                        self._release(items, False)
                    continue
                self._end_outage()
                backoff = self.retry_backoff_s
                next_check = time.monotonic() + self.check_interval_s
                if not items and not self._backlog:
                    continue
            if items:
                if not self._publish_items(items):
                    next_probe = time.monotonic() + backoff
                continue
            if self._backlog:
                if not self._republish_some():
                    next_probe = time.monotonic() + backoff
                continue
            next_check = time.monotonic() + self.check_interval_s  # idle: is the master there?
            if not self._probe():
                next_probe = time.monotonic() + backoff

    def _fault(self, what: str, error: BaseException) -> None:
        """A publication fault: latched (``raise``) or the start of an outage (``retry``)."""
        self._stats["publish_failures"] += 1
        if not self._retry:
            self._error = error
            logger.error("publishing auxiliary outputs to Mooncake failed: %s", error)
            return
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._stats["outages"] += 1
            self._warn_once(
                "%s failed (%s); inference goes on with the local tier, what cannot be "
                "published is recorded as unpublished (stats()['unpublished_objects']) and "
                "republished from the local tier when the master answers again",
                what,
                error,
            )

    def _end_outage(self) -> None:
        since = self._outage_since
        self._outage_since = None
        self._warned = False
        if since is not None:
            with self._cond:
                recorded = len(self._record)
            logger.info(
                "aostore Mooncake tier: the master answers again after %.1f s; republishing "
                "what the local tier still holds of %d unpublished keys",
                time.monotonic() - since,
                recorded,
            )

    def _probe(self) -> bool:
        """Asks the master for the tier's marker (and writes it when absent). A marker that was
        written and is gone means a master that lost its data: what this tier published
        lately is recorded as unpublished, to be republished from the local tier."""
        try:
            if not self.remote.marker_present(self._marker):
                if self._marker_written:
                    self._stats["master_restarts"] += 1
                    with self._cond:
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
            with self._cond:
                self._release(items, False)
            self._fault(f"publishing {len(unique)} objects", error)
            return False
        with self._cond:
            self._release(items, True)
            self._stats["published_objects"] += len(unique)
            self._stats["publish_batches"] += 1
        if self._retry and not self._marker_written:
            self._probe()
        return True

    def _republish_some(self) -> bool:
        """Republishes up to one batch of recorded keys that the local tier holds, with the
        bytes it holds; marks those it lacks (they stay recorded). False on a fault."""
        limit = max(1, self._batch_bytes // self.object_nbytes)
        with self._write_lock:  # no put between the look at the record and the local read
            with self._cond:
                keys = [key for key, entry in self._record.items() if not entry[1]][:limit]
                if not keys:
                    self._backlog = False
                    return True
                self._seq += 1
                seq = self._seq
            try:
                data, missing = self.local.get_many(keys)
            except Exception as error:  # the local store closed under us
                logger.debug("reading the local tier to republish failed: %s", error)
                with self._cond:
                    self._backlog = False
                return True
        absent = set(missing)
        held = [key for key in keys if key not in absent]
        n = self.object_nbytes
        view = memoryview(data)
        payloads = [view[i * n : (i + 1) * n] for i in range(len(held))]
        if held:
            try:
                self.remote.publish(held, payloads)
            except BaseException as error:
                self._fault(f"republishing {len(held)} objects", error)
                return False
        with self._cond:
            for key in absent:
                entry = self._record.get(key)
                if entry is not None and entry[0] < seq:
                    entry[1] = True  # evicted locally: stays recorded, not retried
            self._settled(held, seq)
            self._stats["republished_objects"] += len(held)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every queued batch is published or recorded as unpublished and, while
        the master answers, recorded keys that the local tier holds are republished; at most
        ``timeout`` seconds when given. True when that state was reached. Raises a latched
        error (``raise`` mode)."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (
                self._queue
                or self._busy
                or (self._backlog and self._outage_since is None and self._error is None)
            ):
                if not self._thread.is_alive():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            done = not self._queue and not self._busy
        self._raise_if_failed()
        return done

    # -- reads ---------------------------------------------------------------------------

    def get_concatenated(self, keys: Iterable[str]) -> bytes:
        """The payloads of ``keys`` in order, from the local store or else from Mooncake."""
        self._check_usable()
        key_list = list(keys)
        try:
            data: bytes = self.local.get_concatenated(key_list)
        except BlockObjectStoreError as error:
            if "does not exist" not in str(error):
                raise
        else:
            self._count_local_hit(len(key_list))
            return data
        out = bytearray(len(key_list) * self.object_nbytes)
        self._read_tiers(key_list, memoryview(out))
        return bytes(out)

    def get_into(self, keys: Iterable[str], out: Any) -> Any:
        """Writes the payloads of ``keys`` into ``out`` (local first, misses from Mooncake)."""
        self._check_usable()
        key_list = list(keys)
        host, pending = _tensors.writable_host_bytes(out)
        try:
            self.local.get_into(key_list, host)
        except BlockObjectStoreError as error:
            if "does not exist" not in str(error):
                raise
            self._read_tiers(key_list, _writable_view(host))
        else:
            self._count_local_hit(len(key_list))
        _tensors.finish_device_copy(pending)
        return out

    def get_array(self, keys: Sequence[str], *, dtype: Any, shape_per_token: Sequence[int]) -> Any:
        """A new numpy array of the payloads of ``keys``, shape ``(-1, *shape_per_token)``."""
        import numpy as np

        key_list = list(keys)
        out = np.empty(len(key_list) * self.object_nbytes, dtype=np.uint8)
        self.get_into(key_list, out)
        return out.view(np.dtype(dtype)).reshape((-1, *shape_per_token))

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
        absent = list(dict.fromkeys(missing))
        self._stats["local_hit_objects"] += len(key_list) - len(missing)
        fetched = self._fetch_remote(absent)
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
        absent = list(
            dict.fromkeys(key for key, hit in zip(key_list, found, strict=True) if not hit)
        )
        if not absent:
            return list(found)
        deadline = time.monotonic() + self.read_deadline_s
        ask = [key for key in absent if key not in self._wait_unsettled(absent, deadline)]
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
        first: dict[str, int] = {}
        for index, key in enumerate(keys):
            first.setdefault(_check_key(key), index)
        with self._write_lock:
            self._reads_in_flight += 1
        try:
            absent: list[str] = []
            for key, index in first.items():
                try:
                    self.local.get_into([key], view[index * n : (index + 1) * n])
                except BlockObjectStoreError as error:
                    if "does not exist" not in str(error):
                        raise
                    absent.append(key)
            self._stats["local_hit_objects"] += len(first) - len(absent)
            fetched = self._fetch_remote(absent)
            missing = [key for key in absent if key not in fetched]
            if missing:
                self._stats["read_misses"] += 1
                raise BlockObjectStoreError(
                    f'auxiliary output object "{missing[0]}" does not exist in the local store '
                    f"or in Mooncake"
                    f"{' (and ' + str(len(missing) - 1) + ' more)' if len(missing) > 1 else ''}; "
                    f"it was evicted from both, never published, or Mooncake could not give "
                    f"it within read_deadline_s. Increase aux_output_config.max_bytes or "
                    f"Mooncake's memory when a KV cache hit needs it."
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
        _copy_duplicates(keys, first, view, n)

    def _wait_unsettled(self, keys: list[str], deadline: float) -> set[str]:
        """Waits (until ``deadline``) for this process's queued publications of ``keys``; the
        keys that Mooncake may not hold with this process's bytes afterwards: still queued,
        or recorded as unpublished."""
        with self._cond:
            while any(key in self._pending for key in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    break
                self._cond.wait(remaining)
            self._raise_if_failed()
            return {key for key in keys if key in self._pending or self._unsettled(key)}

    def _remote_call(self, fn: Any, deadline: float, what: str) -> Any:
        """``fn()`` on the reader thread, waited for until ``deadline``; ``None`` when it
        failed or did not return in time (``retry`` mode; ``raise`` mode raises)."""
        try:
            done, result = self._reader.call(fn, deadline - time.monotonic())
        except MooncakeError as error:
            self._stats["remote_read_failures"] += 1
            if not self._retry:
                raise
            self._warn_once("%s failed (%s); served as a miss, as without the tier", what, error)
            return None
        if done:
            if self._warned and self._outage_since is None and not self._record:
                self._warned = False
            return result
        self._stats["remote_read_failures"] += 1
        if not self._retry:
            raise MooncakeError(
                f"{what} did not complete within read_deadline_s={self.read_deadline_s} "
                f"(the Mooncake master at {self.remote.master_address or '?'} is stalled or "
                f"a previous call still waits on it)"
            )
        self._warn_once(
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
        unsettled = self._wait_unsettled(absent, deadline)
        ask = [key for key in absent if key not in unsettled]
        if not ask:
            return {}
        n = self.object_nbytes
        private = bytearray(len(ask) * n)
        whole = memoryview(private)
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

    def _check_process(self) -> None:
        if self._generation != _fork_generation:
            raise RuntimeError(
                "this aostore tiered store was created in the parent process before fork(); "
                "its publisher thread does not exist here: create a new store in the child"
            )

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise RuntimeError("auxiliary output store is closed")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise BlockObjectStoreError(
                f"auxiliary output publication failed: {self._error}"
            ) from self._error

    def _check_usable(self) -> None:
        self._check_open()
        self._raise_if_failed()

    def stats(self) -> dict[str, int]:
        """The tier's counters, the local store's as ``local_*`` and Mooncake's as ``remote_*``.

        Tier counters: puts, queued/published objects, publish batches, pending batches,
        reads (calls), objects served locally and from Mooncake, read misses (calls that
        missed some key), objects kept locally after a fetch, fetched objects not kept (no
        room without growing, or written meanwhile) and the puts that could not keep them.
        Faults: ``unpublished_objects`` (keys Mooncake may lack or hold with other bytes: the
        record plus those beyond it), ``unpublished_recorded`` (the record, listed by
        ``unpublished_keys()``), ``unpublished_not_recorded`` (beyond the record),
        ``dropped_objects`` (did not fit the queue), ``publish_failures`` (failed
        publications and checks), ``republished_objects``, ``outages``, ``master_restarts``
        (a master that lost this tier's objects), ``remote_read_failures`` (reads that
        Mooncake failed or did not answer in time), ``mooncake_down`` (1 during an outage).
        """
        with self._cond:
            out = dict(self._stats)
            out["pending_batches"] = len(self._queue)
            out["unpublished_recorded"] = len(self._record)
            out["unpublished_objects"] = len(self._record) + out["unpublished_not_recorded"]
            out["mooncake_down"] = int(self._outage_since is not None)
        if not self._closed:
            out.update({f"local_{k}": v for k, v in self.local.stats().items()})
        out.update({f"remote_{k}": v for k, v in self.remote.stats().items()})
        return out

    def close(self) -> None:
        """Publishes what is queued (within ``close_timeout_s``; the rest is recorded as
        unpublished), stops the publisher, closes both stores, then raises any latched error
        (``raise`` mode); idempotent. In a forked child it raises ``RuntimeError``."""
        self._check_process()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(self.close_timeout_s)
        stuck = self._thread.is_alive() or self._reader.stuck
        if self._thread.is_alive():
            with self._cond:
                left = list(self._queue)
                self._queue.clear()
                self._release(left, False)
            logger.warning(
                "aostore Mooncake tier: Mooncake did not take the queued publications within "
                "close_timeout_s=%s; %d keys stay unpublished",
                self.close_timeout_s,
                len(self._record) + self._stats["unpublished_not_recorded"],
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
        self._raise_if_failed()

    def _close_remote(self) -> None:
        try:
            if self._marker_written and self._outage_since is None:
                self.remote.remove_marker(self._marker)
        finally:
            self.remote.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<{type(self).__name__} closed>"
        return f"<{type(self).__name__} local={self.local!r} remote={self.remote!r}>"


def _snapshot(payload: Any) -> bytes:
    """A private copy of a buffer's bytes (the caller may reuse the buffer)."""
    if _tensors.is_tensor(payload):
        payload = _tensors.block_bytes(payload.reshape(1, -1), 1, payload.nbytes)
    with memoryview(payload) as view:
        return view.tobytes()
