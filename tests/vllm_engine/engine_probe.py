"""Runs inside vLLM's worker process: what store it uses, what the store holds, step timings.

Loaded as vLLM's ``worker_extension_cls="engine_probe.StoreProbe"`` (``engine_run.py`` puts
this folder on ``PYTHONPATH``), so its methods become methods of the worker and
``llm.collective_rpc("aostore_probe_...")`` calls them in the process that owns the
routed-experts store. Everything returned is plain data (str, int, bytes, lists, dicts).

Reading vLLM's own store means reading its private attributes; that belongs here, in the test
tree, and nowhere in aostore.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_TIMED = ("execute_model", "sample_tokens")
# The tier counters sampled by ``aostore_probe_watch_tier``, in each sample's order after the time.
TIER_SAMPLED = (
    "mooncake_down",
    "unpublished_objects",
    "pending_batches",
    "queued_objects",
    "published_objects",
    "republished_objects",
    "dropped_objects",
    "publish_failures",
    "outages",
    "master_restarts",
)
# Store calls timed by ``aostore_probe_watch_tier``: the engine thread's, on the background
# store, and the background writer's, on the tier.
_ENGINE_CALLS = ("put", "put_blocks", "get_concatenated", "get_into", "get_array")
_WRITER_CALLS = ("put", "put_blocks")


def _qualname(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def vllm_store_contents(store: Any) -> dict[str, Any]:
    """vLLM's store in aostore's ``snapshot()`` shape: evictable keys oldest first, counts,
    and the bytes of every stored key.

    vLLM 0.32 keeps every stored key (referenced or not) in ``_lru`` with its slot; 0.33 keeps
    stored keys in ``_slots`` and only evictable ones in ``_lru``. Either way the evictable
    order is the LRU order restricted to unreferenced keys.
    """
    references = dict(store._references)
    slots: dict[str, int] = dict(store._slots if hasattr(store, "_slots") else store._lru)
    unallocated = getattr(store, "_UNALLOCATED_SLOT", -1)
    arena = store._arena
    size = store.object_nbytes
    objects = {
        key: bytes(arena[slot * size : (slot + 1) * size])
        for key, slot in slots.items()
        if slot != unallocated
    }
    lru = [key for key in store._lru if key not in references and key in objects]
    return {"lru": lru, "references": references, "objects": objects}


def _timed(method: Callable[..., Any], out: list[float]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            out.append(time.perf_counter() - start)

    return timed


class _CallWatch:
    """Count, worst and total seconds of one store method, and every exception it raised."""

    def __init__(self) -> None:
        self.count = 0
        self.worst_s = 0.0
        self.total_s = 0.0
        self.errors: list[str] = []

    def wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return method(*args, **kwargs)
            except BaseException as error:
                self.errors.append(repr(error))
                raise
            finally:
                took = time.monotonic() - start
                self.count += 1
                self.total_s += took
                self.worst_s = max(self.worst_s, took)

        return watched

    def report(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "worst_s": self.worst_s,
            "total_s": self.total_s,
            "errors": list(self.errors),
        }


class _TierWatch:
    """A thread that samples the tier's counters (``time.monotonic()`` first: one clock for
    every process of the machine) until stopped, and the watched store calls."""

    def __init__(self, tier: Any, interval_s: float) -> None:
        self.tier = tier
        self.interval_s = interval_s
        self.samples: list[tuple[float, ...]] = []
        self.sample_errors: list[str] = []
        self.calls: dict[str, _CallWatch] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="aostore-probe-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stats = self.tier.stats()
            except Exception as error:  # a probe must not stop the engine
                self.sample_errors.append(repr(error))
            else:
                self.samples.append((time.monotonic(), *(stats[k] for k in TIER_SAMPLED)))
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10.0)
        return {
            "fields": ["t", *TIER_SAMPLED],
            "samples": list(self.samples),
            "sample_errors": list(self.sample_errors),
            "calls": {name: watch.report() for name, watch in self.calls.items()},
        }


class StoreProbe:
    """Mixed into vLLM's worker class; every name starts with ``aostore_probe_``."""

    def _aostore_probe_connector(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        connector = getattr(runner, "aux_output_connector", None)
        if connector is None:
            raise RuntimeError("the worker has no aux_output_connector: routed experts are off")
        return connector

    def aostore_probe_classes(self) -> dict[str, Any]:
        """The classes the worker's store objects are, and what vLLM's modules hold."""
        background = self._aostore_probe_connector()._store
        inner = getattr(background, "_store", None)
        store_module = sys.modules["vllm.distributed.aux_output_connector.store"]
        worker_module = sys.modules["vllm.distributed.aux_output_connector.worker"]
        routed_module = sys.modules["vllm.distributed.aux_output_connector.routed_experts"]
        return {
            "pid": os.getpid(),
            "background": _qualname(background),
            "store": _qualname(inner),
            "profile": getattr(inner, "profile", None),
            "num_slots": int(inner.num_slots),
            "object_nbytes": int(inner.object_nbytes),
            "modules": {
                "store.BlockObjectStore": _qualname(store_module.BlockObjectStore),
                "store.BlockObject": _qualname(store_module.BlockObject),
                "worker.BlockObjectStore": _qualname(worker_module.BlockObjectStore),
                "worker.BackgroundBlockObjectStore": _qualname(
                    worker_module.BackgroundBlockObjectStore
                ),
                "routed_experts.BlockObject": _qualname(routed_module.BlockObject),
            },
            "plugin_mark": hasattr(store_module, "__aostore_originals__"),
        }

    def aostore_probe_contents(self) -> dict[str, Any]:
        """Everything the store holds once its writer has applied every queued put."""
        background = self._aostore_probe_connector()._store
        background.get_concatenated([])  # both writers drain their queue before a read
        inner = background._store
        if hasattr(inner, "snapshot"):
            contents = dict(inner.snapshot())
            contents["stats"] = dict(inner.stats())
        else:
            contents = vllm_store_contents(inner)
            contents["stats"] = {}
        return contents

    def aostore_probe_tier(self, timeout_s: float | None = None) -> dict[str, Any]:
        """With ``AOSTORE_VLLM_MOONCAKE``: the tiered store's parts, what its local tier holds
        (keys and bytes), its counters and its record of unpublished keys, once everything
        queued is in Mooncake or recorded. With ``timeout_s``, at most that long: first for a
        Mooncake outage to end, then for the flush (``flushed`` says whether it finished)."""
        background = self._aostore_probe_connector()._store
        background.get_concatenated([])  # the writer has applied every queued put
        tier = background._store
        started = time.monotonic()
        if timeout_s is None:
            flushed = tier.flush()  # the publisher has put every queued object into Mooncake
        else:
            deadline = started + timeout_s
            while tier.stats()["mooncake_down"] and time.monotonic() < deadline:
                time.sleep(0.02)
            flushed = tier.flush(timeout=max(0.0, deadline - time.monotonic()))
        flush_s = time.monotonic() - started
        writer_error = getattr(getattr(background, "_writer", None), "_error", None)
        local = tier.local
        return {
            "tier": _qualname(tier),
            "local": _qualname(local),
            "profile": getattr(local, "profile", None),
            "remote": _qualname(tier.remote),
            "master": tier.remote.master_address,
            "key_prefix": tier.remote.key_prefix,
            "objects": dict(local.snapshot()["objects"]),
            "stats": dict(tier.stats()),
            "read_deadline_s": getattr(tier, "read_deadline_s", None),
            "unpublished": list(tier.unpublished_keys()),
            "flushed": bool(flushed),
            "flush_s": flush_s,
            "settled_at": time.monotonic(),
            "writer_error": None if writer_error is None else repr(writer_error),
        }

    def aostore_probe_watch_tier(self, interval_s: float = 0.02) -> None:
        """From now on, sample the tier's counters every ``interval_s`` and time (and catch
        the exceptions of) the store calls of the engine thread and of the background writer.
        """
        background = self._aostore_probe_connector()._store
        tier = background._store
        watch = _TierWatch(tier, interval_s)
        self._aostore_probe_watch = watch  # type: ignore[attr-defined]
        for prefix, target, names in (
            ("engine", background, _ENGINE_CALLS),
            ("writer", tier, _WRITER_CALLS),
        ):
            for name in names:
                method = getattr(target, name, None)
                if method is not None:
                    watch.calls[f"{prefix}.{name}"] = call = _CallWatch()
                    setattr(target, name, call.wrap(method))

    def aostore_probe_tier_watch(self) -> dict[str, Any] | None:
        """Stops the sampling; the samples (``fields`` names their columns) and call figures."""
        watch: _TierWatch | None = getattr(self, "_aostore_probe_watch", None)
        return None if watch is None else watch.stop()

    def aostore_probe_record_calls(self) -> None:
        """Record every call the worker makes on its store from now on, in call order.

        Recorded at the background store, the object the connector calls (under its lock, so
        the order is the order the writer applies): ``("put", [(key, payload)], retains,
        releases)`` and ``("get", keys, returned bytes)``.
        """
        background = self._aostore_probe_connector()._store
        calls: list[tuple[Any, ...]] = []
        self._aostore_probe_calls = calls  # type: ignore[attr-defined]
        put, get = background.put, background.get_concatenated

        def recorded_put(objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> Any:
            batch, retains, releases = list(objects), tuple(retain_keys), tuple(release_keys)
            payloads = [(obj.key, bytes(obj.payload)) for obj in batch]
            calls.append(("put", payloads, retains, releases))
            return put(batch, retain_keys=retains, release_keys=releases)

        def recorded_get(keys: Any) -> Any:
            keys = list(keys)
            data = get(keys)
            calls.append(("get", keys, bytes(data)))
            return data

        background.put = recorded_put
        background.get_concatenated = recorded_get

    def aostore_probe_calls(self) -> list[tuple[Any, ...]]:
        """The calls recorded since ``aostore_probe_record_calls``."""
        return list(getattr(self, "_aostore_probe_calls", []))

    def aostore_probe_start_timing(self) -> None:
        """Time every ``execute_model``/``sample_tokens`` call the engine makes from now on."""
        timings: dict[str, list[float]] = {name: [] for name in _TIMED}
        self._aostore_probe_timings = timings  # type: ignore[attr-defined]
        for name in _TIMED:
            setattr(self, name, _timed(getattr(self, name), timings[name]))

    def aostore_probe_timings(self) -> dict[str, list[float]]:
        """Seconds per call, in call order, since ``aostore_probe_start_timing``."""
        return dict(getattr(self, "_aostore_probe_timings", {}))
