"""``get_into`` and ``get_array`` written once, over each store's ``_read_into``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from aostore import _buffers


class BufferReads:
    """Reads into caller-chosen memory for a store of fixed-size objects.

    A store supplies ``_check_readable()`` (raises when it cannot read: closed, a latched error)
    and ``_read_into(keys, host)``, which writes the payloads of ``keys``, concatenated, into
    the host buffer ``host`` (a writable buffer or numpy array). ``_array_nbytes(count)`` is the
    size of ``count`` objects, or ``None`` for a store whose objects have no one size (then
    ``get_array`` goes through ``get_concatenated``).
    """

    __slots__ = ()

    def _check_readable(self) -> None:
        raise NotImplementedError

    def _read_into(self, keys: list[str], host: Any) -> None:
        raise NotImplementedError

    def _array_nbytes(self, count: int) -> int | None:
        return count * int(self.object_nbytes)  # type: ignore[attr-defined]

    def get_into(self, keys: Iterable[str], out: Any) -> Any:
        """Writes the payloads of ``keys``, concatenated, into ``out`` and returns ``out``.

        ``out`` is a writable buffer, numpy array or torch tensor (CPU, or CUDA through one
        host-to-device copy) of exactly ``len(keys) * object_nbytes`` bytes.
        """
        self._check_readable()
        host, pending = _buffers.writable_host_bytes(out)
        self._read_into(list(keys), host)
        _buffers.finish_device_copy(pending)
        return out

    def get_array(self, keys: Sequence[str], *, dtype: Any, shape_per_token: Sequence[int]) -> Any:
        """A new numpy array of the payloads of ``keys``, shape ``(-1, *shape_per_token)``."""
        import numpy as np

        self._check_readable()
        key_list = list(keys)
        nbytes = self._array_nbytes(len(key_list))
        if nbytes is None:
            payload = self.get_concatenated(key_list)  # type: ignore[attr-defined]
            return np.frombuffer(payload, dtype=dtype).reshape((-1, *shape_per_token))
        out = np.empty(nbytes, dtype=np.uint8)
        # Shape the result first: a bad dtype or shape fails before the read touches the LRU.
        result = out.view(np.dtype(dtype)).reshape((-1, *shape_per_token))
        self._read_into(key_list, out)
        return result
