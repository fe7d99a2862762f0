"""aostore's transport of routed-experts rows across vLLM's processes.

After the worker connector, vLLM moves each step's rows as one Python object per request per
step. Here: the worker hands the engine core one buffer a step (``rows``), the engine core's
encoder sends routed-experts rows inline on vLLM's own wire and the frontend's decoder copies
them out (``wire``), the frontend holds each request's rows in pages (``frontend``), and the
API server answers with vLLM's bytes, cheaper (``answer``); ``install`` puts them in. What users see
(every ``RequestOutput``, every HTTP body) stays vLLM's: docs/transport.md.
"""

from __future__ import annotations

from .frontend import RowChunks, request_state_subclass
from .install import crosses_unpacked, install, why_not_packed
from .rows import FORMAT, StepArray, StepRows, is_step_rows

__all__ = [
    "FORMAT",
    "RowChunks",
    "StepArray",
    "StepRows",
    "crosses_unpacked",
    "install",
    "is_step_rows",
    "request_state_subclass",
    "why_not_packed",
]
