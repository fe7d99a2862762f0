"""Putting the transport's pieces into vLLM, per process, and the rule both ends compute.

What goes in wherever the plugin loads and the release record recognizes the transport's files
(:data:`aostore.vllm.compat.releases.TRANSPORT`), unless ``AOSTORE_VLLM_TRANSPORT=0``:

- the encoder (engine core): ``MsgpackEncoder``'s ``enc_hook`` and ``_encode_ndarray`` send
  routed-experts rows of a step buffer inline (:mod:`.wire`); any other array goes vLLM's way;
  the decoder (frontend): ``MsgpackDecoder.dec_hook`` makes an inline array over a copy of its
  bytes (no ``memoryview`` kept alive, no message pinned);
- the frontend: ``RequestState`` is aostore's subclass, whose rows are held in pages per
  request (:mod:`.frontend`);
- the API server: ``numpy2base64`` and Starlette's ``JSONResponse.render`` give vLLM's bytes,
  cheaper (:mod:`.answer`); with R3 by reference, Starlette's ``Starlette.__call__`` marks what
  runs for an HTTP request (:data:`.delivery.OVER_HTTP`), so that rows go to the arena only for
  an answer that renders them (:mod:`.delivery`);
- the worker (through the data plane's connector): a step's rows are packed as one
  :class:`.rows.StepRows` where :func:`why_not_packed` says both ends run this aostore; the
  engine core reads them with vLLM's ``take_output`` or aostore's (:meth:`StepRows.take`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from . import delivery as r3_delivery
from .answer import numpy2base64_over, render_over
from .frontend import process_outputs_method, request_state_subclass, trim_method
from .wire import (
    DECODE,
    DECODER_HOOK,
    ENCODE,
    ENCODE_INTO,
    FRONTEND_VARIABLE,
    HOOK,
    METHOD,
    SERIAL_MODULE,
    decode_method,
    decoder_hook,
    encode_into_method,
    encode_method,
    encoder_hook,
    encoder_method,
    frontend_mark,
    packs_for_frontend,
)

UTILS_MODULE = "vllm.utils.serial_utils"
NUMPY2BASE64 = "numpy2base64"
STARLETTE_RESPONSES = "starlette.responses"
STARLETTE_APPLICATIONS = "starlette.applications"
OUTPUT_PROCESSOR_MODULE = r3_delivery.OUTPUT_PROCESSOR_MODULE
ENGINE_MODULE = "vllm.v1.engine"
PROCESS_OUTPUTS = "process_outputs"
TRIM = "_trim_surplus_tokens"
PACKING_LINE = "aostore transport: rows to the frontend (pid %d) as one frame a step"
"""What an engine core that packs its steps for its frontend logs once (:mod:`.wire`)."""
REQUEST_STATE = "RequestState"
_MARK = "__aostore_over_http__"
"""Set on aostore's ``Starlette.__call__``: installed once a process."""


