"""The arena's locks and the node's identity: what lets a reader lease a slot, the frontend say
it lives, and a reference be refused on another node.

Locks (open-file-description locks, ``F_OFD_SETLK``, on bytes past the file's end, where no
data lives): the frontend holds a write lock on :data:`LIVE` for its life, on a descriptor of
its own that nothing maps, so the kernel says whether it lives (whatever PID namespace asks); a
reader leases slot ``i`` by a read lock on byte ``LOCKS + i``, which the frontend's write lock
on that byte (taken to reuse a slot, never waited for) cannot pass; readers append to the read
log under a write lock on :data:`LOG`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import uuid

from .errors import ReferenceGone

LOCKS = 1 << 40
"""The lock bytes: slot ``i`` is leased by a lock on byte ``LOCKS + i`` (no data lives there)."""
LIVE = LOCKS - 1
"""The frontend's liveness lock: a write lock held while it lives."""
LOG = LOCKS - 2
"""Readers append to the read log under a write lock on this byte."""

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
