"""Drives contenders through one schedule in lockstep and reports every difference.

Each operation of the schedule runs on every contender in turn (each gets its own copy of
the inputs); after it, the harness compares with the first contender (the reference):

- the exception: both raise or neither does; the other's is an instance of the reference's
  class, or of the class aostore's plugin put in its place (messages are not compared);
- after ``process_output``: the outputs' request ids (in order), each ``token_start`` (value and
  type) and its rows (type, dtype, shape, bytes, and the ``writeable`` and ``c_contiguous`` flags);
- the store's contents (:class:`~.contenders.StoreView`: keys and bytes, reference counts,
  evictable keys in LRU order, ``num_slots``, whether the writer latched an error), read once
  the writer has applied every queued put;
- that earlier outputs did not change: each output's rows are copied when it is returned and
  compared again after later steps and at the end.

A schedule stops at the first exception (vLLM leaves its state half-updated then).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import standins
from .contenders import Built, Factory, StoreView
from .schedule import Begin, Enqueue, Op, Prepare, Process, Schedule

# Outputs re-checked after each processed step: those of the last few processed steps.
RECHECK_STEPS = 3


_UNREAD = StoreView()


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
    outputs: int = 0
    raised: str = ""
    """The reference's exception class that ended the schedule ("" when none did)."""


def _metadata(op: Begin) -> Any:
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputConnectorMetadata,
        PackedBlockHashes,
    )

    def pack(hashes: Sequence[bytes] | None) -> Any:
        if not hashes:
            return None
        return PackedBlockHashes(b"".join(hashes), len(hashes[0]))

    fields = {f.name for f in dataclasses.fields(AuxOutputConnectorMetadata)}
    extra = {}
    if "retained_block_hashes" in fields:
        extra = {
            "retained_block_hashes": pack(op.retained),
            "released_block_hashes": pack(op.released),
        }
    return AuxOutputConnectorMetadata(
        op.generation,
        dict(op.requests),
        {rid: pack(hashes) for rid, hashes in op.block_hashes.items()},
        tuple(op.finished),
        **extra,
    )


@dataclass
class _Run:
    built: Built
    pending: dict[int, Any] = field(default_factory=dict)
    # (step, request id, output object, token_start, rows copy)
    kept: list[tuple[int, str, Any, int, np.ndarray]] = field(default_factory=list)


def _call(run: _Run, op: Op) -> tuple[Any, BaseException | None]:
    connector = run.built.connector
    try:
        if isinstance(op, Begin):
            connector.begin_step(_metadata(op))
            return None, None
        if isinstance(op, Prepare):
            capturer = run.built.capturer
            capturer.load(op.rows)
            dtype = capturer.output_dtype
            if op.dtype_name is not None:
                capturer.output_dtype = getattr(torch, op.dtype_name)
            try:
                batch = standins.StandInInputBatch(
                    list(op.req_ids), op.query_start_loc.copy(), op.token_starts.copy()
                )
                run.pending[op.step] = connector.prepare_output(batch)
            finally:
                capturer.output_dtype = dtype
            return None, None
        if isinstance(op, Enqueue):
            run.pending[op.step].enqueue_cpu_copy(op.num_sampled.copy(), op.num_rejected.copy())
            return None, None
        assert isinstance(op, Process)
        return run.pending.pop(op.step).process_output(), None
    except Exception as error:
        return None, error


def _same_error(reference: BaseException, other: BaseException, built: Built) -> bool:
    cls = type(reference)
    if isinstance(other, cls):
        return True
    replaced = built.error_classes.get(cls)
    return replaced is not None and isinstance(other, replaced)


def _output_diff(reference: Any, other: Any) -> str:
    if type(other).__name__ == "StepRows":
        return _packed_diff(reference, other)
    if not isinstance(other, dict) or not isinstance(reference, dict):
        return f"outputs are {type(other).__name__}, not {type(reference).__name__}"
    if list(reference) != list(other):
        return f"request ids {list(other)} instead of {list(reference)}"
    for rid, mine in reference.items():
        theirs = other[rid]
        if int(theirs.token_start) != int(mine.token_start):
            return f"{rid}: token_start {theirs.token_start} instead of {mine.token_start}"
        if type(theirs.token_start) is not type(mine.token_start):
            kinds = type(theirs.token_start).__name__, type(mine.token_start).__name__
            return f"{rid}: token_start is a {kinds[0]}, not a {kinds[1]}"
        if type(theirs.rows) is not type(mine.rows):
            return f"{rid}: rows are a {type(theirs.rows).__name__}, not {type(mine.rows).__name__}"
        a, b = np.asarray(mine.rows), np.asarray(theirs.rows)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{rid}: rows {b.dtype}{b.shape} instead of {a.dtype}{a.shape}"
        # The flags a consumer can observe (not OWNDATA or .base, which name the memory's owner).
        for flag in ("writeable", "c_contiguous"):
            theirs_flag, mine_flag = getattr(b.flags, flag), getattr(a.flags, flag)
            if theirs_flag != mine_flag:
                return f"{rid}: rows.flags.{flag} is {theirs_flag}, not {mine_flag}"
        if a.tobytes() != b.tobytes():
            return f"{rid}: rows differ"
    return ""


