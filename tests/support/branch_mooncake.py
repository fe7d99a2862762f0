"""Mooncake as vLLM's Mooncake branch uses it, for aostore's interop tests (docs/mooncake.md).

The branch (vllm#57968; ``vllm/distributed/aux_output_connector/mooncake.py`` at commit
8f0833bf of vllm-project/vllm) is not on the package index, so the tests cannot import it.
This module is written from its behaviour, with no vLLM code in it; it imports nothing from
aostore, so what it reads and writes is Mooncake's, not aostore's idea of it. What it does:

- Keys. A full block of routed-expert rows is stored under
  ``vllm-artifact/{namespace}/{block_hash.hex()}`` (``block_key``); rows that end a request
  without filling a block go under ``r3-tail:{uuid4().hex}`` (``tail_key``), cut into objects
  of at most ``object_nbytes`` bytes. Mooncake sees the key as given: no prefix is added.
- Values. One Mooncake value per key holding the object's bytes and nothing else (no header,
  length or checksum): a block is ``block_size`` rows in C order, ``object_nbytes`` bytes; a
  tail object is a whole number of rows, 1 to ``object_nbytes`` bytes.
- Writing (``BranchStore.put``). The last payload of a key given twice is kept, at the key's
  first position; the distinct keys go out in batches of ``max_batch_bytes // object_nbytes``
  keys, one ``put_batch(keys, values)`` per batch, sizes checked batch by batch; a non-zero
  return raises (batches before it stay written). Mooncake's ``put_batch`` keeps the bytes a
  key already holds, so the first write of a key stays.
- Reading (``BranchStore.get_concatenated``). The keys in the order given, repeats included, in
  batches of the same count; one ``batch_get_buffer(keys)`` per batch; ``None`` raises naming
  the key; each handle's bytes are copied out (``bytes(handle)``, whatever its size) and the
  handles dropped before the next batch; the result is the concatenation.
- The batch bound: ``min(64 MiB, local_buffer_size)`` (``branch_batch_bytes``).
- The terminal output. A finished request's response carries an ordered list of keys instead
  of rows (its full blocks, then tail objects); a reader concatenates their bytes in order
  and views them as rows (``read_rows``: ``(-1, *shape_per_token)`` of ``dtype``).
- Retains and releases are accepted and ignored; ``close`` closes the client.

As a script, the other process of the interop tests (one JSON line on stdout):

    python branch_mooncake.py read CONFIG_JSON KEYS_JSON OBJECT_NBYTES
    python branch_mooncake.py write CONFIG_JSON OBJECTS_JSON OBJECT_NBYTES MAX_BATCH_BYTES

``read`` connects its own client and reports the SHA-256 of each key's bytes, their sizes, the
SHA-256 of the concatenation and the size of every ``batch_get_buffer`` call; ``write`` puts
``[[key, fill_prefix, index, nbytes], ...]`` (the bytes of ``mooncake_util.payload``) and
reports the size of every ``put_batch`` call. CONFIG_JSON has aostore's config keys, with
sizes in bytes (ints).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

BRANCH_MAX_BATCH_BYTES = 64 * 1024 * 1024
BLOCK_KEY_ROOT = "vllm-artifact"
TAIL_KEY_PREFIX = "r3-tail:"


class BranchStoreError(Exception):
    """What the branch raises as ``BlockObjectStoreError`` (a failed put, a missing key)."""


def block_key(namespace: str, block_hash: bytes) -> str:
    """The key of a full block: the namespace and the block hash in lowercase hex."""
    return f"{BLOCK_KEY_ROOT}/{namespace}/{block_hash.hex()}"


def tail_key() -> str:
    """A fresh key for tail rows: random, never reused."""
    return TAIL_KEY_PREFIX + uuid.uuid4().hex


def branch_batch_bytes(
    local_buffer_size: int, max_batch_bytes: int = BRANCH_MAX_BATCH_BYTES
) -> int:
    """The batch bound the branch's factory gives its store."""
    return min(max_batch_bytes, local_buffer_size)


def tail_objects(rows: bytes, object_nbytes: int) -> list[tuple[str, bytes]]:
    """Tail rows cut into objects of at most ``object_nbytes`` bytes, each under a new key."""
    return [
        (tail_key(), rows[start : start + object_nbytes])
        for start in range(0, len(rows), object_nbytes)
    ]


