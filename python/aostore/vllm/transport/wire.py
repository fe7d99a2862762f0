"""Engine core to frontend: vLLM's wire, with routed-experts rows inline or packed.

vLLM's ``MsgpackEncoder`` sends every array of at least ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD``
bytes (256 by default) as a ZMQ frame of its own, so each 368-byte decode row of a GLM-4.5-Air
request is one frame: about 500 a step. Every vLLM decoder (the Python one and the Rust
frontend) reads an array either way, as ``(dtype, shape, data)`` with ``data`` a frame index or
msgpack's raw-view extension. aostore's ``_encode_ndarray`` sends the arrays that are rows of a
step buffer (:func:`.rows.is_step_rows`: routed experts from aostore's worker, nothing else)
inline, as vLLM does for small arrays; every other array goes vLLM's way.

On the frontend, vLLM's decoder makes an inline array a view of the message, through a
``memoryview`` that the garbage collector tracks; ~500 of them alive through a step's
``process_outputs`` promote garbage into the oldest generation and cause full collections.
aostore's ``dec_hook`` makes such an array over a copy of its bytes (over ``bytes`` where the
message was read-only, an array owning its copy where it was writable: the same ``writeable``
flag, and no tracked ``memoryview`` as a base), so the ``memoryview`` dies at once and the array
no longer pins the message; values, dtype, shape and flags are vLLM's.

**The packed hop.** Inline rows still cost a Python call per row on each side (the encoder's
hook, the decoder's hook, ``RowChunks.append`` in vLLM's loop). Where the engine core knows its
client is a frontend running this aostore with the transport on (:func:`packs_for_frontend`:
the frontend made its ``OutputProcessor``, which set :data:`FRONTEND_VARIABLE` to this aostore's
version and its pid, then started this engine core as its child), its ``encode_into`` takes a
step's rows out of the message (each output's ``routed_experts`` is None on the wire) and sends
them as one more frame after vLLM's frames; the frontend's ``decode`` keeps that frame for the
outputs it decoded, and one native call before vLLM's ``process_outputs`` loop writes each
output's rows into its request's pages (:mod:`.frontend`). Anywhere else (a headless or
separately started engine core, an API server of several, vLLM's Rust frontend, another
aostore version) the rows stay inline: a frontend that cannot read the frame never gets one.

The packed frame, format :data:`PACKED_FORMAT` 1 (specified here once; the native code,
``src/python/packed_rows.rs``, writes and reads it and cites this), little-endian:

- 16 bytes of magic, ``\\x93aostore-r3rows\\x00`` (no frame of vLLM's starts so: its frames
  are msgpack or an array's bytes, and this frame is always the last);
- ``u32`` format; ``u16`` length and UTF-8 of the writer's aostore version; ``u16`` length and
  ASCII of the rows' numpy dtype (``dtype.str``); ``u8`` row dimensions, then ``u64`` each
  (one token's row shape);
- ``u64`` count, then per output that has rows, ``u64`` its position in the message's
  ``outputs`` (strictly increasing) and ``u64`` the end of its rows, counted in rows from the
  data's start (each output's rows start where the previous one's end);
- the data: every output's rows back to back, in C order.

A frame of another format or aostore version raises ``RuntimeError`` at once; one that does
not fit its message raises ``ValueError``: never wrong rows.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..._native import is_packed_rows, pack_step_rows, rows_arrived, unspan_outputs
from .rows import VERSION, StepArray, is_step_rows

SERIAL_MODULE = "vllm.v1.serial_utils"
"""vLLM's module of ``MsgpackEncoder`` and ``MsgpackDecoder``."""
METHOD = "_encode_ndarray"
HOOK = "enc_hook"
DECODER_HOOK = "dec_hook"
ENCODE_INTO = "encode_into"
ENCODE = "encode"
DECODE = "decode"
_PACKS = "_aostore_packs"
"""Set on aostore's ``encode_into``: the encoder class packs (:func:`packing`)."""
PACKED_FORMAT = 1
"""The packed frame's layout (this module's docstring specifies it)."""
FRONTEND_VARIABLE = "AOSTORE_TRANSPORT_FRONTEND"
"""Not a setting (no ``AOSTORE_VLLM_`` prefix: nobody sets it but aostore). Set by a frontend
that reads packed frames, as ``"<aostore version>:<its pid>"``, when it makes its
``OutputProcessor`` (vLLM starts the engine cores after that): what an engine core reads to
know its client (:func:`packs_for_frontend`)."""


def frontend_mark() -> str:
    """What this process sets :data:`FRONTEND_VARIABLE` to when it reads packed frames."""
    return f"{VERSION}:{os.getpid()}"


def packs_for_frontend(environ: Any = os.environ) -> bool:
    """The rule both ends compute: an engine core packs its steps' rows for its frontend only
    when its parent is a process that reads packed frames of this aostore's version (the
    parent set :data:`FRONTEND_VARIABLE` to its version and pid before starting it). An engine
    core started any other way (headless, by a launcher, by the main process of several API
    servers, by vLLM's Rust frontend) sees another pid or none."""
    return bool(environ.get(FRONTEND_VARIABLE) == f"{VERSION}:{os.getppid()}")


INLINE = "vLLM's, with routed-experts rows of a step buffer inline."


def _over(function: Any, vllm_function: Any, qualname: str, doc: str) -> Any:
    """``function``, named as vLLM's method it stands in for, and wrapping it."""
    function.__qualname__ = qualname
    function.__doc__ = doc
    function.__wrapped__ = vllm_function
    return function


