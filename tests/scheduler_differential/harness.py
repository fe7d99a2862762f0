"""Drives scheduler connectors through one schedule in lockstep and reports every difference.

Each contender gets a :class:`World`: its own stand-in KV cache manager (pool of GPU-cached
hashes) and its own vLLM ``Request`` objects, rebuilt from the schedule's plain-data operations.
Each operation runs on every contender in turn; after each connector call the harness
compares with the first contender (the reference):

- the exception: both raise or neither does, and the other's is an instance of the reference's
  class (or of its replacement in ``contenders.ERROR_CLASSES``); messages are not compared;
- the returned value: ``build_connector_meta``'s metadata (generation; requests in order with
  their token starts; block hashes in order, each ``data`` and ``item_size``; finished
  requests; on 0.33.0 the retained and released hashes), ``take_output``'s rows (``None``, or
  dtype, shape and bytes), ``max_cache_hit``'s and ``cap_external_hit``'s ints, ``None``
  elsewhere;
- the requests the connector was handed are left as they were (tokens, hashes, computed).

A schedule stops at the first exception (vLLM leaves its state half-updated then).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import standins
from .contenders import ERROR_CLASSES, Factory, Setup
from .schedule import (
    CONNECTOR_OPS,
    Add,
    Append,
    Build,
    Cache,
    CapHit,
    Finish,
    Loading,
    MaxHit,
    Op,
    Reset,
    Schedule,
    SetComputed,
    SetFinished,
    Take,
    Truncate,
)

ROW_SHAPE = (3, 2)
_BASE = (np.arange(4096 * 6, dtype=np.int64) * 2654435761 % 251).astype(np.uint8)
BASE_ROWS = _BASE.reshape(4096, *ROW_SHAPE)
"""The worker's rows: token t's row is BASE_ROWS[t] (the same for every contender)."""


@dataclass
class Difference:
    seed: int
    index: int
    op: str
    contender: str
    what: str

    def __str__(self) -> str:
        return (
            f"seed {self.seed}, operation {self.index} ({self.op}), {self.contender}: {self.what}"
        )


@dataclass
class Outcome:
    seed: int
    differences: list[Difference] = field(default_factory=list)
    ops: int = 0
    calls: int = 0
    raised: str = ""
    """The reference's exception class that ended the schedule ("" when none did)."""
    events: Counter[str] = field(default_factory=Counter)
    """What the reference's results showed (hash-only updates, retains, releases, ...)."""


