"""One step's routed-experts rows as one buffer: what the worker hands the engine core.

vLLM's worker connector returns ``dict[str, AuxRequestOutput]`` (one dataclass and one ndarray
per request), and the multiprocess executor pickles it into the engine core's shared-memory
queue every step. :class:`StepRows` is that mapping over one fresh buffer and a small index:
it pickles as the buffer (protocol 5, a ``PickleBuffer``), the index and a format version, and
reads back without one object per request. It is a read-only ``Mapping`` from request id to
vLLM's own ``AuxRequestOutput``, built on access, so vLLM's ``take_output`` reads it unchanged
(an engine core whose plugin is off still works, only slower); aostore's scheduler connector
calls :meth:`StepRows.take` instead, which keeps vLLM's checks and messages.

Every step's buffer is new and owned by Python (the rows handed on are views of it, and vLLM
keeps them past the step: memory reused for the next step would change them under it). The
arrays are plain ``ndarray``; the buffer under them is a :class:`StepArray`, which is how
:mod:`.wire` knows a routed-experts array when vLLM's encoder meets one.

The format (:data:`FORMAT` 1), specified here once; the worker's native plane
(``src/python/step_rows.rs``) writes it and cites this:

- ``ids``: the requests that emitted rows this step, in vLLM's dict order (a tuple of ``str``);
- ``index``: per request, two little-endian ``int64`` (:data:`_INDEX`): its first row's token
  position (``token_start``) and the end of its rows in the buffer, counted in rows from the
  buffer's start (the requests' rows follow each other, so a request's rows start where the
  previous one's end);
- ``data``: every request's rows back to back, each row ``shape`` of ``dtype`` in C order, in
  a fresh buffer of exactly their bytes (a ``bytearray`` from the native plane);
- ``dtype``: the rows' numpy dtype (its ``str`` when pickled), ``shape``: one token's row.

The native plane hands these to :meth:`StepRows.packed`; a pickle carries them, after
:data:`FORMAT` and the writer's aostore :data:`VERSION`, to :func:`_rebuild`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pickle
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np

from ..._native import take_step_rows

FORMAT = 1
"""The layout's version (the module's docstring specifies it); a reader that does not know it
raises (:func:`_rebuild`)."""

_INDEX = np.dtype("<i8")
"""The index's numbers: per request, its token start and the end of its rows in the buffer."""


class StepArray(np.ndarray):
    """The step buffer's own array type: no behaviour, a marker. The rows handed to vLLM are
    plain ``ndarray`` views whose base is one of these."""


def is_step_rows(array: Any) -> bool:
    """Whether ``array`` is a view of a step buffer (its base, or its base's base, is one)."""
    base = array.base
    if type(base) is StepArray:
        return True
    return type(base) is np.ndarray and type(base.base) is StepArray


