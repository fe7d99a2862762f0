"""The engine core's encoder with aostore's ``_encode_ndarray``: vLLM's wire, rows inline.

A step's ``EngineCoreOutputs`` whose routed experts are rows of a step buffer (what aostore's
scheduler side takes from a ``StepRows``) encodes to the bytes vLLM's own encoder gives when it
inlines every array (a zero-copy threshold above the rows' size): one frame, where vLLM's
default sends a frame per row; vLLM's decoder reads the same outputs; any other array (a
routed-experts array that is not a step buffer's, a logprobs tensor) goes vLLM's way, as does
everything with the transport not installed. Skips where vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from aostore.vllm.install import swap, undo_swap
from aostore.vllm.transport import StepRows, install
from vllm.v1 import engine as v1_engine
from vllm.v1 import serial_utils

SHAPE = (46, 8)


@pytest.fixture
def installed() -> Iterator[None]:
    undo: list[Any] = []
    install(swap, undo)
    try:
        yield
    finally:
        undo_swap(undo)


def outputs(packed: bool, counts: list[int]) -> Any:
    data = np.random.default_rng(3).integers(0, 128, (sum(counts), *SHAPE), np.uint8)
    index = np.empty((len(counts), 2), "<i8")
    index[:, 0] = 0
    index[:, 1] = np.cumsum(counts)
    ids = tuple(f"req-{i}" for i in range(len(counts)))
    step = StepRows.packed(ids, index.tobytes(), bytearray(data), data.dtype, SHAPE)
    made = []
    for i, request_id in enumerate(ids):
        rows = step[request_id].rows if packed else step[request_id].rows.copy()
        made.append(
            v1_engine.EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[i],
                routed_experts=rows,
                finish_reason=v1_engine.FinishReason.LENGTH if i == 0 else None,
            )
        )
    return v1_engine.EngineCoreOutputs(outputs=made, engine_index=0)


def frames(encoder: Any, message: Any) -> list[bytes]:
    return [bytes(frame) for frame in encoder.encode(message)]


COUNTS = [700, 1, 1, 0, 3]  # a prefill, decodes, an output with no rows


@pytest.mark.parametrize("built", ["after", "before"])
def test_step_rows_go_inline_as_vllm_inlines_them(built: str) -> None:
    """An encoder built after the plugin loaded (its hook is aostore's) or before (vLLM's hook
    calls aostore's ``_encode_ndarray``)."""
    message = outputs(True, COUNTS)
    early = serial_utils.MsgpackEncoder()
    undo: list[Any] = []
    install(swap, undo)
    try:
        encoder = early if built == "before" else serial_utils.MsgpackEncoder()
        ours = frames(encoder, message)
    finally:
        undo_swap(undo)
    inline = frames(serial_utils.MsgpackEncoder(size_threshold=1 << 30), message)
    assert ours == inline and len(ours) == 1
    decoded = serial_utils.MsgpackDecoder(v1_engine.EngineCoreOutputs).decode(ours)
    for got, want in zip(decoded.outputs, message.outputs, strict=True):
        assert got.request_id == want.request_id and got.new_token_ids == want.new_token_ids
        assert got.routed_experts.dtype == want.routed_experts.dtype
        assert np.array_equal(got.routed_experts, want.routed_experts)


def test_other_arrays_go_vllms_way() -> None:
    message = outputs(False, COUNTS)  # the same rows, copied out of the step buffer
    undo: list[Any] = []
    install(swap, undo)
    try:
        ours = frames(serial_utils.MsgpackEncoder(), message)
    finally:
        undo_swap(undo)
    theirs = frames(serial_utils.MsgpackEncoder(), message)
    assert ours == theirs
    assert len(ours) == 1 + 4  # a frame for each array of 256 B or more: 700, 1, 1, 3 rows


def test_without_the_transport_vllms_encoder_is_back() -> None:
    names = ("_encode_ndarray", "enc_hook")
    vllm_functions = [vars(serial_utils.MsgpackEncoder)[name] for name in names]
    undo: list[Any] = []
    install(swap, undo)
    for name, function in zip(names, vllm_functions, strict=True):
        assert vars(serial_utils.MsgpackEncoder)[name] is not function
    undo_swap(undo)
    for name, function in zip(names, vllm_functions, strict=True):
        assert vars(serial_utils.MsgpackEncoder)[name] is function
    message = outputs(True, COUNTS)
    assert len(frames(serial_utils.MsgpackEncoder(), message)) == 1 + 4


@pytest.mark.parametrize("message", ["bytes", "bytearray", "zmq.Frame"])
def test_the_decoder_gives_vllms_arrays_without_a_tracked_base(message: str) -> None:
    """Inline arrays decoded with aostore's hook equal vLLM's (values, dtype, shape, the
    ``writeable`` flag of a view of a read-only or writable message), and none keeps a
    ``memoryview`` (which the collector tracks) alive as its base."""
    import gc

    import zmq

    frames = frames_of(outputs(True, COUNTS))
    wrap = {"bytes": bytes, "bytearray": bytearray, "zmq.Frame": zmq.Frame}[message]
    vllm_decoded = serial_utils.MsgpackDecoder(v1_engine.EngineCoreOutputs).decode(
        [wrap(f) for f in frames]
    )
    undo: list[Any] = []
    install(swap, undo)
    try:
        decoder = serial_utils.MsgpackDecoder(v1_engine.EngineCoreOutputs)
    finally:
        undo_swap(undo)
    ours = decoder.decode([wrap(f) for f in frames])
    for mine, theirs in zip(ours.outputs, vllm_decoded.outputs, strict=True):
        a, b = mine.routed_experts, theirs.routed_experts
        assert type(a) is type(b) is np.ndarray
        assert (a.dtype, a.shape, a.flags.writeable) == (b.dtype, b.shape, b.flags.writeable)
        assert np.array_equal(a, b)
        base = a
        while isinstance(base, np.ndarray):
            base = base.base
        assert not gc.is_tracked(base), type(base)


def frames_of(message: Any) -> list[bytes]:
    undo: list[Any] = []
    install(swap, undo)
    try:
        return frames(serial_utils.MsgpackEncoder(), message)
    finally:
        undo_swap(undo)
