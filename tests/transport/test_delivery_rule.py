"""R3 rows go to the arena only for what leaves as a reference (docs/r3-reference.md, issue 45
item 6).

Over HTTP (a request vLLM's serving code adds while it answers an HTTP request: Starlette's
ASGI call, which the plugin marks), the finish keeps vLLM's rows and only an answer that renders
them (``numpy2base64`` in vLLM's serving modules) writes them into the arena: a non-streamed
completion or chat, ``/inference/v1/generate`` streamed or not. A streamed chunk (which carries
no routed experts), a client that disconnected (vLLM aborts its request; nobody renders the
abort's output) and beam search's inner requests (whose outputs vLLM consumes without
rendering) keep no slot. In process (``LLM``, ``AsyncLLM`` called directly, as verl, NeMo-RL and
SkyRL do, even beside an HTTP app in the same process), every output that carries rows carries
a reference, aborted ones included.

vLLM's own ``OutputProcessor``, ``RequestOutputCollector``, abort and serving modules, and a
FastAPI app called through its ASGI interface (what uvicorn calls per request); the arena's
figures (``slots_held``, ``references``) say whether a slot was taken. Skips where vLLM is not
importable.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import importlib.util
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("fastapi") is None:
    pytest.skip("vllm (with its fastapi) is not importable here", allow_module_level=True)

# What vLLM's API server has imported when the plugin loads: Starlette, and the serving modules
# whose answers render routed experts (imported here before the install, as in the server).
import fastapi
import starlette.applications
from aostore import r3
from aostore.vllm.install import swap, undo_swap
from aostore.vllm.transport import delivery, install
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1 import engine as v1_engine
from vllm.v1.engine import output_processor as op_module

SERVING = {
    "completion": "vllm.entrypoints.openai.completion.serving",
    "chat": "vllm.entrypoints.openai.chat_completion.serving",
    "generate": "vllm.entrypoints.scale_out.token_in_token_out.serving",
}
serving = {name: importlib.import_module(module) for name, module in SERVING.items()}
install_module = importlib.import_module("aostore.vllm.transport.install")

SHAPE = (46, 8)  # GLM-4.5-Air's row: 368 B
ROWS = 24  # rows of a request: two outputs of 12 rows


def rows_of(seed: int) -> np.ndarray:
    rows: np.ndarray = np.random.default_rng(seed).integers(0, 128, (ROWS, *SHAPE), np.uint8)
    return rows


def request(request_id: str, kind: RequestOutputKind) -> Any:
    params = SamplingParams(max_tokens=8, output_kind=kind, detokenize=False)
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


def step(processor: Any, request_id: str, rows: np.ndarray, finished: bool) -> None:
    """One engine-core output for the request: a token and its rows (a fresh array)."""
    reason = v1_engine.FinishReason.LENGTH if finished else None
    output = v1_engine.EngineCoreOutput(
        request_id=request_id, new_token_ids=[5], routed_experts=rows.copy(), finish_reason=reason
    )
    processor.process_outputs([output], 0.0, None)


class Frontend:
    """vLLM's ``OutputProcessor`` as ``AsyncLLM`` drives it: a request is added where its
    caller runs (an HTTP request's task, or a trainer's own) and its outputs go to its
    collector. Where a finish runs does not matter (in vLLM, its output handler's task): what
    the request's arrival recorded decides."""

    def __init__(self) -> None:
        self.processor = op_module.OutputProcessor(None, log_stats=False)
        self.queues: dict[str, Any] = {}

    def add(self, request_id: str, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        queue = op_module.RequestOutputCollector(kind, request_id)
        self.queues[request_id] = queue
        self.processor.add_request(request(request_id, kind), None, None, 0, queue)

    def run(self, request_id: str, rows: np.ndarray) -> None:
        """The request's two outputs, the second finishing it."""
        step(self.processor, request_id, rows[: ROWS // 2], finished=False)
        step(self.processor, request_id, rows[ROWS // 2 :], finished=True)

    def output(self, request_id: str) -> Any:
        """What the request's consumer gets (``RequestOutputCollector.get_nowait``)."""
        got = self.queues[request_id].get_nowait()
        assert got is not None
        return got


async def _answer(app: fastapi.FastAPI) -> None:
    """One HTTP request into ``app`` through its ASGI call, as uvicorn makes it."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(scope, receive, send)
    assert sent and sent[0]["status"] == 200, sent


def over_http(handler: Callable[[], Awaitable[Any]]) -> Any:
    """What ``handler`` returns when run as the endpoint of an HTTP request (vLLM's app is a
    FastAPI app; FastAPI's ``__call__`` calls Starlette's)."""
    app = fastapi.FastAPI()
    got: list[Any] = []

    @app.post("/")
    async def endpoint() -> dict[str, str]:
        got.append(await handler())
        return {}

    asyncio.run(_answer(app))
    return got[0]


def stats(installed: delivery.Delivery) -> dict[str, int]:
    gc.collect()  # outputs nobody holds are gone: so are their marks
    figures = installed.stats()
    assert figures is not None
    return figures


@pytest.fixture
def installed() -> Iterator[delivery.Delivery]:
    """aostore's transport with R3 by reference as the default, in a process that serves HTTP."""
    undo: list[Any] = []
    made = delivery.Delivery("reference", 8 << 20, 60.0)
    install(swap, undo, made)
    try:
        yield made
    finally:
        undo_swap(undo)
        assert delivery.installed() is None
        if made.arena is not None:
            made.arena.close()


def test_the_plugin_marks_http_requests_and_puts_starlette_back(
    installed: delivery.Delivery,
) -> None:
    app_call = vars(starlette.applications.Starlette)["__call__"]
    assert app_call.__wrapped__ is not None  # marked by the install
    for module in serving.values():  # the answers render through aostore's numpy2base64
        assert module.numpy2base64.__module__ == "aostore.vllm.transport.answer"

    async def seen() -> bool:
        return delivery.OVER_HTTP.get()

    assert over_http(seen) is True
    assert asyncio.run(seen()) is False
    undo: list[Any] = []
    assert install_module.answering_http(undo)  # once a process: the arena's start asks again
    assert not undo and vars(starlette.applications.Starlette)["__call__"] is app_call


def test_after_the_plugin_is_undone_starlette_is_vllms() -> None:
    original = vars(starlette.applications.Starlette)["__call__"]
    assert not hasattr(original, "__wrapped__")
    undo: list[Any] = []
    install(swap, undo, delivery.Delivery("reference", 1 << 20, 60.0))
    assert vars(starlette.applications.Starlette)["__call__"] is not original
    undo_swap(undo)
    assert vars(starlette.applications.Starlette)["__call__"] is original
    # Without R3 by reference nothing marks HTTP requests.
    install(swap, undo, None)
    assert vars(starlette.applications.Starlette)["__call__"] is original
    undo_swap(undo)


@pytest.mark.parametrize("answer", ["completion", "chat", "generate"])
def test_a_non_streamed_answer_carries_a_reference_that_reads_back(
    installed: delivery.Delivery, answer: str
) -> None:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/inference/v1/generate`` without
    streaming: the finished output is rendered, written into the arena then, and its reference
    reads vLLM's rows."""
    frontend = Frontend()
    rows = rows_of(1)

    async def handler() -> str:
        frontend.add("a")
        frontend.run("a", rows)  # vLLM's output handler: the finish
        completion = frontend.output("a").outputs[0]
        assert np.array_equal(completion.routed_experts, rows)  # until an answer renders them
        # Written once, into a slot the answer publishes: the arena's bytes, read-only.
        assert not completion.routed_experts.flags.writeable
        text: str = serving[answer].numpy2base64(completion.routed_experts)
        return text

    text = over_http(handler)
    assert len(text) < 1024
    assert np.array_equal(r3.Reader().fetch([text])[0], rows)
    figures = stats(installed)
    assert (figures["references"], figures["slots_held"]) == (1, 1)
    assert delivery.left_for_answers() == 0


def test_a_streamed_generate_carries_a_reference_in_its_last_chunk(
    installed: delivery.Delivery,
) -> None:
    """``/inference/v1/generate`` streamed: its last chunk carries the routed experts."""
    frontend = Frontend()
    rows = rows_of(2)

    async def handler() -> str:
        frontend.add("g", RequestOutputKind.DELTA)
        step(frontend.processor, "g", rows[: ROWS // 2], finished=False)
        first = frontend.output("g").outputs[0]
        assert first.routed_experts is None  # a chunk before the finish carries none
        step(frontend.processor, "g", rows[ROWS // 2 :], finished=True)
        last = frontend.output("g").outputs[0]
        text: str = serving["generate"].numpy2base64(last.routed_experts)
        return text

    text = over_http(handler)
    assert np.array_equal(r3.Reader().fetch([text])[0], rows)
    assert stats(installed)["references"] == 1


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_streamed_completion_or_chat_keeps_no_slot(
    installed: delivery.Delivery, kind: RequestOutputKind
) -> None:
    """Streamed ``/v1/completions`` and ``/v1/chat/completions`` chunks carry no routed
    experts: the last output's rows are never rendered, and never take a slot."""
    frontend = Frontend()
    rows = rows_of(3)

    async def handler() -> None:
        frontend.add("s", kind)
        frontend.run("s", rows)
        output = frontend.output("s")  # the stream's last chunk, rendered without its rows
        assert output.finished and output.outputs[0].routed_experts is not None

    over_http(handler)
    figures = stats(installed)
    assert (figures["references"], figures["slots_held"]) == (0, 0), figures
    assert delivery.left_for_answers() == 0


def test_a_non_streamed_output_nobody_renders_gives_its_slot_back(
    installed: delivery.Delivery,
) -> None:
    """A non-streamed answer's rows go into a reserved slot at the finish; if its answer never
    renders them (the client left between the finish and the answer), the slot goes back
    with the output, and no reference was made."""
    frontend = Frontend()
    rows = rows_of(6)

    async def handler() -> None:
        frontend.add("late")
        frontend.run("late", rows)
        output = frontend.output("late")
        assert np.array_equal(output.outputs[0].routed_experts, rows)
        assert installed.stats() is not None and installed.stats()["slots_held"] == 1

    over_http(handler)
    figures = stats(installed)  # the output is gone: so is its reservation
    assert (figures["references"], figures["slots_held"]) == (0, 0), figures
    assert delivery.left_for_answers() == 0


def test_a_disconnected_client_keeps_no_slot(installed: delivery.Delivery) -> None:
    """The client goes away mid-request: vLLM aborts it (``abort_requests``), whose final
    output, with the rows so far, goes to a collector nobody reads any more."""
    frontend = Frontend()
    rows = rows_of(4)

    async def handler() -> None:
        frontend.add("gone")
        step(frontend.processor, "gone", rows[: ROWS // 2], finished=False)

    over_http(handler)
    # The handler is cancelled; AsyncLLM.generate's cleanup aborts the request.
    frontend.processor.abort_requests(["gone"], internal=True)
    abort = frontend.queues["gone"].get_nowait()
    assert abort.outputs[0].finish_reason == "abort"
    assert abort.outputs[0].routed_experts is not None
    del abort
    frontend.queues.clear()  # the handler's task is gone, and its collector with it
    figures = stats(installed)
    assert (figures["references"], figures["slots_held"]) == (0, 0), figures


def test_beam_search_inner_requests_keep_no_slot(installed: delivery.Delivery) -> None:
    """Beam search (``vllm.entrypoints...beam_search``) adds a request per beam and step from
    the HTTP request's task, tasks of it included (``merge_async_iterators``), and builds its
    answer from their tokens and logprobs: their rows are never rendered."""
    frontend = Frontend()
    rows = rows_of(5)

    async def beam(request_id: str) -> Any:
        frontend.add(request_id)
        frontend.run(request_id, rows)
        return frontend.output(request_id).outputs[0].token_ids

    async def handler() -> list[Any]:
        tasks = [asyncio.create_task(beam(f"beam-{i}")) for i in range(4)]
        return await asyncio.gather(*tasks)

    assert len(over_http(handler)) == 4
    figures = stats(installed)
    assert (figures["references"], figures["slots_held"]) == (0, 0), figures


def test_in_process_every_output_carries_a_reference_aborted_ones_included(
    installed: delivery.Delivery,
) -> None:
    """``AsyncLLM`` called directly (verl's rollout server does so beside vLLM's HTTP app in
    one process): a finished request's output and an aborted one's carry references, and
    ``aostore.r3.fetch`` gives exactly the rows vLLM would have given (verl keeps an aborted
    segment's routes)."""
    frontend = Frontend()
    done, aborted = rows_of(6), rows_of(7)

    async def trainer() -> tuple[Any, Any]:
        frontend.add("done")
        frontend.run("done", done)
        frontend.add("aborted")
        step(frontend.processor, "aborted", aborted[: ROWS // 2], finished=False)
        frontend.processor.abort_requests(["aborted"], internal=True)
        return frontend.output("done"), frontend.output("aborted")

    finished, abort = asyncio.run(trainer())
    assert abort.outputs[0].finish_reason == "abort"
    references = [finished.outputs[0].routed_experts, abort.outputs[0].routed_experts]
    for reference in references:
        assert reference.dtype.names is not None and reference.shape == ()
    batch = r3.Reader().fetch(references)
    assert np.array_equal(batch[0], done)
    assert np.array_equal(batch[1], aborted[: ROWS // 2])
    batch.release()
    assert stats(installed)["references"] == 2


def test_a_rendered_answer_rendered_again_is_the_same_reference(
    installed: delivery.Delivery,
) -> None:
    frontend = Frontend()
    rows = rows_of(8)

    async def handler() -> tuple[str, str]:
        frontend.add("twice")
        frontend.run("twice", rows)
        completion = frontend.output("twice").outputs[0]
        encode = serving["completion"].numpy2base64
        return encode(completion.routed_experts), encode(completion.routed_experts)

    first, again = over_http(handler)
    assert first == again
    assert stats(installed)["references"] == 1


def test_rows_left_for_an_answer_that_do_not_fit_go_as_rows(
    installed: delivery.Delivery,
) -> None:
    """An answer's rows that find no room go as vLLM's rows (counted, as at a finish)."""
    installed.budget = 4096  # one page: these rows need three
    frontend = Frontend()
    rows = rows_of(9)

    async def handler() -> str:
        frontend.add("big")
        frontend.run("big", rows)
        completion = frontend.output("big").outputs[0]
        text: str = serving["completion"].numpy2base64(completion.routed_experts)
        return text

    text = over_http(handler)
    assert np.array_equal(r3.Reader().fetch([text])[0], rows)  # rows read as themselves
    figures = stats(installed)
    assert (figures["fallbacks"], figures["slots_held"]) == (1, 0), figures