def encoder_method(vllm_method: Any, serial_utils: Any) -> Any:
    """aostore's ``MsgpackEncoder._encode_ndarray`` over vLLM's (``serial_utils``: vLLM's
    module, whose ``msgpack`` and ``CUSTOM_TYPE_RAW_VIEW`` it uses)."""
    ext = serial_utils.msgpack.Ext
    raw_view = serial_utils.CUSTOM_TYPE_RAW_VIEW

    def _encode_ndarray(self: Any, obj: Any) -> Any:
        if obj.shape and obj.flags.c_contiguous and is_step_rows(obj):
            # vLLM's inline form, byte for byte (what it sends below the threshold).
            return obj.dtype.str, obj.shape, ext(raw_view, obj.data)
        return vllm_method(self, obj)

    return _over(_encode_ndarray, vllm_method, f"MsgpackEncoder.{METHOD}", INLINE)


def encoder_hook(vllm_hook: Any, serial_utils: Any) -> Any:
    """aostore's ``MsgpackEncoder.enc_hook`` over vLLM's: the same inline form for step rows a
    Python call sooner (an encoder binds its hook when built; :func:`encoder_method` covers one
    built before the plugin loaded), everything else to vLLM's hook."""
    ext = serial_utils.msgpack.Ext
    raw_view = serial_utils.CUSTOM_TYPE_RAW_VIEW
    ndarray = np.ndarray

    def enc_hook(self: Any, obj: Any) -> Any:
        if type(obj) is ndarray and obj.shape and obj.flags.c_contiguous:
            # is_step_rows, inlined: msgspec calls this once per array.
            base = obj.base
            if type(base) is StepArray or (type(base) is ndarray and type(base.base) is StepArray):
                return obj.dtype.str, obj.shape, ext(raw_view, obj.data)
        return vllm_hook(self, obj)

    return _over(enc_hook, vllm_hook, f"MsgpackEncoder.{HOOK}", INLINE)


def decoder_hook(vllm_hook: Any, serial_utils: Any) -> Any:
    """aostore's ``MsgpackDecoder.dec_hook`` over vLLM's: an inline array over a copy of its
    bytes (vLLM's own steps otherwise: ``np.frombuffer``, then ``reshape``)."""
    ndarray = np.ndarray
    frombuffer = np.frombuffer

    def dec_hook(self: Any, t: Any, obj: Any) -> Any:
        if t is ndarray and self.share_mem:
            dtype, shape, data = obj
            if type(data) is memoryview:
                if data.readonly:  # over bytes: read-only, as the view of the message was
                    return frombuffer(bytes(data), dtype=dtype).reshape(shape)
                # A writable message: an array that owns a copy (np.frombuffer over a
                # bytearray would keep a tracked memoryview as its base).
                return frombuffer(data, dtype=dtype).reshape(shape).copy()
        return vllm_hook(self, t, obj)

    return _over(
        dec_hook,
        vllm_hook,
        f"MsgpackDecoder.{DECODER_HOOK}",
        "vLLM's, with an inline array over a copy of its bytes.",
    )


def encode_into_method(vllm_method: Any, outputs_type: Any) -> Any:
    """aostore's ``MsgpackEncoder.encode_into`` over vLLM's, for an engine core that packs
    (:func:`packs_for_frontend`): an ``EngineCoreOutputs`` (``outputs_type``) goes with its
    step rows in one trailing frame; everything else as vLLM sends it."""

    def encode_into(self: Any, obj: Any, buf: Any) -> Any:
        if type(obj) is outputs_type and obj.outputs:
            packed = pack_step_rows(obj.outputs, StepArray, VERSION)
            if packed is not None:
                try:
                    frames = vllm_method(self, obj, buf)
                finally:
                    packed.restore()
                frames.append(packed.frame)
                return frames
        return vllm_method(self, obj, buf)

    setattr(encode_into, _PACKS, True)
    return _over(
        encode_into,
        vllm_method,
        f"MsgpackEncoder.{ENCODE_INTO}",
        "vLLM's, with a step's routed-experts rows in one trailing frame.",
    )


def encode_method(vllm_method: Any, outputs_type: Any) -> Any:
    """aostore's ``MsgpackEncoder.encode`` over vLLM's, in an engine core that packs: vLLM sends
    a few messages by it rather than by its output thread's ``encode_into`` (the engine dead,
    the coordinator's): their rows go inline, as arrays (``StepRowsSpan``s made views)."""

    def encode(self: Any, obj: Any) -> Any:
        if type(obj) is outputs_type and obj.outputs:
            unspan_outputs(obj.outputs)
        return vllm_method(self, obj)

    return _over(encode, vllm_method, f"MsgpackEncoder.{ENCODE}", INLINE)


def packing(encoder_class: Any) -> bool:
    """Whether ``encoder_class`` (vLLM's ``MsgpackEncoder``) has aostore's packing methods in:
    then the scheduler's ``take_output`` gives ``StepRowsSpan``s, which only they read."""
    return bool(getattr(vars(encoder_class).get(ENCODE_INTO), _PACKS, False))


def decode_method(vllm_method: Any) -> Any:
    """aostore's ``MsgpackDecoder.decode`` over vLLM's: a message whose last frame is packed
    rows is decoded without it, and the frame kept for its outputs until ``process_outputs``
    (:func:`aostore._native.rows_arrived`)."""

    def decode(self: Any, bufs: Any) -> Any:
        if type(bufs) is list and len(bufs) > 1 and is_packed_rows(bufs[-1]):
            frame = bufs[-1]
            decoded = vllm_method(self, bufs[:-1])
            rows_arrived(decoded.outputs, frame, VERSION)
            return decoded
        return vllm_method(self, bufs)

    return _over(
        decode,
        vllm_method,
        f"MsgpackDecoder.{DECODE}",
        "vLLM's, keeping a trailing frame of packed step rows for the outputs it decodes.",
    )
