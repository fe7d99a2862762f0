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

from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from ... import _npy as npy
from ..._native import RowPages, deliver_rows, end_delivery, pending_step_rows, rows_delivered
from . import delivery


class RowChunks:
    """``list[np.ndarray]`` of one request's routed-experts chunks, stored in pages.

    Chunks of one dtype and row shape (what vLLM sends) are copied into the pages of a native
    :class:`~aostore._native.RowPages` (``bytearray`` pages of whole rows; the first 4 KiB, each
    next one as large as all before it up to 64 KiB, or as large as the chunk that opens it),
    with each chunk's end (8 bytes): the rows are held at about their size, not as views of the
    messages they came in, and a page never moves. With the packed hop (:mod:`.wire`) a step's
    rows reach the pages from its message in one native call per ``process_outputs``, never
    through :meth:`append`. Reads see vLLM's list, chunk for chunk (``len``, truth, indexing
    and iteration give copies of the chunks); :meth:`joined` gives every row as a few arrays,
    the pages. Anything the pages cannot hold (a chunk of another dtype or shape, a subclass, a
    write other than to the last chunk) turns it into the plain list vLLM would have, so every
    operation stays the list's.
    """

    __slots__ = ("_list", "_pages")

    def __init__(self) -> None:
        # The pages until anything they cannot hold arrives; then None and the list.
        self._pages: RowPages | None = RowPages()
        self._list: list[Any] | None = None

    def append(self, chunk: Any) -> None:
        pages = self._pages
        if pages is not None:
            # The common case in one native call: an ndarray like the last, C-contiguous.
            if pages.append(chunk):
                return
            if self._fits(pages, chunk):
                pages.push(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
                return
        self._to_list().append(chunk)

    def __setitem__(self, position: Any, chunk: Any) -> None:
        pages = self._pages
        last = len(self) - 1
        if pages is not None and last >= 0 and position in (-1, last) and self._fits(pages, chunk):
            pages.replace_last(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        else:
            self._to_list()[position] = chunk

    def __getitem__(self, position: Any) -> Any:
        pages = self._pages
        if pages is None:
            return cast(list[Any], self._list)[position]
        if isinstance(position, slice):
            return self._chunks(pages)[position]
        index = range(pages.count)[position]  # the list's IndexError and TypeError
        return self._rows(pages, pages.chunk(index))

    def __len__(self) -> int:
        pages = self._pages
        return pages.count if pages is not None else len(cast(list[Any], self._list))

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Any]:
        pages = self._pages
        return iter(self._chunks(pages) if pages is not None else cast(list[Any], self._list))

    def joined(self) -> list[Any]:
        """What ``np.concatenate`` joins to give every row: the pages' rows (views: the
        concatenation copies them), or nothing when no chunk came; once a plain list, the list
        itself."""
        pages = self._pages
        if pages is None:
            return cast(list[Any], self._list)
        if not pages.count:
            return []
        views = [self._view(pages, bytearray(), 0)]  # the dtype and shape, when all are empty
        views += [self._view(pages, page, used) for page, used in pages.pages()]
        return views

    def finished(self) -> np.ndarray | None:
        """Every row as one array, what vLLM's ``np.concatenate(chunks, axis=0)`` gives on the
        finish (None when no chunk came; once a plain list, that concatenation). The array's
        bytes follow its ``.npy`` header in one buffer (:class:`aostore._npy.LaidOut`), so that
        the API server's ``numpy2base64`` encodes that buffer as it is instead of copying the
        rows again."""
        pages = self._pages
        if pages is None:
            listed = cast(list[Any], self._list)
            return np.concatenate(listed, axis=0) if listed else None
        if not pages.count:
            return None
        shape, dtype = self.shape, pages.dtype
        if npy.plain(dtype):
            rows = npy.lay_out(dtype, shape)
        else:  # rows vLLM's numpy2base64 writes itself: no header to lay them out after
            # Not a bytearray: that would zero every byte before they are copied.
            rows = np.empty(pages.nbytes, np.uint8).view(dtype).reshape(shape)
        self.copy_into(rows.reshape(-1).view(np.uint8))
        return rows

    def bind(self, owner: Any) -> None:
        """Binds the pages to the ``RequestState`` that holds these chunks: the packed hop then
        writes that state's rows into them without reading the state (see
        :func:`request_state_subclass`)."""
        if self._pages is not None:
            self._pages.bind(owner)

    def unbind(self) -> None:
        """Ends :meth:`bind` (the state holds other chunks now)."""
        if self._pages is not None:
            self._pages.unbind()

    @property
    def paged(self) -> bool:
        """Whether the pages hold every row (else it has turned into a plain list)."""
        return self._pages is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of every row together (pages only: not once a plain list)."""
        pages = cast(RowPages, self._pages)
        return (pages.nbytes // pages.row, *pages.shape)

    @property
    def dtype(self) -> Any:
        """The rows' dtype (None before a chunk, and once a plain list)."""
        return self._pages.dtype if self._pages is not None else None

    def copy_into(self, target: np.ndarray) -> None:
        """Copy every row's bytes, in order, into ``target`` (``uint8``, :attr:`nbytes` long):
        the one copy a finish makes, into the answer's buffer, which is read at once."""
        pages = cast(RowPages, self._pages)
        if len(target) != pages.nbytes:
            raise ValueError(f"out holds {len(target)} bytes, not the {pages.nbytes} held")
        pages.copy_into(target, stream=False)

    def stream_into(self, targets: list[np.ndarray]) -> None:
        """:meth:`copy_into` with streaming stores, for an R3 arena's slot (its page runs, in
        order: one target unless the arena's free pages were scattered): read later by another
        process, its lines are not worth loading, nor the answer's working set worth evicting
        for them (measured: a 16k sample's copy 0.8 ms plainly; see the CHANGELOG)."""
        pages = cast(RowPages, self._pages)
        if sum(len(target) for target in targets) != pages.nbytes:
            raise ValueError(f"the targets hold not the rows' {pages.nbytes} bytes: none written")
        at = 0
        for target in targets:
            pages.copy_into(target, stream=True, start=at)
            at += len(target)

    @property
    def nbytes(self) -> int:
        """The bytes of rows held."""
        if self._pages is None:
            listed = cast(list[Any], self._list)
            return sum(int(getattr(chunk, "nbytes", 0)) for chunk in listed)
        return self._pages.nbytes

    @property
    def allocated(self) -> int:
        """The bytes of the pages that hold them."""
        return self._pages.allocated if self._pages is not None else 0

    @staticmethod
    def _fits(pages: RowPages, chunk: Any) -> bool:
        """Whether the pages hold ``chunk`` (setting the rows' dtype and shape from the first)."""
        if type(chunk) is not np.ndarray:
            return False
        dtype = chunk.dtype
        held = pages.dtype
        if held is not None:
            return bool(dtype == held) and chunk.shape[1:] == pages.shape
        if chunk.ndim < 1 or dtype.hasobject:
            return False
        row = chunk.itemsize * int(np.prod(chunk.shape[1:], dtype=np.int64))
        if row == 0:  # rows of no bytes: their count is not in the pages' size
            return False
        pages.begin(dtype, list(chunk.shape[1:]), row)
        return True

    @staticmethod
    def _view(pages: RowPages, page: bytearray, used: int) -> np.ndarray:
        rows: np.ndarray = np.frombuffer(page, np.uint8, used).view(pages.dtype)
        return rows.reshape(-1, *pages.shape)

    @staticmethod
    def _rows(pages: RowPages, data: bytes) -> np.ndarray:
        """A chunk's bytes (a copy) as rows: writable, as vLLM's chunks may be."""
        rows: np.ndarray = np.frombuffer(bytearray(data), np.uint8).view(pages.dtype)
        return rows.reshape(-1, *pages.shape)

    def _chunks(self, pages: RowPages) -> list[Any]:
        return [self._rows(pages, pages.chunk(index)) for index in range(pages.count)]

    def _to_list(self) -> list[Any]:
        if self._list is None:
            pages = cast(RowPages, self._pages)
            self._list = self._chunks(pages) if pages.dtype is not None else []
            pages.unbind()  # the packed hop appends to the list from now on
            self._pages = None
        return self._list


def request_state_subclass(vllm_request_state: Any, r3: delivery.Delivery | None = None) -> type:
    """aostore's ``RequestState``: vLLM's, with :class:`RowChunks` for the routed experts; its
    ``_new_completion_output`` (where vLLM concatenates the chunks of a finished request)
    sees them as one array. ``r3``: R3 rows by reference (:mod:`.delivery`), bound to the class
    as its :data:`~.delivery.ATTRIBUTE` (None: off, a request that asks for a reference is
    refused)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        self.routed_experts_chunks = RowChunks()  # bound to this state by the setter below
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

    def get_chunks(self: Any) -> Any:
        return self._aostore_row_chunks

    def set_chunks(self: Any, chunks: Any) -> None:
        # The pages of the chunks a state holds are bound to it, and only those: the packed hop
        # writes a bound state's rows into its pages without reading the state, so any other
        # chunks put there (vLLM's list, a test's, aostore's own during a finish) end the
        # binding first, and the rows reach what the state holds, as in vLLM's loop.
        held = getattr(self, "_aostore_row_chunks", None)
        if type(held) is RowChunks and held is not chunks:
            held.unbind()
        self._aostore_row_chunks = chunks
        if type(chunks) is RowChunks:
            chunks.bind(self)

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
            "routed_experts_chunks": property(get_chunks, set_chunks),
            delivery.ATTRIBUTE: r3,
            "__module__": __name__,
            "__qualname__": vllm_request_state.__qualname__,
            "__doc__": "vLLM's RequestState; routed-experts rows held in one buffer per request "
            "(aostore.vllm.transport.frontend.RowChunks).",
        },
    )


def process_outputs_method(vllm_method: Any) -> Any:
    """aostore's ``OutputProcessor.process_outputs`` over vLLM's: the rows of packed steps
    (:mod:`.wire`) reach their requests' pages in one native call before vLLM's loop, where
    that loop would have appended them; then vLLM's loop, which finds no rows on those
    outputs."""

    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not pending_step_rows():
            return vllm_method(self, engine_core_outputs, *args, **kwargs)
        deliver_rows(engine_core_outputs, self.request_states, RowChunks)
        try:
            return vllm_method(self, engine_core_outputs, *args, **kwargs)
        finally:
            end_delivery()

    process_outputs.__wrapped__ = vllm_method  # type: ignore[attr-defined]
    process_outputs.__qualname__ = "OutputProcessor.process_outputs"
    return process_outputs


def trim_method(vllm_function: Any) -> Any:
    """aostore's ``OutputProcessor._trim_surplus_tokens`` (a static method, vLLM 0.32 on) over
    vLLM's: for an output whose rows came packed, vLLM's code sees them (a copy of the last
    chunk, which they are) for the call, so it trims the chunk as it would have."""

    def _trim_surplus_tokens(req_state: Any, output: Any, num_prev_tokens: int) -> None:
        if output.routed_experts is not None or not rows_delivered(output):
            return vllm_function(req_state, output, num_prev_tokens)  # type: ignore[no-any-return]
        output.routed_experts = req_state.routed_experts_chunks[-1]
        try:
            vllm_function(req_state, output, num_prev_tokens)
        finally:
            output.routed_experts = None

    _trim_surplus_tokens.__wrapped__ = vllm_function  # type: ignore[attr-defined]
    _trim_surplus_tokens.__qualname__ = "OutputProcessor._trim_surplus_tokens"
    return staticmethod(_trim_surplus_tokens)
