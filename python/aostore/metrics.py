"""Prometheus export of ``store.stats()``, for when ``prometheus_client`` is installed.

This module imports without ``prometheus_client``; building a collector without it raises
``ImportError`` saying what to install (``pip install aostore[prometheus]``; vLLM already
ships the package).

Every key of ``stats()`` becomes one metric named ``aostore_<key>``: occupancy as gauges,
event counts as counters (which the exposition format suffixes with ``_total``). Each
collection calls ``stats()`` once, so the samples of one scrape are consistent with each other.

==========================  =======  =========================================================
metric                      type     meaning (unit)
==========================  =======  =========================================================
aostore_capacity            gauge    slots in the arena, ``num_slots`` (objects)
aostore_object_nbytes       gauge    size of one object (bytes)
aostore_stored              gauge    stored objects (objects)
aostore_referenced          gauge    keys with a reference count >= 1 (keys)
aostore_evictable           gauge    stored unreferenced objects, the LRU length (objects)
aostore_free_slots          gauge    slots holding no object (slots)
aostore_puts                counter  ``put`` calls (calls)
aostore_objects_written     counter  payloads copied into slots (objects)
aostore_retains             counter  applied retains (references)
aostore_releases            counter  applied releases (references)
aostore_evictions           counter  objects evicted (objects)
aostore_capacity_errors     counter  puts refused with ``cannot retain`` (calls)
aostore_growths             counter  arena growths, profile ``grow`` (events)
aostore_reads               counter  ``get_*`` calls that succeeded (calls)
aostore_read_misses         counter  reads that named a key not stored (calls)
aostore_bytes_written       counter  payload bytes copied in (bytes)
aostore_bytes_read          counter  payload bytes copied out (bytes)
aostore_eviction_visits     counter  LRU entries the eviction walk looked at (entries)
==========================  =======  =========================================================

A Mooncake tier (``aostore.mooncake.TieredBlockObjectStore``) adds its fault figures:

==================================  =======  =================================================
metric                              type     meaning (unit)
==================================  =======  =================================================
aostore_unpublished_objects         gauge    keys Mooncake may lack or hold stale (keys)
aostore_unpublished_recorded        gauge    of those, in the tier's record (keys)
aostore_mooncake_down               gauge    whether the publisher sees an outage (0/1)
aostore_unpublished_not_recorded    counter  unpublished keys beyond the record (keys)
aostore_dropped_objects             counter  publications that did not fit the queue (objects)
aostore_publish_failures            counter  failed publications and master checks (calls)
aostore_republished_objects         counter  recorded keys republished from local (objects)
aostore_outages                     counter  outages the publisher saw (events)
aostore_master_restarts             counter  masters that lost the tier's data (events)
aostore_remote_read_failures        counter  reads Mooncake failed or did not answer (calls)
==================================  =======  =================================================

The keys themselves are not exported (one label per key would be unbounded):
``TieredBlockObjectStore.unpublished_keys()`` lists them.

A key that a later aostore adds to ``stats()`` is exported as a gauge ``aostore_<key>``.

Use::

    from aostore.metrics import register_store

    register_store(store)                      # the default prometheus_client.REGISTRY
    register_store(store, registry=my_registry, labels={"engine": "0"})
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric  # type: ignore[import-not-found, unused-ignore]
    from prometheus_client.registry import (  # type: ignore[import-not-found, unused-ignore]
        CollectorRegistry,
    )

__all__ = ["COUNTERS", "GAUGES", "AostoreCollector", "StatsSource", "register_store"]

PREFIX = "aostore_"

GAUGES: dict[str, str] = {
    "capacity": "Slots in the arena, num_slots (objects).",
    "object_nbytes": "Size of one object (bytes).",
    "stored": "Stored objects (objects).",
    "referenced": "Keys with a reference count of at least 1 (keys).",
    "evictable": "Stored unreferenced objects, the LRU length (objects).",
    "free_slots": "Slots holding no object (slots).",
    "unpublished_objects": "Mooncake tier: keys Mooncake may lack or hold stale (keys).",
    "unpublished_recorded": "Mooncake tier: unpublished keys in the tier's record (keys).",
    "mooncake_down": "Mooncake tier: whether the publisher sees an outage (0 or 1).",
    "bytes_held": "R3 arena: bytes of rows held, whole pages (bytes).",
    "slots_held": "R3 arena: references whose rows are held (references).",
    "leases": "R3 arena: held rows a reader leases now (references).",
    "offnode_pending": "R3 across nodes: puts and removals waiting for Mooncake (entries).",
    "offnode_segment_committed": "R3 across nodes: Mooncake segment committed at start (bytes).",
}
"""``stats()`` keys exported as gauges, with their help text (unit in parentheses)."""

COUNTERS: dict[str, str] = {
    "puts": "put calls (calls).",
    "objects_written": "Payloads copied into slots (objects).",
    "retains": "Applied retains (references).",
    "releases": "Applied releases (references).",
    "evictions": "Objects evicted (objects).",
    "capacity_errors": "Puts refused with 'cannot retain' (calls).",
    "growths": "Arena growths, profile grow (events).",
    "reads": "Successful get calls (calls).",
    "read_misses": "Reads that named a key that is not stored (calls).",
    "bytes_written": "Payload bytes copied into the store (bytes).",
    "bytes_read": "Payload bytes copied out of the store (bytes).",
    "eviction_visits": "LRU entries the eviction walk looked at (entries).",
    "unpublished_not_recorded": "Mooncake tier: unpublished keys beyond the record (keys).",
    "dropped_objects": "Mooncake tier: publications that did not fit the queue (objects).",
    "publish_failures": "Mooncake tier: failed publications and master checks (calls).",
    "republished_objects": "Mooncake tier: recorded keys republished from local (objects).",
    "outages": "Mooncake tier: outages the publisher saw (events).",
    "master_restarts": "Mooncake tier: masters found to have lost the tier's data (events).",
    "remote_read_failures": "Mooncake tier: reads Mooncake failed or did not answer (calls).",
    "references": "R3 arena: references made (references).",
    "expiries": "R3 arena: unread rows given up past their deadline (references).",
    "leased_when_wanted": "R3 arena: rows that could have gone but were leased (events).",
    "fallbacks": "R3 arena: requests whose rows went as rows, not fitting (requests).",
    "offnode_published": "R3 across nodes: references put into Mooncake (references).",
    "offnode_put_failures": "R3 across nodes: puts Mooncake failed, each retried (puts).",
    "offnode_gone_before_put": "R3 across nodes: references gone before their put (references).",
    "offnode_removed": "R3 across nodes: objects removed after their slot went (objects).",
    "offnode_read_offnode": "R3 across nodes: references read off-node (references).",
    "offnode_renewed_offnode": "R3 across nodes: renewals asked off-node, applied (references).",
    "offnode_restarts": "R3 across nodes: masters found to have restarted empty (events).",
    "offnode_republished": "R3 across nodes: references put again after a restart (references).",
    "offnode_remove_retries": "R3 across nodes: removals put off, leased or failed (removals).",
    "offnode_dropped": "R3 across nodes: retries given up, the queue full (entries).",
    "offnode_outages": "R3 across nodes: outages of Mooncake the publisher saw (events).",
    "offnode_misplaced": "R3 across nodes: markers placed off this node's segment (events).",
}
"""``stats()`` keys exported as counters, with their help text (unit in parentheses)."""


class StatsSource(Protocol):
    """Anything with aostore's ``stats()``: a ``BlockObjectStore``."""

    def stats(self) -> Mapping[str, int]: ...


