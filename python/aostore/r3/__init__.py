"""R3 rows by reference: read the routed experts a vLLM frontend on this node kept for you.

With aostore's delivery by reference on (``AOSTORE_VLLM_R3_DELIVERY=reference``, or
``"aostore_r3_delivery": "reference"`` in a request's ``vllm_xargs``/``extra_args``), a
response's ``routed_experts`` is a reference (base64 ``.npy`` of a 0-d structured array, under
1 KB) instead of the rows (about 8.5 MB of JSON for a 16k-token GLM-4.5-Air sample). The
frontend keeps the rows in shared memory on its node; :func:`fetch` reads them::

    from aostore import r3

    batch = r3.fetch([choice["routed_experts"] for choice in choices])
    rows = batch[0]  # np.ndarray [tokens, layers, top_k], read-only, no copy
    ...
    del rows
    batch.release()  # or let the arrays go: the lease ends with them

    out = np.empty((total_rows, layers, top_k), np.uint8)
    r3.fetch(references, out=out)  # copied into your buffer, no lease: keep as long as you like

vLLM's rows (either form) are accepted too, so one code path reads both. :func:`padded` and
:func:`packed` read a batch straight into a trainer's layout (docs/r3-trainer.md).
docs/r3-reference.md has the rules: how long rows are kept, leases, forks, restarts, errors.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._reader import DEFAULT_RENEWAL, Fetched, Reader, ReaderStats
from ._reader import process_reader as reader
from .errors import (
    BadLayout,
    ForeignReference,
    MixedArenas,
    OffNodeError,
    OtherNode,
    R3Error,
    ReferenceGone,
    RouteOutOfRange,
)
from .layouts import Routes, packed, padded

__all__ = [
    "DEFAULT_RENEWAL",
    "BadLayout",
    "Fetched",
    "ForeignReference",
    "MixedArenas",
    "OffNodeError",
    "OtherNode",
    "R3Error",
    "Reader",
    "ReaderStats",
    "ReferenceGone",
    "RouteOutOfRange",
    "Routes",
    "fetch",
    "packed",
    "padded",
    "reader",
    "renew",
]


def fetch(
    references: Sequence[Any],
    *,
    start: int | Sequence[int] | None = None,
    out: np.ndarray | None = None,
) -> Fetched:
    """:meth:`Reader.fetch` with this process's reader."""
    return reader().fetch(references, start=start, out=out)


def renew(references: Sequence[Any], seconds: float = DEFAULT_RENEWAL) -> None:
    """:meth:`Reader.renew` with this process's reader."""
    reader().renew(references, seconds)
