"""R3 rows by reference: the frontend keeps a finished request's rows in its arena
and the output carries a reference (:mod:`aostore.r3`) instead of them.

Off unless ``AOSTORE_VLLM_R3_DELIVERY`` is set: ``reference`` makes references the default,
``rows`` keeps vLLM's rows as the default and lets a request ask for a reference. A request
chooses with ``"aostore_r3_delivery": "rows" | "reference"`` in ``SamplingParams.extra_args``
(HTTP: ``vllm_xargs``). The arena (``AOSTORE_VLLM_R3_BUDGET`` bytes, reserved) is made when
vLLM's ``OutputProcessor`` is, so a budget the node cannot hold stops start-up.

The rows written are exactly those vLLM would have sent: what its finish makes, after its stop
trimming (``RequestState._new_completion_output``); rows that do not fit go as rows (counted,
one WARNING).

Rows go to the arena only for what leaves as a reference (a slot held for rows nobody reads
would crowd out references a trainer will fetch):

- a request that arrives while this process answers an HTTP request (:data:`OVER_HTTP`, set by
  the plugin around Starlette's ASGI call: vLLM's API server, or an in-process server built on
  vLLM's app) finishes with vLLM's rows, left for its answer (:func:`leave_for_answer`): only
  when vLLM's serving code renders them (``numpy2base64``, :func:`answered`) are they written
  into the arena and the answer carries the reference. Streamed chunks (which carry no routed
  experts), a client that disconnected (vLLM aborts its request and nobody renders the
  output) and beam search's inner requests (whose outputs vLLM never renders) take no slot;
- any other request (``LLM``, ``AsyncLLM`` called directly: verl, NeMo-RL, SkyRL, even beside
  an HTTP server in the same process) finishes with a reference, aborted ones included: its
  output is handed to the caller as it is.

A process's delivery is bound to aostore's ``RequestState`` (the class attribute
:data:`ATTRIBUTE`, set when :func:`~aostore.vllm.transport.frontend.request_state_subclass` makes
the class): what a request chooses and where its rows go is read from its own class, so the
plugin undone (vLLM's class back) is delivery off, with nothing else to reset.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from aostore.r3 import format as r3_format
from aostore.r3 import offnode
from aostore.r3.arena import Arena, Reservation

KEY = "aostore_r3_delivery"
MODES = ("rows", "reference")
ENV_DELIVERY = "AOSTORE_VLLM_R3_DELIVERY"
ENV_BUDGET = "AOSTORE_VLLM_R3_BUDGET"
ENV_TTL = "AOSTORE_VLLM_R3_TTL"
ENV_MOONCAKE = "AOSTORE_VLLM_R3_MOONCAKE"
PREFIX = "aostore_r3_"
ATTRIBUTE = "aostore_r3"
"""The class attribute of aostore's ``RequestState`` that holds its :class:`Delivery` (None:
by reference off)."""
OUTPUT_PROCESSOR_MODULE = "vllm.v1.engine.output_processor"
"""Where vLLM's output processor finds the ``RequestState`` it makes (aostore's, installed)."""

# Under ``vllm``, as the plugin's own lines, so vLLM's logging configuration shows it.
log = logging.getLogger("vllm.plugins.aostore")

OVER_HTTP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "aostore_r3_over_http", default=False
)
"""True while this task answers an HTTP (or WebSocket) request: what it adds to vLLM is
answered by vLLM's serving code, which renders the routed experts it sends (``numpy2base64``)
and drops the rest. A per-request fact, not a per-process one, because trainers run vLLM's HTTP
app beside their own in-process calls (verl's server does both in one process), and tasks that
vLLM starts for a request (``merge_async_iterators``) inherit it."""


class FinishingRows(Protocol):
    """What a finishing request's rows offer the delivery (:class:`~.frontend.RowChunks`)."""

    @property
    def paged(self) -> bool: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...
    def __bool__(self) -> bool: ...
    def finished(self) -> np.ndarray | None: ...
    def stream_into(self, targets: list[np.ndarray]) -> None: ...


class Delivery:
    """This process's delivery: the default mode, and the arena once a frontend starts."""

    def __init__(self, default: str, budget: int, ttl: float, mooncake: Any = None) -> None:
        if default not in MODES:
            raise ValueError(f"{ENV_DELIVERY}={default!r}: one of {', '.join(MODES)}")
        self.default = default
        self.budget = budget
        self.ttl = ttl
        self.mooncake = mooncake
        """A ``MooncakeConfig`` (``AOSTORE_VLLM_R3_MOONCAKE``): references are published there
        for other nodes; None: read on this node only."""
        self.arena: Arena | None = None
        self.publisher: offnode.Publisher | None = None
        self._lock = threading.Lock()
        self._warned = False

    def start(self) -> Arena:
        """The arena, made (and its budget reserved) on the first call; its figures exported
        as ``aostore_r3_*`` where ``prometheus_client`` is (vLLM's ``/metrics``)."""
        with self._lock:
            if self.arena is None or self.arena.closed:
                arena = Arena(self.budget, self.ttl, setting=ENV_BUDGET)
                if self.mooncake is not None:
                    try:  # an unreachable master stops start-up, naming the setting
                        self.publisher = offnode.connect_publisher(
                            arena, self.mooncake, setting=ENV_MOONCAKE
                        )
                    except BaseException:
                        arena.close()
                        raise
                self.arena = arena
                _export()
            return self.arena

    def choose(self, sampling_params: Any) -> str:
        """The request's mode: its ``extra_args`` key, else the default; a bad value is a
        ``ValueError`` naming the key (:func:`refused`: vLLM's API server answers a 400)."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        if KEY not in extra:
            return self.default
        mode = extra[KEY]
        if mode not in MODES:
            raise refused(f"{KEY} must be one of {', '.join(map(repr, MODES))}", mode)
        return str(mode)

    def deliver(self, rows: np.ndarray) -> np.ndarray:
        """A reference to ``rows`` kept in the arena, or ``rows`` when they do not fit or no
        reference can name them (``aostore.r3.format.rows_refused``)."""
        if r3_format.rows_refused(rows.dtype, rows.shape) is not None:
            return rows
        reference = self.start().deliver(rows, token_start=0)
        if reference is not None:
            return reference
        self._fell_back(rows.nbytes)
        return rows

    def deliver_chunks(
        self, chunks: FinishingRows, *, over_http: bool = False, expected: bool = False
    ) -> np.ndarray | None:
        """What a finishing output carries for the rows in ``chunks``: their reference, written
        from the pages straight into the arena; the rows (:meth:`RowChunks.finished`) when they
        do not fit; None when no rows came. ``over_http`` (the request came in over HTTP): the
        rows, left for the answer (:func:`leave_for_answer`), so that only an answer that
        renders them becomes a reference. ``expected`` (an answer will render them, as far as
        the finish can tell): written into a reserved slot of the arena now (one copy, as by
        reference in process; the output's rows are that slot's, read-only), which the answer
        publishes and an output nobody renders gives back when it goes; otherwise, or where no
        run of the arena holds them, the finish's rows, written into the arena if an answer
        renders them (a second copy, for what is rarely rendered)."""
        if not chunks:
            return chunks.finished()
        dtype = chunks.dtype
        if over_http:
            if expected and chunks.paged and r3_format.rows_refused(dtype, chunks.shape) is None:
                reserved = self.start().reserve(dtype, chunks.shape, chunks.stream_into)
                if reserved is not None:
                    leave_for_answer(reserved[1], self, reserved[0])
                    return reserved[1]
            finished = chunks.finished()
            if finished is not None:
                leave_for_answer(finished, self)
            return finished
        if not chunks.paged or r3_format.rows_refused(dtype, chunks.shape) is not None:
            rows = chunks.finished()  # vLLM's concatenation: any rows vLLM could send
            return None if rows is None else self.deliver(rows)
        reference = self.start().deliver_written(dtype, chunks.shape, chunks.stream_into)
        if reference is not None:
            return reference
        self._fell_back(chunks.nbytes)
        return chunks.finished()

    def _fell_back(self, nbytes: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "aostore: R3 rows of %d bytes did not fit the arena (%s=%d, unread references "
                "are kept until read or expired): sent as rows; counted from here on in the "
                "arena's fallbacks",
                nbytes,
                ENV_BUDGET,
                self.budget,
            )

    def stats(self) -> dict[str, int] | None:
        """The arena's figures (``Arena.stats``) and, publishing for other nodes, the
        publisher's (``offnode_*``); None before it starts."""
        if self.arena is None:
            return None
        stats = self.arena.stats()
        if self.publisher is not None:
            published = dataclasses.asdict(self.publisher.stats)
            stats |= {f"offnode_{key}": int(value) for key, value in published.items()}
        return stats


_exported = False


class _Left:
    """Rows a finish over HTTP left for its answer, and what the answer carries once rendered."""

    __slots__ = ("answer", "delivery", "ref", "reservation")

    def __init__(
        self,
        ref: weakref.ref[np.ndarray],
        delivery: Delivery,
        reservation: Reservation | None,
    ) -> None:
        self.ref = ref
        self.delivery = delivery
        self.reservation = reservation
        self.answer: np.ndarray | None = None


# By the array's id, as long as it lives (an array is not hashable, and the output must stay
# vLLM's plain ndarray: a subclass or an attribute would show in every consumer's code).
_left: dict[int, _Left] = {}


def leave_for_answer(
    rows: np.ndarray, delivery: Delivery, reservation: Reservation | None = None
) -> None:
    """Mark ``rows`` (an output's ``routed_experts``) as to be delivered by reference if, and
    when, an answer renders them (:func:`answered`). Rows nobody renders are never written to
    the arena: the mark goes with the array. Rows an arena cannot hold (a dtype of fields or
    objects: vLLM never sends one; ``aostore.r3.format.rows_refused``) are not marked, and go
    as rows."""
    if r3_format.rows_refused(rows.dtype, rows.shape) is not None:
        return
    key = id(rows)

    # The table bound here: at interpreter exit the module's globals may already be None.
    def forget(
        ref: weakref.ref[np.ndarray], key: int = key, table: dict[int, _Left] = _left
    ) -> None:
        left = table.get(key)
        if left is not None and left.ref is ref:
            table.pop(key, None)
            if left.reservation is not None:
                left.reservation.withdraw()  # never rendered: its slot goes back

    _left[key] = _Left(weakref.ref(rows, forget), delivery, reservation)


def answered(array: Any) -> np.ndarray | None:
    """What an answer renders for ``array``: None unless it is rows left for an answer; then
    their reference, the rows written into the arena now (the same reference if rendered
    again), or the rows themselves when they do not fit (counted, as at a finish)."""
    left = _left.get(id(array))
    if left is None:
        return None
    rows = left.ref()
    if rows is not array or rows is None:
        return None
    if left.answer is None and left.reservation is not None:
        # The rows are in a reserved slot already: the reference is made now. A closed arena
        # (the plugin undone) makes none: the answer carries a copy of the rows.
        left.answer = left.reservation.publish()
        if left.answer is None:
            left.answer = np.array(rows)
    elif left.answer is None:
        arena = left.delivery.arena
        if arena is not None and arena.closed:
            left.answer = rows  # its arena closed since (the plugin undone): vLLM's rows
        else:
            left.answer = left.delivery.deliver(rows)
    return left.answer


def left_for_answers() -> int:
    """How many finished outputs' rows wait for an answer to render them (for tests)."""
    return len(_left)


def over_http(call: Callable[..., Any]) -> Callable[..., Any]:
    """An ASGI application's ``__call__`` that runs ``call`` with :data:`OVER_HTTP` set for an
    HTTP or WebSocket request (not for ``lifespan``: what vLLM starts then is no request's)."""

    async def __call__(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await call(self, scope, receive, send)
            return
        token = OVER_HTTP.set(True)
        try:
            await call(self, scope, receive, send)
        finally:
            OVER_HTTP.reset(token)

    __call__.__wrapped__ = call  # type: ignore[attr-defined]
    __call__.__doc__ = call.__doc__
    return __call__


_refusals: list[type[ValueError]] = []


def _refusal() -> type[ValueError]:
    """A ``ValueError`` that is also vLLM's ``VLLMValidationError`` where vLLM has it: vLLM
    answers a client error with a 400 and takes any other exception from ``add_request`` for
    a fault of the engine (a 500, and the server shuts down). Made once a process."""
    if not _refusals:
        try:
            from vllm.exceptions import VLLMValidationError  # type: ignore[import-not-found]
        except ImportError:
            _refusals.append(ValueError)
        else:
            _refusals.append(
                type(
                    "DeliveryChoiceError",
                    (VLLMValidationError, ValueError),
                    {"__doc__": "A request's ``aostore_r3_delivery`` that cannot be served."},
                )
            )
    return _refusals[0]


def refused(message: str, value: Any) -> ValueError:
    """The error for a bad ``aostore_r3_delivery``, naming the key and the value."""
    error = _refusal()
    if error is ValueError:
        return ValueError(f"{message} (parameter={KEY}, value={value!r})")
    return error(message, parameter=KEY, value=repr(value))  # type: ignore[call-arg]


def _export() -> None:
    """Register, once per process, a collector of the installed delivery's arena figures."""
    global _exported
    if _exported:
        return
    try:
        from aostore.metrics import register_store

        register_store(lambda: _installed_stats() or {}, prefix=PREFIX)
    except ImportError:  # no prometheus_client: the figures stay in Arena.stats()
        return
    _exported = True


def installed() -> Delivery | None:
    """This process's delivery: the one bound to the ``RequestState`` vLLM's output processor
    makes now (aostore's, while the plugin is in), else None."""
    processor = sys.modules.get(OUTPUT_PROCESSOR_MODULE)
    delivery: Delivery | None = getattr(getattr(processor, "RequestState", None), ATTRIBUTE, None)
    return delivery


def _installed_stats() -> dict[str, int] | None:
    delivery = installed()
    return None if delivery is None else delivery.stats()


def deliver_chunks(
    delivery: Delivery | None,
    chunks: FinishingRows,
    *,
    over_http: bool = False,
    expected: bool = False,
) -> np.ndarray | None:
    """:meth:`Delivery.deliver_chunks` with ``delivery`` (the rows, without one)."""
    if delivery is None:
        return chunks.finished()
    return delivery.deliver_chunks(chunks, over_http=over_http, expected=expected)


def choose(delivery: Delivery | None, sampling_params: Any) -> str:
    """The request's mode under ``delivery`` (``rows`` when delivery by reference is off;
    asking for a reference then is a ``ValueError`` saying how to turn it on)."""
    if delivery is None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        if extra.get(KEY, "rows") != "rows":
            raise refused(
                f"{KEY}: delivery by reference is off in this vLLM (set {ENV_DELIVERY}=rows "
                "or =reference where it starts)",
                extra[KEY],
            )
        return "rows"
    return delivery.choose(sampling_params)
