"""The frontend holds each request's routed-experts rows at their size.

vLLM's ``RequestState`` keeps ``routed_experts_chunks: list[np.ndarray]``: every arriving row
stays a view of the message it came in (a GC-tracked ZMQ frame, or in one process the step's
buffer) until the request finishes, then ``np.concatenate`` joins thousands of them. aostore's
``RequestState`` puts a :class:`RowChunks` there instead: each chunk is copied into one
growing buffer as it arrives, and the list's operations that vLLM's ``OutputProcessor`` uses
keep their meaning exactly (``append``; ``chunks[-1] = rows``, which
``_trim_surplus_tokens`` uses to replace the last chunk, possibly with an empty one; truth;
``np.concatenate(chunks, axis=0)``, which now joins one array).
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from typing import Any

import numpy as np


class RowChunks:
    """``list[np.ndarray]`` of one request's routed-experts chunks, stored as one buffer.

    Chunks of one dtype and row shape (what vLLM sends) are copied into a ``bytearray`` that
    grows by at most an eighth (CPython's over-allocation for ``+=``), with each chunk's end
    (8 bytes): the rows are held at about their size, not as views of the messages they came
    in. Reads see vLLM's list, chunk for chunk (``len``, truth, indexing and iteration give
    copies of the chunks); :meth:`joined` gives every row as one array. Anything the buffer
    cannot hold (a chunk of another dtype or shape, a subclass, a write other than to the last
    chunk) turns it into the plain list vLLM would have, so every operation stays the list's.
    """

    __slots__ = ("_data", "_ends", "_dtype", "_shape", "_list")

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array.array("q")  # byte offset of each chunk's end
        self._dtype: Any = None
        self._shape: tuple[int, ...] = ()
        self._list: list[Any] | None = None

    def append(self, chunk: Any) -> None:
        if self._list is None and self._fits(chunk):
            self._extend(chunk)
            self._ends.append(len(self._data))
        else:
            self._to_list().append(chunk)

    def __setitem__(self, position: Any, chunk: Any) -> None:
        last = len(self._ends) - 1
        if self._list is None and last >= 0 and position in (-1, last) and self._fits(chunk):
            start = self._ends[-2] if last else 0
            try:
                del self._data[start:]
            except BufferError:  # a view from joined() still pins the buffer: it moves
                self._data = self._data[:start]
            self._extend(chunk)
            self._ends[-1] = len(self._data)
        else:
            self._to_list()[position] = chunk

    def __getitem__(self, position: Any) -> Any:
        if self._list is not None:
            return self._list[position]
        if isinstance(position, slice):
            return self._chunks()[position]
        ends = self._ends
        index = range(len(ends))[position]  # the list's IndexError and TypeError
        return self._view(ends[index - 1] if index else 0, ends[index]).copy()

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else len(self._ends)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self._list if self._list is not None else self._chunks())

    def joined(self) -> list[Any]:
        """What ``np.concatenate`` joins: every row as one array, or nothing when no chunk
        came; once a plain list, the list itself. The array is a view of the buffer (the
        concatenation copies it): let it go before the next write, or that write moves the
        buffer."""
        if self._list is not None:
            return self._list
        if not self._ends:
            return []
        return [self._view(0, len(self._data))]

    @property
    def nbytes(self) -> int:
        """The bytes of rows held."""
        if self._list is not None:
            return sum(int(getattr(chunk, "nbytes", 0)) for chunk in self._list)
        return len(self._data)

    def _fits(self, chunk: Any) -> bool:
        if type(chunk) is not np.ndarray:
            return False
        dtype = chunk.dtype
        if dtype is self._dtype or (self._dtype is not None and dtype == self._dtype):
            return chunk.shape[1:] == self._shape and chunk.ndim == len(self._shape) + 1
        if self._dtype is not None or chunk.ndim < 1 or dtype.hasobject:
            return False
        self._dtype, self._shape = dtype, chunk.shape[1:]
        return True

    def _extend(self, chunk: np.ndarray) -> None:
        if not chunk.flags.c_contiguous:
            chunk = np.ascontiguousarray(chunk)
        # extend() takes the array's bytes (the buffer protocol), as one memcpy.
        try:
            self._data.extend(chunk)
        except BufferError:  # a view from joined() still pins the buffer: it moves
            self._data = bytearray(self._data)
            self._data.extend(chunk)

    def _view(self, start: int, end: int) -> np.ndarray:
        rows = np.frombuffer(self._data, np.uint8)[start:end].view(self._dtype)
        return rows.reshape(-1, *self._shape)

    def _chunks(self) -> list[Any]:
        starts = [0, *self._ends[:-1]][: len(self._ends)]
        return [self._view(a, b).copy() for a, b in zip(starts, self._ends, strict=True)]

    def _to_list(self) -> list[Any]:
        if self._list is None:
            self._list = self._chunks()
            self._data, self._ends = bytearray(), array.array("q")
        return self._list


def request_state_subclass(vllm_request_state: type) -> type:
    """aostore's ``RequestState``: vLLM's, with :class:`RowChunks` for the routed experts; its
    ``_new_completion_output`` (where vLLM concatenates the chunks of a finished request)
    sees them as one array."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_request_state.__init__(self, *args, **kwargs)
        self.routed_experts_chunks = RowChunks()

    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = self.routed_experts_chunks
        # vLLM's (token_ids, finish_reason, stop_reason); it reads the chunks only when finished.
        finish_reason = args[1] if len(args) > 1 else kwargs.get("finish_reason")
        if type(chunks) is not RowChunks or finish_reason is None:
            return vllm_new_completion_output(self, *args, **kwargs)
        # vLLM's code reads a list here: `if finished and chunks: np.concatenate(chunks)`.
        self.routed_experts_chunks = chunks.joined()
        try:
            return vllm_new_completion_output(self, *args, **kwargs)
        finally:
            self.routed_experts_chunks = chunks

    vllm_new_completion_output = vllm_request_state._new_completion_output
    return type(
        vllm_request_state.__name__,
        (vllm_request_state,),
        {
            "__init__": __init__,
            "_new_completion_output": _new_completion_output,
            "__module__": __name__,
            "__qualname__": vllm_request_state.__qualname__,
            "__doc__": "vLLM's RequestState; routed-experts rows held in one buffer per request "
            "(aostore.vllm.transport.frontend.RowChunks).",
        },
    )
