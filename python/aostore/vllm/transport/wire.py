"""Engine core to frontend: vLLM's wire, with routed-experts rows inline.

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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .rows import StepArray, is_step_rows

METHOD = "_encode_ndarray"
HOOK = "enc_hook"
DECODER_HOOK = "dec_hook"


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
