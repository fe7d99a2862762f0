"""The frontend holds each request's routed-experts rows at their size.

vLLM's ``RequestState`` keeps ``routed_experts_chunks: list[np.ndarray]``: every arriving row
stays a view of the message it came in (a GC-tracked ZMQ frame, or in one process the step's
buffer) until the request finishes, then ``np.concatenate`` joins thousands of them. aostore's
``RequestState`` puts a :class:`RowChunks` there instead: each chunk is copied into pages that
never move as it arrives, and the list's operations that vLLM's ``OutputProcessor`` uses keep
their meaning exactly (``append``; ``chunks[-1] = rows``, which ``_trim_surplus_tokens`` uses
to replace the last chunk, possibly with an empty one; truth; the finish's
``np.concatenate(chunks, axis=0)``, which ``_new_completion_output`` gets over the pages).
"""

from __future__ import annotations

import array
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import _npy as npy
from ..._native import copy_pages
from . import delivery

PAGE = 64 * 1024
"""The largest page: a request's rows live in pages of at most this many bytes (whole rows),
so a page is never moved or regrown, and at most one page per request is part full."""
FIRST_PAGE = 4 * 1024


class RowChunks:
    """``list[np.ndarray]`` of one request's routed-experts chunks, stored in pages.

    Chunks of one dtype and row shape (what vLLM sends) are copied into ``bytearray`` pages
    (whole rows; the first 4 KiB, each next one as large as all before it up to 64 KiB, or as
    large as the chunk that opens it), with each chunk's end (8 bytes): the rows are held at
    about their size, not as views of the messages they came in, and a page never moves. Reads
    see vLLM's list, chunk for chunk (``len``, truth, indexing and iteration give copies of the
    chunks); :meth:`joined` gives every row as a few arrays, the pages. Anything the pages cannot
    hold (a chunk of another dtype or shape, a subclass, a write other than to the last chunk)
    turns it into the plain list vLLM would have, so every operation stays the list's.
    """

    __slots__ = (
        "_dtype",
        "_ends",
        "_last",
        "_last_start",
        "_list",
        "_ndim",
        "_pages",
        "_room_end",
        "_row",
        "_shape",
        "_size",
        "_starts",
    )

    def __init__(self) -> None:
        self._pages: list[bytearray] = []
        # The last page (its first byte is _starts[-1]): the page itself, not a memoryview of
        # it, which the collector would track and, one per page, promote.
        self._last = bytearray()
        self._last_start = 0  # the last page's first byte, over all pages
        self._room_end = 0  # the last page's end, over all pages
        self._starts = array.array("q")  # each page's first byte, over all pages
        self._size = 0  # bytes held
        self._ends = array.array("q")  # each chunk's end, in bytes
        self._dtype: Any = None
        self._shape: tuple[int, ...] = ()
        self._ndim = 0
        self._row = 0
        self._list: list[Any] | None = None

    def append(self, chunk: Any) -> None:
        # The common case first, cheaply: a chunk like the last that fits the last page (the
        # bytearray copies a strided chunk's bytes in C order, as np.ascontiguousarray would).
        if type(chunk) is np.ndarray and chunk.dtype is self._dtype and self._list is None:
            shape = chunk.shape
            size = self._size
            end = size + chunk.nbytes
            if end <= self._room_end and shape[1:] == self._shape and len(shape) == self._ndim:
                at = size - self._last_start
                try:
                    self._last[at : at + end - size] = chunk.data
                except (TypeError, ValueError, BufferError):  # no buffer for this dtype
                    pass
                else:
                    self._size = end
                    self._ends.append(end)
                    return
        if self._list is None and self._fits(chunk):
            self._write(chunk)
            self._ends.append(self._size)
        else:
            self._to_list().append(chunk)

    def __setitem__(self, position: Any, chunk: Any) -> None:
        last = len(self._ends) - 1
        if self._list is None and last >= 0 and position in (-1, last) and self._fits(chunk):
            self._truncate(self._ends[-2] if last else 0)
            self._write(chunk)
            self._ends[-1] = self._size
        else:
            self._to_list()[position] = chunk

    def __getitem__(self, position: Any) -> Any:
        if self._list is not None:
            return self._list[position]
        if isinstance(position, slice):
            return self._chunks()[position]
        ends = self._ends
        index = range(len(ends))[position]  # the list's IndexError and TypeError
        return self._rows(ends[index - 1] if index else 0, ends[index])

    def __len__(self) -> int:
        return len(self._list) if self._list is not None else len(self._ends)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self._list if self._list is not None else self._chunks())

    def joined(self) -> list[Any]:
        """What ``np.concatenate`` joins to give every row: the pages' rows (views: the
        concatenation copies them), or nothing when no chunk came; once a plain list, the list
        itself."""
        if self._list is not None:
            return self._list
        if not self._ends:
            return []
        views = [self._view(bytearray(), 0)]  # the dtype and shape, when every chunk is empty
        for page, start in zip(self._pages, self._starts, strict=True):
            used = min(len(page), self._size - start)
            views.append(self._view(page, used))
        return views

    def finished(self) -> np.ndarray | None:
        """Every row as one array, what vLLM's ``np.concatenate(chunks, axis=0)`` gives on the
        finish (None when no chunk came; once a plain list, that concatenation). The array's
        bytes follow its ``.npy`` header in one buffer (:class:`aostore._npy.LaidOut`), so that
        the API server's ``numpy2base64`` encodes that buffer as it is instead of copying the
        rows again."""
        if self._list is not None:
            return np.concatenate(self._list, axis=0) if self._list else None
        if not self._ends:
            return None
        shape = self.shape
        if npy.plain(self._dtype):
            rows = npy.lay_out(self._dtype, shape)
        else:  # rows vLLM's numpy2base64 writes itself: no header to lay them out after
            # Not a bytearray: that would zero every byte before they are copied.
            rows = np.empty(self._size, np.uint8).view(self._dtype).reshape(shape)
        self.copy_into(rows.reshape(-1).view(np.uint8))
        return rows

    @property
    def paged(self) -> bool:
        """Whether the pages hold every row (else it has turned into a plain list)."""
        return self._list is None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of every row together (pages only: not once a plain list)."""
        return (self._size // self._row, *self._shape)

    @property
    def dtype(self) -> Any:
        """The rows' dtype (pages only: not once a plain list; None before a chunk)."""
        return self._dtype

    def copy_into(self, target: np.ndarray) -> None:
        """Copy every row's bytes, in order, into ``target`` (``uint8``, :attr:`nbytes` long):
        the one copy a finish makes, into the answer's buffer, which is read at once."""
        copy_pages(self._pages, self._size, target, stream=False)

    def stream_into(self, targets: list[np.ndarray]) -> None:
        """:meth:`copy_into` with streaming stores, for an R3 arena's slot (its page runs, in
        order: one target unless the arena's free pages were scattered): read later by another
        process, its lines are not worth loading, nor the answer's working set worth evicting
        for them (measured: a 16k sample's copy 0.8 ms plainly; see the CHANGELOG)."""
        if len(targets) == 1:
            copy_pages(self._pages, self._size, targets[0], stream=True)
            return
        if sum(len(target) for target in targets) != self._size:
            raise ValueError(f"the targets hold not the rows' {self._size} bytes: nothing written")
        at = 0
        for target in targets:
            copy_pages(self._slices(at, at + len(target)), len(target), target, stream=True)
            at += len(target)

    @property
    def nbytes(self) -> int:
        """The bytes of rows held."""
        if self._list is not None:
            return sum(int(getattr(chunk, "nbytes", 0)) for chunk in self._list)
        return self._size

    @property
    def allocated(self) -> int:
        """The bytes of the pages that hold them."""
        return sum(len(page) for page in self._pages)

    def _fits(self, chunk: Any) -> bool:
        if type(chunk) is not np.ndarray:
            return False
        dtype = chunk.dtype
        if dtype is self._dtype or (self._dtype is not None and dtype == self._dtype):
            return chunk.shape[1:] == self._shape and chunk.ndim == self._ndim
        if self._dtype is not None or chunk.ndim < 1 or dtype.hasobject:
            return False
        row = chunk.itemsize * int(np.prod(chunk.shape[1:], dtype=np.int64))
        if row == 0:  # rows of no bytes: their count is not in the pages' size
            return False
        self._dtype, self._shape, self._ndim, self._row = dtype, chunk.shape[1:], chunk.ndim, row
        return True

    def _write(self, chunk: np.ndarray) -> None:
        if not chunk.flags.c_contiguous:
            chunk = np.ascontiguousarray(chunk)
        data = chunk.reshape(-1).view(np.uint8).data
        n, done = len(data), 0
        while done < n:
            page = self._room(n - done)
            at = self._size - self._last_start
            take = min(len(page) - at, n - done)
            page[at : at + take] = data[done : done + take]
            done += take
            self._size += take

    def _room(self, wanted: int) -> bytearray:
        """The last page if it has room, else a new one."""
        if self._size < self._room_end:
            return self._pages[-1]
        row = self._row
        size = min(PAGE, max(FIRST_PAGE, self._size))
        size = max(size, wanted)  # a large chunk gets a page of its own size
        page = bytearray(max(row, size // row * row))
        self._pages.append(page)
        self._starts.append(self._size)
        self._last = page
        self._last_start = self._size
        self._room_end = self._size + len(page)
        return page

    def _truncate(self, size: int) -> None:
        while self._pages and self._starts[-1] >= size and self._starts[-1] > 0:
            self._pages.pop()
            self._starts.pop()
        if self._pages:
            self._last = self._pages[-1]
            self._last_start = self._starts[-1]
            self._room_end = self._starts[-1] + len(self._pages[-1])
        self._size = size

    def _view(self, page: bytearray, used: int) -> np.ndarray:
        rows: np.ndarray = np.frombuffer(page, np.uint8, used).view(self._dtype)
        return rows.reshape(-1, *self._shape)

    def _slices(self, start: int, end: int) -> list[memoryview]:
        """The bytes ``start:end``, as slices of the pages."""
        parts = []
        for page, first in zip(self._pages, self._starts, strict=True):
            a, b = max(start, first), min(end, first + len(page))
            if a < b:
                parts.append(memoryview(page)[a - first : b - first])
        return parts

    def _rows(self, start: int, end: int) -> np.ndarray:
        """A copy of the bytes ``start:end`` as rows."""
        data = bytearray(b"".join(self._slices(start, end)))
        rows: np.ndarray = np.frombuffer(data, np.uint8).view(self._dtype)
        return rows.reshape(-1, *self._shape)

    def _chunks(self) -> list[Any]:
        starts = [0, *self._ends[:-1]][: len(self._ends)]
        return [self._rows(a, b) for a, b in zip(starts, self._ends, strict=True)]

    def _to_list(self) -> list[Any]:
        if self._list is None:
            self._list = self._chunks()
            self._pages, self._starts, self._ends = [], array.array("q"), array.array("q")
            self._size = self._room_end = self._last_start = 0
            self._last = bytearray()
        return self._list


def request_state_subclass(vllm_request_state: Any, r3: delivery.Delivery | None = None) -> type:
    """aostore's ``RequestState``: vLLM's, with :class:`RowChunks` for the routed experts; its
    ``_new_completion_output`` (where vLLM concatenates the chunks of a finished request)
    sees them as one array. ``r3``: R3 rows by reference (:mod:`.delivery`), bound to the class
    as its :data:`~.delivery.ATTRIBUTE` (None: off, a request that asks for a reference is
    refused)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        self.routed_experts_chunks = RowChunks()
        self.aostore_r3_delivery = "rows"
        self.aostore_r3_over_http = False

    def from_new_request(cls: Any, *args: Any, **kwargs: Any) -> Any:
        request = kwargs["request"] if "request" in kwargs else args[1]
        # Before the state exists: a bad choice refuses the request and changes nothing.
        mode = delivery.choose(
            getattr(cls, delivery.ATTRIBUTE), getattr(request, "sampling_params", None)
        )
        state = vllm_from_new_request(cls, *args, **kwargs)
        state.aostore_r3_delivery = mode
        # Read where the request arrives (the caller's context): its finish runs in vLLM's
        # output handler, a task of no request.
        state.aostore_r3_over_http = delivery.OVER_HTTP.get()
        return state

    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = self.routed_experts_chunks
        # vLLM's (token_ids, finish_reason, stop_reason); it reads the chunks only when finished.
        finish_reason = args[1] if len(args) > 1 else kwargs.get("finish_reason")
        if type(chunks) is not RowChunks or finish_reason is None:
            return vllm_new_completion_output(self, *args, **kwargs)
        # vLLM's code reads a list: `if finished and chunks: np.concatenate(chunks, axis=0)`.
        # It gets none, and the output gets what that concatenation gives, copied once.
        if self.aostore_r3_delivery == "reference":
            # In process: straight from the pages into the arena. Over HTTP: the rows, written
            # into the arena only if an answer renders them (delivery.answered).
            over_http = self.aostore_r3_over_http
            rows = delivery.deliver_chunks(
                getattr(self, delivery.ATTRIBUTE),
                chunks,
                over_http=over_http,
                # Rows an answer will render are written into the arena now (one copy): a
                # non-streamed answer (FINAL_ONLY: vLLM's serving code asks for that) that was
                # not aborted. Streamed outputs (DELTA: completions and chat render no routed
                # experts; /inference/v1/generate's last chunk does), beam search's inner
                # requests (CUMULATIVE) and aborted ones (a client that went away) keep rows of
                # their own until an answer renders them, if one ever does.
                expected=over_http
                and getattr(self.output_kind, "name", None) == "FINAL_ONLY"
                and str(finish_reason) != "abort",
            )
        else:
            rows = chunks.finished()
        self.routed_experts_chunks = []
        try:
            output = vllm_new_completion_output(self, *args, **kwargs)
        finally:
            self.routed_experts_chunks = chunks
        output.routed_experts = rows
        return output

    vllm_init = vllm_request_state.__init__
    vllm_new_completion_output = vllm_request_state._new_completion_output
    vllm_from_new_request = vars(vllm_request_state)["from_new_request"].__func__
    return type(
        vllm_request_state.__name__,
        (vllm_request_state,),
        {
            "__init__": __init__,
            "_new_completion_output": _new_completion_output,
            "from_new_request": classmethod(from_new_request),
            delivery.ATTRIBUTE: r3,
            "__module__": __name__,
            "__qualname__": vllm_request_state.__qualname__,
            "__doc__": "vLLM's RequestState; routed-experts rows held in one buffer per request "
            "(aostore.vllm.transport.frontend.RowChunks).",
        },
    )
