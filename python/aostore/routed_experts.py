"""Drop-in versions of vLLM's routed-experts publish and materialize helpers.

Same signatures and errors as ``vllm.distributed.aux_output_connector.routed_experts``; with an
aostore store they skip the per-block ``tobytes()`` copies and the ``bytes`` round trip, and with
any other store they behave as vLLM's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from aostore._background import BackgroundBlockObjectStore
from aostore._native import BlockObject
from aostore._store import BlockObjectStore
from aostore.errors import is_missing


def routed_experts_keys(block_hashes: Iterable[bytes], aux_output_namespace: str) -> list[str]:
    """Store keys for KV-block hashes: ``vllm-artifact/<namespace>/<hash as hex>``."""
    prefix = f"vllm-artifact/{aux_output_namespace}/"
    return [prefix + block_hash.hex() for block_hash in block_hashes]


def _full_blocks(
    batches: Sequence[tuple[Sequence[str], list[tuple[int, np.ndarray]]]], block_size: int
) -> tuple[list[str], list[np.ndarray]]:
    keys: list[str] = []
    arrays: list[np.ndarray] = []
    for block_keys, blocks in batches:
        for block_start, array in blocks:
            if block_start < 0 or block_start % block_size:
                raise ValueError("auxiliary output block start is not hash-block aligned")
            index = block_start // block_size
            if index >= len(block_keys):
                raise ValueError(
                    "auxiliary output block has no corresponding key: "
                    f"start={block_start}, index={index}, "
                    f"keys={len(block_keys)}, block_size={block_size}"
                )
            if len(array) != block_size:
                raise ValueError("auxiliary output block length does not match hash block size")
            keys.append(block_keys[index])
            arrays.append(array)
    return keys, arrays


def _stackable(arrays: Sequence[np.ndarray]) -> bool:
    """Whether ``np.stack`` keeps every block's bytes: one dtype and one shape (it would
    otherwise convert values or raise where the per-block path reports a payload size)."""
    return all(a.dtype == arrays[0].dtype and a.shape == arrays[0].shape for a in arrays)


def publish_routed_experts(
    store: Any,
    *,
    batches: Sequence[tuple[Sequence[str], list[tuple[int, np.ndarray]]]],
    block_size: int,
    retain_keys: Sequence[str] = (),
    release_keys: Sequence[str] = (),
) -> None:
    """Publishes full routed-experts blocks (``(block_start, array)`` per block) under their keys.

    With an aostore store each block is copied once, straight into its slot. A background
    writer reads its batch later, after the engine may have reused the capture buffer, so the
    blocks are first gathered into one private array (one copy, no per-block objects).
    """
    keys, arrays = _full_blocks(batches, block_size)
    if isinstance(store, BlockObjectStore):
        objects = [
            BlockObject(k, np.ascontiguousarray(a)) for k, a in zip(keys, arrays, strict=True)
        ]
        store.put(objects, retain_keys=retain_keys, release_keys=release_keys)
    elif (
        isinstance(store, BackgroundBlockObjectStore)
        and hasattr(store.store, "put_blocks")
        and _stackable(arrays)
    ):
        blocks = np.stack(arrays) if arrays else np.empty((0,), dtype=np.uint8)
        store.put_blocks(keys, blocks, retain_keys=retain_keys, release_keys=release_keys)
    else:
        objects = [BlockObject(k, a.tobytes(order="C")) for k, a in zip(keys, arrays, strict=True)]
        store.put(objects, retain_keys=retain_keys, release_keys=release_keys)


def materialize_routed_experts(
    store: Any,
    aux_output_keys: list[str],
    *,
    shape_per_token: tuple[int, ...],
    dtype: np.dtype[Any],
) -> np.ndarray:
    """The routed experts of ``aux_output_keys`` as one array of shape ``(-1, *shape_per_token)``.

    With an aostore store the bytes land in the new array directly (no ``bytes`` in between).
    """
    if not aux_output_keys:
        raise ValueError("routed-experts auxiliary output key list must not be empty")
    if hasattr(store, "get_array"):
        result: np.ndarray = store.get_array(
            aux_output_keys, dtype=dtype, shape_per_token=shape_per_token
        )
        return result
    payload = store.get_concatenated(aux_output_keys)
    return np.frombuffer(payload, dtype=dtype).reshape((-1, *shape_per_token))


class AvailableRoutedExperts(NamedTuple):
    """What ``materialize_available_routed_experts`` found: the rows, and what to recompute."""

    #: Shape ``(len(keys) * block_size, *shape_per_token)``; the rows of a missing block are 0.
    rows: np.ndarray
    #: Half-open token ranges ``(start, end)`` whose blocks are missing, merged, in order.
    recompute: list[tuple[int, int]]


def materialize_available_routed_experts(
    store: Any,
    aux_output_keys: Sequence[str],
    *,
    shape_per_token: tuple[int, ...],
    dtype: np.dtype[Any],
    block_size: int,
    first_token: int = 0,
) -> AvailableRoutedExperts:
    """Opt-in: the routed experts of the blocks that are stored, and the token ranges to
    recompute for the ones that are not, instead of failing the step on the first miss.

    Block ``i`` covers tokens ``first_token + i * block_size`` up to the next block. With an
    aostore store this is one ``get_many`` call (one copy into the result); with any other
    store, one ``get_concatenated`` per key, treating a miss (``aostore.errors.is_missing``) as
    missing.
    """
    keys = list(aux_output_keys)
    dtype = np.dtype(dtype)
    block_nbytes = block_size * int(np.prod(shape_per_token, dtype=np.int64)) * dtype.itemsize
    rows = np.zeros((len(keys) * block_size, *shape_per_token), dtype=dtype)
    blocks = rows.reshape(len(keys), -1).view(np.uint8) if keys else rows.view(np.uint8)
    present: list[bool]
    if hasattr(store, "get_many"):
        data, missing = store.get_many(keys)[:2]
        gone = set(missing)
        present = [key not in gone for key in keys]
        if len(data) != sum(present) * block_nbytes:
            raise ValueError(
                f"stored routed-experts blocks hold {len(data)} bytes; "
                f"{sum(present)} blocks of {block_nbytes} bytes expected"
            )
        if data:
            blocks[np.flatnonzero(present)] = np.frombuffer(data, np.uint8).reshape(
                -1, block_nbytes
            )
    else:
        present = []
        for i, key in enumerate(keys):
            try:
                payload = store.get_concatenated([key])
            except RuntimeError as error:  # BlockObjectStoreError, vLLM's or aostore's
                if not is_missing(error):
                    raise
                present.append(False)
                continue
            if len(payload) != block_nbytes:
                raise ValueError(
                    f"routed-experts block {key!r} holds {len(payload)} bytes; "
                    f"{block_nbytes} expected"
                )
            blocks[i] = np.frombuffer(payload, np.uint8)
            present.append(True)
    recompute: list[tuple[int, int]] = []
    for i, here in enumerate(present):
        if here:
            continue
        start = first_token + i * block_size
        if recompute and recompute[-1][1] == start:
            recompute[-1] = (recompute[-1][0], start + block_size)
        else:
            recompute.append((start, start + block_size))
    return AvailableRoutedExperts(rows, recompute)
