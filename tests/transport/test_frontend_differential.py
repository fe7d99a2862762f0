"""Differential at the level users see: vLLM's ``OutputProcessor`` with aostore's transport and
with vLLM's, fed the same engine outputs, give equal ``RequestOutput``s.

Per seed, a schedule of requests (``n`` of 1 to 3 through vLLM's ``ParentRequest`` fan-out, as
``AsyncLLM.add_request`` does; streaming ``DELTA`` and ``CUMULATIVE`` and non-streaming
``FINAL_ONLY``; stop strings, with or without the stop string in the output) gets, step by
step, outputs of one to four tokens with their routed-experts rows (the prompt's rows first;
several tokens accepted in one step, as with speculative decoding, so a stop string found
mid-step makes the frontend trim surplus tokens and rows), engine-side finishes (length, EOS),
client aborts, requests that finish in their first step, and outputs that still arrive for a
request the frontend has already finished by a stop string. A real detokenizer runs: a
word-level fast tokenizer built here, offline.

aostore's arm is what its processes do: the rows are views of a step's ``StepRows`` buffer,
encoded by the engine core's ``MsgpackEncoder`` with aostore's method (inline) and decoded by
vLLM's decoder, and the frontend's ``RequestState`` is aostore's (``RowChunks``). The packed
arm is the packed hop (``aostore.vllm.transport.wire``): the engine core's ``encode_into``
sends the step's rows as one trailing frame, the frontend's ``decode`` keeps it and
``process_outputs`` delivers the rows into the pages natively before vLLM's loop (whose
``_trim_surplus_tokens`` sees them for a stop string found mid-step). vLLM's arm:
fresh arrays, vLLM's encoder (a frame per row), vLLM's ``RequestState``. Compared: every
``RequestOutput`` of every step (each field, arrays by type, dtype, shape, values and
writability) and what each abort returns. Nothing differs between two runs of stock vLLM in
this harness (the same arrival times and ids are given to both), so nothing is masked.
Skips where vLLM is not importable.
"""

from __future__ import annotations

import copy
import importlib.util
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable here", allow_module_level=True)

from aostore import r3
from aostore._native import pending_step_rows
from aostore.r3 import format as r3_format
from aostore.vllm.install import swap, undo_swap
from aostore.vllm.transport import StepRows, delivery, install
from aostore.vllm.transport.frontend import RowChunks, request_state_subclass
from aostore.vllm.transport.wire import encode_into_method
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1 import engine as v1_engine
from vllm.v1 import serial_utils
from vllm.v1.engine import output_processor as op_module
from vllm.v1.engine.parallel_sampling import ParentRequest

SHAPE = (4, 2)  # a row: layers x top-k, small (the wire's size rule is exercised by rows of
WIDE = (46, 8)  # GLM-4.5-Air's 368 B, used by some requests' rows: a frame each in vLLM's arm)
WORDS = [f"w{i}" for i in range(8)]
EOS = len(WORDS)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)} | {"[EOS]": EOS, "[UNK]": EOS + 1}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="[EOS]", unk_token="[UNK]")


@pytest.fixture(scope="module")
def transport() -> Iterator[type]:
    """aostore's transport installed (the encoder's method; the frontend's RequestState in
    vLLM's modules); yields aostore's and puts vLLM's back after."""
    vllm_state = op_module.RequestState
    undo: list[Any] = []
    install(swap, undo)
    ours = op_module.RequestState
    op_module.RequestState = vllm_state  # each arm's add_request picks its own below
    try:
        yield ours
    finally:
        op_module.RequestState = ours
        undo_swap(undo)


@dataclass
class Live:
    """A request (one child of a parent) as the engine core runs it."""

    request_id: str
    prompt_len: int
    max_tokens: int
    shape: tuple[int, int]
    sent: int = 0  # tokens sent
    stopped_at: int | None = None  # the step the frontend finished it (a stop string)


@dataclass
class Arm:
    """One side: its output processor, the ``RequestState`` class its requests get, and the
    engine core's encoder."""

    name: str
    processor: Any
    state_class: type
    encoder: Any

    def add(self, request: Any, prompt: str, parent: Any, index: int) -> None:
        if self.name == "reference":  # the client asks for its rows by reference
            params = request.sampling_params
            params.extra_args = {**(params.extra_args or {}), delivery.KEY: "reference"}
        vllm_state = op_module.RequestState
        op_module.RequestState = self.state_class  # what add_request looks up
        try:
            self.processor.add_request(request, prompt, parent, index, None)
        finally:
            op_module.RequestState = vllm_state


def normalized(value: Any) -> Any:
    """A value as compared: arrays by type, dtype, shape, bytes and writability; objects by
    their fields."""
    if isinstance(value, np.ndarray):
        return (
            "ndarray",
            type(value),
            value.dtype.str,
            value.shape,
            value.tobytes(),
            value.flags.writeable,
        )
    if isinstance(value, (list, tuple)):
        return (type(value), [normalized(v) for v in value])
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return (type(value).__name__, normalized(vars(value)))
    return value