class Recorder:
    """A Mooncake client that passes every call through and records the batch calls."""

    BATCH_CALLS = ("put_batch", "upsert_batch", "batch_get_buffer", "batch_is_exist")

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[tuple[str, list[str]]] = []

    def sizes(self, name: str) -> list[int]:
        """The number of keys of each recorded call of ``name``, in order."""
        return [len(keys) for called, keys in self.calls if called == name]

    def keys(self, name: str) -> list[str]:
        """Every key passed to ``name``, in order."""
        return [key for called, keys in self.calls if called == name for key in keys]

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.client, name)
        if name not in self.BATCH_CALLS:
            return target

        def recorded(keys: list[str], *args: Any) -> Any:
            self.calls.append((name, list(keys)))
            return target(keys, *args)

        return recorded


class BranchStore:
    """The branch's Mooncake store: ``put`` and ``get_concatenated`` as described above."""

    def __init__(self, client: Any, *, object_nbytes: int, max_batch_bytes: int) -> None:
        if not 0 < object_nbytes <= max_batch_bytes:
            raise ValueError("a batch must hold at least one object")
        self.client = client
        self.object_nbytes = object_nbytes
        self.batch_keys = max_batch_bytes // object_nbytes

    def put(
        self,
        objects: Iterable[tuple[str, bytes]],
        *,
        retain_keys: Iterable[str] = (),
        release_keys: Iterable[str] = (),
    ) -> None:
        latest: dict[str, bytes] = {}
        for key, payload in objects:
            latest[key] = payload
        keys = list(latest)
        for start in range(0, len(keys), self.batch_keys):
            names = keys[start : start + self.batch_keys]
            values = [latest[name] for name in names]
            for value in values:
                if not 0 < len(value) <= self.object_nbytes:
                    raise ValueError(f"an object of {len(value)} bytes does not fit a block")
            code = self.client.put_batch(names, values)
            if code != 0:
                raise BranchStoreError(f"put_batch failed: {code}")

    def get_concatenated(self, keys: Sequence[str]) -> bytes:
        parts: list[bytes] = []
        for start in range(0, len(keys), self.batch_keys):
            names = list(keys[start : start + self.batch_keys])
            handles = self.client.batch_get_buffer(names)
            for name, handle in zip(names, handles, strict=True):
                if handle is None:
                    raise BranchStoreError(f"unavailable: {name}")
                parts.append(bytes(handle))
            del handles  # the handles hold the client's local buffer
        return b"".join(parts)

    def close(self) -> None:
        self.client.close()


def read_rows(
    store: Any, keys: Sequence[str], *, dtype: Any, shape_per_token: Sequence[int]
) -> Any:
    """A terminal output's rows: the keys' bytes in order, as a ``(-1, *shape)`` array."""
    import numpy as np

    if not keys:
        raise ValueError("a terminal output has at least one key")
    data = store.get_concatenated(list(keys))
    return np.frombuffer(data, dtype=dtype).reshape((-1, *shape_per_token))


def connect(config: dict[str, Any]) -> Any:
    """A ``MooncakeDistributedStore`` set up from ``config`` with Mooncake's positional
    ``setup`` (sizes in bytes)."""
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.get("local_hostname", "127.0.0.1"))
    client = MooncakeDistributedStore()
    code = client.setup(
        config.get("local_hostname", "127.0.0.1"),
        config.get("metadata_server", "P2PHANDSHAKE"),
        int(config.get("global_segment_size", 0)),
        int(config["local_buffer_size"]),
        config.get("protocol", "tcp"),
        config.get("device_name", ""),
        config["master_server_address"],
    )
    if code != 0:
        raise BranchStoreError(f"setup failed: {code}")
    return client


def _main(argv: list[str]) -> int:
    mode, config_json, items_json, nbytes_text, *rest = argv
    config = json.loads(config_json)
    items = json.loads(items_json)
    nbytes = int(nbytes_text)
    client = Recorder(connect(config))
    batch_bytes = int(rest[0]) if rest else branch_batch_bytes(int(config["local_buffer_size"]))
    store = BranchStore(client, object_nbytes=nbytes, max_batch_bytes=batch_bytes)
    try:
        if mode == "read":
            keys = list(items)
            sizes, digests = [], []
            for key in keys:  # each key alone, for its own digest and size
                data = store.get_concatenated([key])
                sizes.append(len(data))
                digests.append(hashlib.sha256(data).hexdigest())
            client.calls.clear()
            whole = store.get_concatenated(keys)  # the terminal read: every key in one call
            result: dict[str, Any] = {
                "sha256": digests,
                "sizes": sizes,
                "total_sha256": hashlib.sha256(whole).hexdigest(),
                "get_batches": client.sizes("batch_get_buffer"),
            }
        elif mode == "write":
            from mooncake_util import payload

            store.put((key, payload(prefix, index, size)) for key, prefix, index, size in items)
            result = {"put_batches": client.sizes("put_batch")}
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        store.close()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
