"""The API server's answer with aostore's transport: vLLM's bytes.

``numpy2base64`` gives vLLM's string for any array (dtypes, byte orders, shapes, empty and 0-d,
Fortran order, strided views, subclasses); Starlette's ``JSONResponse.render`` with aostore's
splice gives Starlette's bytes for the bodies the three endpoints send (a routed-experts
string of any length, ``n`` > 1, streaming's final chunk) and for bodies it must leave alone
(long text, non-ASCII, a string that looks like aostore's marker); the plugin's install puts
both in and its undo takes them out. Skips where vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

import starlette.responses
from aostore.vllm.install import swap, undo_swap
from aostore.vllm.transport import install
from aostore.vllm.transport.answer import LONG, numpy2base64_over, render_over
from vllm.utils import serial_utils as vllm_utils

VLLM_NUMPY2BASE64 = vllm_utils.numpy2base64
VLLM_RENDER = vars(starlette.responses.JSONResponse)["render"]
ours = numpy2base64_over(VLLM_NUMPY2BASE64)
render = render_over(VLLM_RENDER)

DTYPES = st.sampled_from(
    ["|u1", "<i2", ">i2", "<i4", ">i4", "<f4", ">f8", "|b1", "<c8", "<u8", "<f2", "<M8[s]"]
)


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)))
def test_numpy2base64_is_vllms_for_any_array(array: np.ndarray) -> None:
    assert ours(array) == VLLM_NUMPY2BASE64(array)
    if array.ndim >= 2:
        assert ours(np.asfortranarray(array)) == VLLM_NUMPY2BASE64(np.asfortranarray(array))
        strided = array[::2]
        assert ours(strided) == VLLM_NUMPY2BASE64(strided)


def test_numpy2base64_of_routed_experts_and_odd_arrays() -> None:
    rows = np.random.default_rng(0).integers(0, 128, (17_083, 46, 8), np.uint8)
    assert ours(rows) == VLLM_NUMPY2BASE64(rows)
    for odd in (
        rows[:5].view(type("Sub", (np.ndarray,), {})),  # a subclass: vLLM's path
        np.zeros(3, dtype=[("a", "<i4"), ("b", "|u1")]),  # structured: vLLM's path
        np.zeros((2, 2), dtype="(3,)<i4"),
    ):
        assert ours(odd) == VLLM_NUMPY2BASE64(odd)
    with pytest.raises(ValueError):
        ours(np.array([object()]))  # as vLLM's: allow_pickle=False
    with pytest.raises(ValueError):
        VLLM_NUMPY2BASE64(np.array([object()]))


def test_numpy2base64_of_an_r3_reference_is_vllms() -> None:
    """A reference is encoded from its header as this numpy's ``np.save`` writes it: the same
    string as vLLM's, for any slot, generation, dtype and shape it names."""
    from aostore.r3 import format as fmt

    arena = bytes(range(16))
    for slot, generation, dtype, shape, start in [
        (0, 1, np.dtype(np.uint8), (17_083, 46, 8), 0),
        (65_535, 2**63, np.dtype(">u2"), (3,), 12),
        (7, 9, np.dtype("<i8"), (1, 2, 3, 4, 5, 6, 7, 8), 0),
    ]:
        reference = fmt.make_reference(arena, slot, generation, dtype, shape, start)
        assert ours(reference) == VLLM_NUMPY2BASE64(reference)
    swapped = reference.astype(reference.dtype.newbyteorder(">"))  # not ours: vLLM's path
    assert ours(swapped) == VLLM_NUMPY2BASE64(swapped)


