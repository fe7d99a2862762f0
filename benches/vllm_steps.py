"""vLLM's scheduler side of R3, shared by ``benches/scheduler.py`` and ``benches/worker.py``.

- The stand-ins vLLM's ``AuxOutputSchedulerConnector`` needs (a KV cache manager whose block
  pool runs vLLM's own ``get_cached_block`` over vLLM's ``BlockHashToBlockMap``) and a request's
  block hasher.
- :class:`SchedulerSteps`: the per-step worker inputs of ``worker.py --schedule
  vllm-scheduler``. A small model of vLLM's scheduler (synchronous: async scheduling off) runs
  ``worker.schedule``'s requests (W3's prompts, lengths and block ids, in their order) as
  vLLM ``Request`` objects and asks vLLM's own ``AuxOutputSchedulerConnector`` for each step's
  metadata, so the worker connector gets what vLLM's scheduler really sends: the emit starts,
  the block hashes of blocks whose tokens are known (for a speculative decode that is after the
  step that captured their rows: hashes after rows), prefix hits (their blocks read back from
  the store), finishes with their last hashes, KV-cached retains and releases (0.33.0's
  metadata, the same on 0.34.0).

The scheduler model, in vLLM's order each step, with a token budget of
``max_num_batched_tokens``: the running requests first (a decode schedules its sampled token
and ``spec_tokens`` draft tokens, fewer near its ``max_tokens``; an unfinished prefill its next
chunk), then the waiting requests in order while fewer than ``max_running`` run and tokens are
left. An admitted request's prefix hit is vLLM's: ``max_cache_hit`` from the connector, capped by
the GPU prefix cache (the leading blocks the stand-in pool holds) and ``num_tokens - 1``, in
whole blocks; its prompt is prefilled in chunks of what is left of the budget. A block is in the
GPU prefix cache from the step that schedules its last known token until the last running
request holding it finishes (then taken as evicted). After the step, each draft is accepted with
probability ``accept`` until the first rejection; the rest are rejected (``num_rejected``, and
the scheduler takes them back from ``num_computed_tokens``); the sampled tokens are appended
(``append_output_token_ids``, so vLLM's ``Request`` computes the block hashes), vLLM's
``take_output`` takes each output, and a request that reached ``max_tokens`` is finished
(``request_finished``, its blocks freed). The metadata goes through a pickle round trip, as it
crosses from the engine core to the worker. The batch is in the order vLLM's GPU model runner
sorts it (``sort_batch_req_ids``: speculative decodes, then by tokens).

Not modelled: async scheduling (so no reattach after a rejected optimistic step), preemption
(the KV cache is not bounded: W3's KV blocks outlast the steps this runs), a KV connector,
resets.
"""

from __future__ import annotations

import inspect
import pickle
import types
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

BLOCK = 16


# -- Stand-ins for vLLM's scheduler side --------------------------------------------------------


class StandInBlockPool:
    """What the connector reads of the GPU block pool: ``hash_block_size`` and vLLM's own
    ``get_cached_block`` over vLLM's ``BlockHashToBlockMap``. A block is in the map while a
    running request holds it (``hold`` / ``drop``, counted; untimed). Like vLLM's pool, its
    ``KVCacheBlock`` objects are made up front (``num_blocks``), so the heap the engine's
    garbage collector walks holds no stand-in objects made while the schedule runs."""

    def __init__(self, hash_block_size: int, num_blocks: int) -> None:
        from vllm.v1.core.block_pool import BlockHashToBlockMap, BlockPool
        from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

        self._key_of = make_block_hash_with_group_id
        self.get_cached_block = types.MethodType(BlockPool.get_cached_block, self)
        self.hash_block_size = hash_block_size
        blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks + 1)]
        if inspect.signature(BlockHashToBlockMap).parameters:
            # vLLM 0.34.0: the map holds block ids, over the pool's list of blocks.
            self.cached_block_hash_to_block = BlockHashToBlockMap(blocks)
        else:
            self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 is vLLM's null block; the free list is popped from its end.
        self._free = blocks[:0:-1]
        self._holders: dict[bytes, int] = {}
        self._blocks: dict[bytes, Any] = {}

    def hold(self, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash, 0)
        self._holders[block_hash] = holders + 1
        if holders == 0:
            block = self._free.pop()
            self._blocks[block_hash] = block
            self.cached_block_hash_to_block.insert(self._key_of(block_hash, 0), block)

    def drop(self, block_hash: bytes) -> None:
        holders = self._holders[block_hash] - 1
        if holders:
            self._holders[block_hash] = holders
            return
        del self._holders[block_hash]
        block = self._blocks.pop(block_hash)
        self.cached_block_hash_to_block.pop(self._key_of(block_hash, 0), block.block_id)
        self._free.append(block)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self._holders

    def __len__(self) -> int:
        return len(self._holders)


