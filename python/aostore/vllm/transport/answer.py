"""The API server's answer: the same bytes as vLLM's, cheaper.

A finished 16k-token sample's routed experts reach the client as base64 ``.npy`` in a JSON
body of about 8.5 MB. vLLM makes it with ``numpy2base64`` (``np.save`` into a ``BytesIO``, then
base64, then a decode to ``str``) and renders it with Starlette's ``JSONResponse.render``
(``json.dumps`` scanning the 8.5 MB string for characters to escape, then an encode to
UTF-8). Here:

- :func:`numpy2base64` writes the ``.npy`` header and the array's bytes once and encodes them
  straight to a ``str``: vLLM's string exactly, for every array (anything the fast path does not
  cover goes to vLLM's function). A finished request's rows already sit after their header in
  one buffer (:meth:`~aostore.vllm.transport.frontend.RowChunks.finished`), known by its type
  (:class:`aostore._npy.LaidOut`): that buffer is encoded as it is. An R3 reference is its
  header as ``np.save`` writes it, then its bytes (:mod:`aostore._npy` makes both). Rows that
  a finish over HTTP left for the answer (R3 by reference,
  :func:`~aostore.vllm.transport.delivery.answered`) are written into the arena here, when an
  answer carries them, and their reference is encoded;
- :func:`render_over`'s ``render`` is Starlette's for every answer but one that carries a long
  string this context's ``numpy2base64`` made (routed experts as rows: a request's handler
  makes and renders its answer in one task); only that answer is walked, and only where such
  a string can be (lists of numbers are passed over whole). It dumps the body with those
  strings set aside, then splices them in, in one allocation (``aostore._native.splice_json``):
  ``json.dumps(ensure_ascii=False)`` writes an ASCII string without ``"``, ``\\`` or control
  characters as itself in quotes (base64 is such a string), so the bytes are vLLM's; a body with
  any other long string is rendered by vLLM's code.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _npy as npy
from ..._native import splice_json
from ...r3 import format as r3_format
from . import delivery as r3_delivery

LONG = 64 * 1024
"""Strings from this many characters are set aside (shorter ones cost ``json.dumps`` little)."""

_MADE: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "aostore_long_strings_made", default=None
)
"""The ids of the long strings ``numpy2base64`` made in this context and no answer rendered
yet: a hint, not a promise (an id may be reused once its string is gone; the splice checks
every string it sets aside), kept to the last :data:`REMEMBERED`."""
REMEMBERED = 1024


def _made(text: str) -> None:
    if len(text) < LONG:
        return
    made = _MADE.get()
    if made is None:
        made = []
        _MADE.set(made)
    made.append(id(text))
    if len(made) > REMEMBERED:
        del made[: REMEMBERED // 2]


def numpy2base64_over(vllm_numpy2base64: Callable[[np.ndarray], str]) -> Callable[..., str]:
    """aostore's ``numpy2base64`` over vLLM's (its fallback)."""
    import pybase64  # type: ignore[import-not-found]  # vLLM's dependency

    encode = getattr(pybase64, "b64encode_as_string", None)

    def numpy2base64(array: np.ndarray) -> str:
        """Encode a NumPy array using its `.npy` representation."""
        text = encoded(array)
        _made(text)
        return text

    def encoded(array: np.ndarray) -> str:
        if type(array) is np.ndarray:
            # Rows a finish over HTTP left for the answer: delivered by reference now that an
            # answer carries them (the reference, or the rows when they do not fit).
            answer = r3_delivery.answered(array)
            if answer is not None:
                array = answer
        if encode is not None and type(array) is np.ndarray and r3_format.is_reference(array):
            text: str = encode(r3_format.npy_of(array))
            return text
        if (
            encode is None
            or type(array) is not np.ndarray
            or not array.flags.c_contiguous
            or not npy.plain(array.dtype)
        ):
            return vllm_numpy2base64(array)
        laid_out = npy.laid_out(array)
        if laid_out is not None:
            text = encode(laid_out)
            return text
        text = encode(npy.saved(array))
        return text

    numpy2base64.__wrapped__ = vllm_numpy2base64  # type: ignore[attr-defined]
    return numpy2base64


_MARKER = "\x00aostore-long-string-{}\x00"
"""What a long string is replaced by while the rest is dumped (``json.dumps`` escapes the NULs,
so the dumped marker is ``"\\u0000aostore-long-string-<i>\\u0000"``)."""


class _NotPlain(Exception):
    pass


_SCALARS = frozenset({int, float, bool, type(None)})


def _set_aside(value: Any, long: list[str], wanted: set[int]) -> Any:
    """``value`` with every string whose id is in ``wanted`` replaced by a marker and kept in
    ``long`` (ids found are taken out of ``wanted``: once it is empty nothing more is walked);
    raises :class:`_NotPlain` for one that is not ASCII. (Whether ``json.dumps`` writes each
    as itself in quotes is checked as it is spliced.)"""
    if not wanted:
        return value
    kind = type(value)
    if kind is str:
        if id(value) not in wanted or len(value) < LONG:
            return value
        if not value.isascii():  # O(1): CPython records it
            raise _NotPlain
        wanted.discard(id(value))
        long.append(value)
        return _MARKER.format(len(long) - 1)
    if kind is dict:
        return {key: _set_aside(item, long, wanted) for key, item in value.items()}
    if kind is list:
        if set(map(type, value)) <= _SCALARS:  # token ids, logprobs: no string (C speed)
            return value
        return [_set_aside(item, long, wanted) for item in value]
    return value


# Starlette's ``JSONResponse.render`` (1.x), written as Starlette writes it: what
# :func:`is_starlettes_render` compares a render with (no docstring: it would be a constant).
def _starlettes_render(self: Any, content: Any) -> bytes:
    return json.dumps(
        content,
        ensure_ascii=False,
        allow_nan=False,
        indent=None,
        separators=(",", ":"),
    ).encode("utf-8")


def is_starlettes_render(render: Any) -> bool:
    """Whether ``render`` is Starlette's own ``JSONResponse.render``: the same instructions,
    names, constants and argument names as :func:`_starlettes_render`, with the standard
    ``json`` as its module's ``json``. A Starlette that renders otherwise, or a render another
    plugin put in, is not (it is then called as it is)."""
    code = getattr(render, "__code__", None)
    mine = _starlettes_render.__code__
    return (
        code is not None
        and code.co_code == mine.co_code
        and code.co_names == mine.co_names
        and code.co_consts == mine.co_consts
        and code.co_varnames == mine.co_varnames
        and getattr(render, "__globals__", {}).get("json") is json
    )


def render_over(vllm_render: Callable[[Any, Any], bytes]) -> Callable[[Any, Any], bytes]:
    """aostore's ``JSONResponse.render`` over Starlette's (its fallback)."""
    dumps = json.dumps
    # An answer without routed experts pays one context-variable read over Starlette's render:
    # Starlette's body is written here, not called (a call costs 2% of a 3 µs answer). Any
    # other render is called.
    inline = is_starlettes_render(vllm_render)

    def render(self: Any, content: Any) -> bytes:
        made = _MADE.get()
        if not made:  # no routed experts made for this answer: Starlette's render, no walk
            if inline:
                return dumps(
                    content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
                ).encode("utf-8")
            return vllm_render(self, content)
        long: list[str] = []
        wanted = set(made)
        try:
            shallow = _set_aside(content, long, wanted)
        except _NotPlain:
            return vllm_render(self, content)
        if not long:
            return vllm_render(self, content)
        made[:] = [i for i in made if i in wanted]  # rendered: no longer looked for
        text = json.dumps(
            shallow, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
        )
        parts: list[str] = []
        rest = text
        for i, value in enumerate(long):
            dumped = json.dumps(_MARKER.format(i), ensure_ascii=False)
            before, found, after = rest.partition(dumped)
            # The marker's text may also be the content's own: then vLLM's render decides.
            if not found or dumped in after:
                return vllm_render(self, content)
            parts += [before, value]
            rest = after
        parts.append(rest)
        # json.dumps of a plain string is the string in quotes; any other: vLLM's render.
        body = splice_json(parts)
        return vllm_render(self, content) if body is None else body

    render.__wrapped__ = vllm_render  # type: ignore[attr-defined]
    render.__doc__ = "Starlette's JSON body, byte for byte; long base64 strings spliced in."
    return render