class ClassAttributes:
    """A class's attributes as the plugin's undo list wants a namespace: ``undo`` sets them."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.cls, name, value)


def install(
    swap: Callable[..., list[str]], undo: list[Any], delivery: r3_delivery.Delivery | None = None
) -> list[str]:
    """Puts the encoder's method and the frontend's ``RequestState`` in (``swap``: the plugin's
    swap of module globals; ``undo`` takes what puts each back), and with ``delivery`` R3 rows
    by reference (:mod:`.delivery`: the arena is made with vLLM's ``OutputProcessor``).
    Returns the patched modules."""
    serial_utils = importlib.import_module(SERIAL_MODULE)
    encoder = serial_utils.MsgpackEncoder
    decoder = serial_utils.MsgpackDecoder
    for cls, name, make in (
        (encoder, METHOD, encoder_method),
        (encoder, HOOK, encoder_hook),
        (decoder, DECODER_HOOK, decoder_hook),
    ):
        vllm_function = vars(cls)[name]
        undo.append((ClassAttributes(cls), name, vllm_function))
        setattr(cls, name, make(vllm_function, serial_utils))
    # The packed hop: every process reads a packed frame; an engine core whose frontend reads
    # them (the rule, computed here from what that frontend set before starting it) sends them.
    vllm_decode = vars(decoder)[DECODE]
    undo.append((ClassAttributes(decoder), DECODE, vllm_decode))
    decoder.decode = decode_method(vllm_decode)
    if packs_for_frontend():
        outputs_type = importlib.import_module(ENGINE_MODULE).EngineCoreOutputs
        vllm_encode_into = vars(encoder)[ENCODE_INTO]
        vllm_encode = vars(encoder)[ENCODE]
        undo.append((ClassAttributes(encoder), ENCODE_INTO, vllm_encode_into))
        undo.append((ClassAttributes(encoder), ENCODE, vllm_encode))
        encoder.encode_into = encode_into_method(vllm_encode_into, outputs_type)
        encoder.encode = encode_method(vllm_encode, outputs_type)
        r3_delivery.log.info(PACKING_LINE, os.getppid())
    processor = importlib.import_module(OUTPUT_PROCESSOR_MODULE)
    vllm_state = getattr(processor, REQUEST_STATE)
    replaced = r3_delivery.installed()
    patched = swap(
        {REQUEST_STATE: vllm_state},
        {REQUEST_STATE: request_state_subclass(vllm_state, delivery)},
        undo,
    )
    # One arena a process: the delivery this one replaces lets its budget go.
    if replaced is not None and replaced is not delivery:
        _Closing(replaced)["arena"] = None
    undo.append((_Closing(delivery), "arena", None))
    output_processor = processor.OutputProcessor
    members = vars(output_processor)
    vllm_init = members["__init__"]
    undo.append((ClassAttributes(output_processor), "__init__", vllm_init))
    output_processor.__init__ = _starting(vllm_init, delivery, undo)
    undo.append((ClassAttributes(output_processor), PROCESS_OUTPUTS, members[PROCESS_OUTPUTS]))
    output_processor.process_outputs = process_outputs_method(members[PROCESS_OUTPUTS])
    if TRIM in members:  # vLLM 0.32 on
        undo.append((ClassAttributes(output_processor), TRIM, members[TRIM]))
        setattr(output_processor, TRIM, trim_method(members[TRIM].__func__))
    # The API server's answer: numpy2base64 where vLLM's serving modules will import it (and
    # where they already did), and Starlette's JSON rendering in a process that serves HTTP
    # (vLLM's API server imports Starlette before it loads plugins; other processes never
    # render a body, so Starlette is not imported for them).
    utils = importlib.import_module(UTILS_MODULE)
    vllm_numpy2base64 = utils.numpy2base64
    patched += swap(
        {NUMPY2BASE64: vllm_numpy2base64},
        {NUMPY2BASE64: numpy2base64_over(vllm_numpy2base64)},
        undo,
    )
    responses = sys.modules.get(STARLETTE_RESPONSES)
    if responses is not None:
        json_response = responses.JSONResponse
        vllm_render = vars(json_response)["render"]
        undo.append((ClassAttributes(json_response), "render", vllm_render))
        json_response.render = render_over(vllm_render)
        patched.append(STARLETTE_RESPONSES)
    if delivery is not None and answering_http(undo):
        patched.append(STARLETTE_APPLICATIONS)
    return sorted({*patched, SERIAL_MODULE})


def answering_http(undo: list[Any]) -> bool:
    """Where this process serves HTTP (Starlette imported: vLLM's API server imports it before
    it loads plugins; a trainer that builds vLLM's app in process has imported it before its
    engine starts), mark what runs for each HTTP request (:func:`.delivery.over_http` around
    ``Starlette.__call__``, which FastAPI's calls): a request vLLM's serving code adds there
    gets rows by reference only when its answer renders them. Once a process; whether it is
    in place."""
    if STARLETTE_RESPONSES not in sys.modules and STARLETTE_APPLICATIONS not in sys.modules:
        return False
    starlette = importlib.import_module(STARLETTE_APPLICATIONS).Starlette
    call = vars(starlette)["__call__"]
    if getattr(call, _MARK, False):
        return True
    undo.append((ClassAttributes(starlette), "__call__", call))
    marking = r3_delivery.over_http(call)
    setattr(marking, _MARK, True)
    starlette.__call__ = marking
    return True


def _routed_experts(caller: Any) -> bool | None:
    """Whether the engine whose ``__init__`` is ``caller`` (vLLM's ``AsyncLLM`` and
    ``LLMEngine`` make their ``OutputProcessor`` with ``self.vllm_config`` set) returns routed
    experts (``--enable-return-routed-experts``); None where that cannot be told."""
    owner = caller.f_locals.get("self")
    config = getattr(getattr(owner, "vllm_config", None), "aux_output_config", None)
    flag = getattr(config, "enable_return_routed_experts", None)
    return flag if isinstance(flag, bool) else None


class _Closing:
    """What the undo list sets to close a delivery's arena (its ``RequestState`` goes with the
    swap's own undo, and delivery by reference with it)."""

    def __init__(self, delivery: r3_delivery.Delivery | None) -> None:
        self.delivery = delivery

    def __setitem__(self, name: str, value: Any) -> None:
        if self.delivery is not None and self.delivery.arena is not None:
            self.delivery.arena.close()


def _starting(
    vllm_init: Callable[..., None], delivery: r3_delivery.Delivery | None, undo: list[Any]
) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_init(self, *args, **kwargs)
        # A frontend starts here, and vLLM starts its engine cores after this: they learn
        # from their environment that their client reads packed frames (wire.packs_for_frontend).
        os.environ[FRONTEND_VARIABLE] = frontend_mark()
        if delivery is None:
            return
        # The arena's budget is reserved now, or start-up stops; unless the engine making it
        # runs without routed experts (no rows ever come: a later one would start the arena).
        if _routed_experts(sys._getframe(1)) is not False:
            delivery.start()
        # A process that imported Starlette after the plugin loaded serves HTTP from here on.
        answering_http(undo)

    __init__.__wrapped__ = vllm_init  # type: ignore[attr-defined]
    return __init__


def why_not_packed(config: Any) -> str | None:
    """``None`` when a worker's step rows cross to the engine core pickled by this aostore and
    read by the same one: the multiprocess executor on one node (the engine core starts its
    workers from its own environment). Else why vLLM's dict goes, per executor: ``uni`` and
    ``external_launcher`` hand it over in one process (no pickle: nothing to save); ``ray`` may
    place workers on other nodes, with other environments."""
    parallel = config.parallel_config
    name = _executor(config)
    if name != "mp":
        return f"the {name} executor hands vLLM's dict over"
    if int(getattr(parallel, "nnodes", 1) or 1) > 1:
        return "the mp executor spans nodes"
    return None


def crosses_unpacked(config: Any, why_unpacked: str | None) -> bool:
    """Whether rows go as vLLM's dict over a hop that pickles them (``ray``, or ``mp`` across
    nodes): the transport is on but the two ends were not shown to agree."""
    if why_unpacked is None or why_unpacked == "transport off":
        return False
    return _executor(config) not in ("uni", "external_launcher", None)


def _executor(config: Any) -> str | None:
    """The executor's name, given as a name or as a class (vLLM allows both)."""
    backend = config.parallel_config.distributed_executor_backend
    return backend if isinstance(backend, str) or backend is None else str(backend.__name__)