def kv_cache_manager(num_blocks: int) -> tuple[SimpleNamespace, StandInBlockPool]:
    """The smallest KV cache manager 0.33.0's connector reads: one full-attention group."""
    pool = StandInBlockPool(BLOCK, num_blocks)
    manager = SimpleNamespace(block_size=BLOCK, block_pool=pool)
    return (
        SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[manager]),
            block_pool=pool,
            kv_cache_config=SimpleNamespace(num_blocks=num_blocks),
        ),
        pool,
    )


def block_hasher(hashes: list[bytes]) -> Any:
    """A request's block hasher: the hashes of its blocks that became full (vLLM's contract:
    those after ``len(request.block_hashes)``)."""

    def hasher(request: Any) -> list[bytes]:
        done = len(request.block_hashes)
        full = min(request.num_tokens // BLOCK, len(hashes))
        return hashes[done:full] if full > done else []

    return hasher


def sort_batch_req_ids(
    num_tokens_per_req: dict[str, int], draft_tokens: dict[str, list[int]], decode_query_len: int
) -> list[str]:
    """The batch order of vLLM's GPU model runner (``vllm.v1.worker.gpu.model_runner``'s
    ``sort_batch_req_ids``, whose module needs a GPU build to import): speculative decodes
    first, then decode-like requests, then by scheduled tokens."""
    key = lambda r: (  # noqa: E731  (vLLM's own key, as written there)
        not draft_tokens.get(r),
        (num := num_tokens_per_req[r]) != decode_query_len,
        num,
    )
    return sorted(num_tokens_per_req, key=key)


# -- The worker's inputs, step by step ----------------------------------------------------------


@dataclass
class WorkerStep:
    """One step's inputs to the worker connector, and what to check its outputs against."""

    metadata: Any  # vLLM's AuxOutputConnectorMetadata, after a pickle round trip
    req_ids: list[str]  # the batch, in the model runner's order
    query_start_loc: np.ndarray  # int32, len(req_ids) + 1
    num_computed: np.ndarray  # int32: each request's num_computed_tokens before the step
    positions: list[tuple[int, int, int]]  # per batch entry: (index, first token, kept rows)
    num_sampled: np.ndarray  # int32
    num_rejected: np.ndarray  # int32
    prefix_reads: int  # admissions with a prefix hit (read back from the store)


@dataclass
class _Running:
    r: Any  # worker.Request
    request: Any  # vllm.v1.request.Request
    held: int = 0  # leading blocks held in the GPU prefix cache
    emitted: int = 0  # the token start the next output must have


class SchedulerSteps:
    """vLLM's scheduler connector over ``requests`` (``worker.Request``: ``index``,
    ``request_id``, ``prompt_len``, ``out_len``, ``keys``), step by step; see the module."""

    def __init__(
        self,
        requests: list[Any],
        hash_of: Any,
        *,
        connector_class: type,
        kv_blocks: int,
        max_running: int,
        max_num_batched_tokens: int,
        spec_tokens: int,
        accept: float,
        seed: int,
    ) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.request import Request, RequestStatus

        self._request_class = Request
        self._params_class = SamplingParams
        self._status = RequestStatus
        self._output_class = SchedulerOutput
        self.requests = requests
        self.hashes = [[hash_of(k) for k in r.keys] for r in requests]
        self.waiting = deque(requests)
        self.running: list[_Running] = []
        self.live: dict[str, Any] = {}
        self.manager, self.pool = kv_cache_manager(kv_blocks)
        self.connector = connector_class(self.manager)
        self.max_running = max_running
        self.budget = max_num_batched_tokens
        self.spec_tokens = spec_tokens
        self.accept = accept
        self.rng = np.random.default_rng(seed)
        self.counts = dict.fromkeys(
            (
                "steps",
                "admitted",
                "prefix_hits",
                "chunked_prefill_steps",
                "spec_decodes",
                "rejections",
                "rejected_tokens",
                "finished",
                "hashes_sent",
                "hashes_after_rows",
                "retained",
                "released",
                "outputs_checked",
            ),
            0,
        )
        self.max_running_seen = 0
        self._step: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _hold(self, state: _Running, tokens: int) -> None:
        """The GPU prefix cache takes the request's full blocks up to ``tokens`` (known ones)."""
        upto = min(tokens, state.request.num_tokens) // BLOCK
        upto = min(upto, len(state.request.block_hashes))
        hashes = self.hashes[state.r.index]
        while state.held < upto:
            self.pool.hold(hashes[state.held])
            state.held += 1

    def _prefix_hit(self, request: Any) -> int:
        """vLLM's local prefix-cache hit, capped by the connector's ``max_cache_hit``."""
        cap = self.connector.max_cache_hit(request)
        blocks = 0
        for block_hash in request.block_hashes:
            if not self.pool.holds(block_hash):
                break
            blocks += 1
        return min(blocks * BLOCK, cap, request.num_tokens - 1) // BLOCK * BLOCK

    def next(self) -> WorkerStep:
        """Schedules a step; the worker's inputs (untimed)."""
        counts = self.counts
        budget = self.budget
        scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}
        states: dict[str, _Running] = {}
        for state in self.running:
            request = state.request
            computed = request.num_computed_tokens
            if computed < request.num_prompt_tokens:
                tokens = min(request.num_prompt_tokens - computed, budget)
            else:
                left = state.r.out_len - request.num_output_tokens
                k = max(min(self.spec_tokens, left - 1), 0)
                tokens = 1 + k
                if tokens > budget:
                    continue
                if k:
                    drafts[request.request_id] = [0] * k
            if tokens <= 0:
                continue
            budget -= tokens
            scheduled[request.request_id] = tokens
            states[request.request_id] = state
            self._hold(state, computed + tokens)
        admitted: list[_Running] = []
        prefix_reads = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_running and budget:
            r = self.waiting.popleft()
            request = self._request_class(
                r.request_id,
                [0] * r.prompt_len,
                self._params_class(max_tokens=r.out_len, routed_experts_prompt_start=0),
                None,
                block_hasher=block_hasher(self.hashes[r.index]),
            )
            hit = self._prefix_hit(request)
            counts["prefix_hits"] += hit > 0
            prefix_reads += hit > 0
            request.status = self._status.RUNNING
            request.num_computed_tokens = hit
            tokens = min(r.prompt_len - hit, budget)
            budget -= tokens
            state = _Running(r, request)
            self._hold(state, hit + tokens)
            self.live[r.request_id] = request
            scheduled[r.request_id] = tokens
            states[r.request_id] = state
            admitted.append(state)
        self.running.extend(admitted)
        counts["admitted"] += len(admitted)
        self.max_running_seen = max(self.max_running_seen, len(self.running))

        output = self._output_class.make_empty()
        output.num_scheduled_tokens = scheduled
        output.total_num_scheduled_tokens = sum(scheduled.values())
        output.scheduled_spec_decode_tokens = drafts
        metadata = self.connector.build_connector_meta(output, self.live)
        for packed in metadata.block_hashes.values():
            counts["hashes_sent"] += len(packed.data) // packed.item_size
        for packed, key in (
            (metadata.retained_block_hashes, "retained"),
            (metadata.released_block_hashes, "released"),
        ):
            if packed is not None:
                counts[key] += len(packed.data) // packed.item_size
        metadata = pickle.loads(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))

        # The model runner's batch; what it samples and rejects.
        order = sort_batch_req_ids(scheduled, drafts, 1 + self.spec_tokens)
        num = len(order)
        query_start = np.zeros(num + 1, dtype=np.int32)
        num_computed = np.zeros(num, dtype=np.int32)
        num_sampled = np.zeros(num, dtype=np.int32)
        num_rejected = np.zeros(num, dtype=np.int32)
        positions: list[tuple[int, int, int]] = []
        accepted_of: dict[str, tuple[int, int]] = {}  # sampled requests: (accepted, rejected)
        for i, request_id in enumerate(order):
            state = states[request_id]
            request = state.request
            tokens = scheduled[request_id]
            computed = request.num_computed_tokens
            query_start[i + 1] = query_start[i] + tokens
            num_computed[i] = computed
            k = len(drafts.get(request_id, ()))
            if computed + tokens < request.num_prompt_tokens:
                counts["chunked_prefill_steps"] += 1
                kept = tokens  # a chunk: nothing sampled, nothing rejected
            else:
                accepted = 0
                while accepted < k and self.rng.random() < self.accept:
                    accepted += 1
                num_sampled[i] = 1 + accepted
                num_rejected[i] = k - accepted
                accepted_of[request_id] = (accepted, k - accepted)
                kept = tokens - (k - accepted)
                counts["spec_decodes"] += k > 0
                counts["rejections"] += k > accepted
                counts["rejected_tokens"] += k - accepted
            positions.append((state.r.index, computed, kept))
        self._step = {"scheduled": scheduled, "states": states, "accepted": accepted_of}
        counts["steps"] += 1
        return WorkerStep(
            metadata,
            order,
            query_start,
            num_computed,
            positions,
            num_sampled,
            num_rejected,
            prefix_reads,
        )

    def finish(self, outputs: dict[str, Any], check: Any = None) -> None:
        """The scheduler's update from the step's outputs (untimed): tokens, ``take_output``
        (``check(r, token_start, rows)`` on what it returns), finishes."""
        step = self._step
        scheduled = step["scheduled"]
        accepted_of = step["accepted"]
        finishing: list[_Running] = []
        for request_id, tokens in scheduled.items():
            state = step["states"][request_id]
            request = state.request
            request.num_computed_tokens += tokens
            if request_id not in accepted_of:
                continue  # a prefill chunk: no token sampled, no output
            accepted, rejected = accepted_of[request_id]
            request.num_computed_tokens -= rejected
            known = len(request.block_hashes)
            request.append_output_token_ids([0] * (1 + accepted))
            # Blocks whose rows the worker captured (accepted drafts) before their hashes: the
            # next step's metadata brings these.
            after = min(len(request.block_hashes), request.num_computed_tokens // BLOCK) - known
            self.counts["hashes_after_rows"] += max(after, 0)
            self._hold(state, request.num_computed_tokens)
            rows = self.connector.take_output(request, outputs)
            output = outputs[request_id]
            assert output.token_start == state.emitted, (
                request_id,
                output.token_start,
                state.emitted,
            )
            if check is not None and rows is not None:
                check(state.r, output.token_start, rows)
                self.counts["outputs_checked"] += 1
            state.emitted = request.num_tokens - 1
            if request.num_output_tokens >= state.r.out_len:
                request.status = self._status.FINISHED_LENGTH_CAPPED
                finishing.append(state)
        for state in finishing:
            self.connector.request_finished(state.request)
            hashes = self.hashes[state.r.index]
            for block_hash in hashes[: state.held]:
                self.pool.drop(block_hash)
            del self.live[state.r.request_id]
            self.counts["finished"] += 1
        if finishing:
            gone = {id(state) for state in finishing}
            self.running = [state for state in self.running if id(state) not in gone]