def test_numpy2base64_of_rows_laid_out_after_their_header_is_vllms() -> None:
    """A finished request's rows sit after their ``.npy`` header in one buffer: encoded as it
    is; any array whose memory is not exactly that (changed in place, a slice, another header,
    a buffer without one) is still vLLM's string."""
    from aostore.vllm.transport import RowChunks

    want = np.random.default_rng(1).integers(0, 128, (3_000, 46, 8), np.uint8)
    chunks = RowChunks()
    chunks.append(want[:700])
    for i in range(700, len(want)):
        chunks.append(want[i : i + 1])
    finished = chunks.finished()
    assert finished is not None
    assert ours(finished) == VLLM_NUMPY2BASE64(want)
    finished[5, 5, 5] = 200  # the caller's writes are the rows encoded
    assert ours(finished) == VLLM_NUMPY2BASE64(finished)
    odd = [finished[1:], finished[:-1], finished[0], finished.reshape(-1), finished.view(np.int8)]
    reshaped = finished.view()
    reshaped.shape = (1_500, 92, 8)
    odd.append(reshaped)
    odd.append(np.frombuffer(bytearray(want.tobytes()), np.uint8).reshape(want.shape))
    odd.append(np.concatenate([want]))  # no header before it
    for array in odd:
        assert ours(array) == VLLM_NUMPY2BASE64(array)
    buffer = finished.base  # up to the LaidOut buffer that holds the header and the rows
    while isinstance(buffer.base, np.ndarray):  # type: ignore[union-attr]
        buffer = buffer.base  # type: ignore[union-attr]
    buffer[10] ^= 1  # type: ignore[index]  # its header no longer the array's: vLLM's string all the same
    assert ours(finished) == VLLM_NUMPY2BASE64(finished)


def body(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": list(choices),
        "usage": {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4},
        **extra,
    }


def choice(index: int, routed: str | None, text: str = "ok") -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": "length", "routed_experts": routed}


def rendered(content: Any) -> tuple[bytes, bytes]:
    response = object.__new__(starlette.responses.JSONResponse)
    return render(response, content), VLLM_RENDER(response, content)


@pytest.mark.parametrize("rows", [0, 1, 200, 5_000, 17_083])
def test_the_body_is_starlettes_for_routed_experts_of_any_length(rows: int) -> None:
    routed = ours(np.full((rows, 46, 8), 7, np.uint8))  # made here: the answer is spliced
    mine, theirs = rendered(body(choice(0, routed), choice(1, None)))
    assert mine == theirs
    json.loads(mine)


def test_the_body_is_starlettes_for_several_long_strings_and_odd_content() -> None:
    rows = [ours(np.full((3_000 + i, 46, 8), i, np.uint8)) for i in range(3)]
    marker = json.loads(json.dumps("\x00aostore-long-string-0\x00"))
    cases = [
        body(*(choice(i, r) for i, r in enumerate(rows))),  # n > 1
        body(choice(0, rows[0], text="é" * 10 + '"quoted"\n')),  # escapes around it
        body(choice(0, rows[0], text="x" * (LONG + 5))),  # long plain text: spliced too
        body(choice(0, rows[0], text="x" * LONG + '"')),  # a quote to escape: vLLM's
        body(choice(0, rows[0], text="x" * LONG + "\\")),  # a backslash: vLLM's
        body(choice(0, rows[0], text="x" * LONG + "\n\x01")),  # controls: vLLM's
        body(choice(0, rows[0], text="x" * LONG + "\x7f ~")),  # DEL is not escaped
        body(choice(0, rows[0], text='"' + "x" * LONG)),  # escapes in any 64 KiB block
        body(choice(0, rows[0], text="x" * (LONG + 70_000) + "\t" + "x" * 100)),
        body(choice(0, rows[0][:-9] + "\x1f" + rows[0][-8:])),
        body(choice(0, rows[0], text="€" * LONG)),  # long and not ASCII: vLLM's
        body(choice(0, rows[0], text=marker)),  # aostore's marker in the content: vLLM's
        body(choice(0, rows[0]), extra={"nested": [[rows[1]], {"k": rows[2]}], "n": 1.5}),
        [rows[0], 3, None, True],
        rows[0],
        {"no": "long strings"},
    ]
    from aostore.vllm.transport import answer

    for content in cases:
        for made in rows:  # each case is an answer of its own: its rows made for it
            answer._made(made)
        mine, theirs = rendered(content)
        assert mine == theirs, str(content)[:80]


