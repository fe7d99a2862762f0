"""aostore's data plane for vLLM's aux-output connectors: R3 capture per step in Rust.

Where the plugin recognizes a vLLM release for a feature (``aostore.vllm.compat.releases``),
it puts aostore's subclasses in vLLM's modules: the worker connector and a marker buffer
(``worker``), the scheduler connector (``scheduler``). ``install`` puts them in and records
(``installed``) what the worker side's decision compares against; ``report`` writes the tests'
proof from inside vLLM's processes. docs/data-plane.md says what each keeps exactly.
"""

from __future__ import annotations

from .install import install, remove_mark
from .installed import BY_FEATURE, MARK, NAMES
from .scheduler import DataPlaneSchedulerConnector, scheduler_subclass
from .worker import DataPlaneConnector

__all__ = [
    "BY_FEATURE",
    "MARK",
    "NAMES",
    "DataPlaneConnector",
    "DataPlaneSchedulerConnector",
    "install",
    "remove_mark",
    "scheduler_subclass",
]
