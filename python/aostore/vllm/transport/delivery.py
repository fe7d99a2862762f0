"""R3 rows by reference (SPEC 17): the frontend keeps a finished request's rows in its arena
and the output carries a reference (:mod:`aostore.r3`) instead of them.

Off unless ``AOSTORE_VLLM_R3_DELIVERY`` is set: ``reference`` makes references the default,
``rows`` keeps vLLM's rows as the default and lets a request ask for a reference. A request
chooses with ``"aostore_r3_delivery": "rows" | "reference"`` in ``SamplingParams.extra_args``
(HTTP: ``vllm_xargs``). The arena (``AOSTORE_VLLM_R3_BUDGET`` bytes, reserved) is made when
vLLM's ``OutputProcessor`` is, so a budget the node cannot hold stops start-up.

The rows written are exactly those vLLM would have sent: what its finish makes, after its stop
trimming (``RequestState._new_completion_output``); rows that do not fit go as rows (counted,
one WARNING).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from aostore.r3.arena import Arena

if TYPE_CHECKING:
    from .frontend import RowChunks

KEY = "aostore_r3_delivery"
MODES = ("rows", "reference")
ENV_DELIVERY = "AOSTORE_VLLM_R3_DELIVERY"
ENV_BUDGET = "AOSTORE_VLLM_R3_BUDGET"
ENV_TTL = "AOSTORE_VLLM_R3_TTL"
PREFIX = "aostore_r3_"

# Under ``vllm``, as the plugin's own lines, so vLLM's logging configuration shows it.
log = logging.getLogger("vllm.plugins.aostore")


class Delivery:
    """This process's delivery: the default mode, and the arena once a frontend starts."""

    def __init__(self, default: str, budget: int, ttl: float) -> None:
        if default not in MODES:
            raise ValueError(f"{ENV_DELIVERY}={default!r}: one of {', '.join(MODES)}")
        self.default = default
        self.budget = budget
        self.ttl = ttl
        self.arena: Arena | None = None
        self._lock = threading.Lock()
        self._warned = False

    def start(self) -> Arena:
        """The arena, made (and its budget reserved) on the first call; its figures exported
        as ``aostore_r3_*`` where ``prometheus_client`` is (vLLM's ``/metrics``)."""
        with self._lock:
            if self.arena is None or self.arena.closed:
                self.arena = Arena(self.budget, self.ttl, setting=ENV_BUDGET)
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
        """A reference to ``rows`` kept in the arena, or ``rows`` when they do not fit."""
        reference = self.start().deliver(rows, token_start=0)
        if reference is not None:
            return reference
        self._fell_back(rows.nbytes)
        return rows

    def deliver_chunks(self, chunks: RowChunks) -> np.ndarray | None:
        """What a finishing output carries for the rows in ``chunks``: their reference, written
        from the pages straight into the arena; the rows (:meth:`RowChunks.finished`) when they
        do not fit; None when no rows came."""
        if not chunks:
            return chunks.finished()
        dtype = chunks.dtype
        if not chunks.paged or dtype.hasobject or dtype.names is not None:
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
        """The arena's figures (``Arena.stats``), or None before it starts."""
        return None if self.arena is None else self.arena.stats()


_delivery: Delivery | None = None
_exported = False


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
    """Register, once per process, a collector of the current delivery's arena figures."""
    global _exported
    if _exported:
        return
    try:
        from aostore.metrics import register_store

        register_store(lambda: (_delivery.stats() if _delivery else None) or {}, prefix=PREFIX)
    except ImportError:  # no prometheus_client: the figures stay in Arena.stats()
        return
    _exported = True


def configure(delivery: Delivery | None) -> None:
    """Set (or, with None, clear) this process's delivery."""
    global _delivery
    if _delivery is not None and _delivery is not delivery and _delivery.arena is not None:
        _delivery.arena.close()
    _delivery = delivery


def current() -> Delivery | None:
    return _delivery


def deliver_chunks(chunks: RowChunks) -> np.ndarray | None:
    """:meth:`Delivery.deliver_chunks` with this process's delivery (the rows, without one)."""
    if _delivery is None:
        return chunks.finished()
    return _delivery.deliver_chunks(chunks)


def choose(sampling_params: Any) -> str:
    """The request's mode (``rows`` when delivery by reference is off; asking for a reference
    then is a ``ValueError`` saying how to turn it on)."""
    if _delivery is None:
        extra = getattr(sampling_params, "extra_args", None) or {}
        if extra.get(KEY, "rows") != "rows":
            raise refused(
                f"{KEY}: delivery by reference is off in this vLLM (set {ENV_DELIVERY}=rows "
                "or =reference where it starts)",
                extra[KEY],
            )
        return "rows"
    return _delivery.choose(sampling_params)
