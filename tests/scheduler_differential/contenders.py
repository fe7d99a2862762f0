"""Contenders: factories that each build one scheduler-side aux-output connector.

A factory takes a :class:`Setup` (what vLLM's scheduler builds the connector from) and returns
the connector: an object with ``AuxOutputSchedulerConnector``'s methods (``build_connector_meta``,
``take_output``, ``request_finished``, ``reset`` and, where ``Setup.kv_events``,
``max_cache_hit``, ``cap_external_hit``, ``request_loading``). The harness calls each contender
with its own requests and stand-ins (rebuilt from the schedule), so no state is shared.

Hook for a native connector: write ``def native_contender(setup): return
NativeSchedulerConnector(setup.kv_cache_manager, setup.kv_connector)`` (or whatever its
constructor takes; on 0.32.0 ``setup.kv_cache_manager`` is None) and add it to
:data:`CONTENDERS` (or select it with ``AOSTORE_SD_CONTENDERS=vllm,native``). It must return
metadata the worker accepts: ``AuxOutputConnectorMetadata`` with ``PackedBlockHashes`` (or
objects with the same fields; the harness compares field values and ``data``/``item_size``),
rows as numpy arrays, and raise exceptions of vLLM's classes (``AssertionError`` where vLLM
asserts, ``KeyError`` for an unknown request), or map them in :data:`ERROR_CLASSES`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setup:
    kv_cache_manager: Any
    """The stand-in KV cache manager (0.33.0), or None (0.32.0's connector takes nothing)."""
    kv_connector: Any
    """A truthy stand-in KV connector (0.33.0 doubles its retention capacity), or None."""
    kv_events: bool


Factory = Callable[[Setup], Any]


@functools.cache
def release() -> Any:
    """The release record (``aostore.vllm.compat.releases``) of the vLLM installed here, for
    the scheduler side: the differential runs once per release, in that release's environment,
    and the native contender takes its layout from the record, as the plugin does."""
    from aostore.vllm.compat import releases

    record = releases.installed(releases.SCHEDULER)
    assert record is not None, "\n".join(releases.describe(releases.vllm_root())[0])
    return record


def kv_events() -> bool:
    """Whether this vLLM's connector tracks the KV cache (0.33.0's and 0.34.0's take a
    manager), as its record's layout says; checked against the connector's signature."""
    from aostore._native import Layout
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    parameters = inspect.signature(AuxOutputSchedulerConnector.__init__).parameters
    takes_manager = "kv_cache_manager" in parameters
    layout = Layout(release().layout)
    assert layout.kv_events == takes_manager, (release().name, layout)
    return layout.kv_events


def vllm_contender(setup: Setup) -> Any:
    """vLLM's own ``AuxOutputSchedulerConnector``."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    if setup.kv_events:
        return AuxOutputSchedulerConnector(setup.kv_cache_manager, setup.kv_connector)
    return AuxOutputSchedulerConnector()


@functools.cache
def _native_class() -> type:
    from aostore.vllm.dataplane import scheduler_subclass
    from vllm.distributed.aux_output_connector import connector as module

    cls = module.AuxOutputSchedulerConnector
    return scheduler_subclass(cls, module, layout=release().layout)


def native_contender(setup: Setup) -> Any:
    """aostore's scheduler-side connector, as its plugin installs it on a recognized vLLM
    (``build_connector_meta`` in Rust), without the plugin's swap."""
    cls = _native_class()
    if setup.kv_events:
        return cls(setup.kv_cache_manager, setup.kv_connector)
    return cls()


CONTENDERS: dict[str, Factory] = {"vllm": vllm_contender, "native": native_contender}
"""The first is the reference."""

ERROR_CLASSES: dict[type[BaseException], type[BaseException]] = {}
"""vLLM's exception class -> the class a contender raises instead (none today)."""
