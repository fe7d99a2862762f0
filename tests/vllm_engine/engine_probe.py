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
import time
from collections.abc import Callable
from typing import Any

_TIMED = ("execute_model", "sample_tokens")


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

    def aostore_probe_tier(self) -> dict[str, Any]:
        """With ``AOSTORE_VLLM_MOONCAKE``: the tiered store's parts, what its local tier holds
        (keys and bytes), and its counters, once everything queued is in Mooncake."""
        background = self._aostore_probe_connector()._store
        background.get_concatenated([])  # the writer has applied every queued put
        tier = background._store
        tier.flush()  # and the tier's publisher has put every one of them into Mooncake
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
        }

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
