"""Code that hooks vLLM's worker connector still runs with aostore's plugin installed.

An RL framework, a worker extension, a test double or a later plugin derives from the installed
connector, patches one of its methods, or wraps a function of vLLM's worker module. The data
plane stands in for all of those, so it stays off for such a connector and vLLM's code (which
calls the hook) runs; the reason is in the connector's report. Built by the connector's own
``__init__`` in the environments of ``make test-connector`` (vLLM 0.33.0 and 0.32.0).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.worker")
    pytest.importorskip("aostore.vllm_plugin")

from . import contenders, harness, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PARAMS = contenders.Params(
    block_size=2,
    shape_per_token=(2, 3),
    dtype_name="uint8",
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_concurrent_batches=1,
    store_slots=64,
    kv_blocks=64,
)


@pytest.fixture
def installed() -> Any:
    """The worker module with aostore's data plane classes in it."""
    setup = contenders.installation()
    setup.use("dataplane")
    return contenders.worker_module()


def one_step(connector: Any) -> None:
    """A new request whose block hash arrives: vLLM publishes its retain."""
    op = schedule.Begin(
        generation=0, requests={"r": 0}, block_hashes={"r": [b"\x01\x02"]}, finished=()
    )
    connector.begin_step(harness._metadata(op))


def test_the_installed_connector_runs_the_data_plane(installed: Any) -> None:
    connector, _ = contenders.build_connector(PARAMS)
    try:
        assert type(connector) is installed.AuxOutputWorkerConnector
        assert connector.__dict__["_aostore_plane"] is not None
        assert connector.__dict__["_aostore_why_not"] is None
    finally:
        connector.close()


def test_a_subclass_of_the_installed_connector_gets_vllms_code(installed: Any) -> None:
    calls: list[str] = []

    class Hooked(installed.AuxOutputWorkerConnector):  # type: ignore[misc, name-defined]
        def _publish_blocks(self, *args: Any, **kwargs: Any) -> None:
            calls.append("publish")
            super()._publish_blocks(*args, **kwargs)

    connector, _ = contenders.build_connector(PARAMS, Hooked)
    try:
        assert connector.__dict__["_aostore_plane"] is None
        assert "subclass" in connector.__dict__["_aostore_why_not"]
        one_step(connector)
        assert calls == ["publish"]
    finally:
        connector.close()


def test_a_patched_method_of_vllms_connector_keeps_the_plane_off(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm_class = contenders.installation().plane_replaced["AuxOutputWorkerConnector"][0]
    calls: list[str] = []
    original = vllm_class._publish_blocks

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        calls.append("publish")
        original(self, *args, **kwargs)

    monkeypatch.setattr(vllm_class, "_publish_blocks", wrapped)
    connector, _ = contenders.build_connector(PARAMS)
    try:
        assert connector.__dict__["_aostore_plane"] is None
        assert "_publish_blocks was patched" in connector.__dict__["_aostore_why_not"]
        one_step(connector)
        assert calls == ["publish"]
    finally:
        connector.close()


def test_a_wrapped_function_of_vllms_worker_module_keeps_the_plane_off(
    installed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    original = installed.publish_routed_experts

    def wrapped(*args: Any, **kwargs: Any) -> None:
        calls.append("publish")
        original(*args, **kwargs)

    monkeypatch.setattr(installed, "publish_routed_experts", wrapped)
    connector, _ = contenders.build_connector(PARAMS)
    try:
        assert connector.__dict__["_aostore_plane"] is None
        assert "publish_routed_experts" in connector.__dict__["_aostore_why_not"]
        one_step(connector)
        assert calls == ["publish"]
    finally:
        connector.close()
