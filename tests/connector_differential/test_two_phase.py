"""vLLM 0.34.0 builds the worker connector in two phases, and the data plane follows them.

``profile_run`` builds the connector (capture only); after KV-cache initialization the model
runner calls ``initialize_output_storage`` on that same object, which builds the store and the
buffer on the first TP rank only. The plane is decided there. Before it, vLLM's own methods run
(``begin_step`` records the metadata, ``prepare_output`` returns ``None``); a non-first rank
never gets storage; a second call builds a new store, as vLLM's does.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.worker")
    pytest.importorskip("aostore.vllm_plugin")
    import torch

from . import contenders, harness, schedule, standins

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(not contenders.two_phase(), reason="this vLLM builds storage in __init__"),
]

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


@pytest.fixture(params=["vllm", "dataplane"])
def which(request: pytest.FixtureRequest) -> Iterator[str]:
    """vLLM's classes, or aostore's with the data plane: both must behave alike here."""
    contenders.installation().use(request.param)
    yield request.param


def _profiled() -> Any:
    """The connector as ``profile_run`` leaves it: constructed, no storage yet."""
    config, _ = contenders._configs(PARAMS)
    standins.set_next_profile(PARAMS.shape_per_token, PARAMS.dtype_name)
    connector = contenders.worker_module().AuxOutputWorkerConnector(
        vllm_config=config, model=torch.nn.Module()
    )
    standins.built.clear()
    return connector


def _step(connector: Any, rows: np.ndarray) -> Any:
    """A new request's 3-token prefill, its first block's hash with it."""
    op = schedule.Begin(0, {"r": 0}, {"r": [b"\x07\x01"]}, ())
    connector.begin_step(harness._metadata(op))
    connector._capturer.load(rows)
    batch = standins.StandInInputBatch(["r"], np.array([0, 3], np.int32), np.zeros(1, np.int32))
    pending = connector.prepare_output(batch)
    if pending is None:
        return None
    pending.enqueue_cpu_copy(np.array([1], np.int32), np.array([0], np.int32))
    return connector.process_output(pending)


ROWS = np.arange(18, dtype=np.uint8).reshape(3, 2, 3)


def test_before_storage_vllms_methods_run(which: str) -> None:
    connector = _profiled()
    try:
        assert connector.__dict__.get("_aostore_plane") is None
        metadata = harness._metadata(schedule.Begin(0, {"r": 0}, {}, ()))
        connector.begin_step(metadata)
        assert connector._step_metadata is metadata and connector._requests == {}
        assert _step(connector, ROWS) is None
        if which == "dataplane":
            assert "storage not initialized" in connector.__dict__["_aostore_why_not"]
    finally:
        connector.close()


def test_storage_turns_the_plane_on_and_a_second_call_builds_a_new_store(which: str) -> None:
    _, kv_cache_config = contenders._configs(PARAMS)
    connector = _profiled()
    try:
        connector.initialize_output_storage(kv_cache_config)
        first_store = connector._store
        assert (connector.__dict__.get("_aostore_plane") is not None) == (which == "dataplane")
        outputs = _step(connector, ROWS)
        assert outputs["r"].token_start == 0 and outputs["r"].rows.tobytes() == ROWS.tobytes()
        connector.begin_step(harness._metadata(schedule.Begin(0, {}, {}, ("r",))))
        connector.initialize_output_storage(kv_cache_config)
        assert connector._store is not first_store
        plane = connector.__dict__.get("_aostore_plane")
        assert (plane is not None) == (which == "dataplane")
        if plane is not None:
            assert plane.steps == 0  # a new plane over the new store
        # The new store holds nothing; the connector goes on as before.
        again = _step(connector, ROWS[::-1].copy())
        assert again["r"].rows.tobytes() == ROWS[::-1].tobytes()
        first_store.close()
    finally:
        connector.close()


def test_a_rank_that_is_not_first_never_gets_storage(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, kv_cache_config = contenders._configs(PARAMS)
    connector = _profiled()
    monkeypatch.setattr(standins._TP_GROUP, "is_first_rank", False)
    try:
        connector.initialize_output_storage(kv_cache_config)
        assert connector._store is None and connector._buffer is None
        assert connector.__dict__.get("_aostore_plane") is None
        if which == "dataplane":
            assert connector.__dict__["_aostore_why_not"] == "not the output rank (no store)"
        assert _step(connector, ROWS) is None
    finally:
        connector.close()
