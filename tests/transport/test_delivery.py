"""R3 delivery by reference in vLLM's frontend (``aostore.vllm.transport.delivery``): how a
request chooses, what a bad choice gets, and the arena's start with vLLM's ``OutputProcessor``.
(The rows a reference reads are vLLM's: ``test_frontend_differential.py``.)"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from aostore import r3
from aostore.vllm.install import swap, undo_swap
from aostore.vllm.settings import Settings
from aostore.vllm.transport import delivery, install
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1 import engine as v1_engine
from vllm.v1.engine import output_processor as op_module


def request(request_id: str, extra: dict[str, Any] | None = None) -> Any:
    params = SamplingParams(
        max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra, detokenize=False
    )
    return v1_engine.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=f"ext-{request_id}",
    )


def finish(processor: Any, request_id: str, rows: np.ndarray) -> Any:
    outputs = [
        v1_engine.EngineCoreOutput(
            request_id=request_id, new_token_ids=[5], routed_experts=rows[:3]
        ),
        v1_engine.EngineCoreOutput(
            request_id=request_id,
            new_token_ids=[6],
            routed_experts=rows[3:],
            finish_reason=v1_engine.FinishReason.LENGTH,
        ),
    ]
    processor.process_outputs(outputs[:1], 0.0, None)
    (done,) = processor.process_outputs(outputs[1:], 0.0, None).request_outputs
    return done.outputs[0].routed_experts


@pytest.fixture
def installed(request: pytest.FixtureRequest) -> Any:
    """The transport with delivery by reference (default: the test's parameter)."""
    undo: list[Any] = []
    made = delivery.Delivery(request.param, 8 << 20, 60.0) if request.param else None
    install(swap, undo, made)
    try:
        yield made
    finally:
        undo_swap(undo)
        assert delivery.installed() is None
        if made is not None and made.arena is not None:
            made.arena.close()


@pytest.mark.parametrize("installed", ["rows"], indirect=True)
def test_a_request_chooses_and_the_default_is_vllms_rows(installed: Any) -> None:
    processor = op_module.OutputProcessor(None, log_stats=False)
    assert installed.arena is not None  # made with the OutputProcessor: reserved at start
    rows = np.random.default_rng(0).integers(0, 128, (4, 46, 8), np.uint8)
    processor.add_request(request("plain"), None)
    processor.add_request(request("asked", {delivery.KEY: "reference"}), None)
    processor.add_request(request("rows", {delivery.KEY: "rows"}), None)
    plain, asked, chose_rows = (finish(processor, rid, rows) for rid in ("plain", "asked", "rows"))
    assert plain.dtype == np.uint8 and np.array_equal(plain, rows)
    assert np.array_equal(chose_rows, rows)
    assert asked.dtype.names is not None and asked.shape == ()
    assert np.array_equal(r3.Reader().fetch([asked])[0], rows)
    assert installed.stats()["references"] == 1
    # Exported where vLLM's /metrics reads (prometheus_client's default registry).
    registry = pytest.importorskip("prometheus_client").REGISTRY
    assert registry.get_sample_value("aostore_r3_references_total") == 1
    assert registry.get_sample_value("aostore_r3_bytes_held") == 4096


@pytest.mark.parametrize("installed", ["reference"], indirect=True)
def test_reference_as_the_default_and_a_bad_choice_changes_nothing(installed: Any) -> None:
    processor = op_module.OutputProcessor(None, log_stats=False)
    rows = np.random.default_rng(1).integers(0, 128, (4, 46, 8), np.uint8)
    processor.add_request(request("default"), None)
    assert finish(processor, "default", rows).dtype.names is not None
    for bad in ("Reference", "", 1, None):
        with pytest.raises(ValueError, match=delivery.KEY) as refused:
            processor.add_request(request("bad", {delivery.KEY: bad}), None)
        assert "bad" not in processor.request_states
        # What vLLM's API server answers with a 400 (any other error there is a 500 that stops
        # the server): tests/vllm_engine/test_engine_serve.py posts one.
        client_error = importlib.import_module("vllm.exceptions").VLLMValidationError
        assert isinstance(refused.value, client_error)


@pytest.mark.parametrize("installed", ["reference"], indirect=True)
def test_rows_that_do_not_fit_go_as_rows_with_one_warning(installed: Any) -> None:
    """A budget of two pages: rows of three go as vLLM's rows (counted, one WARNING); so do
    chunks the pages cannot hold (a dtype that changes: vLLM's concatenation), when they do not
    fit; small ones still go by reference."""
    installed.budget = 2 * 4096
    processor = op_module.OutputProcessor(None, log_stats=False)
    rng = np.random.default_rng(2)
    big = rng.integers(0, 128, (30, 46, 8), np.uint8)  # 11,040 bytes: three pages
    mixed = np.concatenate([big[:3].astype(np.int16), big[3:].astype(np.int16)])
    small = big[:4]
    for rid in ("big", "big again", "small"):
        processor.add_request(request(rid), None)
    logger = logging.getLogger("vllm.plugins.aostore")  # vLLM's "vllm" may not propagate
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        got = [
            finish(processor, rid, want)
            for rid, want in (("big", big), ("big again", big), ("small", small))
        ]
    finally:
        logger.removeHandler(handler)
    assert np.array_equal(got[0], big) and np.array_equal(got[1], big)
    assert got[2].dtype.names is not None
    assert np.array_equal(r3.Reader().fetch([got[2]])[0], small)
    warnings = [r for r in records if "did not fit the arena" in r.getMessage()]
    assert len(warnings) == 1 and "AOSTORE_VLLM_R3_BUDGET" in warnings[0].getMessage()
    assert installed.stats()["fallbacks"] == 2 and installed.stats()["references"] == 1

    processor.add_request(request("mixed"), None)
    outputs = [
        v1_engine.EngineCoreOutput(request_id="mixed", new_token_ids=[5], routed_experts=big[:3]),
        v1_engine.EngineCoreOutput(
            request_id="mixed",
            new_token_ids=[6],
            routed_experts=mixed[3:],
            finish_reason=v1_engine.FinishReason.LENGTH,
        ),
    ]
    processor.process_outputs(outputs[:1], 0.0, None)
    (done,) = processor.process_outputs(outputs[1:], 0.0, None).request_outputs
    got_mixed = done.outputs[0].routed_experts
    assert got_mixed.dtype == np.int16 and np.array_equal(got_mixed, mixed)  # too big: rows
    assert installed.stats()["fallbacks"] == 3


@pytest.mark.parametrize("installed", [None], indirect=True)
def test_asking_for_a_reference_where_it_is_off_says_how_to_turn_it_on(installed: Any) -> None:
    processor = op_module.OutputProcessor(None, log_stats=False)
    with pytest.raises(ValueError, match="AOSTORE_VLLM_R3_DELIVERY"):
        processor.add_request(request("asked", {delivery.KEY: "reference"}), None)
    processor.add_request(request("rows", {delivery.KEY: "rows"}), None)  # vLLM's way: fine
    rows = np.ones((4, 46, 8), np.uint8)
    assert np.array_equal(finish(processor, "rows", rows), rows)


class Engine:
    """What vLLM's ``AsyncLLM`` and ``LLMEngine`` are when they make their ``OutputProcessor``:
    ``self.vllm_config`` set, its ``aux_output_config`` saying whether routed experts return."""

    def __init__(self, routed_experts: bool) -> None:
        aux = SimpleNamespace(enable_return_routed_experts=routed_experts)
        self.vllm_config = SimpleNamespace(aux_output_config=aux)
        self.output_processor = op_module.OutputProcessor(None, log_stats=False)


@pytest.mark.parametrize("installed", ["reference"], indirect=True)
def test_no_budget_is_reserved_for_an_engine_without_routed_experts(installed: Any) -> None:
    """Issue 45, item 17: the arena's budget was reserved although no rows would ever come."""
    Engine(routed_experts=False)
    assert installed.arena is None
    Engine(routed_experts=True)
    assert installed.arena is not None


def test_a_budget_the_node_cannot_hold_stops_the_frontends_start() -> None:
    undo: list[Any] = []
    install(swap, undo, delivery.Delivery("reference", 1 << 50, 60.0))
    try:
        with pytest.raises(OSError, match="AOSTORE_VLLM_R3_BUDGET"):
            op_module.OutputProcessor(None, log_stats=False)
    finally:
        undo_swap(undo)


def test_settings_read_and_refuse_bad_values() -> None:
    good = Settings.from_env(
        {
            "AOSTORE_VLLM_R3_DELIVERY": "Reference",
            "AOSTORE_VLLM_R3_BUDGET": "2G",
            "AOSTORE_VLLM_R3_TTL": "90",
        }
    )
    assert (good.r3_delivery, good.r3_budget, good.r3_ttl, good.r3_said) == (
        "reference",
        2 << 30,
        90.0,
        "",
    )
    assert Settings.from_env({}).r3_delivery is None
    for env, said in [
        ({"AOSTORE_VLLM_R3_DELIVERY": "refs"}, "not rows or reference"),
        ({"AOSTORE_VLLM_R3_DELIVERY": "rows", "AOSTORE_VLLM_R3_BUDGET": "lots"}, "size"),
        ({"AOSTORE_VLLM_R3_DELIVERY": "rows", "AOSTORE_VLLM_R3_TTL": "-1"}, "positive"),
        ({"AOSTORE_VLLM_R3_DELIVERY": "rows", "AOSTORE_VLLM_R3_TTL": "inf"}, "finite"),
    ]:
        settings = Settings.from_env(env)
        assert settings.r3_delivery is None and said in settings.r3_said


def test_the_rust_frontend_refuses_it_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from aostore.vllm.plan import Plan, _r3

    settings = Settings.from_env({"AOSTORE_VLLM_R3_DELIVERY": "reference"})
    plan = Plan(vllm={})
    plan.transport = True
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    mode, said = _r3(plan, settings)
    assert mode is None and "refused" in said and "VLLM_USE_RUST_FRONTEND=1" in said
    monkeypatch.delenv("VLLM_USE_RUST_FRONTEND")
    assert _r3(plan, settings)[0] == "reference"
    plan.transport = False
    assert "needs the transport" in _r3(plan, settings)[1]
    assert os.environ.get("VLLM_USE_RUST_FRONTEND") is None
