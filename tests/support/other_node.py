"""A process that sees this node as another node would: for R3's off-node path without a
second machine (tests and ``benches/r3_reference.py --t15``).

:func:`become_another_node` gives the calling process a mount namespace of its own with an
empty ``/dev/shm`` (the frontend's arenas are not there) and another boot id bind-mounted over
``/proc/sys/kernel/random/boot_id`` (what ``aostore.r3`` compares a reference's ``boot``
with). The network stays the node's: the tests' Mooncake master listens on 127.0.0.1 only, as
every server a test starts does. Needs root, and a process with one thread (``unshare``
refuses a threaded one): call it first thing in a fresh process.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import uuid

import numpy as np

CLONE_NEWNS = 0x00020000
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def missing_reason() -> str | None:
    """Why this machine cannot make another node's view, or None when it can."""
    if os.geteuid() != 0:
        return "another node's view needs root (a mount namespace and bind mounts)"
    if shutil.which("mount") is None:
        return "another node's view needs mount(8)"
    return None


def become_another_node() -> None:
    """This process, from here on, as on another node (see the module)."""
    with open(BOOT_ID) as file:
        before = uuid.UUID(file.read().strip())
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNS): {os.strerror(errno)}")
    with tempfile.NamedTemporaryFile("w", prefix="aostore-boot-id-", delete=False) as boot:
        boot.write(f"{uuid.uuid4()}\n")
    try:
        for argv in (
            ["mount", "--make-rprivate", "/"],  # nothing mounted here reaches the node's
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"],
            ["mount", "--bind", boot.name, BOOT_ID],
        ):
            subprocess.run(argv, check=True, capture_output=True)
    finally:
        os.unlink(boot.name)  # the bind mount keeps the file's contents
    from aostore.r3 import leases  # imported here: numpy may start threads

    leases._known.clear()  # the boot id is read once a process: read it again
    if leases.boot_id() == before.bytes or os.listdir("/dev/shm"):
        raise RuntimeError("this process still sees the node it runs on")


def elsewhere(reference: np.ndarray) -> np.ndarray:
    """``reference`` as a reader on another node holds it: another boot id (for a process that
    has not called :func:`become_another_node`)."""
    moved = reference.copy()
    moved["boot"] = np.frombuffer(b"another-node-id!", np.uint8)
    return moved
