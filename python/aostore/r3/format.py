"""What the frontend that writes R3 rows and the trainer that reads them both read: the arena's
file layout and the reference, with their versions. Public: a reader of another release reads
these to tell what it was handed.

The arena is one file in ``/dev/shm`` per frontend process, readable by its user only, visible
under its name only once complete (made unnamed with ``O_TMPFILE``, then linked):

- a header page: magic, format version, arena id, boot id, the offsets and sizes of what
  follows, and the read log's tail;
- the slot table: one 64-byte record a slot (generation, first page, bytes, the deadline of an
  unread reference, whether it was read, how many page runs);
- the read log: the (slot, generation) of each slot a reader read first, for the frontend to
  learn which rows may go without looking at every slot;
- the run table: for each data page that starts a run of a slot's pages, the run's length and
  the next run's first page (a slot's rows need not be contiguous: any free pages are room);
- the data: the budget, reserved at start.

The locks on the file and the node's identity are :mod:`.leases`'s; the errors are
:mod:`.errors`'s.

Versions. A reference says what it is (its ``aostore_r3`` field is :data:`KIND`) and its
format (``version``) before anything else, so a reader can tell a reference of a later aostore
from something else. A reader reads every reference format version up to its own
(:data:`REFERENCE_VERSION`). A reference of a newer version is refused
(:class:`~.errors.ForeignReference`) with a message naming both versions, the reference's and
the one this aostore reads, and saying to upgrade aostore on the reader's side: :func:`parse`
tells a reference by its version before it looks at its fields, which a newer version may
have changed. A change to :data:`REFERENCE`'s fields is a new version. The arena's file
(:data:`ARENA_VERSION`) is read at its own version only: the frontend and its readers run on
one node, and a reader refuses an arena of another format naming both.
"""

from __future__ import annotations

import base64
import io
import os
import time
from typing import Any

import numpy as np

from .. import _npy as npy
from . import leases
from .errors import ForeignReference

MAGIC = b"AOSTR3\x00\x01"
ARENA_VERSION = 2
"""The arena file's format (1: the pid-checked arena of aostore 0.1.0's first R3 release)."""
REFERENCE_VERSION = 1
"""The reference's format: this aostore reads references of this version and older."""
PAGE = 4096
DIRECTORY = "/dev/shm"
PREFIX = "aostore-r3-"
LOG_TAIL = 2048
"""The read log's tail (entries ever appended), a ``<u8`` in the header page."""
NO_RUN = 0xFFFFFFFF

HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("slot_size", "<u4"),
        ("arena", "u1", (16,)),
        ("boot", "u1", (16,)),
        ("slots", "<u8"),
        ("slots_offset", "<u8"),
        ("log_offset", "<u8"),
        ("log_capacity", "<u8"),
        ("runs_offset", "<u8"),
        ("data_offset", "<u8"),
        ("data_size", "<u8"),
    ]
)
SLOT = np.dtype(
    [
        ("generation", "<u8"),  # 0: holds no rows; each write gets the arena's next
        ("page", "<u8"),  # the first page of the rows' first run
        ("nbytes", "<u8"),
        ("deadline", "<f8"),  # CLOCK_BOOTTIME seconds: an unread reference's rows last till then
        ("read", "<u8"),  # set by the first reader: from then on the rows may be evicted
        ("runs", "<u8"),  # how many page runs hold the rows
        ("spare", "<u8", (2,)),
    ]
)
assert SLOT.itemsize == 64
LOG_ENTRY = np.dtype([("slot", "<u8"), ("generation", "<u8")])
RUN = np.dtype([("pages", "<u4"), ("next", "<u4")])

MAX_DIMS = 8
REFERENCE = np.dtype(
    [
        ("aostore_r3", "S16"),  # what it is, for a client that prints it
        ("version", "<u2"),
        ("boot", "u1", (16,)),
        ("arena", "u1", (16,)),
        ("slot", "<u8"),
        ("generation", "<u8"),
        ("dtype", "S16"),
        ("ndim", "<u1"),
        ("shape", "<i8", (MAX_DIMS,)),
        ("token_start", "<i8"),
    ]
)
"""A reference: a 0-d array of this structured dtype (vLLM's recipe ``np.load`` decodes it, and
no use as rows works: a structure of several fields casts to no number, and a 0-d array has no
rows to index)."""
KIND = b"reference"


def now() -> float:
    """The arena's clock: CLOCK_BOOTTIME, one for every process of the node and never stepped
    (a wall-clock step would expire every unread reference at once)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def ident(field: Any) -> bytes:
    """An id field's 16 bytes (kept as ``u1`` so no trailing zero byte is dropped)."""
    return np.asarray(field, np.uint8).tobytes()


def as_field(ident: bytes) -> np.ndarray:
    return np.frombuffer(ident, np.uint8)


def path(arena: bytes) -> str:
    """The arena's file: by its id, so a reference names it."""
    return os.path.join(DIRECTORY, f"{PREFIX}{arena.hex()}")


ROW_KINDS = "biuf"
"""The dtype kinds of rows a reference names: bool, signed, unsigned, float (vLLM's routed
experts are integers; readers refuse anything else as rows too)."""


def rows_refused(dtype: Any, shape: tuple[int, ...]) -> TypeError | ValueError | None:
    """Why rows of ``dtype`` and ``shape`` cannot go by reference, as the error to raise, or
    ``None``: the one rule the arena, the finish and the answer apply (rows it refuses go as
    rows, as vLLM sends them). Numeric rows (:data:`ROW_KINDS`) of 1 to :data:`MAX_DIMS`
    dimensions."""
    dtype = np.dtype(dtype)
    if dtype.names is not None or dtype.kind not in ROW_KINDS or not shape:
        return TypeError(f"rows are a numeric array, not {dtype} {shape}")
    if len(shape) > MAX_DIMS:
        return ValueError(f"rows of {len(shape)} dimensions: a reference holds at most {MAX_DIMS}")
    return None


