"""The packed hop (``aostore.vllm.transport.wire``): an engine core whose frontend reads packed
frames sends a step's rows as one trailing frame; the frontend's decoder keeps it, and one
native call before vLLM's ``process_outputs`` loop writes each output's rows where that loop
would have appended them. What users see is vLLM's outputs (the frontend differential's packed
arm); here: the rule both ends compute, real ZMQ frames, and every frame or state that must
not give rows (another version, a corrupt frame, a late output, vLLM's own list)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

import zmq
from aostore._native import deliver_rows, end_delivery, pending_step_rows, rows_arrived
from aostore.vllm.transport import StepRows, wire
from aostore.vllm.transport.frontend import RowChunks, request_state_subclass
from vllm.v1 import engine as v1_engine
from vllm.v1 import serial_utils

SHAPE = (46, 8)


@dataclass
class _Output:
    token_start: int
    rows: np.ndarray


@dataclass
class State:
    """What ``deliver_rows`` reads of vLLM's ``RequestState``."""

    routed_experts_chunks: Any
    queue: Any = None


def packed_encode() -> Any:
    return wire.encode_into_method(
        vars(serial_utils.MsgpackEncoder)["encode_into"], v1_engine.EngineCoreOutputs
    )


def decoder() -> Any:
    decoder = serial_utils.MsgpackDecoder(v1_engine.EngineCoreOutputs)
    decoder.decode = wire.decode_method(serial_utils.MsgpackDecoder.decode).__get__(decoder)
    return decoder


@pytest.fixture
def sockets() -> Iterator[tuple[Any, Any]]:
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    push.bind("inproc://packed-hop")
    pull.connect("inproc://packed-hop")
    try:
        yield push, pull
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        assert pending_step_rows() == 0


def step(rows: dict[str, np.ndarray]) -> Any:
    """A step's ``EngineCoreOutputs`` with each request's rows a view of one step buffer, as
    aostore's scheduler connector hands them on."""
    packed = StepRows.pack({rid: _Output(0, r) for rid, r in rows.items()})
    made = [
        v1_engine.EngineCoreOutput(
            request_id=rid, new_token_ids=[1], routed_experts=packed[rid].rows
        )
        for rid in rows
    ]
    return v1_engine.EngineCoreOutputs(outputs=made)


def test_the_rule_holds_only_for_the_frontends_own_child() -> None:
    """An engine core packs only when its parent set the variable to this aostore's version
    and its own pid; a grandchild, another version or no variable: rows stay inline."""
    mine = wire.frontend_mark()
    assert mine == f"{wire.VERSION}:{os.getpid()}"
    assert not wire.packs_for_frontend({})
    assert not wire.packs_for_frontend({wire.FRONTEND_VARIABLE: mine})  # not its parent
    parent = f"{wire.VERSION}:{os.getppid()}"
    assert wire.packs_for_frontend({wire.FRONTEND_VARIABLE: parent})
    assert not wire.packs_for_frontend({wire.FRONTEND_VARIABLE: f"0.0.0:{os.getppid()}"})
    ask = "from aostore.vllm.transport import wire; print(wire.packs_for_frontend())"
    env = {**os.environ, wire.FRONTEND_VARIABLE: mine}
    child = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True)
    assert child.stdout.strip().splitlines()[-1] == "True", child.stderr
    nested = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {ask!r}])"
    grandchild = subprocess.run(
        [sys.executable, "-c", nested], env=env, capture_output=True, text=True
    )
    assert grandchild.stdout.strip().splitlines()[-1] == "False", grandchild.stderr