class StepRows(Mapping[str, Any]):
    """A step's ``dict[str, AuxRequestOutput]`` as one buffer and an index, read-only.

    ``ids``: the requests in vLLM's insertion order; ``index``: ``(token_start, row_end)`` per
    request (``int64``); ``rows``: every request's rows back to back, ``(N, *shape_per_token)``;
    ``output_class``: vLLM's ``AuxRequestOutput`` (looked up in vLLM's module when rebuilt).
    """

    __slots__ = ("_ids", "_index", "_lookup", "_native_index", "_output_class", "_rows")

    def __init__(self, ids: tuple[str, ...], index: np.ndarray, rows: np.ndarray) -> None:
        if index.shape != (len(ids), 2):
            raise ValueError(f"StepRows: index of shape {index.shape} for {len(ids)} requests")
        if len(ids) and not 0 <= int(index[-1, 1]) <= len(rows):
            raise ValueError(f"StepRows: rows end at {int(index[-1, 1])}, buffer has {len(rows)}")
        self._ids = ids
        self._index = index
        self._rows = rows
        self._lookup: dict[str, tuple[int, int, int]] | None = None
        self._native_index: Any = None  # take's (aostore._native.StepIndex), made at its first
        self._output_class: Any = None

    @classmethod
    def packed(
        cls, ids: tuple[str, ...], index: bytes, data: bytearray, dtype: Any, shape: tuple[int, ...]
    ) -> StepRows:
        """What aostore's worker data plane builds (``NativeDataPlane(step_rows=...)``):
        ``index`` as bytes, ``data`` a fresh buffer of every row."""
        return cls(ids, np.frombuffer(index, _INDEX).reshape(-1, 2), _rows(data, dtype, shape))

    @classmethod
    def pack(cls, outputs: Mapping[str, Any]) -> StepRows:
        """A copy of vLLM's ``dict[str, AuxRequestOutput]`` (all rows of one dtype and shape per
        token) as one buffer: for tests and benchmarks, and for a dict that did not come from
        aostore's plane."""
        ids = tuple(outputs)
        parts = [np.ascontiguousarray(output.rows) for output in outputs.values()]
        if not parts:
            raise ValueError("StepRows.pack: no outputs (vLLM sends None for an empty step)")
        index = np.empty((len(ids), 2), _INDEX)
        index[:, 0] = [int(output.token_start) for output in outputs.values()]
        index[:, 1] = np.cumsum([len(part) for part in parts])
        first = parts[0]
        data = bytearray(b"".join(part.tobytes() for part in parts))
        rows = _rows(data, first.dtype, first.shape[1:])
        return cls(ids, index, rows)

    # -- the mapping vLLM's code reads --------------------------------------------------------

    def __getitem__(self, request_id: str) -> Any:
        lookup = self._lookup
        if lookup is None:
            lookup = self._lookup = self._spans()
        token_start, begin, end = lookup[request_id]
        return self._output()(token_start, self._rows[begin:end])

    def __contains__(self, request_id: object) -> bool:
        lookup = self._lookup
        if lookup is None:
            lookup = self._lookup = self._spans()
        return request_id in lookup

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"StepRows({len(self._ids)} requests, {len(self._rows)} rows)"

    def _output(self) -> Any:
        output = self._output_class
        if output is None:
            module = importlib.import_module("vllm.distributed.aux_output_connector.connector")
            output = self._output_class = module.AuxRequestOutput
        return output

    # -- aostore's scheduler side -------------------------------------------------------------

    def take(self, request: Any) -> np.ndarray | None:
        """vLLM's ``AuxOutputSchedulerConnector.take_output(request, self)``: the same checks,
        messages and result, without the per-request ``AuxRequestOutput`` (native:
        ``aostore._native.take_step_rows``; the scheduler connector calls it through
        ``aostore._native.TakeOutput``, with no Python frame per request)."""
        rows: np.ndarray | None = take_step_rows(self, request)
        return rows

    def _spans(self) -> dict[str, tuple[int, int, int]]:
        """Request id -> (token start, first row, row end), read once a step."""
        starts, ends = self._index[:, 0].tolist(), self._index[:, 1].tolist()
        begins = [0, *ends[:-1]]
        return dict(zip(self._ids, zip(starts, begins, ends, strict=True), strict=True))

    # -- pickling -----------------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        rows = self._rows
        # The rows' own buffer, whole: out of band where the pickler takes it (shm_broadcast
        # does from 1 MiB), else one copy into the stream; either way no per-request object.
        flat = rows.base if type(rows.base) is StepArray else np.ascontiguousarray(rows)
        return _rebuild, (
            FORMAT,
            VERSION,
            self._ids,
            self._index.tobytes(),
            # The array itself, not a memoryview of it: a PickleBuffer over a memoryview that
            # the collector clears in a cycle crashes CPython 3.11 (picklebuf_clear).
            pickle.PickleBuffer(cast(Any, flat)),
            rows.dtype.str,
            rows.shape[1:],
        )


def _rows(data: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Plain rows over ``data`` whose base is a :class:`StepArray` (the wire's marker)."""
    dtype = np.dtype(dtype)
    row = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    count = len(memoryview(data).cast("B")) // row if row else 0
    flat = np.ndarray.__new__(StepArray, (count, *shape), dtype, buffer=data)
    return flat.view(np.ndarray)


def _installed_version() -> str:
    """The installed aostore's version: both ends of the hop must run the same one."""
    try:
        return importlib.metadata.version("aostore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _installed_version()


def _rebuild(
    format_: int,
    version: str,
    ids: tuple[str, ...],
    index: bytes,
    data: Any,
    dtype: str,
    shape: tuple[int, ...],
) -> StepRows:
    """Unpickles a :class:`StepRows`; a layout this aostore does not read raises at once."""
    if format_ != FORMAT or version != VERSION:
        raise RuntimeError(
            f"aostore transport: this process reads step rows of format {FORMAT} from aostore "
            f"{VERSION}, got format {format_} from aostore {version}: the worker and the "
            "engine core must run the same aostore (set AOSTORE_VLLM_TRANSPORT=0 on both to "
            "use vLLM's own transport)"
        )
    return StepRows(ids, np.frombuffer(index, _INDEX).reshape(-1, 2), _rows(data, dtype, shape))