def make_reference(
    arena: bytes,
    slot: int,
    generation: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    token_start: int,
) -> np.ndarray:
    """The reference to rows of ``dtype`` and ``shape`` written to ``slot`` under
    ``generation``."""
    refused = rows_refused(dtype, shape)
    if refused is not None:
        raise refused
    reference = np.zeros((), REFERENCE)
    reference["aostore_r3"] = KIND
    reference["version"] = REFERENCE_VERSION
    reference["boot"] = as_field(leases.boot_id())
    reference["arena"] = as_field(arena)
    reference["slot"] = slot
    reference["generation"] = generation
    reference["dtype"] = dtype.str.encode()
    reference["ndim"] = len(shape)
    reference["shape"][: len(shape)] = shape
    reference["token_start"] = token_start
    return reference


_known: dict[str, bytes] = {}
"""What is made once a process (not ``functools.cache``: stubtest cannot see through it)."""


def _npy_header() -> bytes:
    """The ``.npy`` header of a reference as ``np.save`` (vLLM's ``numpy2base64``) writes it,
    made once."""
    if "npy" not in _known:
        _known["npy"] = npy.header(REFERENCE, ())
    return _known["npy"]


def is_reference(array: np.ndarray) -> bool:
    """Whether ``array`` is a reference as :func:`make_reference` makes one."""
    return array.shape == () and array.dtype == REFERENCE


def npy_of(reference: np.ndarray) -> bytes:
    """What ``np.save`` writes for a reference (a 0-d array of :data:`REFERENCE`), without its
    header's formatting each time."""
    return npy.saved(reference, _npy_header())


def parse(value: Any) -> np.ndarray:
    """A reference as its 0-d array of :data:`REFERENCE`, or rows as vLLM sends them (a numeric
    array), from the array or vLLM's base64 ``.npy`` string. Raises :class:`ForeignReference`
    or ``TypeError`` for anything else. A structure that says it is an aostore reference is
    told by its version first (the module's version policy)."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
            header = _npy_header()
            if len(raw) == len(header) + REFERENCE.itemsize and raw.startswith(header):
                # A reference as this numpy writes one: no header to parse (np.load's
                # literal_eval costs 20x the rest of a fetch of one reference).
                value = np.frombuffer(raw, REFERENCE, 1, len(header)).reshape(())
            else:
                value = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as error:
            # binascii.Error, ValueError, EOFError from the bytes; np.load parses the header
            # with ast.literal_eval, so a corrupted one raises SyntaxError or
            # tokenize.TokenError (an Exception of its own).
            raise ForeignReference(
                f"not routed experts: neither rows nor an aostore reference ({error})"
            ) from None
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"a reference is a str (the HTTP field) or a numpy array, not {type(value).__name__}"
        )
    if value.dtype.names is None:
        if value.dtype.kind not in "biuf" or value.ndim == 0:
            raise ForeignReference(f"not routed experts: an array of {value.dtype} {value.shape}")
        return value  # rows, as vLLM sends them
    if value.shape != ():
        raise ForeignReference(f"not an aostore reference: a {value.dtype} array {value.shape}")
    told = _told_version(value)
    if told is not None:
        _check_version(told)
    if value.dtype.names != REFERENCE.names:
        raise ForeignReference(f"not an aostore reference: a {value.dtype} array {value.shape}")
    reference = value.astype(REFERENCE)  # a byte order of its own: ours
    if reference["aostore_r3"].item() != KIND:
        raise ForeignReference("not an aostore reference: its kind field is not 'reference'")
    _check_version(int(reference["version"]))  # told above unless its fields' types differ
    if not 0 < int(reference["ndim"]) <= MAX_DIMS:
        raise ForeignReference(f"a malformed aostore reference: {int(reference['ndim'])} dims")
    return reference


def _told_version(value: np.ndarray) -> int | None:
    """The version of a structured 0-d array that says it is an aostore reference (a bytes
    field ``aostore_r3`` holding :data:`KIND`, an integer field ``version``), whatever its
    other fields; None for any other."""
    names = value.dtype.names or ()
    if "aostore_r3" not in names or "version" not in names:
        return None
    if value.dtype["aostore_r3"].kind != "S" or value.dtype["version"].kind not in "iu":
        return None  # subarrays (kind "V") included: not how a reference says what it is
    if value["aostore_r3"].item() != KIND:
        return None
    return int(value["version"])


def _check_version(version: int) -> None:
    """Refuse a reference of a version this aostore does not read (the version policy)."""
    if version > REFERENCE_VERSION:
        raise ForeignReference(
            f"an aostore reference of format {version}; this aostore reads format "
            f"{REFERENCE_VERSION} and older (upgrade aostore on the reader's side)"
        )
    if version <= 0:
        raise ForeignReference(f"a malformed aostore reference: its format version {version}")


def rows_of(reference: np.ndarray) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape of a reference's rows."""
    try:
        dtype = np.dtype(reference["dtype"].item().decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise ForeignReference("a malformed aostore reference: its dtype") from None
    shape = tuple(int(n) for n in reference["shape"][: int(reference["ndim"])])
    if rows_refused(dtype, shape) is not None or any(n < 0 for n in shape):
        raise ForeignReference("a malformed aostore reference: its dtype or shape")
    return dtype, shape
