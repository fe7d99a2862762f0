"""Putting the transport's pieces into vLLM, per process, and the rule both ends compute.

What goes in wherever the plugin loads and the release record recognizes the transport's files
(:data:`aostore.vllm.compat.releases.TRANSPORT`), unless ``AOSTORE_VLLM_TRANSPORT=0``:

- the encoder (engine core): ``MsgpackEncoder._encode_ndarray`` sends routed-experts rows of a
  step buffer inline (:mod:`.wire`); any other array goes vLLM's way;
- the frontend: ``RequestState`` is aostore's subclass, whose rows are held in one buffer per
  request (:mod:`.frontend`);
- the worker (through the data plane's connector): a step's rows are packed as one
  :class:`.rows.StepRows` where :func:`why_not_packed` says both ends run this aostore; the
  engine core reads them with vLLM's ``take_output`` or aostore's (:meth:`StepRows.take`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .frontend import request_state_subclass
from .wire import HOOK, METHOD, encoder_hook, encoder_method

SERIAL_MODULE = "vllm.v1.serial_utils"
OUTPUT_PROCESSOR_MODULE = "vllm.v1.engine.output_processor"
REQUEST_STATE = "RequestState"


class ClassAttributes:
    """A class's attributes as the plugin's undo list wants a namespace: ``undo`` sets them."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.cls, name, value)


def install(swap: Callable[..., list[str]], undo: list[Any]) -> list[str]:
    """Puts the encoder's method and the frontend's ``RequestState`` in (``swap``: the plugin's
    swap of module globals; ``undo`` takes what puts each back). Returns the patched modules."""
    serial_utils = importlib.import_module(SERIAL_MODULE)
    encoder = serial_utils.MsgpackEncoder
    for name, make in ((METHOD, encoder_method), (HOOK, encoder_hook)):
        vllm_function = vars(encoder)[name]
        undo.append((ClassAttributes(encoder), name, vllm_function))
        setattr(encoder, name, make(vllm_function, serial_utils))
    processor = importlib.import_module(OUTPUT_PROCESSOR_MODULE)
    vllm_state = getattr(processor, REQUEST_STATE)
    patched = swap(
        {REQUEST_STATE: vllm_state}, {REQUEST_STATE: request_state_subclass(vllm_state)}, undo
    )
    return sorted({*patched, SERIAL_MODULE})


def why_not_packed(config: Any) -> str | None:
    """``None`` when a worker's step rows cross to the engine core pickled by this aostore and
    read by the same one: the multiprocess executor on one node (the engine core starts its
    workers from its own environment). Else why vLLM's dict goes, per executor: ``uni`` and
    ``external_launcher`` hand it over in one process (no pickle: nothing to save); ``ray`` may
    place workers on other nodes, with other environments."""
    parallel = config.parallel_config
    backend = parallel.distributed_executor_backend
    name = backend if isinstance(backend, str) or backend is None else backend.__name__
    if name != "mp":
        return f"the {name} executor hands vLLM's dict over"
    if int(getattr(parallel, "nnodes", 1) or 1) > 1:
        return "the mp executor spans nodes"
    return None
