"""R3 rows in the trainer's own layout: one call from a batch of references (or vLLM's rows) to
the tensor a trainer replays (docs/r3-trainer.md).

:func:`padded` makes ``[batch, length, layers, top_k]`` (verl, NeMo-RL, SkyRL's padded batch),
:func:`packed` makes ``[tokens, layers, top_k]`` with ``cu_seqlens`` (SkyRL's packed batch).
Each output byte is written once: rows are widened to the dtype asked for while they are copied
into place (one pass: vLLM's uint8 rows by ``src/widen.rs``, streaming into a large ``out=``;
any other by ``np.copyto``), and only the tokens without rows are filled (a zero fill of a fresh
layout the kernel zeroed not even that). References
are leased for the call alone (one fetch per arena) and read through their mappings, vLLM's rows
where they lie: neither is copied twice. Everything that can be checked before a byte is
written is (shapes, lengths, offsets, ``out``, every route's range), so bad input raises and
changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import mmap
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np

from .._native import widen_routes
from . import errors, leases, offnode
from . import format as fmt
from ._reader import STREAM_FROM, Reader, process_reader

DTYPES = ("uint8", "uint16", "int8", "int16", "int32", "int64")
"""The dtypes a trainer may ask for."""

_Pad: TypeAlias = int | Literal["arange"]


@dataclass
class Routes:
    """A layout made by :func:`padded` or :func:`packed`."""

    routes: Any
    """``np.ndarray`` or ``torch.Tensor``: ``[batch, length, layers, top_k]`` (padded) or
    ``[tokens, layers, top_k]`` (packed); layer-major puts the layers first after the batch."""
    cu_seqlens: Any = None
    """Packed only: ``[batch + 1]`` int32 offsets of each sample's tokens (where the routes are,
    a torch tensor on the CPU)."""
    missing: dict[int, errors.R3Error] = field(default_factory=dict)
    """With ``missing="report"``: each sample whose rows could not be read, and why (its tokens
    hold the missing-route value)."""
    _pending: tuple[Any, Any] | None = None  # (CUDA event, the pinned buffer it copies from)

    def wait(self) -> Any:
        """Wait for a CUDA copy to finish (nothing to wait for otherwise); the routes."""
        if self._pending is not None:
            event, _staging = self._pending
            event.synchronize()
            self._pending = None  # the pinned buffer can go now
        return self.routes


@dataclass
class _Segment:
    """Rows ``start:stop`` of one source (a reference or vLLM's rows) of sample ``sample``."""

    sample: int
    source: np.ndarray  # the parsed item: a reference's 0-d array, or rows
    start: int  # rows of the source's array (a reference's first row is row 0 here)
    stop: int
    first: int = 0  # the source's first row as vLLM counts them (a reference's token_start)
    at: int = 0  # its first row's place in its sample's stitched rows
    rows: np.ndarray | None = None  # the rows once read (a view)


def padded(
    samples: Sequence[Any],
    length: int,
    *,
    offsets: int | Sequence[int] = 0,
    valid_lengths: Sequence[int] | None = None,
    drop_surplus: int | None = 0,
    dtype: Any = np.int16,
    layers: slice | Sequence[int] | None = None,
    layer_major: bool = False,
    num_experts: int | None = None,
    missing_route: int = -1,
    pad: _Pad = 0,
    into: Literal["numpy", "torch", "pinned", "cuda"] = "numpy",
    out: Any = None,
    device: Any = "cuda",
    missing: Literal["raise", "report"] = "raise",
    reader: Reader | None = None,
) -> Routes:
    """Sample ``i``'s routes at ``[i, offsets[i] : offsets[i] + valid_lengths[i]]`` of a
    ``[len(samples), length, layers, top_k]`` batch (``[batch, layers, length, top_k]`` if
    ``layer_major``), the rest ``pad``.

    - ``samples``: each a reference (the HTTP string or the in-process array), vLLM's rows (an
      array ``[tokens, layers, top_k]`` or its base64 ``.npy`` string), or a list of segments
      ``(reference or rows, start, stop)`` stitched in order (a partial rollout resumed; a
      later turn's delta). ``start`` and ``stop`` count rows as :func:`fetch`'s ``start``
      does, as vLLM sent them (``None``: from the first, to the last). Mixed, of any arenas of
      this node.
    - ``offsets``: where each sample's first token goes (a left-padded prompt's
      ``prompt_width - len(prompt)``), one for all or one each.
    - ``valid_lengths``: tokens of each sample that have routes (default: its rows). Rows past
      it are a surplus: up to ``drop_surplus`` are dropped (NeMo-RL drops the final token's
      route: 1; ``None``: any number), more are an error. Tokens of the valid length with no
      row hold ``missing_route`` (NeMo-RL's -1).
    - ``pad``: the value of the padding (before the offset, past the valid length), or
      ``"arange"`` for the row ``0, 1, ..., top_k - 1`` (NeMo-RL, SkyRL).
    - ``dtype``: one of :data:`DTYPES`, widened (or narrowed) while copied. A route that does
      not fit it, or is at least ``num_experts`` (or negative, when ``num_experts`` is given),
      is a :class:`~aostore.r3.errors.RouteOutOfRange` naming the sample and token; nothing
      is written then.
    - ``layers``: a slice or a list of vLLM's layers to keep (a pipeline stage's).
    - ``into``: ``"numpy"``, ``"torch"``, ``"pinned"`` (a torch tensor in pinned host memory)
      or ``"cuda"`` (copied once from pinned memory, ``non_blocking``: :meth:`Routes.wait`);
      or ``out``, a C-contiguous numpy array or torch tensor of the exact shape and dtype.
    - ``missing``: ``"report"`` names each sample whose reference gives no rows in
      :attr:`Routes.missing` (its valid length then holds ``missing_route``) instead of
      raising the first such error.
    """
    n = len(_check_batch(samples))
    starts = _per_sample("offsets", offsets, n)
    if valid_lengths is not None:
        valid = _per_sample("valid_lengths", valid_lengths, n)
    if length < 0:
        raise errors.BadLayout(f"a padded length of {length}")

    def place(plan: _Plan) -> None:
        lengths = valid if valid_lengths is not None else plan.rows
        for i in range(n):
            if starts[i] < 0 or lengths[i] < 0 or starts[i] + lengths[i] > length:
                raise errors.BadLayout(
                    f"{lengths[i]} tokens at offset {starts[i]} do not fit a padded length of "
                    f"{length}",
                    i,
                )
        plan.place(lengths, starts, [length] * n, drop_surplus)

    return _make(
        samples,
        place,
        lambda plan: (n, length),
        packed_layout=False,
        dtype=dtype,
        layers=layers,
        layer_major=layer_major,
        num_experts=num_experts,
        no_row=missing_route,
        pad=pad,
        into=into,
        out=out,
        device=device,
        missing=missing,
        reader=reader,
    )


def packed(
    samples: Sequence[Any],
    *,
    lengths: Sequence[int] | None = None,
    drop_surplus: int | None = 0,
    dtype: Any = np.int16,
    layers: slice | Sequence[int] | None = None,
    layer_major: bool = False,
    num_experts: int | None = None,
    fill: _Pad = "arange",
    into: Literal["numpy", "torch", "pinned", "cuda"] = "numpy",
    out: Any = None,
    device: Any = "cuda",
    missing: Literal["raise", "report"] = "raise",
    reader: Reader | None = None,
) -> Routes:
    """The samples' routes one after the other, ``[sum(lengths), layers, top_k]``
    (``[layers, tokens, top_k]`` if ``layer_major``), and their ``cu_seqlens``.

    ``lengths``: each sample's tokens in the pack (default: its rows); the tokens past its rows
    (a suffix the engine did not capture) hold ``fill`` (a value, or ``"arange"`` for the row
    ``0, ..., top_k - 1``: SkyRL's dummy routes), as do a missing sample's with
    ``missing="report"``. Rows past a length are a surplus, dropped up to ``drop_surplus``.
    The other arguments are :func:`padded`'s.
    """
    n = len(_check_batch(samples))
    if lengths is not None:
        given = _per_sample("lengths", lengths, n)
        for i, count in enumerate(given):
            if count < 0:
                raise errors.BadLayout(f"a length of {count}", i)

    def take(plan: _Plan) -> list[int]:
        return given if lengths is not None else plan.rows

    def place(plan: _Plan) -> None:
        counts = take(plan)
        plan.place(counts, [0] * n, counts, drop_surplus)

    return _make(
        samples,
        place,
        lambda plan: (sum(take(plan)),),
        packed_layout=True,
        dtype=dtype,
        layers=layers,
        layer_major=layer_major,
        num_experts=num_experts,
        no_row=fill,
        pad=fill,
        into=into,
        out=out,
        device=device,
        missing=missing,
        reader=reader,
    )


# The plan: every check before a byte is written ------------------------------------------------


class _Plan:
    """A batch's segments, row shape and each sample's place in the output."""

    def __init__(self, samples: Sequence[Any], report: bool, other_nodes: bool) -> None:
        self.segments: list[_Segment] = []
        self.missing: dict[int, errors.R3Error] = {}
        for i, sample in enumerate(samples):
            try:
                self.segments.extend(_segments_of(i, sample, other_nodes))
            except errors.R3Error as error:
                if not report or isinstance(error, errors.BadLayout):
                    raise
                self.missing[i] = error
        self.n = len(samples)
        self.row: tuple[int, ...] | None = None
        for segment in self.segments:
            dtype, shape = _rows_of(segment.source)
            if dtype.kind not in "iu":
                raise errors.BadLayout(f"routes are integers, not {dtype}", segment.sample)
            if len(shape) != 3:
                raise errors.BadLayout(
                    f"rows are [tokens, layers, top_k], not of shape {shape}", segment.sample
                )
            if self.row is None:
                self.row = shape[1:]
            elif shape[1:] != self.row:
                raise errors.BadLayout(
                    f"rows of [layers, top_k] {shape[1:]}, where the batch's are {self.row}",
                    segment.sample,
                )
            if not 0 <= segment.start <= segment.stop <= shape[0]:
                first = segment.first
                raise errors.BadLayout(
                    f"a segment [{first + segment.start}:{first + segment.stop}] of rows "
                    f"{first} to {first + shape[0]}",
                    segment.sample,
                )
        self.rows = [0] * self.n
        for segment in self.segments:
            segment.at = self.rows[segment.sample]
            self.rows[segment.sample] += segment.stop - segment.start
        # Filled by place(): each sample's first token in the output, its valid tokens, and
        # the tokens of its region (padded: the length; packed: its own).
        self.first: list[int] = []
        self.valid: list[int] = []
        self.region: list[int] = []

    def place(
        self, valid: list[int], first: list[int], region: list[int], drop_surplus: int | None
    ) -> None:
        for i in range(self.n):
            surplus = self.rows[i] - valid[i]
            if i not in self.missing and drop_surplus is not None and surplus > drop_surplus:
                raise errors.BadLayout(
                    f"{self.rows[i]} rows for {valid[i]} tokens: {surplus} surplus, at most "
                    f"{drop_surplus} dropped (drop_surplus)",
                    i,
                )
        self.valid, self.first, self.region = valid, first, region

    def used(self, segment: _Segment) -> tuple[int, int]:
        """The rows of ``segment`` that land in the output (a surplus past the valid length
        is left out)."""
        keep = max(0, min(segment.stop - segment.start, self.valid[segment.sample] - segment.at))
        return segment.start, segment.start + keep


def _check_batch(samples: Sequence[Any]) -> Sequence[Any]:
    if isinstance(samples, (str, bytes, np.ndarray)):
        raise TypeError("samples is a sequence of samples (a list of one for one)")
    return samples


def _per_sample(name: str, value: int | Sequence[int], n: int) -> list[int]:
    if isinstance(value, (int, np.integer)):
        return [int(value)] * n
    values = [int(v) for v in value]
    if len(values) != n:
        raise errors.BadLayout(f"{len(values)} {name} for {n} samples")
    return values


def _segments_of(i: int, sample: Any, other_nodes: bool) -> list[_Segment]:
    """A sample as its segments, each source parsed (a reference's node checked where the
    reader cannot read other nodes': ``other_nodes`` false)."""
    if isinstance(sample, (list, tuple)):
        parts = []
        for part in sample:
            if not isinstance(part, tuple) or len(part) != 3:
                raise errors.BadLayout(
                    "a sample's segments are (reference or rows, start, stop) tuples", i
                )
            source, start, stop = part
            parts.append(
                (source, None if start is None else int(start), None if stop is None else int(stop))
            )
    else:
        parts = [(sample, None, None)]
    segments = []
    for source, start, stop in parts:
        try:
            item = fmt.parse(source)
        except TypeError as error:
            raise errors.BadLayout(str(error), i) from None
        if (
            not other_nodes
            and item.dtype.names is not None
            and fmt.ident(item["boot"]) != leases.boot_id()
        ):
            raise errors.OtherNode(
                f"sample {i}: a reference from another node (or an earlier boot of this one): "
                f"its rows are in that node's shared memory; set {offnode.SETTING} (a Mooncake "
                "client config) to read them through Mooncake"
            )
        # start and stop count rows as fetch's start does: as vLLM sent them (a later turn's
        # reference holds its rows from its token_start on).
        first = int(item["token_start"]) if item.dtype.names is not None else 0
        count = _rows_of(item)[1][0]
        low = 0 if start is None else start - first
        high = count if stop is None else stop - first
        segments.append(_Segment(i, item, low, high, first))
    return segments


def _rows_of(item: np.ndarray) -> tuple[np.dtype[Any], tuple[int, ...]]:
    if item.dtype.names is None:
        return item.dtype, item.shape
    return fmt.rows_of(item)


def _layer_plan(layers: slice | Sequence[int] | None, count: int) -> slice | list[int]:
    """The layers kept, as a slice where it is one (a view), else a list (copied a layer at a
    time: no gathered temporary)."""
    if layers is None:
        return slice(0, count)
    if isinstance(layers, slice):
        return slice(*layers.indices(count))
    chosen = [int(layer) for layer in layers]
    for layer in chosen:
        if not 0 <= layer < count:
            raise errors.BadLayout(f"layer {layer} of rows of {count} layers")
    if len(chosen) >= 2:
        step = chosen[1] - chosen[0]
        if step > 0 and chosen == list(range(chosen[0], chosen[-1] + 1, step)):
            return slice(chosen[0], chosen[-1] + 1, step)
    if len(chosen) == 1:
        return slice(chosen[0], chosen[0] + 1)
    return chosen


def _kept(layers: slice | list[int], count: int) -> int:
    return len(range(count)[layers]) if isinstance(layers, slice) else len(layers)


def _pad_value(pad: _Pad, name: str, dtype: np.dtype[Any], top_k: int) -> np.ndarray:
    """``pad`` as what fills a token (a value, or the row ``arange(top_k)``), checked to fit."""
    if isinstance(pad, str):
        if pad != "arange":
            raise errors.BadLayout(f'{name} is a number or "arange", not {pad!r}')
        value = np.arange(top_k)
    else:
        value = np.asarray(int(pad))
    info = np.iinfo(dtype)
    if value.size and (int(value.min()) < info.min or int(value.max()) > info.max):
        raise errors.BadLayout(f"{name} {pad} does not fit {dtype}")
    return value.astype(dtype)


def _check_routes(
    segment: _Segment,
    rows: np.ndarray,
    dtype: np.dtype[Any],
    num_experts: int | None,
) -> errors.RouteOutOfRange | None:
    """Whether every route of ``rows`` (a segment's, its kept layers) fits ``dtype`` and is
    below ``num_experts``: else the :class:`RouteOutOfRange` naming the first bad token,
    returned, not raised (a raised error's frames would keep views of leased rows alive). The
    check is skipped where the rows' dtype cannot hold a bad route."""
    info, have = np.iinfo(dtype), np.iinfo(rows.dtype)
    low, high = info.min, info.max
    if num_experts is not None:
        low, high = max(low, 0), min(high, num_experts - 1)
    if rows.size == 0 or (have.min >= low and have.max <= high):
        return None
    worst_low = int(rows.min()) if have.min < low else low
    worst_high = int(rows.max()) if have.max > high else high
    if worst_low >= low and worst_high <= high:
        return None
    flat = rows.reshape(len(rows), -1)
    bad = (flat < low) | (flat > high)
    token = int(np.argmax(bad.any(axis=1)))
    route = int(flat[token][bad[token]][0])
    why = (
        f"route {route} is not an expert of {num_experts}"
        if num_experts is not None and info.min <= route <= info.max
        else f"route {route} does not fit {dtype}"
    )
    return errors.RouteOutOfRange(why, segment.sample, segment.at + token, route)


# Making the layout ------------------------------------------------------------------------------


def _make(
    samples: Sequence[Any],
    place: Callable[[_Plan], None],
    shape_of: Callable[[_Plan], tuple[int, ...]],
    *,
    packed_layout: bool,
    dtype: Any,
    layers: slice | Sequence[int] | None,
    layer_major: bool,
    num_experts: int | None,
    no_row: _Pad,
    pad: _Pad,
    into: Literal["numpy", "torch", "pinned", "cuda"],
    out: Any,
    device: Any,
    missing: Literal["raise", "report"],
    reader: Reader | None,
) -> Routes:
    if missing not in ("raise", "report"):
        raise errors.BadLayout(f'missing is "raise" or "report", not {missing!r}')
    if into not in ("numpy", "torch", "pinned", "cuda"):
        raise errors.BadLayout(f'into is "numpy", "torch", "pinned" or "cuda", not {into!r}')
    target = np.dtype(dtype)
    if target.name not in DTYPES:
        raise errors.BadLayout(f"a dtype of {', '.join(DTYPES)}, not {target}")
    if num_experts is not None and num_experts <= 0:
        raise errors.BadLayout(f"num_experts {num_experts}")
    reader = reader or process_reader()
    plan = _Plan(samples, missing == "report", reader.reads_other_nodes)
    if plan.row is None:
        raise errors.BadLayout("no sample has rows: the row shape is unknown")
    layer_count, top_k = plan.row
    chosen = _layer_plan(layers, layer_count)
    kept = _kept(chosen, layer_count)
    pad_fill = _pad_value(pad, "pad" if not packed_layout else "fill", target, top_k)
    no_row_fill = _pad_value(
        no_row, "missing_route" if not packed_layout else "fill", target, top_k
    )
    place(plan)
    lead = shape_of(plan)
    shape = (*lead, kept, top_k) if not layer_major else _layer_major(lead, kept, top_k)
    destination = _Destination(shape, target, into, out, device, dense=packed_layout)

    fetched = contextlib.ExitStack()  # the batches' leases, ended when the layout is made
    try:
        _read(plan, reader, missing == "report", fetched)
        for segment in plan.segments:
            if segment.sample in plan.missing:
                continue
            assert segment.rows is not None
            start, stop = plan.used(segment)
            bad = _check_each_layer(segment, segment.rows[start:stop], chosen, target, num_experts)
            if bad is not None:
                raise bad
        routes = destination.host()
        cu_seqlens = None
        if packed_layout:
            cu_seqlens = np.zeros(plan.n + 1, np.int32)
            np.cumsum(plan.region, out=cu_seqlens[1:])
            plan.first = [int(c) for c in cu_seqlens[:-1]]
        _write(
            plan,
            routes,
            chosen,
            layer_major,
            packed_layout,
            pad_fill,
            no_row_fill,
            destination.zeroed,
        )
    finally:
        for segment in plan.segments:
            segment.rows = None  # the views go before their leases end
        fetched.close()  # a view a raised error's frames keep keeps its lease until it goes
    result = destination.finish(Routes(None, missing=plan.missing))
    if cu_seqlens is not None:
        result.cu_seqlens = destination.like(cu_seqlens)
    return result


def _layer_major(lead: tuple[int, ...], kept: int, top_k: int) -> tuple[int, ...]:
    # padded: [batch, layers, length, top_k]; packed: [layers, tokens, top_k]
    return (lead[0], kept, lead[1], top_k) if len(lead) == 2 else (kept, lead[0], top_k)


def _check_each_layer(
    segment: _Segment,
    rows: np.ndarray,
    layers: slice | list[int],
    dtype: np.dtype[Any],
    num_experts: int | None,
) -> errors.RouteOutOfRange | None:
    if isinstance(layers, slice):
        return _check_routes(segment, rows[:, layers], dtype, num_experts)
    for layer in layers:
        if _check_routes(segment, rows[:, layer : layer + 1], dtype, num_experts) is not None:
            # The first bad token over all the kept layers, not this layer's (the error path
            # may allocate the gathered layers).
            return _check_routes(segment, rows[:, layers], dtype, num_experts)
    return None


def _read(plan: _Plan, reader: Reader, report: bool, fetched: contextlib.ExitStack) -> None:
    """Give each segment its rows: vLLM's where they are, references' as views of one fetch
    per arena of this node (kept leased in ``fetched`` until the layout is written), and
    other nodes' in one fetch, one Mooncake batch (``OtherNode`` where the reader has no
    Mooncake client)."""
    here = leases.boot_id()
    by_arena: dict[bytes, list[_Segment]] = {}
    for segment in plan.segments:
        source = segment.source
        if source.dtype.names is None:
            segment.rows = source
        else:
            elsewhere = fmt.ident(source["boot"]) != here
            key = b"other nodes" if elsewhere else fmt.ident(source["arena"])
            by_arena.setdefault(key, []).append(segment)
    for group in by_arena.values():
        while group:
            try:
                batch = reader.fetch([segment.source for segment in group])
            except errors.R3Error as error:
                index = error.index if isinstance(error, errors.ReferenceGone) else None
                lost = group if index is None else [group[index]]
                if not report:
                    raise type(error)(f"sample {lost[0].sample}: {error}") from error
                for segment in lost:
                    plan.missing[segment.sample] = error
                group = [s for s in group if s.sample not in plan.missing]
                continue
            fetched.enter_context(batch)
            for segment, rows in zip(group, batch, strict=True):
                segment.rows = rows
            break


def _write(
    plan: _Plan,
    out: np.ndarray,
    layers: slice | list[int],
    layer_major: bool,
    packed_layout: bool,
    pad: np.ndarray,
    no_row: np.ndarray,
    zeroed: bool,
) -> None:
    """Each sample's rows widened into place and its other tokens filled: every byte once (a
    zero fill of an array the kernel zeroed is left as it is)."""

    def tokens(sample: int, begin: int, end: int) -> np.ndarray:
        """The output's tokens ``begin:end`` of ``sample``'s region as ``[tokens, layers,
        top_k]`` (a view)."""
        if packed_layout:
            base = plan.first[sample]
            if layer_major:
                return out[:, base + begin : base + end].transpose(1, 0, 2)
            return out[base + begin : base + end]
        if layer_major:
            return out[sample, :, begin:end].transpose(1, 0, 2)
        return out[sample, begin:end]

    pad_rows = pad if pad.ndim == 0 else pad[None, None, :]
    no_rows = no_row if no_row.ndim == 0 else no_row[None, None, :]
    skip_pad = zeroed and not pad.any()
    skip_no_row = zeroed and not no_row.any()
    for i in range(plan.n):
        first, valid, region = plan.first[i], plan.valid[i], plan.region[i]
        # Padded: the region is the whole length, the sample's tokens start at first; packed:
        # the region is the sample's own tokens, from 0.
        begin = 0 if packed_layout else first
        have = 0 if i in plan.missing else min(valid, plan.rows[i])
        if not skip_pad and not packed_layout and begin:
            tokens(i, 0, begin)[...] = pad_rows
        if not skip_no_row:
            tokens(i, begin + have, begin + valid)[...] = no_rows
        if not skip_pad:
            tokens(i, begin + valid, region)[...] = pad_rows
    for segment in plan.segments:
        if segment.sample in plan.missing:
            continue
        assert segment.rows is not None
        start, stop = plan.used(segment)
        if stop == start:
            continue
        begin = 0 if packed_layout else plan.first[segment.sample]
        at = begin + segment.at
        into = tokens(segment.sample, at, at + stop - start)
        rows = segment.rows[start:stop]
        if isinstance(layers, slice):
            kept = rows[:, layers]
            if _native_widens(kept, into):
                # Streaming stores into a large buffer already in memory (the caller's out=,
                # pinned memory); plain ones into fresh pages, which the kernel has just zeroed
                # through the cache (streamed, a fresh 0.84 GB layout took twice as long).
                widen_routes(kept, into, not zeroed and out.nbytes >= STREAM_FROM)
            else:
                np.copyto(into, kept, casting="unsafe")  # widened as it is placed
        else:
            for j, layer in enumerate(layers):
                np.copyto(into[:, j], rows[:, layer], casting="unsafe")


def _native_widens(rows: np.ndarray, into: np.ndarray) -> bool:
    """Whether ``rows`` go into ``into`` by the native widening copy: vLLM's uint8 routes, both
    contiguous, into little-endian integers (numpy's cast writes about half as fast as a
    memcpy: it neither streams nor uses the CPU's widening loads)."""
    return (
        rows.dtype == np.uint8
        and into.dtype.kind in "iu"
        and into.dtype.byteorder in "=|<"
        and sys.byteorder == "little"
        and rows.flags.c_contiguous
        and into.flags.c_contiguous
    )


class _Destination:
    """Where the layout goes: numpy, torch (pinned on request), CUDA through pinned memory, or
    the caller's ``out``; checked before anything is read."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        into: Literal["numpy", "torch", "pinned", "cuda"],
        out: Any,
        device: Any,
        dense: bool = False,
    ) -> None:
        self.shape, self.dtype, self.into, self.out, self.device = shape, dtype, into, out, device
        self.dense = dense  # every byte of the layout is written (packed): commit it at once
        self.torch: Any = None
        self.tensor: Any = None  # the torch tensor written on the host, if any
        self.array: np.ndarray | None = None  # the numpy array written, if numpy
        self.zeroed = False  # whether host() gave an array of zeros
        if out is None:
            if into != "numpy":
                self.torch = _torch()
                if into in ("pinned", "cuda") and not self.torch.cuda.is_available():
                    # Pinned memory is CUDA's: torch cannot pin without a driver.
                    raise RuntimeError(f"into={into!r} on a machine where torch sees no CUDA")
            return
        if isinstance(out, np.ndarray):
            if out.dtype != dtype or out.shape != shape:
                raise errors.BadLayout(
                    f"out is {out.dtype} {out.shape}; the layout is {dtype} {shape}"
                )
            if not out.flags.writeable or not out.flags.c_contiguous:
                raise errors.BadLayout("out must be writable and C-contiguous")
            self.into = "numpy"
            return
        self.torch = _torch()
        if not isinstance(out, self.torch.Tensor):
            raise TypeError(f"out is a numpy array or a torch tensor, not {type(out).__name__}")
        want = _torch_dtype(self.torch, dtype)
        if out.dtype != want or tuple(out.shape) != shape:
            raise errors.BadLayout(
                f"out is {out.dtype} {tuple(out.shape)}; the layout is {want} {shape}"
            )
        if not out.is_contiguous():
            raise errors.BadLayout("out must be contiguous")
        self.into = "cuda" if out.device.type == "cuda" else "torch"

    def host(self) -> np.ndarray:
        """The host array the layout is written into."""
        if self.into == "numpy":
            if self.out is None:
                self.array, self.zeroed = _allocate(self.shape, self.dtype, self.dense)
            else:
                self.array = self.out
            return self.array
        if self.into == "torch":
            if self.out is None:
                fresh, self.zeroed = _allocate(self.shape, self.dtype, self.dense)
                self.out = self.torch.from_numpy(fresh)
            self.tensor = self.out
        else:
            self.tensor = self.torch.empty(
                self.shape,
                dtype=_torch_dtype(self.torch, self.dtype),
                pin_memory=self.into in ("pinned", "cuda"),
            )
        array: np.ndarray = self.tensor.numpy()
        return array

    def finish(self, result: Routes) -> Routes:
        if self.into == "numpy":
            result.routes = self.array
            return result
        if self.into != "cuda":
            result.routes = self.tensor
            return result
        on_device = self.out
        if on_device is None:
            on_device = self.torch.empty(self.shape, dtype=self.tensor.dtype, device=self.device)
        on_device.copy_(self.tensor, non_blocking=True)
        event = self.torch.cuda.Event()
        event.record()
        result.routes = on_device
        result._pending = (event, self.tensor)
        return result

    def like(self, array: np.ndarray) -> Any:
        """``array`` (``cu_seqlens``) in the routes' kind: numpy, or a CPU torch tensor."""
        return array if self.into == "numpy" else self.torch.from_numpy(array)


MAP_FROM = 8 << 20
"""Outputs of at least this many bytes are a mapping of their own: fresh pages the kernel
zeroed, so a zero padding is never written (nor faulted in until the trainer reads it). Not
asked for huge pages: where the kernel compacts memory for them on a fault (THP ``defrag`` of
``madvise``), a fresh 1.7 GB batch stalled for seconds."""


MADV_POPULATE_WRITE = 23
"""Linux 5.14: commit a range's pages in one call (``mmap`` names it from Python 3.12 on)."""


def _allocate(
    shape: tuple[int, ...], dtype: np.dtype[Any], dense: bool = False
) -> tuple[np.ndarray, bool]:
    """An array for a layout, and whether it is all zeros already. A ``dense`` layout (every
    byte written) is committed in one call: a fresh 0.84 GB packed layout took 0.29-0.32 s
    to fill against 0.37-0.44 s faulting a page at a time (docs/performance.md, T16)."""
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < MAP_FROM:
        return np.empty(shape, dtype), False
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if dense:
        with contextlib.suppress(OSError):  # an older kernel: the pages fault in as written
            mapped.madvise(MADV_POPULATE_WRITE)
    return np.frombuffer(mapped, dtype).reshape(shape), True  # the array keeps the mapping


def _torch() -> Any:
    """torch, an optional dependency (``aostore[torch]``), imported only when asked for."""
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise ImportError(
            "a torch destination (into= or out=) needs torch: pip install 'aostore[torch]'"
        ) from None


def _torch_dtype(torch: Any, dtype: np.dtype[Any]) -> Any:
    return torch.from_numpy(np.empty(0, dtype)).dtype
