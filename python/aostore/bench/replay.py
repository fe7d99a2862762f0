"""W3's schedule (docs/workloads.md): a seeded generator makes an RL rollout's traffic without a
GPU, as the worker puts it to the store step by step: the data of the blocks that became full
in the previous step, retains of the block keys that appeared in this step (before their data),
the releases of requests that finished (each request's keys in reverse), and the reads of a
finished request's routed experts before its release. The stores it is replayed against are in
``aostore.bench.contenders``, the replay and its figures in ``aostore.bench.measure``.
"""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from dataclasses import dataclass, field

BLOCK_TOKENS = 16
# Distinct payload rows; a block's bytes are row (block id % POOL_ROWS), so reads can be checked.
POOL_ROWS = 1024


@dataclass(frozen=True)
class RolloutShape:
    """The rollout: GLM-4.5-Air's sizes, as docs/workloads.md gives W3's."""

    prompts: int = 64
    samples: int = 8
    prompt_tokens: tuple[int, int] = (200, 1200)
    output_tokens: tuple[int, int] = (1024, 16384)
    kv_blocks: int = 152_129
    store_factor: float = 1.1
    max_running: int = 512
    max_num_batched_tokens: int = 16_384
    object_nbytes: int = 5_888
    rollout_steps: int = 1
    seed: int = 0

    @property
    def store_slots(self) -> int:
        return int(self.kv_blocks * self.store_factor)


@dataclass
class Request:
    prompt: int
    prompt_len: int
    out_len: int
    keys: list[int]  # block ids, prompt blocks first
    prompt_blocks: int

    @property
    def blocks(self) -> int:
        return len(self.keys)


@dataclass
class Step:
    """One worker ``put``: block ids to publish, retain and release."""

    publish: list[int] = field(default_factory=list)
    retain: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    reads: list[list[int]] = field(default_factory=list)


def block_key(block_id: int) -> str:
    """The store key of a block, shaped like vLLM's routed-experts keys (80 bytes)."""
    return f"vllm-artifact/0/{block_id * 0x9E3779B97F4A7C15 % (1 << 256):064x}"


def generate(shape: RolloutShape) -> list[Step]:
    """The worker's puts, step by step, for ``shape.rollout_steps`` rollouts: ``prompts``
    prompts x ``samples`` samples, prompts shared by their samples, 16-token blocks. Requests
    run as the engine schedules them (at most ``max_running``, admitted while their KV blocks
    fit in ``kv_blocks``).

    A step schedules at most ``max_num_batched_tokens`` tokens, as vLLM's scheduler does: one
    for each running request, then the prompts of the requests it admits (a prompt whose blocks
    a running sample of it holds is a prefix-cache hit: only its last tokens are computed). The
    default, 16,384, is vLLM 0.33's for a GB200 node; ``0`` lifts the bound (every request that
    fits the KV cache is prefilled in its first step).

    Simplifications, written down: admission reserves a request's final KV size, so no request
    is preempted; a prompt that does not fit what is left of a step's tokens waits for the next
    step whole (vLLM would start it in chunks; prompts are at most 1,200 tokens, so a step holds
    at most one prompt's tokens fewer)."""
    rng = random.Random(shape.seed)
    steps: dict[int, Step] = defaultdict(Step)
    next_block = 0
    clock = 0
    for _ in range(shape.rollout_steps):
        requests: list[Request] = []
        for prompt in range(shape.prompts):
            prompt_len = rng.randint(*shape.prompt_tokens)
            prompt_blocks = prompt_len // BLOCK_TOKENS
            shared = list(range(next_block, next_block + prompt_blocks))
            next_block += prompt_blocks
            for _ in range(shape.samples):
                out_len = rng.randint(*shape.output_tokens)
                own = (prompt_len + out_len) // BLOCK_TOKENS - prompt_blocks
                keys = shared + list(range(next_block, next_block + own))
                next_block += own
                requests.append(Request(prompt, prompt_len, out_len, keys, prompt_blocks))
        clock = _schedule(shape, requests, steps, clock)
    return [steps[s] for s in sorted(steps)]


def _schedule(
    shape: RolloutShape, requests: list[Request], steps: dict[int, Step], start: int
) -> int:
    """Admits requests in order as KV room and the step's token budget allow; returns the step
    after the last release."""
    waiting = list(reversed(requests))
    finishing: list[tuple[int, int]] = []  # (release step, request index)
    reserved = 0
    running = 0
    samples_running: dict[int, int] = defaultdict(int)  # prompt -> its running samples
    published: set[int] = set()
    budget = shape.max_num_batched_tokens
    step = start
    last = start
    while waiting:
        while finishing and finishing[0][0] <= step:
            _, index = heapq.heappop(finishing)
            reserved -= requests[index].blocks
            running -= 1
            samples_running[requests[index].prompt] -= 1
        # Every running request decodes one token this step; prompts share what is left.
        tokens = running
        admitted = 0
        out_of_tokens = False
        while waiting and running < shape.max_running:
            request = waiting[-1]
            if reserved + request.blocks > shape.kv_blocks and running:
                break
            cost = _prefill_tokens(request, cached=samples_running[request.prompt] > 0)
            if budget and admitted and tokens + cost > budget:
                out_of_tokens = True
                break
            waiting.pop()
            tokens += cost
            admitted += 1
            reserved += request.blocks
            running += 1
            samples_running[request.prompt] += 1
            index = len(requests) - len(waiting) - 1
            release = admit(request, step, steps, published)
            heapq.heappush(finishing, (release, index))
            last = max(last, release)
        if not waiting:
            break
        # Out of tokens, admission goes on in the next step; otherwise nothing else can start
        # until a running request releases its blocks.
        step = step + 1 if out_of_tokens else finishing[0][0]
    return last + 1


def _prefill_tokens(request: Request, *, cached: bool) -> int:
    """The prompt tokens a request's prefill computes: all of them, or after a prefix-cache hit
    on its full prompt blocks only the rest (vLLM computes at least the last token)."""
    if not cached:
        return request.prompt_len
    hit = min(request.prompt_blocks * BLOCK_TOKENS, request.prompt_len - 1)
    return request.prompt_len - hit // BLOCK_TOKENS * BLOCK_TOKENS


def admit(request: Request, start: int, steps: dict[int, Step], published: set[int]) -> int:
    """Schedules one request from step ``start`` into ``steps`` (``published``: the blocks
    whose data an earlier step put); returns its release step. ``generate`` calls it through
    the module, so a caller can record each admission by wrapping it."""
    prefill = steps[start]
    prompt_keys = request.keys[: request.prompt_blocks]
    prefill.retain.extend(prompt_keys)
    fresh = [k for k in prompt_keys if k not in published]
    published.update(fresh)
    steps[start + 1].publish.extend(fresh)
    for k in range(request.prompt_blocks, request.blocks):
        # Block k is full when token 16(k+1)-1 is generated, one token per step after prefill.
        full = start + 1 + BLOCK_TOKENS * (k + 1) - 1 - request.prompt_len
        steps[full].retain.append(request.keys[k])
        steps[full + 1].publish.append(request.keys[k])
    # The last token comes at step start + out_len; its block's data one step later, when the
    # request's routed experts are read for its output. The scheduler reports the finish in
    # the next step, whose put releases the keys.
    finish = start + request.out_len
    steps[finish + 1].reads.append(request.keys)
    steps[finish + 2].release.extend(reversed(request.keys))
    return finish + 2