def test_rows_cross_real_frames_and_reach_the_pages(sockets: tuple[Any, Any]) -> None:
    """Over ZMQ with ``copy=False`` (vLLM's frontend receives so): the step's rows reach each
    request's pages as its chunk; the engine core's message keeps its rows after encoding;
    a request with rows of another shape keeps vLLM's wire for them."""
    push, pull = sockets
    rng = np.random.default_rng(0)
    rows = {f"r{i}": rng.integers(0, 128, (i + 1, *SHAPE), np.uint8) for i in range(5)}
    message = step(rows)
    odd = rng.integers(0, 128, (3, 4, 2), np.uint8)
    message.outputs.append(
        v1_engine.EngineCoreOutput(request_id="odd", new_token_ids=[1], routed_experts=odd)
    )
    frames = packed_encode()(serial_utils.MsgpackEncoder(), message, bytearray())
    assert wire.is_packed_rows(frames[-1])
    assert all(out.routed_experts is not None for out in message.outputs)  # put back
    push.send_multipart(frames, copy=False)
    decoded = decoder().decode(pull.recv_multipart(copy=False))
    assert [out.routed_experts is None for out in decoded.outputs] == [True] * 5 + [False]
    np.testing.assert_array_equal(decoded.outputs[-1].routed_experts, odd)
    states = {rid: State(RowChunks()) for rid in [*rows, "odd"]}
    assert pending_step_rows() == 5
    assert deliver_rows(decoded.outputs, states, RowChunks) == 5
    end_delivery()
    assert pending_step_rows() == 0
    for rid, want in rows.items():
        got = states[rid].routed_experts_chunks
        assert len(got) == 1 and got.paged
        np.testing.assert_array_equal(got.finished(), want)


def test_vllms_list_gets_what_vllms_decoder_gives(sockets: tuple[Any, Any]) -> None:
    """A request whose chunks are vLLM's list (its own ``RequestState``) gets an array per
    step, of the rows' dtype and shape and read-only, as an inline array of a received
    message decodes; an output of a request already gone is dropped, as vLLM ignores it."""
    push, pull = sockets
    rows = {
        "listed": np.arange(2 * 368, dtype=np.uint8).reshape(2, *SHAPE),
        "gone": np.ones((1, *SHAPE), np.uint8),
    }
    push.send_multipart(
        packed_encode()(serial_utils.MsgpackEncoder(), step(rows), bytearray()), copy=False
    )
    decoded = decoder().decode(pull.recv_multipart(copy=False))
    listed: list[Any] = []
    assert deliver_rows(decoded.outputs, {"listed": State(listed)}, RowChunks) == 1
    end_delivery()
    assert len(listed) == 1 and type(listed[0]) is np.ndarray
    assert listed[0].dtype == np.uint8 and not listed[0].flags.writeable
    np.testing.assert_array_equal(listed[0], rows["listed"])


class _VllmState:
    """What ``request_state_subclass`` builds on of vLLM's ``RequestState``."""

    def __init__(self) -> None:
        self.routed_experts_chunks: Any = []
        self.queue = None

    @classmethod
    def from_new_request(cls, *args: Any, **kwargs: Any) -> Any:
        return cls()

    def _new_completion_output(self, *args: Any, **kwargs: Any) -> Any:
        return None


def deliver(sockets: tuple[Any, Any], rows: dict[str, np.ndarray], states: dict[str, Any]) -> int:
    """One step's rows over real frames into ``states``, as ``process_outputs`` delivers them."""
    push, pull = sockets
    push.send_multipart(
        packed_encode()(serial_utils.MsgpackEncoder(), step(rows), bytearray()), copy=False
    )
    decoded = decoder().decode(pull.recv_multipart(copy=False))
    try:
        return int(deliver_rows(decoded.outputs, states, RowChunks))
    finally:
        end_delivery()


