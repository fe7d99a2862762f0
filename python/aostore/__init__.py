"""aostore: the block store behind an LLM engine's auxiliary outputs.

A drop-in for vLLM's ``vllm.distributed.aux_output_connector.store`` module: fixed-size slots
in one arena, reference counts per key, and an O(1) LRU that holds only evictable keys, so an
evicting put never rescans the keys that running requests hold.
"""

from aostore._background import BackgroundBlockObjectStore
from aostore._native import BlockObject, BlockObjectStoreError, ObjectMissingError
from aostore._shm import ShmBlockObjectStore
from aostore._store import BlockObjectStore
from aostore._variable import VariableBlockObjectStore

__all__ = [
    "BackgroundBlockObjectStore",
    "BlockObject",
    "BlockObjectStore",
    "BlockObjectStoreError",
    "ObjectMissingError",
    "ShmBlockObjectStore",
    "VariableBlockObjectStore",
]