def requests_for(rng: random.Random, step: int, count: int) -> list[tuple[Any, str, int]]:
    """New client requests: (EngineCoreRequest, prompt text, n)."""
    made = []
    for i in range(count):
        prompt_len = rng.randint(1, 12)
        prompt_ids = [rng.randrange(len(WORDS)) for _ in range(prompt_len)]
        n = rng.choice([1, 1, 2, 3])
        kind = rng.choice(list(RequestOutputKind))
        stop = rng.choice([None, ["w1 w2"], ["w3"], ["w0 w0", "w5 w6 w7"]])
        params = SamplingParams(
            n=n,
            max_tokens=rng.choice([1, 2, 5, 12, 30]),
            output_kind=kind,
            stop=stop,
            include_stop_str_in_output=rng.random() < 0.3,
            seed=rng.choice([None, 7]) if n > 1 else None,
            temperature=1.0,
        )
        request_id = f"s{step}-r{i}"
        request = v1_engine.EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=1000.0 + step,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=f"ext-{request_id}",
        )
        made.append((request, " ".join(WORDS[t] for t in prompt_ids), n))
    return made


def fan_out(request: Any, n: int) -> tuple[Any, list[Any]]:
    """``AsyncLLM.add_request``'s fan-out of ``n`` > 1 (``None`` and the request for 1)."""
    if n == 1:
        return None, [request]
    parent = ParentRequest(request)
    children = []
    for index in range(n):
        child_id, child_params = parent.get_child_info(index)
        child = request if index == n - 1 else copy.copy(request)
        child.request_id = child_id
        child.sampling_params = child_params
        children.append(child)
    return parent, children


def dereferenced(request_outputs: list[Any], reader: r3.Reader) -> list[Any]:
    """The reference arm's outputs as its client sees them: each reference replaced by the
    rows ``aostore.r3`` reads for it (into a buffer of the client's)."""
    for request_output in request_outputs:
        for completion in request_output.outputs:
            routed = completion.routed_experts
            if routed is None:
                continue
            assert routed.dtype.names is not None, "rows where a reference was asked for"
            dtype, shape = r3_format.rows_of(r3_format.parse(routed))
            out = np.empty(shape, dtype)
            reader.fetch([routed], out=out)
            completion.routed_experts = out
    return request_outputs


