"""Mooncake Store as a shared tier behind aostore.

``MooncakeBlockObjectStore`` is the aostore store API over a Mooncake Store cluster;
``TieredBlockObjectStore(local, remote)`` keeps the local aostore arena as the hot tier and
publishes to Mooncake from a writer thread, fetching local misses from it. ``MooncakeConfig``
and ``connect`` set a client up; nothing is imported from Mooncake until then, so this package
imports without it. docs/mooncake.md has the semantics, the faults, and the Mooncake API used.
"""

from aostore.mooncake.client import MOONCAKE_PIP_PACKAGE, MooncakeError, connect
from aostore.mooncake.config import MooncakeConfig
from aostore.mooncake.remote import MooncakeBlockObjectStore
from aostore.mooncake.tiered import TieredBlockObjectStore

__all__ = [
    "MOONCAKE_PIP_PACKAGE",
    "MooncakeBlockObjectStore",
    "MooncakeConfig",
    "MooncakeError",
    "TieredBlockObjectStore",
    "connect",
]

# The public classes name the package, where users import them from (logs, reprs, pickles).
for _public in (MooncakeBlockObjectStore, MooncakeConfig, MooncakeError, TieredBlockObjectStore):
    _public.__module__ = __name__
del _public
