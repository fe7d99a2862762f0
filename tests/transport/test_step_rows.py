"""``StepRows``, a step's routed-experts outputs as one buffer, against vLLM's dict.

What vLLM's engine core reads of the worker's ``dict[str, AuxRequestOutput]`` (the mapping,
vLLM's own ``take_output``) it reads the same of a ``StepRows``, before and after the hop's
pickling (shared-memory queue: protocol 5, buffers from 1 MiB out of band); aostore's
``StepRows.take`` gives ``take_output``'s rows and raises its assertions with its messages for
any request; a reader that does not know the pickled format raises, naming aostore; bad input
to the constructor is refused. Skips where vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from aostore.vllm.transport import StepArray, StepRows, is_step_rows
from aostore.vllm.transport import rows as rows_module
from vllm.distributed.aux_output_connector import connector as aux

SHAPE = (46, 8)


def step(counts: list[int], starts: list[int], seed: int = 0) -> dict[str, Any]:
    """vLLM's worker output for a step: views of one array, as vLLM's connector returns."""
    data = np.random.default_rng(seed).integers(0, 128, (sum(counts), *SHAPE), np.uint8)
    outputs, offset = {}, 0
    for i, (count, start) in enumerate(zip(counts, starts, strict=True)):
        outputs[f"req-{i}"] = aux.AuxRequestOutput(start, data[offset : offset + count])
        offset += count
    return outputs


def same_outputs(got: Any, want: dict[str, Any]) -> None:
    assert list(got) == list(want) and len(got) == len(want)
    for request_id, output in want.items():
        assert request_id in got
        mine = got[request_id]
        assert type(mine) is aux.AuxRequestOutput
        assert mine.token_start == output.token_start
        assert type(mine.rows) is np.ndarray and mine.rows.dtype == output.rows.dtype
        assert mine.rows.shape == output.rows.shape and np.array_equal(mine.rows, output.rows)
    assert "no such request" not in got and 7 not in got
    with pytest.raises(KeyError):
        got["no such request"]


def shm_round_trip(obj: Any) -> Any:
    """The shared-memory queue's pickling (vLLM's ``MessageQueue.enqueue``/``dequeue``)."""
    buffers: list[Any] = []

    def oob(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if len(raw) < 1024 * 1024:
            return True
        buffers.append(bytes(raw))
        return False

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=oob)
    return pickle.loads(data, buffers=[bytearray(b) for b in buffers])


@pytest.mark.parametrize(
    "counts",
    [[1] * 500, [700, 1, 1, 3], [4000, 1] * 2, [0, 2, 0]],
    ids=["decodes", "a prefill", "out of band", "empty rows"],
)
def test_it_is_vllms_dict_before_and_after_the_queue(counts: list[int]) -> None:
    want = step(counts, [5 * i for i in range(len(counts))])
    packed = StepRows.pack(want)
    same_outputs(packed, want)
    crossed = shm_round_trip(packed)
    assert type(crossed) is StepRows
    same_outputs(crossed, want)
    # Fresh and Python-owned on the far side, writable, and marked as step rows for the wire.
    rows = crossed["req-0"].rows
    assert rows.flags.writeable and is_step_rows(rows)
    assert not is_step_rows(np.zeros((2, *SHAPE), np.uint8))
    assert not is_step_rows(want["req-0"].rows)


def test_it_pickles_as_one_buffer_not_an_object_per_request() -> None:
    want = step([1] * 500, list(range(500)))
    mine = pickle.dumps(StepRows.pack(want), protocol=5)
    theirs = pickle.dumps(want, protocol=5)
    # vLLM's: a dataclass and an ndarray's reduce per request; ours: the ids and one buffer.
    assert mine.count(b"AuxRequestOutput") == 0 and theirs.count(b"numpy") >= 1
    assert len(mine) < len(theirs)
    assert len(pickle.loads(mine)) == 500


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6),  # rows in the output
            st.integers(0, 40),  # token start
            st.integers(1, 50),  # the request's num_tokens
            st.booleans(),  # finished
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 5),
    st.booleans(),
)
def test_take_is_vllms_take_output(
    requests: list[tuple[int, int, int, bool]], missing_at: int, backwards: bool
) -> None:
    """In the worker's order (the native index's next request), backwards (found by id), with
    a request the step lacks, each request taken twice."""
    outputs = step([r[0] for r in requests], [r[1] for r in requests])
    packed = shm_round_trip(StepRows.pack(outputs))
    connector = aux.AuxOutputSchedulerConnector.__new__(aux.AuxOutputSchedulerConnector)
    order = list(enumerate(requests))
    for i, (_, _, num_tokens, finished) in reversed(order) if backwards else order:
        request_id = f"req-{i}" if i != missing_at else "not sent"
        request = SimpleNamespace(
            request_id=request_id, num_tokens=num_tokens, is_finished=lambda f=finished: f
        )
        want: Any
        try:
            want = connector.take_output(request, outputs)
        except AssertionError as error:
            want = ("AssertionError", str(error))
        for reader in (packed.take, lambda r: connector.take_output(r, packed)):
            got: Any
            try:
                got = reader(request)
            except AssertionError as error:
                got = ("AssertionError", str(error))
            if isinstance(want, np.ndarray):
                assert isinstance(got, np.ndarray) and got.shape == want.shape
                assert np.array_equal(got, want) and is_step_rows(got)
            else:
                assert got == want


def test_a_reader_of_another_format_or_aostore_raises_naming_aostore() -> None:
    packed = StepRows.pack(step([2, 1], [0, 4]))
    function, arguments = packed.__reduce__()
    assert function is rows_module._rebuild
    for changed in ((99, *arguments[1:]), (arguments[0], "0.0.0-other", *arguments[2:])):
        data = pickle.dumps(_Reduced(function, changed), protocol=5)
        with pytest.raises(RuntimeError, match="aostore transport") as caught:
            pickle.loads(data)
        assert "AOSTORE_VLLM_TRANSPORT=0" in str(caught.value)


class _Reduced:
    def __init__(self, function: Any, arguments: tuple[Any, ...]) -> None:
        self.reduced = (function, arguments)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduced


def test_bad_input_is_refused() -> None:
    rows = rows_module._rows(bytearray(368 * 3), np.uint8, SHAPE)
    assert type(rows.base) is StepArray and len(rows) == 3
    with pytest.raises(ValueError, match="index of shape"):
        StepRows(("a", "b"), np.zeros((1, 2), "<i8"), rows)
    with pytest.raises(ValueError, match="rows end at 4"):
        StepRows(("a",), np.array([[0, 4]], "<i8"), rows)
    with pytest.raises(ValueError, match="no outputs"):
        StepRows.pack({})
    packed = StepRows.pack(step([1], [0]))
    with pytest.raises(TypeError):
        packed["req-0"] = None  # type: ignore[index]
