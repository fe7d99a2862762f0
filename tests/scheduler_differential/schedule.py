"""Seeded random schedules: the calls vLLM's scheduler makes on its aux-output connector.

A schedule is built from one seed before any contender runs, as a list of plain-data
operations (the same for every contender; each contender's :class:`~.harness.World` turns them
into calls on its own requests and stand-ins). A small scheduler model keeps each request's
tokens, computed tokens and expected token start, so most schedules are ones vLLM accepts.
They cover: requests with shared prefixes (so block hashes repeat), a routed-experts prompt
start of 0 or past 0 (also past the prompt), prefix-cache hits, chunked prefills, decodes of
1 and speculative decodes with rejected tokens, requests left out of a step (hash-only updates),
``take_output`` with consistent outputs, a late ``token_start`` (``None``), extra rows,
finishes, aborts (also of never-scheduled requests), preemptions (``request_finished`` on a
running request that is scheduled again from 0), ``reset()``, and on 0.33.0 ``max_cache_hit``,
``cap_external_hit`` and ``request_loading`` with a GPU prefix cache (the stand-in pool's set of
hashes) that changes every step and a retention capacity of 1 to 6 blocks (so retains and
releases happen). About a quarter of the schedules end with one input vLLM rejects.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .standins import chain_hashes

BLOCK = 16


@dataclass(frozen=True)
class Params:
    block_size: int
    hash_block_size: int
    num_blocks: int
    kv_connector: bool
    kv_events: bool
    """0.33.0's connector: KV-cache tracking (max_cache_hit, retains and releases)."""


@dataclass
class Add:
    rid: str
    prompt: list[int]
    prompt_start: int


@dataclass
class SetComputed:
    rid: str
    tokens: int


@dataclass
class Build:
    scheduled: dict[str, int]


@dataclass
class Append:
    rid: str
    tokens: list[int]
    rejected: int = 0


@dataclass
class SetFinished:
    rid: str


@dataclass
class Take:
    rid: str
    # None: no worker output; else per request id (token_start, number of rows).
    outputs: dict[str, tuple[int, int]] | None


@dataclass
class Finish:
    rid: str
    remove: bool = True
    """False: a preemption (the request stays, its computed tokens back to 0)."""


@dataclass
class Reset:
    pass


@dataclass
class Cache:
    add: list[bytes]
    drop: list[bytes]
    clear: bool = False


@dataclass
class MaxHit:
    rid: str


@dataclass
class CapHit:
    rid: str
    num_local: int
    num_external: int


@dataclass
class Loading:
    rid: str
    tokens: int


@dataclass
class Truncate:
    """Drops a request's last block hash (an input vLLM rejects: the history shrank)."""

    rid: str


Op = (
    Add | SetComputed | Build | Append | SetFinished | Take | Finish | Reset | Cache | MaxHit
    | CapHit | Loading | Truncate
)  # fmt: skip
CONNECTOR_OPS = (Build, Take, Finish, Reset, MaxHit, CapHit, Loading)


@dataclass
class Schedule:
    seed: int
    params: Params
    ops: list[Op]
    bad: str = ""
    features: Counter[str] = field(default_factory=Counter)


BAD_INPUTS = (
    "take-missing",
    "take-none",
    "take-short",
    "take-finished-late",
    "hashes-shrank",
    "schedule-unknown",
)


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    prompt_start: int
    max_new: int
    computed: int = 0
    finished: bool = False

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len