class World:
    """One contender's connector, requests and stand-ins."""

    def __init__(self, schedule: Schedule, factory: Factory, name: str) -> None:
        params = schedule.params
        self.name = name
        self.params = params
        self.manager = None
        if params.kv_events:
            self.manager = standins.kv_cache_manager(
                params.block_size, params.hash_block_size, params.num_blocks
            )
        setup = Setup(self.manager, object() if params.kv_connector else None, params.kv_events)
        self.connector = factory(setup)
        self.requests: dict[str, Any] = {}  # every request made
        self.live: dict[str, Any] = {}  # the scheduler's requests

    def apply(self, op: Op) -> tuple[Any, BaseException | None]:
        try:
            return self._apply(op), None
        except Exception as error:
            return None, error

    def _apply(self, op: Op) -> Any:
        from vllm.v1.request import RequestStatus

        connector = self.connector
        if isinstance(op, Add):
            request = standins.make_request(
                op.rid, op.prompt, op.prompt_start, self.params.hash_block_size
            )
            self.requests[op.rid] = self.live[op.rid] = request
            return None
        if isinstance(op, SetComputed):
            self.requests[op.rid].num_computed_tokens = op.tokens
            return None
        if isinstance(op, Append):
            request = self.requests[op.rid]
            request.append_output_token_ids(list(op.tokens))
            request.num_computed_tokens -= op.rejected
            return None
        if isinstance(op, SetFinished):
            self.requests[op.rid].status = RequestStatus.FINISHED_STOPPED
            return None
        if isinstance(op, Cache):
            pool = self.manager.block_pool if self.manager is not None else None
            if pool is not None:
                if op.clear:
                    pool.cached.clear()
                pool.cached.update(op.add)
                pool.cached.difference_update(op.drop)
            return None
        if isinstance(op, Truncate):
            self.requests[op.rid].block_hashes.pop()
            return None
        if isinstance(op, Build):
            from vllm.v1.core.sched.output import SchedulerOutput

            output = SchedulerOutput.make_empty()
            output.num_scheduled_tokens = dict(op.scheduled)
            output.total_num_scheduled_tokens = sum(op.scheduled.values())
            metadata = connector.build_connector_meta(output, self.live)
            # The scheduler then advances the computed tokens (_update_after_schedule).
            for rid, count in op.scheduled.items():
                self.requests[rid].num_computed_tokens += count
            return metadata
        if isinstance(op, Take):
            from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

            outputs = None
            if op.outputs is not None:
                outputs = {
                    rid: AuxRequestOutput(start, BASE_ROWS[start : start + rows])
                    for rid, (start, rows) in op.outputs.items()
                }
            return connector.take_output(self.requests[op.rid], outputs)
        if isinstance(op, Finish):
            request = self.requests[op.rid]
            connector.request_finished(request)
            if op.remove:
                del self.live[op.rid]
            else:
                request.num_computed_tokens = 0  # preempted: scheduled again from 0
            return None
        if isinstance(op, Reset):
            return connector.reset()
        if isinstance(op, MaxHit):
            return connector.max_cache_hit(self.requests[op.rid])
        if isinstance(op, CapHit):
            return connector.cap_external_hit(self.requests[op.rid], op.num_local, op.num_external)
        if isinstance(op, Loading):
            return connector.request_loading(self.requests[op.rid], op.tokens)
        raise TypeError(op)

    def snapshot(self, rid: str) -> Any:
        request = self.requests.get(rid)
        if request is None:
            return None
        return (
            tuple(request.all_token_ids),
            tuple(request.block_hashes),
            request.num_computed_tokens,
            request.status,
        )


def _packed(value: Any) -> Any:
    if value is None:
        return None
    return (bytes(value.data), int(value.item_size))


def canonical(op: Op, result: Any) -> Any:
    """What a connector call returned, as plain comparable data."""
    if isinstance(op, Build):
        fields = [
            ("generation", int(result.generation)),
            ("requests", [(rid, int(start)) for rid, start in result.requests.items()]),
            (
                "block_hashes",
                [(rid, _packed(hashes)) for rid, hashes in result.block_hashes.items()],
            ),
            ("finished_requests", tuple(result.finished_requests)),
            ("finished_requests type", type(result.finished_requests).__name__),
        ]
        for name in ("retained_block_hashes", "released_block_hashes"):
            if hasattr(result, name):
                fields.append((name, _packed(getattr(result, name))))
        return fields
    if isinstance(op, Take):
        if result is None:
            return None
        rows = np.asarray(result)
        return [("dtype", str(rows.dtype)), ("shape", rows.shape), ("bytes", rows.tobytes())]
    if isinstance(op, MaxHit | CapHit):
        return [("value", result if result is None else int(result))]
    return [("value", result)]


def _describe(reference: Any, other: Any) -> str:
    if reference is None or other is None or not isinstance(reference, list):
        return f"returned {_short(other)} instead of {_short(reference)}"
    ours = dict(reference)
    for name, _value in other:
        if name not in ours:
            return f"has {name} (the reference has none)"
    theirs = dict(other)
    for name, value in reference:
        if theirs.get(name, "missing") != value:
            return f"{name}: {_short(theirs.get(name, 'missing'))} instead of {_short(value)}"
    return "differs"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


def _same_error(reference: BaseException, other: BaseException) -> bool:
    cls = type(reference)
    if isinstance(other, cls):
        return True
    replaced = ERROR_CLASSES.get(cls)
    return replaced is not None and isinstance(other, replaced)