def test_rows_reach_whatever_chunks_the_state_holds_now(sockets: tuple[Any, Any]) -> None:
    """aostore's state binds its pages to itself, and the packed hop writes a bound state's rows
    without reading the state; so chunks put in their place (a list, another state's chunks),
    and chunks turned into a list, end the binding, and each step's rows reach what the state
    holds at that step, as in vLLM's loop."""
    state_class = request_state_subclass(_VllmState)
    a, b = state_class(), state_class()
    first = a.routed_experts_chunks
    assert type(first) is RowChunks and first._pages is not None and first._pages.bound
    rng = np.random.default_rng(1)
    sent = [rng.integers(0, 128, (i + 1, *SHAPE), np.uint8) for i in range(6)]

    assert deliver(sockets, {"a": sent[0], "b": sent[1]}, {"a": a, "b": b}) == 2
    listed: list[Any] = []
    a.routed_experts_chunks = listed  # the pages a held are no longer its chunks
    assert not first._pages.bound and b.routed_experts_chunks._pages.bound
    assert deliver(sockets, {"a": sent[2]}, {"a": a}) == 1
    assert len(first) == 1 and len(listed) == 1
    np.testing.assert_array_equal(first.finished(), sent[0])
    np.testing.assert_array_equal(listed[0], sent[2])

    shared = b.routed_experts_chunks
    a.routed_experts_chunks = shared  # one RowChunks held by two states: bound to the last
    assert deliver(sockets, {"a": sent[3], "b": sent[4]}, {"a": a, "b": b}) == 2
    np.testing.assert_array_equal(shared.finished(), np.concatenate([sent[1], sent[3], sent[4]]))

    shared.append(np.zeros((1, 2), np.int64))  # rows the pages cannot hold: a plain list now
    assert not shared.paged
    assert deliver(sockets, {"b": sent[5]}, {"b": b}) == 1
    assert len(shared) == 5
    np.testing.assert_array_equal(shared[-1], sent[5])
    np.testing.assert_array_equal(
        np.concatenate([shared[0], shared[1], shared[2]]),
        np.concatenate([sent[1], sent[3], sent[4]]),
    )
    assert listed == [listed[0]]  # a's old list got nothing more


def test_a_bound_state_gone_from_request_states_gets_no_rows(sockets: tuple[Any, Any]) -> None:
    """A finished or aborted request's state may live on (bound to its pages) after vLLM took
    it out of ``request_states``: a late output for it is dropped, as vLLM ignores it."""
    state_class = request_state_subclass(_VllmState)
    done = state_class()
    assert deliver(sockets, {"done": np.ones((2, *SHAPE), np.uint8)}, {}) == 0
    assert len(done.routed_experts_chunks) == 0 and done.routed_experts_chunks._pages.bound


def frame_for(rows: dict[str, np.ndarray]) -> tuple[Any, bytes]:
    message = step(rows)
    frames = packed_encode()(serial_utils.MsgpackEncoder(), message, bytearray())
    return message, bytes(frames[-1])


def test_another_format_or_version_is_refused_and_keeps_nothing() -> None:
    message, frame = frame_for({"a": np.zeros((2, *SHAPE), np.uint8)})
    with pytest.raises(RuntimeError, match=r"runs aostore 9\.9\.9.*the same aostore"):
        rows_arrived(message.outputs, frame, "9.9.9")
    other = bytearray(frame)
    other[16:20] = (2).to_bytes(4, "little")
    with pytest.raises(RuntimeError, match="of format 1, got format 2"):
        rows_arrived(message.outputs, bytes(other), wire.VERSION)
    assert pending_step_rows() == 0


@pytest.mark.parametrize("cut", ["short", "long", "outputs", "header"])
def test_a_frame_that_does_not_fit_its_message_is_refused(cut: str) -> None:
    message, frame = frame_for(
        {"a": np.zeros((2, *SHAPE), np.uint8), "b": np.ones((1, *SHAPE), np.uint8)}
    )
    outputs = message.outputs
    if cut == "short":
        frame = frame[:-1]
    elif cut == "long":
        frame += b"\0"
    elif cut == "outputs":
        outputs = outputs[:1]  # the index names output 1
    else:
        frame = frame[:24]
    with pytest.raises(ValueError, match="corrupt packed frame"):
        rows_arrived(outputs, frame, wire.VERSION)
    assert pending_step_rows() == 0