class _Model:
    def __init__(self, seed: int, kv_events: bool, caps_prompt_start: bool = True) -> None:
        self.rng = rng = np.random.default_rng(seed)
        self.params = Params(
            block_size=BLOCK,
            hash_block_size=int(rng.choice([BLOCK, BLOCK // 2])),
            num_blocks=int(rng.integers(1, 7)),
            kv_connector=bool(rng.random() < 0.3),
            kv_events=kv_events,
        )
        self.caps_prompt_start = caps_prompt_start
        self.ops: list[Op] = []
        self.features: Counter[str] = Counter()
        self.live: dict[str, _Req] = {}
        self.next_id = 0
        self.families = [
            [int(t) for t in rng.integers(0, 50, int(rng.integers(8, 80)))]
            for _ in range(int(rng.integers(1, 4)))
        ]
        self.bad = str(rng.choice(BAD_INPUTS)) if rng.random() < 0.25 else ""
        self.steps = int(rng.integers(4, 40))

    def hashes(self, req: _Req) -> list[bytes]:
        return chain_hashes(req.tokens, self.params.hash_block_size)

    def add(self) -> None:
        rng = self.rng
        rid = f"r{self.next_id}"
        self.next_id += 1
        family = self.families[int(rng.integers(len(self.families)))]
        shared = family[: int(rng.integers(0, len(family) + 1))] if rng.random() < 0.7 else []
        if shared:
            self.features["shared prefix"] += 1
        prompt = shared + [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 70)))]
        if len(family) >= BLOCK and rng.random() < 0.15:
            # A prompt of whole blocks, all shared: max_cache_hit caps it at num_tokens - 1.
            prompt = family[: BLOCK * int(rng.integers(1, len(family) // BLOCK + 1))]
            self.features["prompt of whole shared blocks"] += 1
        roll = rng.random()
        start = 0 if roll < 0.5 else int(rng.integers(1, len(prompt) + 12))
        if start:
            self.features["prompt start past 0"] += 1
        if start >= len(prompt):
            self.features["prompt start past the prompt"] += 1
        req = _Req(rid, prompt, len(prompt), start, int(rng.integers(1, 24)))
        self.live[rid] = req
        self.ops.append(Add(rid, list(prompt), start))
        self.features["request"] += 1
        if self.params.kv_events:
            self.ops.append(MaxHit(rid))
            if rng.random() < 0.5:
                local = BLOCK * int(rng.integers(0, 3))
                external = int(rng.choice([0, BLOCK, 2 * BLOCK, int(rng.integers(1, 40))]))
                self.ops.append(CapHit(rid, local, external))
            if rng.random() < 0.3:
                self.ops.append(Loading(rid, int(rng.integers(0, len(prompt) + 1))))
                self.features["request_loading"] += 1
        if rng.random() < 0.4 and len(prompt) > BLOCK:
            hit = BLOCK * int(rng.integers(1, (len(prompt) - 1) // BLOCK + 1))
            req.computed = hit
            self.ops.append(SetComputed(rid, hit))
            self.features["prefix hit"] += 1

    def cache(self) -> None:
        rng = self.rng
        add: list[bytes] = []
        for req in self.live.values():
            hashes = self.hashes(req)[: req.computed // self.params.hash_block_size]
            add += [h for h in hashes if rng.random() < 0.6]
        drop = [h for h in self.cached if rng.random() < 0.25]
        self.cached = (self.cached | set(add)) - set(drop)
        self.ops.append(Cache(add, drop))

    def generate(self) -> None:
        rng = self.rng
        self.cached: set[bytes] = set()
        for step in range(self.steps):
            last = step == self.steps - 1
            for _ in range(int(rng.integers(0, 3)) if step else int(rng.integers(1, 4))):
                self.add()
            if self.params.kv_events:
                self.cache()
            if rng.random() < 0.04:
                self.ops.append(Reset())
                self.cached = set()
                self.ops.append(Cache([], [], clear=True))
                self.features["reset"] += 1
            runnable = [r for r in self.live.values() if not r.finished]
            scheduled: dict[str, int] = {}
            specs: dict[str, int] = {}
            for req in runnable:
                if rng.random() < 0.2:
                    continue  # left out of this step (async scheduling: hash-only update)
                if req.prefilling:
                    left = req.prompt_len - req.computed
                    chunk = left if rng.random() < 0.6 else int(rng.integers(1, left + 1))
                    if chunk < left:
                        self.features["chunked prefill"] += 1
                    scheduled[req.rid] = chunk
                else:
                    spec = int(rng.integers(1, 4)) if rng.random() < 0.2 else 0
                    specs[req.rid] = spec
                    scheduled[req.rid] = 1 + spec
                    self.features["decode" if not spec else "speculative decode"] += 1
            if self.bad == "hashes-shrank" and last and scheduled:
                rid = next(iter(scheduled))
                if (
                    self.live[rid].tokens
                    and len(self.live[rid].tokens) >= self.params.hash_block_size
                ):
                    self.ops.append(Truncate(rid))
                    self.features["bad: hashes-shrank"] += 1
            if self.bad == "schedule-unknown" and last:
                scheduled["ghost"] = 3
                self.features["bad: schedule-unknown"] += 1
            # The token starts the worker uses for this step's outputs.
            starts = {}
            for rid in scheduled:
                req = self.live.get(rid)
                if req is None:
                    continue
                new = len(req.tokens) - req.prompt_len
                # vLLM 0.32.0 on caps the prompt start at the prompt; 0.31.0 does not.
                start = (
                    min(req.prompt_start, req.prompt_len)
                    if self.caps_prompt_start
                    else req.prompt_start
                )
                starts[rid] = max(start, len(req.tokens) - 1 if new else 0)
            self.ops.append(Build(dict(scheduled)))
            self.features["build_connector_meta"] += 1
            if "ghost" in scheduled:
                return
            emitting: list[_Req] = []
            for rid, count in scheduled.items():
                req = self.live[rid]
                req.computed += count
                if req.computed < req.prompt_len:
                    continue
                spec = specs.get(rid, 0)
                accepted = int(rng.integers(0, spec + 1)) if spec else 0
                rejected = spec - accepted
                if rejected:
                    self.features["speculative rejection"] += 1
                new = [int(t) for t in rng.integers(0, 50, 1 + accepted)]
                req.tokens += new
                req.computed -= rejected
                self.ops.append(Append(rid, new, rejected))
                emitting.append(req)
            outputs: dict[str, tuple[int, int]] = {}
            for req in emitting:
                start = starts[req.rid]
                rows = max(len(req.tokens) - 1 - start, 0)
                roll = rng.random()
                if roll < 0.1:
                    rows += int(rng.integers(1, 4))
                    self.features["output with extra rows"] += 1
                elif roll < 0.15:
                    start = len(req.tokens)  # a late start: nothing accepted yet
                    self.features["output starting late"] += 1
                outputs[req.rid] = (start, rows)
            bad_take = self.bad.startswith("take-") and last and emitting
            for index, req in enumerate(emitting):
                new = len(req.tokens) - req.prompt_len
                finish = new >= req.max_new or rng.random() < 0.03
                chosen = outputs
                if bad_take and index == len(emitting) - 1:
                    chosen = dict(outputs)
                    start, rows = chosen[req.rid]
                    if self.bad == "take-missing":
                        del chosen[req.rid]
                    elif self.bad == "take-none":
                        chosen = None  # type: ignore[assignment]
                    elif self.bad == "take-short":
                        chosen[req.rid] = (min(start, len(req.tokens) - 2), 0)
                    elif self.bad == "take-finished-late":
                        chosen[req.rid] = (len(req.tokens), 0)
                        finish = True
                    self.features[f"bad: {self.bad}"] += 1
                if finish and chosen is outputs and outputs[req.rid][0] >= len(req.tokens):
                    finish = False  # vLLM asserts on a finished request with nothing accepted
                if finish:
                    req.finished = True
                    self.ops.append(SetFinished(req.rid))
                self.ops.append(Take(req.rid, chosen))
                self.features["take_output"] += 1
            for req in emitting:
                if req.finished:
                    self.finish(req, "finish")
            if bad_take:
                return
            # Aborts (also of requests never scheduled) and preemptions.
            for req in list(self.live.values()):
                roll = rng.random()
                if roll < 0.02:
                    self.finish(req, "abort")
                elif roll < 0.04 and req.computed:
                    self.ops.append(Finish(req.rid, remove=False))
                    req.computed = 0
                    self.features["preemption"] += 1
                    if self.params.kv_events:
                        self.ops.append(MaxHit(req.rid))  # its prefix lookup when resumed

    def finish(self, req: _Req, kind: str) -> None:
        if kind == "abort" and not req.finished:
            self.ops.append(SetFinished(req.rid))
        req.finished = True
        self.ops.append(Finish(req.rid))
        del self.live[req.rid]
        self.features[kind] += 1


def generate(seed: int, kv_events: bool, caps_prompt_start: bool = True) -> Schedule:
    """The schedule of ``seed``; ``caps_prompt_start``: the release caps a prompt start at the
    prompt (0.32.0 on), which the starts of the worker's outputs follow."""
    model = _Model(seed, kv_events, caps_prompt_start)
    model.generate()
    bad = model.bad if any(k.startswith("bad: ") for k in model.features) else ""
    return Schedule(seed, model.params, model.ops, bad, model.features)
