"""Putting the data plane's classes in vLLM's modules.

:func:`install` makes aostore's subclasses of vLLM's ``AuxOutputWorkerConnector``,
``RoutedExpertsBuffer`` and ``AuxOutputSchedulerConnector`` for the features the release
record recognizes, and binds what it recorded (:class:`.installed.Installed`) to them as a class
attribute: a connector compares itself against that record, never against module state.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from aostore._native import Layout
from aostore.vllm.compat import releases

from .installed import (
    BUFFER,
    CONNECTOR,
    CONNECTOR_METHODS,
    CONNECTOR_MODULE,
    MARK,
    ROUTED_EXPERTS_MODULE,
    SCHEDULER,
    WORKER_MODULE,
    WORKER_OBJECTS,
    Installed,
)
from .scheduler import scheduler_subclass
from .worker import subclasses


def install(
    store_classes: Mapping[str, Any],
    release: releases.Release,
    features: Collection[str],
    swap: Callable[..., list[str]],
    undo: list[Any],
    report: str | None = None,
    *,
    transport: bool = False,
) -> list[str]:
    """Puts the subclasses of ``features`` (:data:`BY_FEATURE`) in vLLM's modules (``swap`` as
    the store's); ``store_classes``: aostore's store and writer classes, by vLLM's name;
    ``release``: the record recognized. Returns the patched modules."""
    layout = Layout(release.layout)
    originals: dict[str, type] = {}
    replacements: dict[str, type] = {}
    if releases.WORKER in features:
        worker = importlib.import_module(WORKER_MODULE)
        routed = importlib.import_module(ROUTED_EXPERTS_MODULE)
        vllm_connector, vllm_buffer = getattr(worker, CONNECTOR), getattr(routed, BUFFER)
        connector, buffer = subclasses(vllm_connector, vllm_buffer, layout)
        connector._aostore_installed = Installed(  # type: ignore[attr-defined]
            release=release,
            layout=layout,
            worker=worker,
            classes={**store_classes, BUFFER: buffer, CONNECTOR: connector},
            # vLLM's code as it stood at install: what the decision compares against.
            methods={name: inspect.getattr_static(connector, name) for name in CONNECTOR_METHODS},
            worker_objects={name: vars(worker).get(name) for name in WORKER_OBJECTS},
            report=report,
            transport=transport,
        )
        originals |= {CONNECTOR: vllm_connector, BUFFER: vllm_buffer}
        replacements |= {CONNECTOR: connector, BUFFER: buffer}
    if releases.SCHEDULER in features:
        module = importlib.import_module(CONNECTOR_MODULE)
        vllm_scheduler = getattr(module, SCHEDULER)
        originals[SCHEDULER] = vllm_scheduler
        replacements[SCHEDULER] = scheduler_subclass(
            vllm_scheduler, module, layout=layout, report=report
        )
    patched: list[str] = swap(originals, replacements, undo)
    worker = importlib.import_module(WORKER_MODULE)
    setattr(worker, MARK, originals)
    return patched


def remove_mark() -> None:
    """Undoes :func:`install`'s mark (its swaps are in the caller's ``undo``)."""
    worker = sys.modules.get(WORKER_MODULE)
    if worker is not None and MARK in vars(worker):
        delattr(worker, MARK)
