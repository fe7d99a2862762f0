"""R3's scheduler side: vLLM 0.33.0's ``AuxOutputSchedulerConnector`` over W3, per engine step.

The companion of ``benches/worker.py`` (T10, T12: the worker connector): the same W3 schedule, at
the same sizes, through the connector that vLLM's scheduler runs in the engine-core process.

Real, vLLM 0.33.0's own code as shipped:

- ``AuxOutputSchedulerConnector`` (``vllm.distributed.aux_output_connector.connector``), built by
  its own ``__init__`` (no KV connector, so its retention capacity is ``num_blocks``), and every
  call made on it;
- the requests: ``vllm.v1.request.Request`` objects (``SamplingParams(max_tokens=out_len,
  routed_experts_prompt_start=0)``), their tokens appended with ``append_output_token_ids`` as
  the scheduler does, so ``block_hashes``, ``num_tokens``, ``num_output_tokens`` and
  ``is_finished()`` are vLLM's; their block hasher returns the 32-byte hashes ``worker.py``
  uses for their blocks (``worker.block_hash`` of the replay's block ids, shared by the samples
  of a prompt for its full prompt blocks);
- the ``SchedulerOutput`` (``SchedulerOutput.make_empty()``, its ``num_scheduled_tokens`` and
  ``total_num_scheduled_tokens`` set: prompt tokens minus the prefix-cache hit for a prefill, 1
  for a decode, running requests first as vLLM schedules them);
- the GPU prefix-cache lookup: vLLM's ``BlockPool.get_cached_block`` over vLLM's
  ``BlockHashToBlockMap`` of ``KVCacheBlock`` entries;
- the outputs: ``AuxRequestOutput(token_start, rows)`` per scheduled request, as the worker
  returns them (``token_start`` 0 and the whole prompt for a prefill, the position and one row
  for a decode; ``rows`` views of a uint8 (n, 46, 8) numpy array made before the loop).

Stood in for, and only these: the KV cache manager, as the smallest object the constructor and
methods read (``coordinator.single_type_managers[0]`` with ``block_size`` 16 and ``block_pool``;
``block_pool`` with ``hash_block_size`` 16, the ``get_cached_block`` above, and a map;
``kv_cache_config.num_blocks`` = W3's KV blocks). What is in the GPU prefix cache is W3's (as
``worker.py``'s prefix-cache hits assume): a block is cached from the step that schedules its
last token until the last running request holding it is freed (freed blocks are taken as evicted
at once). So the KV-cached retains and releases are modelled: ``request_finished`` retains a
finishing request's computed blocks, and past ``num_blocks`` retained the connector releases the
oldest ones no running request holds; both go out in the next metadata.

Each step makes, in vLLM's order, the scheduler's calls on the connector, timed (the
engine-core thread's time in the scheduler connector, ``time.perf_counter_ns``):
``max_cache_hit(request)`` for each request admitted in the step (the prefix lookup of a waiting
request, before its blocks are cached), ``build_connector_meta(scheduler_output, requests)``
once (``requests``: the scheduler's live requests), then ``take_output(request, outputs)`` for
each scheduled request (each samples one token; one loop, its few tens of ns a request of
Python loop included) and ``request_finished(request)`` for each one whose last token that was
(its finish goes out in the next step's metadata, the step ``worker.py`` reports it in). The
scheduler's own work between the calls is untimed. ``step`` figures are all four;
``core`` figures leave ``max_cache_hit`` out (``build_connector_meta``, ``take_output``,
``request_finished`` only). Before the loop, as ``EngineCore.__init__`` does after start-up, the
heap is frozen (``gc.freeze``; the stand-in pool's blocks are made before, as vLLM's are) and
``vllm.envs.enable_envs_cache()`` is called; the garbage collector stays on, so a collection that
starts inside a timed call is counted in it, as it would be in the engine.

The schedule is ``worker.py``'s (``worker.schedule`` of W3's ``aostore.bench.replay`` shape, its
sizes from ``worker.parse_args``): a request is prefilled in its admission step, decodes one
token a step, and is finished after ``out_len`` tokens. Not modelled, as in ``worker.py``:
chunked prefill, preemption, speculative decoding, async scheduling, a KV connector
(``request_loading``, ``cap_external_hit``), prefix lookups repeated for a request that waits
for the step's token budget (one ``max_cache_hit`` per admission).

    python benches/scheduler.py                # W3 at GLM-4.5-Air scale, 3 runs
    python benches/scheduler.py --quick        # tiny sizes, a smoke run
    python benches/scheduler.py --out s.json   # also write the figures as JSON

Run it with vLLM 0.33.0 installed (``.venv-vllm/bin/python``). ``aostore.bench.replay`` is pure
Python; where aostore itself is not importable (no built native module), it is loaded from this
tree's ``python/aostore/bench/replay.py``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _import_replay() -> None:
    """``aostore.bench.replay`` for ``worker``: aostore's, or the tree's file where aostore is
    not importable (its package ``__init__`` needs the native module)."""
    try:
        import aostore.bench.replay  # noqa: F401
    except ImportError:
        path = ROOT / "python" / "aostore" / "bench" / "replay.py"
        for name, folder in (("aostore", path.parents[1]), ("aostore.bench", path.parent)):
            package = types.ModuleType(name)
            package.__path__ = [str(folder)]
            sys.modules[name] = package
        spec = importlib.util.spec_from_file_location("aostore.bench.replay", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["aostore.bench.replay"] = module
        spec.loader.exec_module(module)
        sys.modules["aostore.bench"].replay = module  # type: ignore[attr-defined]
        sys.modules["aostore"].bench = sys.modules["aostore.bench"]  # type: ignore[attr-defined]


_import_replay()
sys.path.insert(0, str(HERE))
import worker  # noqa: E402  (benches/worker.py: W3's schedule, its sizes and block hashes)
from vllm_steps import (  # noqa: E402  (the stand-ins, shared with worker.py's vllm-scheduler)
    block_hasher,
    kv_cache_manager,
)

BLOCK = worker.BLOCK
CALLS = ("max_cache_hit", "build_connector_meta", "take_output", "request_finished")


# -- One run ------------------------------------------------------------------------------------


def run(
    args: argparse.Namespace, requests: list[worker.Request], which: str = "vllm"
) -> dict[str, Any]:
    """The whole schedule through a fresh connector (``vllm``: vLLM's class; ``aostore``: the
    subclass aostore's plugin installs, its two per-request calls in Rust); the per-step times
    and counts."""
    from vllm import envs
    from vllm.distributed.aux_output_connector.connector import (
        AuxOutputSchedulerConnector,
        AuxRequestOutput,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request, RequestStatus

    by_start: dict[int, list[worker.Request]] = defaultdict(list)
    for r in requests:
        by_start[r.start].append(r)
    last_step = max(r.finish for r in requests) + 1
    num_steps = min(last_step, args.steps) if args.steps else last_step

    cache: dict[int, bytes] = {}

    def hash_of(block_id: int) -> bytes:
        value = cache.get(block_id)
        if value is None:
            value = cache[block_id] = worker.block_hash(block_id)
        return value

    hashes = [[hash_of(k) for k in r.keys] for r in requests]
    vllm_requests = [
        Request(
            r.request_id,
            [0] * r.prompt_len,
            SamplingParams(max_tokens=r.out_len, routed_experts_prompt_start=0),
            None,
            block_hasher=block_hasher(hashes[r.index]),
        )
        for r in requests
    ]
    for r, request in zip(requests, vllm_requests, strict=True):
        assert len(request.block_hashes) == r.prompt_len // BLOCK
    manager, pool = kv_cache_manager(args.shape.kv_blocks)
    cls: Any = AuxOutputSchedulerConnector
    if which == "aostore":
        from aostore.vllm.dataplane import scheduler_subclass
        from vllm.distributed.aux_output_connector import connector as module

        cls = scheduler_subclass(AuxOutputSchedulerConnector, module, layout="0.33")
    connector = cls(manager)
    rows = np.zeros((max(r.prompt_len for r in requests), worker.LAYERS, worker.TOP_K), np.uint8)
    one_row = rows[:1]

    clock = time.perf_counter_ns
    call_ns = {name: np.zeros(num_steps, dtype=np.int64) for name in CALLS}
    hit_ns, build_ns, take_ns, finish_ns = (call_ns[name] for name in CALLS)
    per_call: dict[str, list[int]] = {"max_cache_hit": [], "request_finished": []}
    live: dict[str, Any] = {}  # the scheduler's requests
    running: list[tuple[worker.Request, Any]] = []
    counts = dict.fromkeys(
        ("scheduled", "admitted", "finished", "hashes_sent", "retained", "released", "hits"), 0
    )
    max_cached = 0
    # As vLLM's EngineCore.__init__ does once start-up is over: freeze the heap, then cache the
    # environment variables (vllm.envs reads os.environ on every access until then, about 2 µs
    # an access, and the connector reads one for every KV block it looks at).
    gc.collect()
    gc.freeze()
    envs.enable_envs_cache()
    loop_start = time.perf_counter()
    for step in range(num_steps):
        # The scheduler, untimed but for the connector calls: running requests decode one token
        # (a block whose last token is scheduled is cached), then the admissions prefill.
        scheduled: dict[str, int] = {}
        batch: list[tuple[worker.Request, Any]] = []
        for r, request in running:
            position = request.num_computed_tokens
            scheduled[r.request_id] = 1
            batch.append((r, request))
            if (position + 1) % BLOCK == 0:
                pool.hold(hashes[r.index][(position + 1) // BLOCK - 1])
        admitted = by_start.get(step, ())
        t_hit = 0
        for r in admitted:
            request = vllm_requests[r.index]
            t0 = clock()
            hit = connector.max_cache_hit(request)
            t5 = clock()
            t_hit += t5 - t0
            per_call["max_cache_hit"].append(t5 - t0)
            counts["hits"] += hit > 0
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = r.cached
            for block_hash in hashes[r.index][: r.prompt_len // BLOCK]:
                pool.hold(block_hash)
            live[r.request_id] = request
            scheduled[r.request_id] = r.prompt_len - r.cached
            batch.append((r, request))
        running.extend((r, vllm_requests[r.index]) for r in admitted)
        output = SchedulerOutput.make_empty()
        output.num_scheduled_tokens = scheduled
        output.total_num_scheduled_tokens = sum(scheduled.values())

        t0 = clock()
        metadata = connector.build_connector_meta(output, live)
        t1 = clock()

        # Untimed: the step runs; the worker's outputs; each request gets its token.
        outputs: dict[str, Any] = {}
        finishing: list[tuple[worker.Request, Any]] = []
        for r, request in batch:
            computed = request.num_computed_tokens
            if request.num_output_tokens == 0:  # admitted this step: its prefill
                outputs[r.request_id] = AuxRequestOutput(0, rows[: r.prompt_len])
                assert metadata.requests[r.request_id] == 0
            else:
                outputs[r.request_id] = AuxRequestOutput(computed, one_row)
                assert metadata.requests[r.request_id] == computed
            request.num_computed_tokens = computed + scheduled[r.request_id]
            request.append_output_token_ids(0)
            if request.num_output_tokens == r.out_len:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                finishing.append((r, request))
        requests_out = [request for _, request in batch]

        t2 = clock()
        accepted = [connector.take_output(request, outputs) for request in requests_out]
        t3 = clock()
        t_finish = 0
        for r, request in finishing:
            t4 = clock()
            connector.request_finished(request)
            t5 = clock()
            t_finish += t5 - t4
            per_call["request_finished"].append(t5 - t4)
            # Untimed: the scheduler frees the request and its blocks (those it computed).
            for block_hash in hashes[r.index][: request.num_computed_tokens // BLOCK]:
                pool.drop(block_hash)
            del live[r.request_id]

        hit_ns[step] = t_hit
        build_ns[step] = t1 - t0
        take_ns[step] = t3 - t2
        finish_ns[step] = t_finish

        # Untimed checks and counts.
        for (r, _), rows_out in zip(batch, accepted, strict=True):
            assert rows_out is not None and len(rows_out) == len(outputs[r.request_id].rows)
        for packed in metadata.block_hashes.values():
            counts["hashes_sent"] += len(packed.data) // packed.item_size
        if metadata.retained_block_hashes is not None:
            retained = metadata.retained_block_hashes
            counts["retained"] += len(retained.data) // retained.item_size
        if metadata.released_block_hashes is not None:
            released = metadata.released_block_hashes
            counts["released"] += len(released.data) // released.item_size
        counts["scheduled"] += len(batch)
        counts["admitted"] += len(admitted)
        counts["finished"] += len(finishing)
        if finishing:
            done = {r.index for r, _ in finishing}
            running = [(r, q) for r, q in running if r.index not in done]
        max_cached = max(max_cached, len(connector._kv_cached))
        if args.progress and step % 4096 == 0:
            print(f"  step {step}/{num_steps}", file=sys.stderr, flush=True)
    loop_s = time.perf_counter() - loop_start
    gc.unfreeze()
    if num_steps == last_step:
        # Every block a request computed went to the worker once.
        expected = sum((r.prompt_len + r.out_len - 1) // BLOCK for r in requests)
        assert counts["hashes_sent"] == expected, (counts["hashes_sent"], expected)
        assert not live and not running and len(pool) == 0
    step_ns = hit_ns + build_ns + take_ns + finish_ns
    return {
        "steps": num_steps,
        "schedule_steps": last_step,
        "step_ns": step_ns,
        "core_ns": step_ns - hit_ns,
        "call_ms": {name: float(call_ns[name].sum() / 1e6) for name in CALLS},
        "per_call_us": {
            name: {
                "calls": len(values),
                "p50": float(np.percentile(values, 50) / 1e3),
                "max": float(max(values) / 1e3),
            }
            for name, values in per_call.items()
        },
        "counts": counts | {"max_kv_cached": max_cached},
        "loop_s": loop_s,
    }


# -- Figures ------------------------------------------------------------------------------------


def figures(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": result["steps"]}
    for prefix, key in (("", "step_ns"), ("core_", "core_ns")):
        ms = np.asarray(result[key], dtype=np.float64) / 1e6
        out[f"{prefix}p50_ms"] = float(np.percentile(ms, 50))
        out[f"{prefix}p99_ms"] = float(np.percentile(ms, 99))
        out[f"{prefix}total_ms"] = float(ms.sum())
    out["call_ms"] = result["call_ms"]
    out["per_call_us"] = result["per_call_us"]
    out["counts"] = result["counts"]
    out["loop_s"] = result["loop_s"]
    return out


MEDIAN_KEYS = ("p50_ms", "p99_ms", "total_ms", "core_p50_ms", "core_p99_ms", "core_total_ms")


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    median = {key: statistics.median(run[key] for run in runs) for key in MEDIAN_KEYS}
    median["call_ms"] = {
        name: statistics.median(run["call_ms"][name] for run in runs) for name in CALLS
    }
    return median


def line(label: str, f: dict[str, Any]) -> str:
    calls = ", ".join(f"{name} {f['call_ms'][name]:.1f}" for name in CALLS)
    return (
        f"  {label}: p50 {f['p50_ms'] * 1e3:.1f} µs, p99 {f['p99_ms'] * 1e3:.1f} µs, "
        f"total {f['total_ms']:.1f} ms (without max_cache_hit: p50 {f['core_p50_ms'] * 1e3:.1f}"
        f" µs, p99 {f['core_p99_ms'] * 1e3:.1f} µs, total {f['core_total_ms']:.1f} ms); "
        f"per call, ms: {calls}"
    )


# -- Main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="worker.py's tiny sizes: a smoke run")
    parser.add_argument("--prompts", type=int, default=None, help="W3: 64")
    parser.add_argument("--samples", type=int, default=None, help="W3: 8")
    parser.add_argument(
        "--steps", type=int, default=0, help="run only the first N steps (0, the default: all)"
    )
    parser.add_argument("--reps", type=int, default=3, help="runs, each with a fresh connector")
    parser.add_argument(
        "--connectors",
        nargs="+",
        default=["vllm", "aostore"],
        choices=["vllm", "aostore"],
        help="whose scheduler connector; several alternate (ABBA) within each run",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--progress", action="store_true", help="a line every 4,096 steps")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    # The shape exactly as worker.py builds it from the same flags.
    shaped = ["--seed", str(args.seed)] + (["--quick"] if args.quick else [])
    if args.prompts is not None:
        shaped += ["--prompts", str(args.prompts)]
    if args.samples is not None:
        shaped += ["--samples", str(args.samples)]
    args.shape = worker.parse_args(shaped).shape
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = args.shape
    requests = worker.schedule(shape)
    steps = max(r.finish for r in requests) + 1
    print(
        f"scheduler.py: W3 {shape.prompts} prompts x {shape.samples} samples, "
        f"{len(requests)} requests, {steps} steps"
        + (f" (first {args.steps} run)" if args.steps and args.steps < steps else "")
        + f", {sum(r.cached > 0 for r in requests)} prefix-cache hits; KV {shape.kv_blocks} "
        f"blocks, at most {shape.max_running} running",
        flush=True,
    )
    started = time.perf_counter()
    import vllm.distributed.aux_output_connector.connector
    import vllm.v1.core.block_pool
    import vllm.v1.request  # noqa: F401

    print(f"scheduler.py: vLLM imported in {time.perf_counter() - started:.1f} s", flush=True)
    by_connector: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for number in range(args.reps):
        order = args.connectors if number % 2 == 0 else args.connectors[::-1]
        for which in order:
            result = figures(run(args, requests, which))
            by_connector[which].append(result)
            print(line(f"run {number + 1}/{args.reps} {which}", result), flush=True)
            c = result["counts"]
            each = "; ".join(
                f"{name} per call p50 {v['p50']:.1f} µs, max {v['max']:.1f} µs ({v['calls']} calls)"
                for name, v in result["per_call_us"].items()
            )
            print(
                f"    {result['steps']} steps in {result['loop_s']:.1f} s; {c['scheduled']} "
                f"request-steps, {c['admitted']} admitted ({c['hits']} with a retained or cached "
                f"prefix), {c['finished']} finished; {c['hashes_sent']} block hashes sent, "
                f"{c['retained']} retained, {c['released']} released (at most "
                f"{c['max_kv_cached']} retained at once); {each}",
                flush=True,
            )
            gc.collect()
    medians = {which: median_of(runs) for which, runs in by_connector.items()}
    for which, median in medians.items():
        print(line(f"median of {args.reps} {which}", median))
    runs = by_connector[args.connectors[0]]
    median = medians[args.connectors[0]]
    if args.quick:
        print("(--quick: tiny sizes, a smoke run)")
    if args.out is not None:
        payload = {
            "shape": {
                key: getattr(shape, key)
                for key in shape.__dataclass_fields__  # type: ignore[attr-defined]
            },
            "requests": len(requests),
            "schedule_steps": steps,
            "steps": runs[0]["steps"],
            "reps": len(runs),
            "runs": runs,
            "median": median,
            "by_connector": {w: {"runs": r, "median": medians[w]} for w, r in by_connector.items()},
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
