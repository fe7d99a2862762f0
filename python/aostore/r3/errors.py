"""``aostore.r3``'s errors: what a reference that gives no rows raises (the reader's), and what
an arena that is closed or not this process's raises (the writer's)."""

from __future__ import annotations


class R3Error(Exception):
    """A reference that gives no rows: the base of ``aostore.r3``'s own errors."""


class ForeignReference(R3Error, ValueError):
    """Not a reference aostore wrote (or of a format version this reader does not read)."""


class OtherNode(R3Error):
    """A reference from another node: its rows are in that node's shared memory."""


class OffNodeError(R3Error):
    """Another node's reference could not be read through Mooncake: no client could be made
    (the master does not answer, the package is missing or lacks a call aostore uses), or a read
    failed other than by a missing object (which is ``ReferenceGone``)."""


class MixedArenas(R3Error, ValueError):
    """No longer raised: ``fetch`` reads one batch of references of any arenas (since issue
    49). Kept so that code which catches it still imports."""


class ReferenceGone(R3Error):
    """The reference's rows are gone: expired unread, evicted after a read, or the arena is no
    longer there (its frontend exited or restarted, or this process does not share its
    ``/dev/shm``). Never other rows. :attr:`index` is the reference's place in its batch."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message if index is None else f"reference {index} of the batch: {message}")
        self.index = index


class BadLayout(ValueError):
    """Input a trainer's layout cannot be made from (``aostore.r3.padded`` / ``packed``): rows
    of another shape, lengths or offsets that do not fit, an ``out`` of the wrong shape or
    dtype. Raised before any byte is written. :attr:`sample` is the sample's place in its batch
    (``None`` when the error is the batch's)."""

    def __init__(self, message: str, sample: int | None = None) -> None:
        super().__init__(message if sample is None else f"sample {sample}: {message}")
        self.sample = sample


class RouteOutOfRange(BadLayout):
    """A route the dtype asked for cannot hold, or at least ``num_experts``: never wrapped.
    :attr:`token` is the token's place in its sample's rows (segments stitched), :attr:`route`
    the value."""

    def __init__(self, message: str, sample: int, token: int, route: int) -> None:
        super().__init__(f"token {token}: {message}", sample)
        self.token = token
        self.route = route
