"""The scheduler side: aostore's subclass of vLLM's ``AuxOutputSchedulerConnector``, whose
``build_connector_meta`` runs in Rust over vLLM's own state (``aostore._native``)."""

from __future__ import annotations

import atexit
import importlib
from typing import Any

from aostore import _native
from aostore._native import Layout

from ..transport import StepRows
from ..transport.wire import SERIAL_MODULE, packing
from .installed import SCHEDULER
from .report import report_scheduler

OWN_HELPERS = {True: ("_take_new_hashes", "_pack_hashes"), False: ("_pack_new_hashes",)}
"""The scheduler connector's helpers that the native ``build_connector_meta`` stands in for,
by whether the layout has KV-cache events (0.33.0 on; 0.32.0 not): while any is not vLLM's own
(a subclass's, an instance's, a patch), vLLM's method runs."""


def scheduler_subclass(
    vllm_scheduler: Any, module: Any, *, layout: str | Layout, report: str | None = None
) -> type:
    """aostore's scheduler-side connector over vLLM's ``AuxOutputSchedulerConnector``:
    ``build_connector_meta`` in Rust over vLLM's own state (its other methods are vLLM's);
    ``module``: vLLM's connector module, ``layout``: the release record's. The helpers the native
    method stands in for (:data:`OWN_HELPERS`) are recorded now and compared on every call."""
    # Made once (install makes it): every step asks it, never parses a name again.
    made = layout if isinstance(layout, Layout) else Layout(layout)
    kv_events = made.kv_events
    return type(
        SCHEDULER,
        (DataPlaneSchedulerConnector, vllm_scheduler),
        {
            "__module__": __name__,
            "__qualname__": SCHEDULER,
            "__doc__": DataPlaneSchedulerConnector.__doc__,
            "_aostore_module": module,
            "_aostore_layout": made,
            "_aostore_report": report,
            "_aostore_vllm_take_output": (vllm_scheduler, vllm_scheduler.take_output),
            "_aostore_own": tuple(
                (name, getattr(vllm_scheduler, name)) for name in OWN_HELPERS[kv_events]
            ),
        },
    )


class DataPlaneSchedulerConnector:
    """vLLM's scheduler-side connector; the loop over each step's requests runs in Rust.

    ``build_connector_meta`` reads and updates the connector's own dicts and lists in vLLM's
    order (``aostore._native.build_connector_meta``), so vLLM's other methods
    (``take_output``, ``request_finished``, ``reset``, the KV-cache lookups) run unchanged on
    the same state. ``take_output`` is vLLM's for vLLM's dict; a step that aostore's worker
    packed (``aostore.vllm.transport.StepRows``) is read by its own ``take``, with vLLM's
    checks.
    """

    _aostore_module: Any
    _aostore_layout: Layout
    _aostore_report: str | None
    _aostore_own: tuple[tuple[str, Any], ...]
    _aostore_vllm_take_output: tuple[Any, Any]
    _aostore_steps = 0
    _aostore_fallbacks = 0
    _aostore_why_not: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where vLLM's scheduler looks it up, once per request: a native callable, so a packed
        # step costs no Python frame per request (the method below is what it does).
        vllm_class, vllm_take_output = self._aostore_vllm_take_output
        # Where this engine core packs its steps for its frontend, spans of the step buffer
        # rather than numpy views: its encoder reads them, nothing else does.
        spans = packing(importlib.import_module(SERIAL_MODULE).MsgpackEncoder)
        native = _native.TakeOutput(self, vllm_class, vllm_take_output, StepRows, spans)
        self.take_output = native  # type: ignore[method-assign]
        if self._aostore_report:
            atexit.register(report_scheduler, self, self._aostore_report)

    def build_connector_meta(self, scheduler_output: Any, requests: Any) -> Any:
        # vLLM's state lives in its own dicts, so this is decided per call: while a helper is
        # not vLLM's own (a subclass's, an instance's, a later patch), vLLM's method calls it.
        cls, attributes = type(self), getattr(self, "__dict__", {})
        for name, function in self._aostore_own:
            if name in attributes or getattr(cls, name) is not function:
                self._aostore_fallbacks += 1
                self._aostore_why_not = f"{SCHEDULER}.{name} is not vLLM's own"
                return super().build_connector_meta(scheduler_output, requests)  # type: ignore[misc]
        self._aostore_steps += 1
        return _native.build_connector_meta(
            self, scheduler_output, requests, self._aostore_module, self._aostore_layout
        )

    def take_output(self, request: Any, output: Any) -> Any:
        # A step packed by aostore's worker (aostore.vllm.transport): vLLM's checks and rows
        # without an AuxRequestOutput per request; vLLM's dict goes to vLLM's method.
        vllm_class, vllm_take_output = self._aostore_vllm_take_output
        if type(output) is StepRows and vllm_class.take_output is vllm_take_output:
            return output.take(request)
        return super().take_output(request, output)  # type: ignore[misc]
