"""Seeded random schedules: the calls a model runner makes on the worker connector.

A schedule is built from one seed, before any contender runs, as a list of operations (the
same for every contender). A small scheduler model keeps, per request, the cursors the worker
will have (capture, scheduled, emit), its tokens and block hashes, and what has been sent,
so most schedules are ones vLLM's connector accepts. They cover: prefills (chunked, with a
prompt start past 0), decodes with speculative tokens (a rejected suffix, and with two
batches in flight the optimistic next step that the worker reattaches), block hashes sent
with, before and after their rows, prefix-cache hits on a sibling's or a KV-cached prompt
(read back from the store), KV-cached retains and releases (vLLM 0.33.0's metadata), finishes
while a step's output is in flight, generation resets, stores small enough to evict (and, on
0.33.0, to grow) and, in about a quarter of the schedules, one input vLLM rejects.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .contenders import Params


@dataclass
class Begin:
    generation: int
    requests: dict[str, int]
    block_hashes: dict[str, list[bytes]]
    finished: tuple[str, ...]
    retained: list[bytes] | None = None
    released: list[bytes] | None = None


@dataclass
class Prepare:
    step: int
    req_ids: list[str]
    token_starts: np.ndarray
    query_start_loc: np.ndarray
    rows: np.ndarray
    # A capturer output dtype other than the connector's (an input vLLM rejects).
    dtype_name: str | None = None


@dataclass
class Enqueue:
    step: int
    num_sampled: np.ndarray
    num_rejected: np.ndarray


@dataclass
class Process:
    step: int


Op = Begin | Prepare | Enqueue | Process


@dataclass
class Schedule:
    seed: int
    params: Params
    ops: list[Op]
    bad: str = ""
    """The input vLLM rejects that this schedule ends with ("" for none)."""
    features: Counter[str] = field(default_factory=Counter)
    """How often each kind of event the module docstring lists was generated."""


@dataclass
class _Request:
    rid: str
    family: int
    tokens: list[int]
    prompt_len: int
    max_new: int
    prompt_start: int
    hit: int = 0  # prefix-cache hit, tokens (whole blocks)
    capture: int = 0  # the worker's capture cursor once every generated step is processed
    scheduled: int = 0  # the worker's scheduled cursor, likewise
    emit: int = 0  # the worker's emit cursor, likewise
    sent: int = 0  # block hashes sent
    inflight: list[int] = field(default_factory=list)  # steps not yet processed
    started: bool = False
    last_rejected: int = 0
    finished: bool = False

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len


BAD_INPUTS = (
    "run-and-finish",
    "generation-backwards",
    "rejected-too-many",
    "rejected-negative",
    "emit-ahead",
    "capture-overlap",
    "capture-gap",
    "profile-dtype",
    "negative-start",
    "too-many-in-flight",
    "generation-in-flight",
    "finish-unknown",
    "hashes-unknown",
    "batch-unknown",
    "empty-request",
    "release-unretained",
)


class _Model:
    def __init__(
        self,
        seed: int,
        kv_events: bool,
        pending_reads: bool = False,
        caps_prompt_start: bool = True,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        self.kv_events = kv_events
        self.pending_reads = pending_reads
        self.caps_prompt_start = caps_prompt_start
        block = int(rng.choice([1, 2, 4]))
        seqs = int(rng.integers(2, 7))
        batched = int(rng.choice([16, 32, 64]))
        mcb = int(rng.integers(1, 3))
        dtype_name = str(rng.choice(["uint8", "uint16"]))
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        # A store that fails closed (0.32.0's) fills up for good, so it is mostly larger.
        small = kv_events or rng.random() < 0.3
        slots = None if rng.random() < 0.2 else int(rng.integers(2, 40 if small else 400))
        kv_blocks = int(rng.integers(4, 64 if small else 400))
        self.params = Params(block, shape, dtype_name, seqs, batched, mcb, slots, kv_blocks)
        self.vmax = 256 if dtype_name == "uint8" else 1024
        self.requests: dict[str, _Request] = {}
        self.families: list[list[int]] = []
        self.kv_cached: dict[bytes, None] = {}  # the scheduler's KV-cached hashes, oldest first
        self.retained: list[bytes] = []
        self.released: list[bytes] = []
        self.generation = 0
        self.next_id = 0
        self.step = 0
        self.pending: list[int] = []  # steps prepared and not processed
        self.ops: list[Op] = []
        self.seen: Counter[str] = Counter()
        self.to_finish: list[str] = []
        self.bad = ""
        self.injected = ""
        if rng.random() < 0.25:
            self.bad = str(rng.choice(BAD_INPUTS))
        self.bad_step = int(rng.integers(1, 12))
        self.p_lag = float(rng.random())  # how often hashes lag behind their rows

    # -- tokens, hashes, rows --------------------------------------------------------------

    def hashes(self, request: _Request, count: int) -> list[bytes]:
        block = self.params.block_size
        out: list[bytes] = []
        previous = b""
        for index in range(count):
            chunk = bytes(np.asarray(request.tokens[index * block : (index + 1) * block], "<u4"))
            previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
            out.append(previous)
        return out

    def rows(self, request: _Request, start: int, kept: int, total: int) -> np.ndarray:
        """Rows for positions ``start..start+kept`` (a function of the token there, so
        siblings agree), then ``total - kept`` rows of a rejected suffix."""
        shape = self.params.shape_per_token
        out = self.rng.integers(0, self.vmax, (total, *shape), dtype=np.int64)
        layer = np.arange(int(np.prod(shape))).reshape(shape)
        for offset in range(kept):
            position = start + offset
            token = request.tokens[position] if position < len(request.tokens) else 0
            out[offset] = (token * 131 + position * 17 + layer * 7) % self.vmax
        if kept and self.rng.random() < 0.03:
            # Routing that is not a function of the tokens: a sibling's block differs.
            out[int(self.rng.integers(0, kept))] = self.rng.integers(0, self.vmax, shape)
        return out.astype(np.int16)

    # -- admission --------------------------------------------------------------------------

    def published_blocks(self, family: int, prompt: list[int]) -> int:
        """Whole prompt blocks a new request may hit: held by a live sibling (captured and
        keyed before this step) or KV-cached."""
        block = self.params.block_size
        best = 0
        for other in self.requests.values():
            if other.finished or other.family != family:
                continue
            common = 0
            limit = min(other.capture, other.prompt_len) // block
            limit = min(limit, other.sent)
            while common < limit and (
                other.tokens[common * block : (common + 1) * block]
                == prompt[common * block : (common + 1) * block]
            ):
                common += 1
            best = max(best, common)
        if self.kv_cached:
            probe = _Request("", family, prompt, len(prompt), 0, 0)
            count = 0
            for digest in self.hashes(probe, len(prompt) // block):
                if digest not in self.kv_cached:
                    break
                count += 1
            best = max(best, count)
        return best

    def admit(self) -> None:
        rng = self.rng
        live = sum(1 for r in self.requests.values())
        if live >= self.params.max_num_seqs or rng.random() < 0.4:
            return
        block = self.params.block_size
        if self.families and rng.random() < 0.5:
            family = int(rng.integers(0, len(self.families)))
        else:
            family = len(self.families)
            self.families.append([int(t) for t in rng.integers(0, 1000, 24)])
        base = self.families[family]
        shared = int(rng.integers(0, len(base) + 1))
        prompt_len = int(rng.integers(max(1, shared), 25))
        own = [int(t) for t in rng.integers(0, 1000, prompt_len)]
        prompt = (base[:shared] + own)[:prompt_len]
        rid = f"req-{self.next_id}"
        self.next_id += 1
        start = 0 if rng.random() < 0.8 else int(rng.integers(0, prompt_len + 2))
        self.seen["prompt start past 0"] += start > 0
        request = _Request(rid, family, prompt, prompt_len, int(rng.integers(1, 10)), start)
        hit_blocks = self.published_blocks(family, prompt)
        if self.params.store_slots is not None and rng.random() < 0.01:
            # A stale hit: a finished sibling's blocks, which the store may have evicted.
            hit_blocks = max(hit_blocks, min(2, prompt_len // block))
        if hit_blocks and rng.random() < 0.8:
            hit = min(hit_blocks * block, (prompt_len - 1) // block * block)
            request.hit = hit
            self.seen["prefix hit"] += hit > 0
        request.capture = request.scheduled = request.hit
        # vLLM 0.32.0 on caps the start at the prompt; 0.31.0 sends it as asked.
        if self.caps_prompt_start:
            request.emit = min(request.prompt_start, prompt_len)
        else:
            request.emit = request.prompt_start
            self.seen["prompt start past the prompt, uncapped"] += start > prompt_len
        self.requests[rid] = request

    # -- one step ---------------------------------------------------------------------------

    def begin(self, scheduled: list[tuple[_Request, int]]) -> Begin:
        rng = self.rng
        block = self.params.block_size
        requests: dict[str, int] = {}
        hashes: dict[str, list[bytes]] = {}
        for request, _ in scheduled:
            if not request.started:
                requests[request.rid] = request.emit
            else:
                # The scheduler's emit start: at most the worker's emit cursor.
                requests[request.rid] = min(request.emit, len(request.tokens) - 1)
        running = {request.rid for request, _ in scheduled}
        for request in self.requests.values():
            if request.finished or not (request.started or request.rid in running):
                continue
            known = len(request.tokens) // block
            settled = request.capture >= request.prompt_len and request.emit >= request.capture
            if request.hit and request.sent < request.hit // block:
                target = known  # a prefix hit sends its cached blocks' hashes at once
                if self.pending_reads and request.sent == 0 and rng.random() < 0.5:
                    # 0.34.0 reads full blocks that have no key yet: the hit's hashes now, the
                    # prompt's own after its rows, so the first output reads them unkeyed.
                    target = request.hit // block
                    self.seen["prompt hashes after a prefix hit's rows"] += 1
            elif settled and rng.random() < self.p_lag * 0.6:
                # Lags behind its rows (by at most two blocks, so the staging pool suffices).
                target = max(request.sent + int(rng.integers(0, 2)), known - 2)
            else:
                target = known
            target = min(max(target, request.sent), known)
            if target > request.sent:
                hashes[request.rid] = self.hashes(request, target)[request.sent :]
                self.seen["hashes after their rows"] += target * block < request.capture
                request.sent = target
        finished = tuple(self.to_finish)
        for rid in finished:
            request = self.requests[rid]
            self.seen["finish in flight"] += bool(request.inflight)
            final = min(len(request.tokens), request.capture) // block
            if final > request.sent and rng.random() < 0.8:
                hashes[rid] = self.hashes(request, final)[request.sent :]
                request.sent = final
            if self.kv_events and rng.random() < 0.6:
                for digest in self.hashes(request, min(request.sent, request.capture // block)):
                    if digest not in self.kv_cached:
                        self.kv_cached[digest] = None
                        self.retained.append(digest)
                        self.seen["KV-cached retain"] += 1
        if self.kv_events and self.kv_cached and rng.random() < 0.2:
            for digest in list(self.kv_cached)[: int(rng.integers(1, 3))]:
                del self.kv_cached[digest]
                self.released.append(digest)
                self.seen["KV-cached release"] += 1
        self.to_finish = []
        op = Begin(self.generation, requests, hashes, finished)
        if self.kv_events:
            op.retained, op.released = self.retained or None, self.released or None
            self.retained, self.released = [], []
        for rid in finished:
            self.requests[rid].finished = True
        return op

    def choose(self) -> list[tuple[_Request, int]]:
        """Who runs this step and how many tokens each is scheduled."""
        rng = self.rng
        budget = self.params.max_num_batched_tokens
        out: list[tuple[_Request, int]] = []
        for request in self.requests.values():
            if request.finished or rng.random() < 0.15:
                continue
            view = request.scheduled if request.inflight else request.capture
            if view < request.prompt_len:
                count = request.prompt_len - view
                if rng.random() < 0.4:
                    count = int(rng.integers(1, count + 1))  # a chunk of the prefill
                    self.seen["chunked prefill"] += count < request.prompt_len - view
            else:
                count = 1 + (int(rng.integers(0, 4)) if rng.random() < 0.4 else 0)
            count = min(count, budget)
            if count <= 0:
                break
            budget -= count
            out.append((request, count))
        return out

    def finish_some(self) -> None:
        rng = self.rng
        for request in self.requests.values():
            if request.finished or not request.started:
                continue
            done = request.capture >= request.prompt_len and request.new_tokens >= request.max_new
            if done or rng.random() < 0.04:
                self.to_finish.append(request.rid)

    def reap(self) -> None:
        """Forget finished requests whose teardown the worker has done."""
        for rid in [r.rid for r in self.requests.values() if r.finished and not r.inflight]:
            del self.requests[rid]

    def process_oldest(self) -> None:
        step = self.pending.pop(0)
        self.ops.append(Process(step))
        for request in self.requests.values():
            if request.inflight and request.inflight[0] == step:
                request.inflight.pop(0)

    def run_step(self) -> bool:
        """One engine step's calls; False once the schedule is over."""
        rng = self.rng
        params = self.params
        bad = self.bad if self.step == self.bad_step else ""
        self.reap()
        live = [r for r in self.requests.values() if not r.finished]
        if (
            not live
            and not self.pending
            and not self.requests
            and rng.random() < 0.3
            and self.step > 0
        ):
            self.generation += 1
            self.seen["generation reset"] += 1
            if self.kv_events:
                self.released.extend(self.kv_cached)
            self.kv_cached = {}
        self.admit()
        scheduled = self.choose()
        scheduled_ids = {request.rid for request, _ in scheduled}
        self.to_finish = [rid for rid in self.to_finish if rid not in scheduled_ids]
        begin = self.begin(scheduled)
        before = copy.deepcopy(begin) if bad else begin
        if bad == "run-and-finish" and scheduled:
            begin.finished = (*begin.finished, scheduled[0][0].rid)
        elif bad == "generation-backwards":
            begin.generation = self.generation - 1
        elif bad == "generation-in-flight" and self.pending:
            begin.generation = self.generation + 1
        elif bad == "finish-unknown":
            begin.finished = (*begin.finished, "req-unknown")
        elif bad == "hashes-unknown":
            begin.block_hashes["req-unknown"] = [b"\x01" * 16]
        elif bad == "release-unretained" and self.kv_events:
            begin.released = [*(begin.released or []), b"\x02" * 16]
        elif bad == "emit-ahead":
            settled = [r for r, _ in scheduled if r.started and not r.inflight]
            if settled:
                begin.requests[settled[0].rid] = settled[0].emit + 1
        self.ops.append(begin)
        at_begin = BAD_INPUTS[:2] + BAD_INPUTS[10:13] + BAD_INPUTS[15:] + ("emit-ahead",)
        if bad in at_begin and begin != before:
            self.injected = bad
        if not scheduled:
            if bad and not self.injected:
                self.bad_step += 1  # nothing runs: inject it at the next step
            while self.pending:
                self.process_oldest()
            self.step += 1
            return bool(self.requests) or self.step < 4
        if len(self.pending) >= params.max_concurrent_batches:
            if bad == "too-many-in-flight":
                self.injected = bad
            else:
                self.process_oldest()

        # The first request's cursors before this step (the bad inputs below are relative to them).
        capture0, scheduled0 = scheduled[0][0].capture, scheduled[0][0].scheduled
        req_ids: list[str] = []
        starts: list[int] = []
        counts: list[int] = []
        rows: list[np.ndarray] = []
        sampled: list[int] = []
        rejected: list[int] = []
        for request, count in scheduled:
            if request.inflight:
                # The previous step's acceptance is not known yet: start where it would end.
                start = request.scheduled
            elif request.capture < request.scheduled and rng.random() < 0.5:
                start = request.scheduled  # reattached by the worker
            else:
                start = request.capture
            decode = start >= request.prompt_len
            reject = 0
            if decode and count > 1:
                reject = int(rng.integers(0, count))
            elif start > request.capture:
                reject = int(rng.integers(0, count))
            kept = count - reject
            self.seen["speculative rejection"] += decode and reject > 0
            self.seen["reattach"] += start > request.capture
            position = request.capture  # where the kept rows land (reattached or not)
            prefill_done = position + kept >= request.prompt_len
            # A token is sampled when the prefill is complete (or while decoding).
            produced = kept if prefill_done else 0
            new = max(0, position + kept + 1 - len(request.tokens)) if prefill_done else 0
            request.tokens.extend(int(t) for t in rng.integers(0, 1000, new))
            rows.append(self.rows(request, position, kept, count))
            req_ids.append(request.rid)
            starts.append(start)
            counts.append(count)
            sampled.append(produced)
            rejected.append(reject)
            token_end = position + kept
            if produced > 0 and request.emit <= token_end:
                request.emit = token_end
            request.capture = token_end
            request.scheduled = start + count
            request.started = True
            request.inflight.append(self.step)

        query = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(counts, out=query[1:])
        token_starts = np.asarray(starts, dtype=np.int32)
        all_rows = np.concatenate(rows) if rows else np.zeros((0, *params.shape_per_token))
        num_sampled = np.asarray(sampled, dtype=np.int32)
        num_rejected = np.asarray(rejected, dtype=np.int32)
        prepare = Prepare(self.step, req_ids, token_starts, query, all_rows.astype(np.int16))
        applied = bad in (*BAD_INPUTS[2:4], "profile-dtype", "batch-unknown")
        if bad == "rejected-too-many":
            num_rejected[0] = counts[0] + 1
        elif bad == "rejected-negative":
            num_rejected[0] = -1
        elif bad == "capture-overlap" and 0 < capture0 == starts[0]:
            token_starts[0] = max(0, token_starts[0] - 1 - int(rng.integers(0, 3)))
            applied = True
        elif bad == "capture-gap" and starts[0] == capture0 == scheduled0:
            token_starts[0] += 1 + int(rng.integers(0, 3))
            applied = True
        elif bad == "profile-dtype":
            prepare.dtype_name = "int32"
        elif bad == "negative-start":
            token_starts[0] = -params.block_size
            applied = True
        elif bad == "batch-unknown":
            prepare.req_ids = [*req_ids[:-1], "req-unknown"]
        elif bad == "empty-request" and len(query) > 2:
            query[1] = 0
            applied = True
        if applied:
            self.injected = bad
        self.ops.append(prepare)
        self.pending.append(self.step)
        enqueue = Enqueue(self.step, num_sampled, num_rejected)
        self.ops.append(enqueue)
        if params.max_concurrent_batches == 1 or rng.random() < 0.3:
            self.process_oldest()
        self.finish_some()
        self.step += 1
        if self.injected:
            while self.pending:
                self.process_oldest()
            return False
        return self.step < 40

    def finish_all(self) -> None:
        """Drain: every step processed, every request finished and torn down."""
        while self.pending:
            self.process_oldest()
        for rid in [r.rid for r in self.requests.values() if not r.started]:
            del self.requests[rid]  # admitted, never scheduled: the worker never saw it
        self.to_finish = [r.rid for r in self.requests.values() if not r.finished]
        self.ops.append(self.begin([]))


def generate(
    seed: int, kv_events: bool, pending_reads: bool = False, caps_prompt_start: bool = True
) -> Schedule:
    """The schedule of ``seed``; ``kv_events``: the metadata carries KV-cached retains and
    releases (vLLM 0.33.0 on); ``pending_reads``: the worker reads rows of full blocks whose
    hash has not arrived (vLLM 0.34.0), so schedules also send a prompt's hashes after its
    rows behind a prefix hit (earlier releases assert there); ``caps_prompt_start``: the
    scheduler caps a prompt start at the prompt (0.32.0 on; 0.31.0 sends it past)."""
    model = _Model(seed, kv_events, pending_reads, caps_prompt_start)
    while model.run_step():
        pass
    if not model.injected:
        model.finish_all()
    model.seen[f"max_concurrent_batches {model.params.max_concurrent_batches}"] += 1
    return Schedule(seed, model.params, model.ops, model.injected, model.seen)
