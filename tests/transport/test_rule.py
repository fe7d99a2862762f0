"""The rule both ends of the worker-to-engine-core hop compute: a step's rows are packed only
under the multiprocess executor on one node, and a hop that pickles without that rule holding
is worth a warning; no vLLM needed (the config is read by its fields)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aostore.vllm.transport import crosses_unpacked, why_not_packed


class RayDistributedExecutor:  # an executor given as a class, as vLLM allows
    pass


def config(backend: object, nnodes: int | None = 1) -> SimpleNamespace:
    parallel = SimpleNamespace(distributed_executor_backend=backend)
    if nnodes is not None:
        parallel.nnodes = nnodes
    return SimpleNamespace(parallel_config=parallel)


@pytest.mark.parametrize(
    ("backend", "nnodes", "why", "warns"),
    [
        ("mp", 1, None, False),
        ("mp", None, None, False),  # a release without nnodes: one node
        ("mp", 2, "the mp executor spans nodes", True),
        ("uni", 1, "the uni executor hands vLLM's dict over", False),
        ("external_launcher", 1, "the external_launcher executor hands vLLM's dict over", False),
        ("ray", 1, "the ray executor hands vLLM's dict over", True),
        (
            RayDistributedExecutor,
            1,
            "the RayDistributedExecutor executor hands vLLM's dict over",
            True,
        ),
        (None, 1, "the None executor hands vLLM's dict over", False),
    ],
)
def test_rows_are_packed_only_where_both_ends_run_this_aostore(
    backend: object, nnodes: int | None, why: str | None, warns: bool
) -> None:
    given = config(backend, nnodes)
    assert why_not_packed(given) == why
    assert crosses_unpacked(given, why) is warns
    assert not crosses_unpacked(given, "transport off")