def test_a_message_without_step_rows_goes_as_vllm_sends_it() -> None:
    """Rows that are no step buffer's (vLLM's own arrays) and outputs without rows: no
    packed frame, vLLM's frames exactly."""
    plain = v1_engine.EngineCoreOutputs(
        outputs=[
            v1_engine.EngineCoreOutput(
                request_id="a", new_token_ids=[1], routed_experts=np.ones((4, *SHAPE), np.uint8)
            ),
            v1_engine.EngineCoreOutput(request_id="b", new_token_ids=[1]),
        ]
    )
    ours = packed_encode()(serial_utils.MsgpackEncoder(), plain, bytearray())
    theirs = serial_utils.MsgpackEncoder().encode_into(plain, bytearray())
    assert [bytes(f) for f in ours] == [bytes(f) for f in theirs]


def spans_and_views(rows: dict[str, np.ndarray]) -> tuple[Any, Any]:
    """One step's outputs twice: with the rows as the scheduler connector's ``take_output``
    gives them where the engine core packs (``StepRowsSpan``s), and as numpy views (elsewhere)."""
    from types import SimpleNamespace

    from aostore._native import TakeOutput

    class Connector:
        def take_output(self, request: Any, output: Any) -> Any:  # vLLM's, never called here
            raise AssertionError("a packed step is read natively")

    step_rows = StepRows.pack({rid: _Output(0, r) for rid, r in rows.items()})
    messages = []
    for spans in (True, False):
        take = TakeOutput(Connector(), Connector, Connector.take_output, StepRows, spans)
        made = []
        for rid, want in rows.items():
            request = SimpleNamespace(
                request_id=rid, num_tokens=len(want) + 1, is_finished=lambda: False
            )
            made.append(
                v1_engine.EngineCoreOutput(
                    request_id=rid, new_token_ids=[1], routed_experts=take(request, step_rows)
                )
            )
        messages.append(v1_engine.EngineCoreOutputs(outputs=made))
    messages[1].timestamp = messages[0].timestamp  # the messages differ in their rows' form only
    return messages[0], messages[1]


def test_spans_pack_to_the_frame_views_do() -> None:
    """Where the engine core packs, ``take_output`` gives spans of the step buffer (no numpy
    view a request): they pack to the very frame the views pack to, vLLM's frames included,
    and each output has its span back after encoding; the view a span stands for is the one
    ``take_output`` gives elsewhere."""
    from aostore._native import StepRowsSpan

    rng = np.random.default_rng(3)
    rows = {f"r{i}": rng.integers(0, 128, (i + 1, *SHAPE), np.uint8) for i in range(6)}
    spans, views = spans_and_views(rows)
    assert all(type(out.routed_experts) is StepRowsSpan for out in spans.outputs)
    assert all(type(out.routed_experts) is np.ndarray for out in views.outputs)
    for span, view in zip(spans.outputs, views.outputs, strict=True):
        assert len(span.routed_experts) == len(view.routed_experts)
        np.testing.assert_array_equal(span.routed_experts.array(), view.routed_experts)
        assert wire.is_step_rows(span.routed_experts.array())
    encode = packed_encode()
    from_spans = encode(serial_utils.MsgpackEncoder(), spans, bytearray())
    from_views = encode(serial_utils.MsgpackEncoder(), views, bytearray())
    assert [bytes(f) for f in from_spans] == [bytes(f) for f in from_views]
    assert all(type(out.routed_experts) is StepRowsSpan for out in spans.outputs)


def test_spans_sent_by_vllms_encode_go_inline_as_arrays() -> None:
    """vLLM sends a few messages with ``encode`` rather than its output thread's
    ``encode_into``: there a span becomes the view it stands for, and the message is what
    vLLM's encoder makes of the views."""
    rng = np.random.default_rng(4)
    rows = {f"r{i}": rng.integers(0, 128, (2, *SHAPE), np.uint8) for i in range(3)}
    spans, views = spans_and_views(rows)
    encode = wire.encode_method(
        vars(serial_utils.MsgpackEncoder)["encode"], v1_engine.EngineCoreOutputs
    )
    ours = encode(serial_utils.MsgpackEncoder(), spans)
    theirs = serial_utils.MsgpackEncoder().encode(views)
    assert [bytes(f) for f in ours] == [bytes(f) for f in theirs]
    assert all(type(out.routed_experts) is np.ndarray for out in spans.outputs)
