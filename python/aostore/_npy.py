"""The ``.npy`` bytes of routed experts, as rows and as R3 references, made in one place.

vLLM's API server sends an array as the base64 of what ``np.save`` writes: a header (format
1.0, which ``np.save`` picks whenever the header fits, as a dtype and a shape of a few dozen
characters always do), then the array's bytes in C order. aostore makes those bytes itself, so
they must be ``np.save``'s exactly, for rows and for references alike:

- the frontend's finish lays a request's rows out after their header in one buffer
  (:func:`lay_out`), and the answer encodes that buffer as it lies (:func:`laid_out`), so the
  rows are not copied a second time;
- any other array, and an R3 reference, is written as its header and its bytes in one copy
  (:func:`saved`);
- the R3 reader matches a reference's header (:func:`header`) to read it without ``np.load``.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ._native import unwritten_bytearray


def header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    """The header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape``: format
    1.0, what it picks when the header fits."""
    written = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        written,
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape},
    )
    return written.getvalue()


def plain(dtype: np.dtype[Any]) -> bool:
    """Whether rows of ``dtype`` are what aostore writes as ``.npy`` itself: neither objects,
    fields nor a subarray (anything else goes to vLLM's ``numpy2base64``)."""
    return not dtype.hasobject and dtype.names is None and dtype.subdtype is None


def saved(array: np.ndarray, head: bytes | None = None) -> bytes:
    """What ``np.save`` writes for ``array`` (C-contiguous): ``head`` (its :func:`header`
    unless given: a caller that writes many arrays of one dtype and shape keeps it), then the
    array's bytes, copied once."""
    if head is None:
        head = header(array.dtype, array.shape)
    return b"".join((head, array.reshape(-1).view(np.uint8).data))


class LaidOut(np.ndarray):
    """A ``uint8`` buffer that holds an array's ``.npy`` form: its header, then its bytes, which
    are that array's own memory. No behaviour: a marker the answer knows by its type (as the
    wire knows a step's rows by ``StepArray``); the array handed out is a plain ``ndarray``
    view of it, as vLLM's own would be."""


def lay_out(dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    """An array of a :func:`plain` ``dtype`` and ``shape``, its bytes not yet written, that
    follows its ``.npy`` header in one :class:`LaidOut` buffer."""
    head = header(dtype, shape)
    size = len(head) + dtype.itemsize * math.prod(shape)
    # Memory left unwritten and committed at once (not numpy's own: see unwritten_bytearray);
    # the buffer is a LaidOut over it, so no plain array stands between it and its views.
    buffer = np.ndarray.__new__(LaidOut, (size,), np.uint8, buffer=unwritten_bytearray(size))
    flat = buffer.view(np.ndarray)
    flat[: len(head)] = np.frombuffer(head, np.uint8)
    rows: np.ndarray = flat[len(head) :].view(dtype)
    return rows.reshape(shape)


def laid_out(array: np.ndarray) -> LaidOut | None:
    """The :class:`LaidOut` buffer that holds exactly ``array``'s ``.npy`` form (a C-contiguous
    array from :func:`lay_out`, whole, its header unchanged), or None: a slice, a reshape or a
    view under another dtype has a header or a size of its own."""
    owner = array.base
    while type(owner) is np.ndarray:
        owner = owner.base
    if type(owner) is not LaidOut:
        return None
    head = header(array.dtype, array.shape)
    if owner.nbytes != len(head) + array.nbytes or owner[: len(head)].tobytes() != head:
        return None
    return owner
