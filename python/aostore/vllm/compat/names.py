"""The names of vLLM's auxiliary-output store package that the checker and the plan look at."""

from __future__ import annotations

STORE_MODULE = "vllm.distributed.aux_output_connector.store"
"""The vLLM module whose classes the plugin replaces."""
PACKAGE = "vllm.distributed.aux_output_connector"
"""The package whose classes the plugin compares (those of the store module and its peers)."""

FIXED_STORE = "BlockObjectStore"
SHM_STORE = "ShmBlockObjectStore"
# Modules of the package besides ``store.py`` whose classes the plan looks at, where they exist:
# vLLM's Mooncake branch (vllm#57968) moves the fixed store to ``shm.py`` and adds ``mooncake.py``.
PEER_MODULES = ("shm", "mooncake")
WRAPPER = "BackgroundBlockObjectStore"
OBJECT = "BlockObject"
ERROR = "BlockObjectStoreError"
# Replaced only beside a store of aostore's: alone they would change vLLM for nothing.
COMPANIONS = (OBJECT, ERROR)
# What makes a class a store (the wrapper aside): the calls vLLM's writer makes on it.
STORE_METHODS = frozenset({"put", "get_concatenated", "close"})
