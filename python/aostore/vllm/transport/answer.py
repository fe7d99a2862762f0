"""The API server's answer: the same bytes as vLLM's, cheaper.

A finished 16k-token sample's routed experts reach the client as base64 ``.npy`` in a JSON
body of about 8.5 MB. vLLM makes it with ``numpy2base64`` (``np.save`` into a ``BytesIO``, then
base64, then a decode to ``str``) and renders it with Starlette's ``JSONResponse.render``
(``json.dumps`` scanning the 8.5 MB string for characters to escape, then an encode to
UTF-8). Here:

- :func:`numpy2base64` writes the ``.npy`` header and the array's bytes once and encodes them
  straight to a ``str``: vLLM's string exactly, for every array (anything the fast path does not
  cover goes to vLLM's function);
- :func:`render_over`'s ``render`` dumps the body with each long string set aside, then splices
  the strings in: ``json.dumps(ensure_ascii=False)`` writes an ASCII string without ``"``,
  ``\\`` or control characters as itself in quotes (base64 is such a string), so the bytes are
  vLLM's; a body with any other long string is rendered by vLLM's code.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np

LONG = 64 * 1024
"""Strings from this many characters are set aside (shorter ones cost ``json.dumps`` little)."""


def numpy2base64_over(vllm_numpy2base64: Callable[[np.ndarray], str]) -> Callable[..., str]:
    """aostore's ``numpy2base64`` over vLLM's (its fallback)."""
    import pybase64  # type: ignore[import-not-found]  # vLLM's dependency

    encode = getattr(pybase64, "b64encode_as_string", None)

    def numpy2base64(array: np.ndarray) -> str:
        """Encode a NumPy array using its `.npy` representation."""
        if (
            encode is None
            or type(array) is not np.ndarray
            or not array.flags.c_contiguous
            or array.dtype.hasobject
            or array.dtype.names is not None
            or array.dtype.subdtype is not None
        ):
            return vllm_numpy2base64(array)
        header = io.BytesIO()
        # np.save's header for such an array: format 1.0 (what np.save picks when it fits).
        np.lib.format.write_array_header_1_0(
            header, np.lib.format.header_data_from_array_1_0(array)
        )
        data = b"".join((header.getbuffer(), array.reshape(-1).view(np.uint8).data))
        text: str = encode(data)
        return text

    numpy2base64.__wrapped__ = vllm_numpy2base64  # type: ignore[attr-defined]
    return numpy2base64


_MARKER = "\x00aostore-long-string-{}\x00"
"""What a long string is replaced by while the rest is dumped (``json.dumps`` escapes the NULs,
so the dumped marker is ``"\\u0000aostore-long-string-<i>\\u0000"``)."""


class _NotPlain(Exception):
    pass


def _set_aside(value: Any, long: list[bytes]) -> Any:
    """``value`` with every string of at least :data:`LONG` characters replaced by a marker and
    kept in ``long``, encoded; raises :class:`_NotPlain` for one that ``json.dumps`` would not
    write as itself in quotes."""
    if type(value) is str:
        if len(value) < LONG:
            return value
        if not value.isascii():  # O(1): CPython records it
            raise _NotPlain
        raw = value.encode("ascii")
        # json.dumps(ensure_ascii=False) escapes '"', '\\' and the controls below 0x20 only.
        if b'"' in raw or b"\\" in raw or int(np.frombuffer(raw, np.uint8).min()) < 0x20:
            raise _NotPlain
        long.append(raw)
        return _MARKER.format(len(long) - 1)
    if type(value) is dict:
        return {key: _set_aside(item, long) for key, item in value.items()}
    if type(value) is list:
        return [_set_aside(item, long) for item in value]
    return value


def render_over(vllm_render: Callable[[Any, Any], bytes]) -> Callable[[Any, Any], bytes]:
    """aostore's ``JSONResponse.render`` over Starlette's (its fallback)."""

    def render(self: Any, content: Any) -> bytes:
        long: list[bytes] = []
        try:
            shallow = _set_aside(content, long)
        except _NotPlain:
            return vllm_render(self, content)
        if not long:
            return vllm_render(self, content)
        text = json.dumps(
            shallow, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
        )
        parts: list[bytes] = []
        rest = text
        for i, value in enumerate(long):
            dumped = json.dumps(_MARKER.format(i), ensure_ascii=False)
            before, found, after = rest.partition(dumped)
            # The marker's text may also be the content's own: then vLLM's render decides.
            if not found or dumped in after:
                return vllm_render(self, content)
            # json.dumps of such a string is the string in quotes.
            parts += [before.encode("utf-8"), b'"', value, b'"']
            rest = after
        parts.append(rest.encode("utf-8"))
        return b"".join(parts)

    render.__wrapped__ = vllm_render  # type: ignore[attr-defined]
    render.__doc__ = "Starlette's JSON body, byte for byte; long base64 strings spliced in."
    return render
