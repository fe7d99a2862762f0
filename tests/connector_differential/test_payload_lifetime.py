"""The data plane's payloads outlive its staging slots.

vLLM copies each published block with ``tobytes()`` and reuses its staging slot at once;
aostore's Rust writer applies a call later. Here that writer is held back (each queued call
waits before it is applied) while the connector runs on: later steps stage new rows in the
slots that earlier calls published from, and prefix hits read back through the lagging queue.
The stores are compared only at the end (a read would let the writer catch up); outputs after
every step, as in the differential.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.worker")
    pytest.importorskip("aostore.vllm_plugin")
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

from . import contenders, harness, schedule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KV_EVENTS = "retained_block_hashes" in {
    f.name for f in dataclasses.fields(AuxOutputConnectorMetadata)
}
HOLD_S = 0.003


def _held_back(params: contenders.Params) -> contenders.Built:
    built = contenders.dataplane_contender(params)
    # Behind, not in step: the plane runs ahead of a writer that applies each call late.
    built.connector._store._writer._synchronous(False)
    built.connector._store._writer._hold_back(HOLD_S)
    read = built.read_store

    def read_store() -> contenders.StoreView:
        built.connector._store._writer._hold_back(0)
        return read()

    return dataclasses.replace(built, name="dataplane-held-back", read_store=read_store)


def test_a_held_back_writer_stores_the_bytes_that_were_published() -> None:
    # Schedules that vLLM runs without an error: when a store fails, the call that reports
    # it depends on how far its writer got, which a held-back writer changes on purpose.
    pending_reads = contenders.layout().reads_pending_blocks
    candidates = [schedule.generate(seed, KV_EVENTS, pending_reads) for seed in range(100)]
    valid = [
        s
        for s in candidates
        if not s.bad and not harness.run_schedule(s, [contenders.vllm_contender]).raised
    ]
    assert len(valid) >= 40
    published = 0
    for one in valid:
        outcome = harness.run_schedule(
            one, [contenders.vllm_contender, _held_back], read_stores=False
        )
        assert not outcome.differences, "\n".join(map(str, outcome.differences))
        published += outcome.outputs
    assert published > 0
