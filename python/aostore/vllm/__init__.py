"""aostore's vLLM plugin: swaps vLLM's auxiliary-output store classes for aostore's drop-ins.

``settings`` reads the environment once, ``compat`` is the drop-in checker (it knows nothing of
aostore), ``plan`` decides, ``probe`` runs vLLM's store to choose the profile, ``stores`` holds
the installed classes, ``install`` swaps them in (``register``) and ``report`` says what a
process would do (``dry_run``, ``aostore vllm-check``). docs/vllm-plugin.md is the reference.
"""

from aostore.vllm.install import register
from aostore.vllm.report import dry_run

__all__ = ["dry_run", "register"]
