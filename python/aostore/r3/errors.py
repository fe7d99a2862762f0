"""``aostore.r3``'s errors: what a reference that gives no rows raises (the reader's), and what
an arena that is closed or not this process's raises (the writer's)."""

from __future__ import annotations


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
