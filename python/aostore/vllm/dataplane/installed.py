"""What the data plane's install records, and the worker side's decision against it.

The names of vLLM's modules and classes the data plane replaces, :class:`Installed` (what
``install`` bound to aostore's connector), and :func:`why_not`: whether a built connector is
still the one installed, with nothing hooking what the plane stands in for. The install
(``install.py``), the worker side and the scheduler side all read this module; it reads none of
them.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Mapping
from typing import Any

from aostore._native import Layout, NativeWriter
from aostore.vllm.compat import releases

WORKER_MODULE = "vllm.distributed.aux_output_connector.worker"
ROUTED_EXPERTS_MODULE = "vllm.distributed.aux_output_connector.routed_experts"
CONNECTOR_MODULE = "vllm.distributed.aux_output_connector.connector"
CONNECTOR = "AuxOutputWorkerConnector"
BUFFER = "RoutedExpertsBuffer"
SCHEDULER = "AuxOutputSchedulerConnector"
NAMES = (CONNECTOR, BUFFER, SCHEDULER)
BY_FEATURE = {releases.WORKER: (CONNECTOR, BUFFER), releases.SCHEDULER: (SCHEDULER,)}
"""The vLLM classes each data-plane feature replaces."""
CONNECTOR_METHODS = (
    "begin_step",
    "prepare_output",
    "process_output",
    "_commit_output",
    "_publish_blocks",
    "_teardown",
    "close",
)
"""The connector's methods the data plane stands in for: an override of any of them (a subclass,
an instance attribute, a patch of vLLM's class) keeps the plane off, so that code runs."""
WORKER_OBJECTS = (
    "publish_routed_experts",
    "materialize_routed_experts",
    "routed_experts_keys",
    "PendingAuxOutput",
    "AuxRequestOutput",
)
"""The worker module's names vLLM's connector calls: a wrap of any of them keeps the plane off."""
MARK = "__aostore_data_plane__"
"""The worker module's attribute: vLLM's classes the data plane replaced, by name."""
NO_STORE = "not the output rank (no store)"


@dataclasses.dataclass(frozen=True)
class Installed:
    """What :func:`install` put in and recorded: the worker connector's decision compares the
    connector against it (as ``type(connector)._aostore_installed``)."""

    release: releases.Release
    """The release record the plugin recognized vLLM's files as."""
    layout: Layout
    """The record's layout, made once here: the connector asks it, never a release's name."""
    worker: Any
    """vLLM's worker module."""
    classes: Mapping[str, type]
    """aostore's classes by vLLM's name: the store, the writer's wrapper, the buffer and the
    connector."""
    methods: Mapping[str, Any]
    """The connector's :data:`CONNECTOR_METHODS` as they resolved at install."""
    worker_objects: Mapping[str, Any]
    """The worker module's :data:`WORKER_OBJECTS` at install."""
    report: str | None
    """``AOSTORE_VLLM_DATA_PLANE_REPORT``'s file, from the plugin's settings."""
    transport: bool = False
    """Whether aostore's transport is on (``aostore.vllm.transport``): the plane then packs a
    step's rows where both ends of the hop run this aostore."""
    said: threading.Event = dataclasses.field(default_factory=threading.Event, compare=False)
    """Set once the worker's log line has been written (one per process)."""


def why_not(connector: Any) -> str | None:
    """``None`` when ``connector``'s vLLM code built aostore's installed classes and nothing
    hooks what the plane stands in for; else why the plane stays off."""
    installed: Installed = type(connector)._aostore_installed
    worker = installed.worker
    for name in ("BlockObjectStore", "BackgroundBlockObjectStore", BUFFER):
        if vars(worker).get(name) is not installed.classes.get(name):
            return f"the worker module's {name} is not the class aostore installed"
    store: Any = connector.__dict__.get("_store")
    buffer: Any = connector.__dict__.get("_buffer")
    if store is None or buffer is None:
        return NO_STORE
    why = _hooked(connector, installed)
    if why is not None:
        return why
    if type(buffer) is not installed.classes[BUFFER]:
        return f"the buffer is a {type(buffer).__name__}"
    if type(store) is not installed.classes["BackgroundBlockObjectStore"]:
        return f"the store is a {type(store).__name__}"
    if type(getattr(store, "_writer", None)) is not NativeWriter:
        return "the store's writer is not aostore's Rust writer"
    inner = getattr(store, "store", None)
    if type(inner) is not installed.classes["BlockObjectStore"]:
        return f"the writer's store is a {type(inner).__name__}"
    return None


def _hooked(connector: Any, installed: Installed) -> str | None:
    """Why code that hooks vLLM's connector would be skipped by the plane, or ``None``: the
    plane's state lives in Rust and cannot hand back to vLLM's Python mid-run, so this is
    decided once, when the store is built; a patch made later is not seen
    (docs/data-plane.md)."""
    cls = installed.classes[CONNECTOR]
    if type(connector) is not cls:
        return f"the connector is a {type(connector).__qualname__}, a subclass: its methods run"
    for name, method in installed.methods.items():
        if name in vars(connector):
            return f"the connector's {name} is replaced on the instance"
        if inspect.getattr_static(cls, name) is not method:
            return f"{CONNECTOR}.{name} was patched after aostore installed its connector"
    for name, value in installed.worker_objects.items():
        if vars(installed.worker).get(name) is not value:
            return f"the worker module's {name} was replaced after aostore installed its connector"
    return None
