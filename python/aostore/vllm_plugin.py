"""The vLLM general plugin's entry point, ``aostore.vllm_plugin:register``, and the installed
classes' public home.

vLLM calls :func:`register` in every process it starts; it swaps aostore's classes into
``vllm.distributed.aux_output_connector.store`` after a compatibility gate and never raises.
The settings it reads are ``AOSTORE_VLLM_PLUGIN``, ``AOSTORE_VLLM_PROFILE``,
``AOSTORE_VLLM_PREFAULT`` and ``AOSTORE_VLLM_MOONCAKE``; :func:`dry_run` (``aostore
vllm-check``) computes the same decision without swapping anything. The code is in
``aostore.vllm``; docs/vllm-plugin.md says what it does and why.
"""

from aostore.vllm import dry_run, register
from aostore.vllm.stores import (
    EngineBlockObjectStore,
    EngineShmBlockObjectStore,
    GrowBlockObjectStore,
    TieredEngineBlockObjectStore,
    TieredGrowBlockObjectStore,
)

__all__ = [
    "EngineBlockObjectStore",
    "EngineShmBlockObjectStore",
    "GrowBlockObjectStore",
    "TieredEngineBlockObjectStore",
    "TieredGrowBlockObjectStore",
    "dry_run",
    "register",
]