def run(seed: int, ours_state: type, reference: bool = False) -> int:
    """One schedule through both arms (and, with ``reference``, a third whose requests ask for
    their rows by reference); returns the number of outputs compared."""
    rng = random.Random(seed)
    rows_rng = np.random.default_rng(seed)
    vllm_state = op_module.RequestState
    arms = [
        Arm(
            "vllm",
            op_module.OutputProcessor(tokenizer(), log_stats=False),
            vllm_state,
            serial_utils.MsgpackEncoder(),
        ),
        Arm(
            "aostore",
            op_module.OutputProcessor(tokenizer(), log_stats=False),
            ours_state,
            serial_utils.MsgpackEncoder(),
        ),
        Arm(
            "packed",
            op_module.OutputProcessor(tokenizer(), log_stats=False),
            ours_state,
            serial_utils.MsgpackEncoder(),
        ),
    ]
    if reference:
        arms.append(
            Arm(
                "reference",
                op_module.OutputProcessor(tokenizer(), log_stats=False),
                ours_state,
                serial_utils.MsgpackEncoder(),
            )
        )
    reader = r3.Reader()
    decoder = serial_utils.MsgpackDecoder(v1_engine.EngineCoreOutputs)
    live: dict[str, Live] = {}
    compared = 0
    for step in range(40):
        # New requests (some only at the start); the same objects' copies for both arms.
        for request, prompt, n in requests_for(rng, step, rng.choice([0, 0, 1, 3])):
            for arm in arms:
                parent, children = fan_out(copy.deepcopy(request), n)
                for index, child in enumerate(children):
                    arm.add(child, prompt, parent, index)
            shape = WIDE if rng.random() < 0.3 else SHAPE
            _, children = fan_out(copy.deepcopy(request), n)
            for child in children:
                live[child.request_id] = Live(
                    child.request_id,
                    len(child.prompt_token_ids),
                    child.sampling_params.max_tokens,
                    shape,
                )
        # A client abort now and then (by the external id, as the API server does).
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            external = f"ext-{victim.split('_', 1)[-1]}"
            results = [
                sorted(arm.processor.abort_requests([external], internal=False)) for arm in arms
            ]
            assert all(r == results[0] for r in results), (seed, step, results)
            for rid in [r for r in live if r.split("_", 1)[-1] == victim.split("_", 1)[-1]]:
                del live[rid]
        # The engine's outputs of this step.
        specs = []
        for rid, request in sorted(live.items()):
            if request.stopped_at is not None and step > request.stopped_at + 1:
                continue  # the abort reached the engine core
            k = rng.randint(1, 4)
            tokens = [rng.choice([*range(len(WORDS)), EOS]) for _ in range(k)]
            finish = None
            if EOS in tokens:
                tokens = tokens[: tokens.index(EOS) + 1]
                finish = v1_engine.FinishReason.STOP
            if request.sent + len(tokens) >= request.max_tokens:
                tokens = tokens[: request.max_tokens - request.sent]
                finish = finish if tokens and tokens[-1] == EOS else v1_engine.FinishReason.LENGTH
            count = request.prompt_len + len(tokens) - 1 if request.sent == 0 else len(tokens)
            if rng.random() < 0.2:  # fewer rows than tokens, down to none: a trim can cut
                count = rng.randint(0, count)  # more tokens than the output has rows
            rows = rows_rng.integers(0, 128, (count, *request.shape), np.uint8)
            specs.append((rid, tokens, finish, rows))
            request.sent += len(tokens)
        if not specs:
            continue
        outputs_by_arm = []
        for arm in arms:
            made = []
            packed = None
            if arm.name != "vllm":
                packed = pack({rid: rows for rid, _, _, rows in specs})
            for rid, tokens, finish, rows in specs:
                routed = packed[rid].rows if packed is not None else rows.copy()
                made.append(
                    v1_engine.EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=list(tokens),
                        routed_experts=routed,
                        finish_reason=finish,
                        stop_reason=None,
                    )
                )
            message = v1_engine.EngineCoreOutputs(outputs=made, engine_index=0)
            if arm.name in ("packed", "reference"):
                frames = packed_encode(arm.encoder, message, bytearray())
                # vLLM's frames, then the rows'; the message keeps its rows after.
                assert len(frames) == 2
                assert all(out.routed_experts is not None for out in made)
            else:
                frames = arm.encoder.encode(message)
            if arm.name == "aostore":
                assert len(frames) == 1  # every row inline
            outputs_by_arm.append(decoder.decode([bytes(f) for f in frames]).outputs)
        results = []
        for arm, outputs in zip(arms, outputs_by_arm, strict=True):
            result = arm.processor.process_outputs(outputs, 2000.0 + step, None)
            request_outputs = result.request_outputs
            if arm.name == "reference":
                request_outputs = dereferenced(request_outputs, reader)
            results.append((normalized(request_outputs), sorted(result.reqs_to_abort)))
            for rid in result.reqs_to_abort:
                if rid in live:
                    live[rid].stopped_at = step
        for other in results[1:]:
            assert other == results[0], (seed, step)
        compared += len(results[0][0])
        for rid, _, finish, _ in specs:
            if finish is not None:
                live.pop(rid, None)
        for rid in [r for r, req in live.items() if req.stopped_at is not None]:
            if step > live[rid].stopped_at + 1:  # type: ignore[operator]
                del live[rid]
    # The aostore arms held their rows in RowChunks, never a list; no packed rows were left.
    for arm in arms[1:]:
        for state in arm.processor.request_states.values():
            assert type(state.routed_experts_chunks) is RowChunks
            assert state.routed_experts_chunks.paged
    assert pending_step_rows() == 0
    return compared


packed_encode = encode_into_method(
    vars(serial_utils.MsgpackEncoder)["encode_into"], v1_engine.EngineCoreOutputs
)
"""What an engine core whose frontend reads packed frames sends (installed there by the rule;
built here over vLLM's method whatever the fixture installed)."""


def pack(rows_by_request: dict[str, np.ndarray]) -> StepRows:
    """A step's rows as aostore's worker hands them over, one buffer per row shape."""
    by_shape: dict[tuple[int, ...], dict[str, Any]] = {}
    for rid, rows in rows_by_request.items():
        by_shape.setdefault(rows.shape[1:], {})[rid] = rows
    merged: dict[str, Any] = {}
    for group in by_shape.values():
        packed = StepRows.pack({rid: _Output(0, rows) for rid, rows in group.items()})
        merged |= {rid: packed[rid] for rid in group}
    return merged  # type: ignore[return-value]


@dataclass
class _Output:
    token_start: int
    rows: np.ndarray


@pytest.mark.parametrize("seed", range(60))
def test_request_outputs_are_vllms(seed: int, transport: type) -> None:
    assert run(seed, transport) > 0


@pytest.mark.parametrize("seed", range(30))
def test_rows_by_reference_read_back_as_vllms_rows(seed: int, transport: type) -> None:
    """R3 by reference: a third arm whose requests ask for references; what ``aostore.r3``
    reads for each is vLLM's finished rows exactly (after its stop trimming), and every other
    field is vLLM's."""
    made = delivery.Delivery("rows", 64 << 20, 60.0)
    ours = request_state_subclass(op_module.RequestState, made)  # vLLM's, between the arms
    try:
        assert run(seed, ours, reference=True) > 0
        stats = made.stats()
        assert stats is not None and stats["references"] > 0 and stats["fallbacks"] == 0
    finally:
        if made.arena is not None:
            made.arena.close()
