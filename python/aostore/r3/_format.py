"""What the frontend that writes R3 rows and the trainer that reads them share: the arena's file
layout, the reference, the node's identity and the locks.

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

Locks (open-file-description locks, ``F_OFD_SETLK``, on bytes past the file's end, where no
data lives): the frontend holds a write lock on :data:`LIVE` for its life, on a descriptor of
its own that nothing maps, so the kernel says whether it lives (whatever PID namespace asks); a
reader leases slot ``i`` by a read lock on byte ``LOCKS + i``, which the frontend's write lock
on that byte (taken to reuse a slot, never waited for) cannot pass; readers append to the read
log under a write lock on :data:`LOG`.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import io
import os
import stat
import struct
import time
import uuid
from typing import Any

import numpy as np

from .. import _npy as npy

MAGIC = b"AOSTR3\x00\x01"
ARENA_VERSION = 2
"""The arena file's format (1: the pid-checked arena of aostore 0.1.0's first R3 release)."""
REFERENCE_VERSION = 1
"""The reference's format."""
PAGE = 4096
DIRECTORY = "/dev/shm"
PREFIX = "aostore-r3-"
LOCKS = 1 << 40
"""The lock bytes: slot ``i`` is leased by a lock on byte ``LOCKS + i`` (no data lives there)."""
LIVE = LOCKS - 1
"""The frontend's liveness lock: a write lock held while it lives."""
LOG = LOCKS - 2
"""Readers append to the read log under a write lock on this byte."""
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


class R3Error(Exception):
    """A reference that gives no rows: the base of ``aostore.r3``'s own errors."""


class ForeignReference(R3Error, ValueError):
    """Not a reference aostore wrote (or of a format version this reader does not read)."""


class OtherNode(R3Error):
    """A reference from another node: its rows are in that node's shared memory."""


class MixedArenas(R3Error, ValueError):
    """One batch with references of several arenas: fetch each arena's apart."""


class ReferenceGone(R3Error):
    """The reference's rows are gone: expired unread, evicted after a read, or the arena is no
    longer there (its frontend exited or restarted, or this process does not share its
    ``/dev/shm``). Never other rows. :attr:`index` is the reference's place in its batch."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"reference {index} of the batch: {message}")
        self.index = index


def ident(field: Any) -> bytes:
    """An id field's 16 bytes (kept as ``u1`` so no trailing zero byte is dropped)."""
    return np.asarray(field, np.uint8).tobytes()


def as_field(ident: bytes) -> np.ndarray:
    return np.frombuffer(ident, np.uint8)


def path(arena: bytes) -> str:
    """The arena's file: by its id, so a reference names it."""
    return os.path.join(DIRECTORY, f"{PREFIX}{arena.hex()}")


_known: dict[str, bytes] = {}
"""What is read once a process (not ``functools.cache``: stubtest cannot see through it)."""


def boot_id() -> bytes:
    """This node's boot id: a reference from another node (or boot) is refused."""
    if "boot" not in _known:
        with open("/proc/sys/kernel/random/boot_id") as file:
            _known["boot"] = uuid.UUID(file.read().strip()).bytes
    return _known["boot"]


READ, WRITE, UNLOCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
_FLOCK = struct.Struct("hh4xqqi4x")  # struct flock on Linux x86-64 and aarch64


def lock_byte(fd: int, byte: int, kind: int) -> bool:
    """Take (``F_RDLCK``, ``F_WRLCK``) or drop (``F_UNLCK``) the lock on ``byte`` for this open
    file description, never waiting: False when another's lock stands in the way."""
    request = _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock(fd: int, slot: int, kind: int) -> bool:
    """:func:`lock_byte` on ``slot``'s byte."""
    return lock_byte(fd, LOCKS + slot, kind)


def held_by_another(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte``."""
    request = _FLOCK.pack(WRITE, os.SEEK_SET, byte, 1, 0)
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, request)
    return bool(_FLOCK.unpack(answer)[0] != UNLOCK)


def leased(fd: int, slot: int) -> bool:
    """Whether another open file description (a reader) holds a lock on ``slot``'s byte."""
    return held_by_another(fd, LOCKS + slot)


def reopen(fd: int) -> int:
    """A new open file description of ``fd``'s file (through ``/proc/self/fd``: the file may be
    unnamed or unlinked): locks on it are its own."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def open_arena_file(path: str, owner: int) -> int:
    """``path`` opened for an arena's reader or sweep: no symlink followed, a regular file of
    ``owner``'s, else ``ReferenceGone`` saying what is there instead (a stale reference's name
    may be taken by anyone: ``/dev/shm`` is world-writable)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ReferenceGone(
            "its R3 arena is not in this node's /dev/shm: its frontend exited or restarted, "
            "or this process does not share the frontend's /dev/shm (same container, or "
            "--ipc=host)"
        ) from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ReferenceGone(f"{path} is a symbolic link, not an R3 arena") from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(
                f"the R3 arena {path} is readable by its user only (uid {_owner(path)}); this "
                f"process runs as uid {os.getuid()}: read as the frontend's user"
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ReferenceGone(f"{path} is not a regular file: not an R3 arena")
        if info.st_uid != owner:
            raise ReferenceGone(
                f"{path} belongs to uid {info.st_uid}, not to the frontend's user (uid {owner}):"
                " its arena is gone and another user took its name (a reader of another user "
                "than the frontend's names the frontend's uid: Reader(owner=...))"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _owner(path: str) -> int | str:
    try:
        return os.stat(path, follow_symlinks=False).st_uid
    except OSError:
        return "unknown"


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
    if len(shape) > MAX_DIMS:
        raise ValueError(f"rows of {len(shape)} dimensions: a reference holds at most {MAX_DIMS}")
    reference = np.zeros((), REFERENCE)
    reference["aostore_r3"] = KIND
    reference["version"] = REFERENCE_VERSION
    reference["boot"] = as_field(boot_id())
    reference["arena"] = as_field(arena)
    reference["slot"] = slot
    reference["generation"] = generation
    reference["dtype"] = dtype.str.encode()
    reference["ndim"] = len(shape)
    reference["shape"][: len(shape)] = shape
    reference["token_start"] = token_start
    return reference


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
    or ``TypeError`` for anything else."""
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
    if value.dtype.names != REFERENCE.names or value.shape != ():
        raise ForeignReference(f"not an aostore reference: a {value.dtype} array {value.shape}")
    reference = value.astype(REFERENCE)  # a byte order of its own: ours
    if reference["aostore_r3"].item() != KIND:
        raise ForeignReference("not an aostore reference: its kind field is not 'reference'")
    if int(reference["version"]) != REFERENCE_VERSION:
        raise ForeignReference(
            f"an aostore reference of format {int(reference['version'])}; this aostore reads "
            f"format {REFERENCE_VERSION} (upgrade aostore on the reader's side)"
        )
    if not 0 < int(reference["ndim"]) <= MAX_DIMS:
        raise ForeignReference(f"a malformed aostore reference: {int(reference['ndim'])} dims")
    return reference


def rows_of(reference: np.ndarray) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape of a reference's rows."""
    try:
        dtype = np.dtype(reference["dtype"].item().decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise ForeignReference("a malformed aostore reference: its dtype") from None
    shape = tuple(int(n) for n in reference["shape"][: int(reference["ndim"])])
    if dtype.hasobject or dtype.names is not None or any(n < 0 for n in shape):
        raise ForeignReference("a malformed aostore reference: its dtype or shape")
    return dtype, shape