def test_an_answer_without_routed_experts_made_for_it_is_starlettes_render_unwalked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 46: every JSON answer paid for a walk of its body (2.6-2.8 ms for 17,084 token ids
    against Starlette's 0.95). An answer for which this context made no routed experts goes
    straight to Starlette's render; one that carries them is walked, its lists of numbers
    passed over whole, and the rows spliced in."""
    import contextvars

    from aostore.vllm.transport import answer

    tokens = {"choices": [{"index": 0, "token_ids": list(range(16_384)), "text": "x" * LONG}]}

    def fresh() -> None:  # a new request's task: nothing made in it yet
        walked: list[int] = []
        real = answer._set_aside
        monkeypatch.setattr(
            answer,
            "_set_aside",
            lambda *a: walked.append(1) or real(*a),  # type: ignore[func-returns-value]
        )
        mine, theirs = rendered(tokens)
        assert mine == theirs and walked == []
        routed = ours(np.full((2_000, 46, 8), 3, np.uint8))
        spliced: list[int] = []
        splice = answer.splice_json
        monkeypatch.setattr(answer, "splice_json", lambda p: spliced.append(1) or splice(p))
        with_rows = {"choices": [{**tokens["choices"][0], "routed_experts": routed}]}
        mine, theirs = rendered(with_rows)
        assert mine == theirs and spliced == [1]
        monkeypatch.setattr(answer, "_set_aside", real)
        monkeypatch.setattr(answer, "splice_json", splice)

    contextvars.Context().run(fresh)


def test_starlettes_render_is_written_in_and_any_other_render_is_called() -> None:
    """An answer without routed experts costs Starlette's render and one context-variable read:
    Starlette's body is written in, not called, where the render wrapped is Starlette's own
    (this vLLM's Starlette: recognized); a render of anyone else's (another plugin's, a
    Starlette that renders otherwise) is called, and its bytes are the answer's."""
    import contextvars
    import types

    from aostore.vllm.transport.answer import is_starlettes_render

    assert is_starlettes_render(VLLM_RENDER)
    content = {"choices": [{"index": 0, "token_ids": [1, 2, 3], "text": "é\u2028"}], "x": None}

    def indented(self: Any, content: Any) -> bytes:
        return json.dumps(content, indent=2).encode()

    # Starlette's code over another module's json: not Starlette's render.
    other_json = types.FunctionType(VLLM_RENDER.__code__, {"json": types.SimpleNamespace()})
    assert not is_starlettes_render(other_json)
    assert not is_starlettes_render(indented)
    assert not is_starlettes_render(len)
    response = object.__new__(starlette.responses.JSONResponse)

    def fresh() -> None:
        assert render(response, content) == VLLM_RENDER(response, content)
        assert render_over(indented)(response, content) == indented(response, content)
        with pytest.raises(ValueError):  # Starlette's allow_nan=False, inline too
            render(response, {"x": float("nan")})

    contextvars.Context().run(fresh)


def test_a_body_vllm_cannot_render_fails_the_same_way() -> None:
    routed = VLLM_NUMPY2BASE64(np.zeros((2_000, 46, 8), np.uint8))
    for bad in (body(choice(0, routed), x=float("nan")), body(choice(0, routed), x=object())):
        with pytest.raises(Exception) as mine:
            rendered(bad)
        with pytest.raises(Exception) as theirs:
            VLLM_RENDER(object.__new__(starlette.responses.JSONResponse), bad)
        assert type(mine.value) is type(theirs.value)


def test_install_puts_both_in_and_undo_takes_them_out() -> None:
    import vllm.entrypoints.openai.completion.serving as completion

    assert "starlette.responses" in sys.modules
    undo: list[Any] = []
    install(swap, undo)
    try:
        assert vllm_utils.numpy2base64 is not VLLM_NUMPY2BASE64
        assert completion.numpy2base64 is vllm_utils.numpy2base64
        assert vars(starlette.responses.JSONResponse)["render"] is not VLLM_RENDER
        routed = VLLM_NUMPY2BASE64(np.ones((300, 46, 8), np.uint8))
        content = body(choice(0, completion.numpy2base64(np.ones((300, 46, 8), np.uint8))))
        assert content["choices"][0]["routed_experts"] == routed
        assert starlette.responses.JSONResponse(content).body == VLLM_RENDER(None, content)
    finally:
        undo_swap(undo)
    assert vllm_utils.numpy2base64 is VLLM_NUMPY2BASE64
    assert completion.numpy2base64 is VLLM_NUMPY2BASE64
    assert vars(starlette.responses.JSONResponse)["render"] is VLLM_RENDER