def _packed_diff(reference: Any, packed: Any) -> str:
    """A step packed for the engine core (``aostore.vllm.transport.StepRows``), read as the
    engine core reads it: after the shared-memory queue's pickling, each request's
    ``token_start`` and rows by value (the token start is an ``int``, the rows writable views
    of one fresh buffer: what ``take_output`` reads of them is the same)."""
    if not isinstance(reference, dict):
        return f"outputs are a StepRows, not {type(reference).__name__}"
    crossed = pickle.loads(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))
    if list(crossed) != list(reference):
        return f"request ids {list(crossed)} instead of {list(reference)}"
    for rid, mine in reference.items():
        theirs = crossed[rid]
        if int(theirs.token_start) != int(mine.token_start):
            return f"{rid}: token_start {theirs.token_start} instead of {mine.token_start}"
        a, b = np.asarray(mine.rows), theirs.rows
        if type(b) is not np.ndarray or a.dtype != b.dtype or a.shape != b.shape:
            return (
                f"{rid}: rows {type(b).__name__} {b.dtype}{b.shape} instead of {a.dtype}{a.shape}"
            )
        if a.tobytes() != b.tobytes():
            return f"{rid}: rows differ"
    return ""


def _store_diff(reference: StoreView, other: StoreView) -> str:
    if reference.failed != other.failed:
        return f"writer failed: {other.failed} instead of {reference.failed}"
    if reference.num_slots != other.num_slots:
        return f"num_slots {other.num_slots} instead of {reference.num_slots}"
    if reference.objects.keys() != other.objects.keys():
        missing = sorted(reference.objects.keys() - other.objects.keys())
        extra = sorted(other.objects.keys() - reference.objects.keys())
        return f"stored keys differ: missing {missing}, extra {extra}"
    for key, payload in reference.objects.items():
        if other.objects[key] != payload:
            return f"bytes of {key} differ"
    if reference.references != other.references:
        return f"reference counts {other.references} instead of {reference.references}"
    if reference.lru != other.lru:
        return f"LRU order {list(other.lru)} instead of {list(reference.lru)}"
    return ""


def _keep(run: _Run, step: int, outputs: Any) -> int:
    for rid, output in outputs.items():
        rows = np.array(output.rows, copy=True)
        run.kept.append((step, rid, output, int(output.token_start), rows))
    return len(outputs)


def _changed(run: _Run, since: int | None) -> str:
    for step, rid, output, token_start, rows in run.kept:
        if since is not None and step < since:
            continue
        now = np.asarray(output.rows)
        if (
            int(output.token_start) != token_start
            or now.dtype != rows.dtype
            or now.shape != rows.shape
            or now.tobytes() != rows.tobytes()
        ):
            return f"the output of step {step} for {rid} changed after it was returned"
    return ""


def run_schedule(
    schedule: Schedule, factories: Sequence[Factory], *, read_stores: bool = True
) -> Outcome:
    """Every operation of ``schedule`` on a connector from each factory; the differences.

    ``read_stores=False``: the stores are compared once, at the end (reading one waits for its
    writer, so a writer held back stays behind the connector until then)."""
    outcome = Outcome(schedule.seed)
    runs: list[_Run] = []
    try:
        for factory in factories:
            runs.append(_Run(factory(schedule.params)))
        names = [run.built.name for run in runs]
        processed: list[int] = []

        def differ(index: int, op: Op, run: _Run, what: str) -> None:
            label = f"{type(op).__name__} of step {getattr(op, 'step', '-')}"
            name = f"{run.built.name} vs {names[0]}"
            outcome.differences.append(Difference(schedule.seed, index, label, name, what))

        for index, op in enumerate(schedule.ops):
            results = []
            for run in runs:
                run.built.activate()
                result, error = _call(run, op)
                # Only these calls write to the store (or raise what may have changed it).
                touches = isinstance(op, Begin | Process) or error is not None
                view = run.built.read_store() if touches and read_stores else _UNREAD
                results.append((result, error, view))
            outcome.ops += 1
            reference_result, reference_error, reference_view = results[0]
            for run, (result, error, view) in zip(runs[1:], results[1:], strict=True):
                if (reference_error is None) != (error is None):
                    raised = reference_error if error is None else error
                    who = names[0] if error is None else run.built.name
                    differ(index, op, run, f"only {who} raised {type(raised).__name__}: {raised}")
                elif reference_error is not None and error is not None:
                    if not _same_error(reference_error, error, run.built):
                        differ(
                            index,
                            op,
                            run,
                            f"raised {type(error).__name__} where {names[0]} raised "
                            f"{type(reference_error).__name__}",
                        )
                elif isinstance(op, Process):
                    what = _output_diff(reference_result, result)
                    if what:
                        differ(index, op, run, what)
                what = _store_diff(reference_view, view)
                if what:
                    differ(index, op, run, f"store: {what}")
            if isinstance(op, Process) and all(error is None for _, error, _ in results):
                processed.append(op.step)
                for run, (result, _, _) in zip(runs, results, strict=True):
                    outcome.outputs += _keep(run, op.step, result)
                since = processed[-RECHECK_STEPS] if len(processed) >= RECHECK_STEPS else None
                for run in runs:
                    what = _changed(run, since)
                    if what:
                        differ(index, op, run, what)
            if outcome.differences:
                break
            if any(error is not None for _, error, _ in results):
                outcome.raised = type(reference_error or results[1][1]).__name__
                break
        for run in runs:
            what = _changed(run, None)
            if what:
                differ(len(schedule.ops), schedule.ops[-1], run, what)
        if not read_stores and not outcome.differences:
            views = [run.built.read_store() for run in runs]
            for run, view in zip(runs[1:], views[1:], strict=True):
                what = _store_diff(views[0], view)
                if what:
                    differ(len(schedule.ops), schedule.ops[-1], run, f"store at the end: {what}")
    finally:
        for run in runs:
            run.built.activate()
            run.built.close()
    return outcome