def _prometheus() -> Any:
    try:
        from prometheus_client import core  # type: ignore[import-not-found, unused-ignore]
    except ImportError as error:
        raise ImportError(
            "aostore.metrics needs prometheus_client: pip install 'aostore[prometheus]' "
            "(or pip install prometheus_client)"
        ) from error
    return core


class AostoreCollector:
    """A ``prometheus_client`` collector that exports one store's ``stats()``.

    ``source`` is a store (anything with ``stats()``) or a callable returning such a mapping,
    e.g. ``lambda: store.stats()``. ``labels`` are constant labels added to every sample.
    prometheus_client refuses two collectors with the same metric names in one registry, so
    several stores need distinct ``prefix`` values or registries.

    A closed store still reports its counters; a ``stats()`` that raises is reported as no
    samples rather than failing the whole scrape.
    """

    def __init__(
        self,
        source: StatsSource | Callable[[], Mapping[str, int]],
        *,
        labels: Mapping[str, str] | None = None,
        prefix: str = PREFIX,
    ) -> None:
        self._core = _prometheus()
        stats = getattr(source, "stats", None)
        if callable(stats):
            self._stats: Callable[[], Mapping[str, int]] = stats
        elif callable(source):
            self._stats = source
        else:
            raise TypeError("source must have a stats() method or be callable")
        self._labels = dict(labels or {})
        self._prefix = prefix

    def _families(self, stats: Mapping[str, int] | None) -> Iterator[Metric]:
        core = self._core
        names = list(self._labels)
        values = list(self._labels.values())
        table = [(key, core.GaugeMetricFamily, text) for key, text in GAUGES.items()]
        table += [(key, core.CounterMetricFamily, text) for key, text in COUNTERS.items()]
        if stats is not None:
            table += [
                (key, core.GaugeMetricFamily, f"aostore stats()[{key!r}].")
                for key in stats
                if key not in GAUGES and key not in COUNTERS
            ]
        for key, factory, help_text in table:
            family = factory(self._prefix + key, help_text, labels=names)
            if stats is not None and key in stats:
                family.add_metric(values, float(stats[key]))
            yield family

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (lets the registry reject duplicate names)."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        """One sample per ``stats()`` key, from a single ``stats()`` call."""
        try:
            stats = dict(self._stats())
        except Exception:
            return iter(())
        return self._families(stats)


def register_store(
    source: StatsSource | Callable[[], Mapping[str, int]],
    *,
    registry: CollectorRegistry | None = None,
    labels: Mapping[str, str] | None = None,
    prefix: str = PREFIX,
) -> AostoreCollector:
    """Builds an :class:`AostoreCollector` for ``source`` and registers it.

    ``registry`` defaults to ``prometheus_client.REGISTRY``. Returns the collector, so the
    caller can ``registry.unregister(collector)`` when the store goes away.
    """
    collector = AostoreCollector(source, labels=labels, prefix=prefix)
    if registry is None:
        registry = _prometheus().REGISTRY
    registry.register(collector)
    return collector
