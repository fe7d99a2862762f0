"""Payloads and outputs as plain bytes: numpy and torch (without importing torch unless it is
in use), byte views, rows of one buffer, private copies.

A tensor is reinterpreted as bytes (``.view(torch.uint8)``), never converted element by element,
so any dtype (bf16 included) round-trips bit-exactly. CUDA tensors cross to the host once.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any, overload

# Field names in a struct format string ("T{<i:name:}"), which may contain any letter.
_FIELD_NAMES = re.compile(r":[^:]*:")


def refuse_object_references(view: memoryview, what: str) -> None:
    """Raises for buffers of Python object references (numpy ``dtype=object``): their bytes are
    pointers, and writing bytes into them corrupts the interpreter's heap."""
    if "O" in view.format and "O" in _FIELD_NAMES.sub("", view.format):
        raise TypeError(f"{what} must hold plain data, not Python object references")


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (checked without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _tensor_rows(blocks: Any, count: int, object_nbytes: int) -> Any:
    if blocks.dim() == 0 or blocks.shape[0] != count:
        raise ValueError(f"blocks must have shape ({count}, ...), got {tuple(blocks.shape)}")
    if not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous tensor (call .contiguous() first)")
    row_nbytes = blocks[0].numel() * blocks.element_size() if count else object_nbytes
    if row_nbytes != object_nbytes:
        raise ValueError(
            f"each block holds {row_nbytes} bytes, expected object_nbytes={object_nbytes}"
        )
    if count == 0:
        return b""
    import torch

    if blocks.device.type != "cpu":
        # One device-to-host copy for the whole batch, into pinned staging so the DMA engine
        # writes it directly (a pageable target goes through the driver's own bounce buffer).
        staging = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
        staging.copy_(blocks)
        blocks = staging
    return blocks.reshape(count, -1).view(torch.uint8).numpy()


def host_rows(blocks: Any, count: int, object_nbytes: int) -> Any:
    """``blocks`` for a native store: a tensor becomes its host bytes (checked as a tensor);
    anything else is passed on unchanged, for the native store to check once."""
    return _tensor_rows(blocks, count, object_nbytes) if is_tensor(blocks) else blocks


def block_bytes(blocks: Any, count: int, object_nbytes: int) -> Any:
    """A C-contiguous host buffer holding ``count`` rows of ``object_nbytes`` bytes, for stores
    that are not native (the Mooncake tier); the native stores check in Rust, with the same
    errors.

    ``blocks`` is a numpy array or torch tensor of shape ``(count, ...)``, or a flat bytes-like
    buffer of ``count * object_nbytes`` bytes. Raises ``ValueError``/``TypeError`` otherwise.
    """
    if is_tensor(blocks):
        return _tensor_rows(blocks, count, object_nbytes)
    try:
        view = memoryview(blocks)
    except TypeError:
        raise TypeError(
            f"blocks must be a numpy array, a torch tensor or a buffer, not {type(blocks).__name__}"
        ) from None
    with view:
        refuse_object_references(view, "blocks")
        if not view.c_contiguous:
            raise ValueError("blocks must be C-contiguous (use numpy.ascontiguousarray)")
        flat_bytes = view.ndim == 1 and view.itemsize == 1
        if not flat_bytes:
            if view.ndim == 0 or view.shape is None or view.shape[0] != count:
                shape = tuple(view.shape or ())
                raise ValueError(f"blocks must have shape ({count}, ...), got {shape}")
            if count and view.nbytes // count != object_nbytes:
                raise ValueError(
                    f"each block holds {view.nbytes // count} bytes, "
                    f"expected object_nbytes={object_nbytes}"
                )
    return blocks


def writable_host_bytes(out: Any) -> tuple[Any, Any]:
    """``(host_buffer, device_tensor_or_None)`` for ``get_into``.

    A CPU tensor is written in place through a uint8 view; a CUDA tensor gets a host staging
    buffer that the caller copies to the device afterwards (one host-to-device copy).
    """
    if not is_tensor(out):
        dtype = getattr(out, "dtype", None)
        if dtype is not None:  # numpy: its dtype answers without exporting a buffer
            if getattr(dtype, "hasobject", False):
                raise TypeError("out must hold plain data, not Python object references")
            return out, None
        try:
            view = memoryview(out)
        except TypeError:
            return out, None  # the store raises its own TypeError for a non-buffer
        with view:
            refuse_object_references(view, "out")
        return out, None
    import torch

    if not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor")
    flat = out.reshape(-1).view(torch.uint8)
    if out.device.type == "cpu":
        return flat.numpy(), None
    staging = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    return staging.numpy(), (flat, staging)


def finish_device_copy(pending: Any) -> None:
    """Copies a staging buffer to the device tensor it stands for."""
    if pending is not None:
        flat, staging = pending
        flat.copy_(staging)


def byte_view(view: memoryview) -> memoryview:
    """``view`` as a flat view of unsigned bytes (itself when it already is one)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def payload_view(key: str, payload: object, object_nbytes: int) -> memoryview:
    """A flat byte view of one object's ``payload``, for stores that are not native; raises the
    native stores' ``TypeError``/``ValueError``."""
    if is_tensor(payload):
        payload = block_bytes(payload.reshape(1, -1), 1, object_nbytes)  # type: ignore[attr-defined]
    try:
        view = memoryview(payload)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"payload of {key!r} must be a C-contiguous buffer, not {type(payload).__name__}"
        ) from None
    refuse_object_references(view, f"payload of {key!r}")
    if not view.c_contiguous:
        raise TypeError(f"payload of {key!r} must be a C-contiguous buffer")
    if view.nbytes != object_nbytes:
        raise ValueError(
            f"payload of {key!r} holds {view.nbytes} bytes, expected object_nbytes={object_nbytes}"
        )
    return byte_view(view)


def writable_view(host: Any) -> memoryview:
    """A flat writable byte view of a host buffer (from ``writable_host_bytes``)."""
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
    return byte_view(view)


def same_bytes(held: Any, payload: Any) -> bool:
    """Whether the buffer ``held`` holds exactly the bytes of ``payload``."""
    with memoryview(held) as a, memoryview(payload) as b:
        # Compared as bytes: memoryview's own == walks item by item (about 25x slower).
        return a.nbytes == b.nbytes and byte_view(a).tobytes() == (
            payload if type(payload) is bytes else byte_view(b).tobytes()
        )


def snapshot(payload: Any) -> bytes:
    """A private copy of a buffer's (or a tensor's) bytes: the caller may reuse the buffer."""
    if is_tensor(payload):
        payload = block_bytes(payload.reshape(1, -1), 1, payload.nbytes)
    with memoryview(payload) as view:
        return view.tobytes()


def first_positions(keys: Sequence[str]) -> dict[str, int]:
    """Each distinct key and the position of its first occurrence, in order."""
    first: dict[str, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
    return first


def copy_duplicates(keys: Sequence[str], first: dict[str, int], view: memoryview, n: int) -> None:
    """Fills each repeated key's row of ``view`` (rows of ``n`` bytes) from its first one."""
    if len(first) == len(keys):
        return
    for index, key in enumerate(keys):
        source = first[key]
        if source != index:
            view[index * n : (index + 1) * n] = view[source * n : (source + 1) * n]


class Rows(Sequence[memoryview]):
    """The rows of one flat buffer as a sequence of views, sliced when read (by the thread
    that reads them, not the caller's)."""

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