def _tally(outcome: Outcome, op: Op, result: Any) -> None:
    events = outcome.events
    if isinstance(op, Build):
        events["metadata"] += 1
        scheduled, finished = result.requests, set(result.finished_requests)
        for rid in result.block_hashes:
            if rid in finished and rid not in scheduled:
                events["final hashes with a finish"] += 1
            elif rid not in scheduled:
                events["hash-only update"] += 1
        events["finished requests delivered"] += len(finished)
        if getattr(result, "retained_block_hashes", None) is not None:
            events["metadata with retains"] += 1
        if getattr(result, "released_block_hashes", None) is not None:
            events["metadata with releases"] += 1
        if result.generation:
            events["metadata past generation 0"] += 1
    elif isinstance(op, Take):
        events["take_output None" if result is None else "take_output rows"] += 1
        if result is not None and len(result) == 0:
            events["take_output empty rows"] += 1
    elif isinstance(op, MaxHit):
        events["max_cache_hit > 0" if result else "max_cache_hit 0"] += 1
    elif isinstance(op, CapHit):
        events["cap_external_hit kept" if result else "cap_external_hit 0"] += 1


def _label(op: Op) -> str:
    rid = getattr(op, "rid", None)
    return f"{type(op).__name__}" + (f" {rid}" if rid else "")


def run_schedule(
    schedule: Schedule, factories: Sequence[Factory], names: Sequence[str] | None = None
) -> Outcome:
    """Every operation of ``schedule`` on a connector from each factory; the differences."""
    outcome = Outcome(schedule.seed)
    names = list(names or [getattr(f, "contender_name", f.__name__) for f in factories])
    worlds = [
        World(schedule, factory, name) for factory, name in zip(factories, names, strict=True)
    ]
    for index, op in enumerate(schedule.ops):
        is_call = isinstance(op, CONNECTOR_OPS)
        results = []
        for world in worlds:
            result, error = world.apply(op)
            if is_call and error is None:
                result = canonical(op, result)
            results.append((result, error))
        outcome.ops += 1
        outcome.calls += is_call
        (reference, reference_error) = results[0]
        rids = set(getattr(op, "scheduled", {})) | {getattr(op, "rid", "")}
        before = {rid: worlds[0].snapshot(rid) for rid in rids}

        def differ(world: World, what: str, op: Op = op, index: int = index) -> None:
            outcome.differences.append(
                Difference(schedule.seed, index, _label(op), f"{world.name} vs {names[0]}", what)
            )

        for world, (result, error) in zip(worlds[1:], results[1:], strict=True):
            if (reference_error is None) != (error is None):
                raised = reference_error if error is None else error
                who = names[0] if error is None else world.name
                differ(world, f"only {who} raised {type(raised).__name__}: {raised}")
            elif reference_error is not None and error is not None:
                if not _same_error(reference_error, error):
                    differ(
                        world,
                        f"raised {type(error).__name__} where {names[0]} raised "
                        f"{type(reference_error).__name__}",
                    )
            elif is_call and result != reference:
                differ(world, _describe(reference, result))
            if is_call and not outcome.differences:
                for rid, state in before.items():
                    if world.snapshot(rid) != state:
                        differ(world, f"request {rid} is not as the reference left it")
        if reference_error is None and is_call:
            _tally(outcome, op, _raw_result(worlds[0], op, reference))
        if outcome.differences:
            break
        if any(error is not None for _, error in results):
            outcome.raised = type(reference_error or results[1][1]).__name__
            break
    return outcome


def _raw_result(world: World, op: Op, canonical_result: Any) -> Any:
    """The fields _tally reads, from the canonical form."""
    if isinstance(op, Build):
        fields = dict(canonical_result)

        return SimpleNamespace(
            generation=fields["generation"],
            requests=dict(fields["requests"]),
            block_hashes=dict(fields["block_hashes"]),
            finished_requests=fields["finished_requests"],
            retained_block_hashes=fields.get("retained_block_hashes"),
            released_block_hashes=fields.get("released_block_hashes"),
        )
    if isinstance(op, Take):
        return None if canonical_result is None else [0] * dict(canonical_result)["shape"][0]
    return dict(canonical_result)["value"]
