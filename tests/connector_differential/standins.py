"""What vLLM's worker connector needs that a CPU without a model does not have.

Only these are stood in, in vLLM's worker module, before any connector is built:

- ``RoutedExpertsCapturer``: :class:`StandInCapturer`, with the real capturer's profile
  attributes (``shape_per_token``, ``output_dtype_name``, ``output_dtype``) and its
  ``snapshot_routing_data(n)``, which converts the first ``n`` rows of an int16 device buffer
  to the output dtype (a fresh tensor, as the real one returns on a GPU). The harness writes
  the step's rows into the buffer before ``prepare_output``.
- ``bind_routed_experts_capturer``: does nothing (there is no model to bind to).
- ``get_tp_group``: rank 0 of 1, so the connector owns the data plane.

The input batch is :class:`StandInInputBatch`, the three fields ``prepare_output`` reads.
On a CPU tensor ``to("cpu", non_blocking=True)`` is the tensor itself, so vLLM's
``enqueue_cpu_copy`` runs unchanged and the rows it hands on are real numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

# The profile the next capturer gets (the factory sets it just before building a connector).
_next_profile: tuple[tuple[int, ...], str] = ((2, 3), "uint8")
# Every capturer built, newest last (a factory takes the one its connector's __init__ built).
built: list[StandInCapturer] = []


def set_next_profile(shape_per_token: tuple[int, ...], dtype_name: str) -> None:
    global _next_profile
    _next_profile = (shape_per_token, dtype_name)


class StandInCapturer:
    """The GPU capturer: a device buffer the harness fills, snapshotted in the output dtype."""

    def __init__(self, max_num_batched_tokens: int, vllm_config: Any) -> None:
        shape, dtype_name = _next_profile
        self.shape_per_token = shape
        self.output_dtype_name = dtype_name
        self.output_dtype = getattr(torch, dtype_name)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device_buffer = torch.zeros((max_num_batched_tokens, *shape), dtype=torch.int16)
        built.append(self)

    def load(self, rows: np.ndarray) -> None:
        """The step's routed experts, as the model's forward pass would leave them."""
        self.device_buffer[: len(rows)] = torch.from_numpy(rows.astype(np.int16))

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        return self.device_buffer[:num_tokens].to(self.output_dtype)


@dataclass
class StandInInputBatch:
    """What ``prepare_output`` reads of the model runner's ``InputBatch``."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray
    num_computed_tokens_np: np.ndarray


_TP_GROUP = SimpleNamespace(is_first_rank=True, rank_in_group=0, world_size=1)


def install(worker: Any) -> None:
    """The stand-ins into vLLM's worker module (idempotent)."""
    worker.RoutedExpertsCapturer = StandInCapturer
    worker.bind_routed_experts_capturer = lambda model, capturer: None
    worker.get_tp_group = lambda: _TP_GROUP
