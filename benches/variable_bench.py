"""T9: the variable-size store with logprob-like objects, as ratios measured in this one run.

- churn: a full store in steady state, batches of 64 new objects of 1.3-4.5 KB with 64 retains
  and 64 releases, then reads of 64 live keys; ns per object for aostore's
  ``VariableBlockObjectStore``, for aostore's fixed ``BlockObjectStore`` at the same bytes
  (objects of the mean size, the same ``max_bytes``), and for the pure-Python variable store of
  the same contract (``aostore.bench.baseline_variable``);
- fragmentation: payload bytes held / arena bytes at the end of the churn (and chunk bytes
  used / arena bytes, and how many pieces an object is in);
- read-merge-write: the vLLM branch worker's shape: every decode step each running request
  reads its last logprob block (``get_optional`` for aostore, a ``get_concatenated`` that may
  raise for the baseline), appends a row and re-publishes it (a put that replaces the key with
  a larger payload); a full block starts a new key (retained), a finished request releases its
  keys in reverse.

    python benches/variable_bench.py            # full sizes: table + bench-out/variable.json
    python benches/variable_bench.py --quick    # tiny sizes (CI smoke)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from aostore import BlockObject, BlockObjectStore, BlockObjectStoreError, VariableBlockObjectStore
from aostore.bench.baseline_variable import PythonVariableBlockObjectStore

BATCH = 64
BLOCK_TOKENS = 16
FRAMING = 1_268  # NPZ headers and names around the rows


def row_nbytes(width: int) -> int:
    """Bytes per logprob row: position (8) + rank (4) + ``width`` (token id, logprob) pairs."""
    return 12 + 8 * width


def logprob_nbytes(rng: random.Random) -> int:
    """A block's payload: 16 rows mostly, a partial block one time in eight; widths 1-24."""
    rows = BLOCK_TOKENS if rng.random() >= 1 / 8 else rng.randint(1, BLOCK_TOKENS - 1)
    return FRAMING + rows * row_nbytes(rng.randint(1, 24))


FINGERPRINTS = (
    "(temperature=1.0, top_p=1.0)",
    "('logprobs': 5, \"prompt\": 0)",
    "(seed 17, 'top_k': 20, n=8)",
    "(greedy)",
    "(temperature=0.6, 'top_k': 40, top_p=0.95)",
)


def logprob_key(i: int) -> str:
    """``vllm-logprobs/v1/{generation}/{fingerprint}/{block_hash_hex}/{boundary_token}``:
    110-130 bytes with spaces, quotes and parentheses."""
    digest = i * 0x9E3779B97F4A7C15 % (1 << 256)
    fingerprint = FINGERPRINTS[i % len(FINGERPRINTS)]
    return f"vllm-logprobs/v1/0/{fingerprint}/{digest:064x}/{(i * 7919) % 151_000}"


def routed_experts_key(i: int) -> str:
    """The fixed store's own keys: ``vllm-artifact/<namespace>/<64 hex digits>``, 80 bytes."""
    return f"vllm-artifact/0/{i * 0x9E3779B97F4A7C15 % (1 << 256):064x}"


def payload_pool(sizes: list[int]) -> list[bytes]:
    rng = random.Random(1)
    return [rng.randbytes(n) for n in sizes]


def churn(
    store: Any,
    sizes: list[int],
    batches: int,
    capacity_objects: int,
    logprob_key: Any = logprob_key,
) -> dict[str, float]:
    """Fill to steady state, then time ``batches`` rounds of put (64 new, 64 retains, 64
    releases) and get (64 live keys). Object ``i`` has size ``sizes[i % len(sizes)]`` and key
    ``logprob_key(i)``."""
    pool = payload_pool(sizes)
    count = len(pool)
    next_key = 0
    fill_to = capacity_objects * 11 // 10  # past full: the store is evicting when timing starts
    while next_key < fill_to:
        store.put(
            [
                BlockObject(logprob_key(next_key + i), pool[(next_key + i) % count])
                for i in range(BATCH)
            ]
        )
        next_key += BATCH
    rng = random.Random(0)
    referenced: list[str] = []
    plan = []
    for _ in range(20 + batches):
        objects = [
            BlockObject(logprob_key(next_key + i), pool[(next_key + i) % count])
            for i in range(BATCH)
        ]
        retains = [o.key for o in objects]
        releases = referenced
        referenced = retains
        next_key += BATCH
        # Reads among the newest third: live (eviction takes the oldest unreferenced keys).
        lo = next_key - capacity_objects // 3
        wanted = [logprob_key(rng.randrange(lo, next_key)) for _ in range(BATCH)]
        plan.append((objects, retains, releases, wanted))
    gc.collect()
    # Thread CPU time: on a shared machine the wall clock also counts other processes' turns.
    clock = time.thread_time_ns
    put_ns = get_ns = put_wall_ns = get_wall_ns = 0
    for step, (objects, retains, releases, wanted) in enumerate(plan):
        w0, t0 = time.perf_counter_ns(), clock()
        store.put(objects, retain_keys=retains, release_keys=releases)
        w1, t1 = time.perf_counter_ns(), clock()
        store.get_concatenated(wanted)
        w2, t2 = time.perf_counter_ns(), clock()
        if step >= 20:  # after 20 warm-up rounds
            put_ns += t1 - t0
            get_ns += t2 - t1
            put_wall_ns += w1 - w0
            get_wall_ns += w2 - w1
    n = batches * BATCH
    return {
        "put_ns": put_ns / n,
        "get_ns": get_ns / n,
        "put_wall_ns": put_wall_ns / n,
        "get_wall_ns": get_wall_ns / n,
    }


def churn_figures(quick: bool) -> dict[str, Any]:
    max_bytes = (8 << 20) if quick else (512 << 20)
    batches = 40 if quick else 1_500
    rng = random.Random(2)
    sizes = [logprob_nbytes(rng) for _ in range(4_096)]
    mean = sum(sizes) / len(sizes)
    capacity_objects = int(max_bytes / mean)
    results: dict[str, Any] = {
        "max_bytes": max_bytes,
        "mean_object_nbytes": mean,
        "min_object_nbytes": min(sizes),
        "max_object_nbytes": max(sizes),
        "key_nbytes": [len(logprob_key(i)) for i in (0, 1, 2, 3, 4)],
    }

    variable = VariableBlockObjectStore(max_bytes=max_bytes, prefault=True)
    results["aostore"] = churn(variable, sizes, batches, capacity_objects)
    stats = variable.stats()
    results["fragmentation"] = {
        "held_over_arena": stats["stored_bytes"] / stats["arena_bytes"],
        "used_over_arena": stats["used_bytes"] / stats["arena_bytes"],
        "mean_runs_per_object": variable.mean_runs(),
        "stored": stats["stored"],
        "chunk_nbytes": stats["chunk_nbytes"],
    }
    variable.check()
    variable.close()

    # The fixed store twice: with the same keys (over its 99 inline bytes: a heap copy each) and
    # with its own 80-byte routed-experts keys, its best case. T9 compares with the faster.
    fixed_nbytes = round(mean)
    for name, keys in (("fixed", logprob_key), ("fixed/80B-keys", routed_experts_key)):
        fixed = BlockObjectStore(max_bytes=max_bytes, object_nbytes=fixed_nbytes, prefault=True)
        results[name] = churn(fixed, [fixed_nbytes], batches, max_bytes // fixed_nbytes, keys)
        results[name]["object_nbytes"] = fixed_nbytes
        fixed.close()

    baseline = PythonVariableBlockObjectStore(max_bytes=max_bytes)
    results["baseline"] = churn(baseline, sizes, max(10, batches // 10), capacity_objects)
    baseline.close()
    return results


def read_merge_write(store: Any, requests: int, steps: int, rng: random.Random) -> dict[str, float]:
    """The vLLM branch worker's logprob path: per decode step, for each running request, read
    the last block (``get_optional``, or a ``get_concatenated`` that may raise), merge in one row,
    re-publish it; a full block starts a new key. Finished requests release in reverse."""
    has_get_optional = isinstance(store, VariableBlockObjectStore)
    widths = [rng.randint(1, 24) for _ in range(requests)]
    blocks = [[logprob_key(1_000_000 + i)] for i in range(requests)]
    next_id = requests
    store.put([], retain_keys=[b[0] for b in blocks])
    filled = [rng.randrange(BLOCK_TOKENS) for _ in range(requests)]
    clock = time.thread_time_ns
    get_ns = put_ns = ops = 0
    for step in range(steps):
        for r in range(requests):
            key = blocks[r][-1]
            t0 = clock()
            if has_get_optional:
                existing = store.get_optional(key)
            else:
                try:
                    existing = store.get_concatenated([key])
                except BlockObjectStoreError:
                    existing = None
            t1 = clock()
            rows = filled[r] + 1
            payload = (existing or b"")[:FRAMING].ljust(FRAMING, b"h") + bytes(
                rows * row_nbytes(widths[r])
            )
            retains: list[str] = []
            releases: list[str] = []
            filled[r] = rows
            if rows == BLOCK_TOKENS:  # the block is full: the next token starts a new key
                filled[r] = 0
                fresh = logprob_key(1_000_000 + next_id)
                next_id += 1
                retains = [fresh]
                if rng.random() < 0.05:  # the request finishes; a new one takes its place
                    releases = list(reversed(blocks[r]))
                    blocks[r] = [fresh]
                else:
                    blocks[r].append(fresh)
            t2 = clock()
            store.put([BlockObject(key, payload)], retain_keys=retains, release_keys=releases)
            t3 = clock()
            if step >= 2:
                get_ns += t1 - t0
                put_ns += t3 - t2
                ops += 1
    return {"get_ns": get_ns / ops, "put_ns": put_ns / ops, "ops": ops}


def read_merge_write_figures(quick: bool) -> dict[str, Any]:
    requests = 64 if quick else 512
    steps = 10 if quick else 200
    max_bytes = (16 << 20) if quick else (256 << 20)
    results: dict[str, Any] = {"requests": requests, "steps": steps}
    for name, make in (
        ("aostore", lambda: VariableBlockObjectStore(max_bytes=max_bytes, prefault=True)),
        ("baseline", lambda: PythonVariableBlockObjectStore(max_bytes=max_bytes)),
    ):
        store = make()
        gc.collect()
        results[name] = read_merge_write(store, requests, steps, random.Random(3))
        store.close()
    return results


def t9(quick: bool) -> dict[str, Any]:
    """Every T9 figure; ``benches/bench.py`` can call this as it calls its workloads."""
    return {"churn": churn_figures(quick), "read_merge_write": read_merge_write_figures(quick)}


def t9_rows(r: dict[str, Any]) -> list[tuple[str, str, float, str, bool, str]]:
    """(id, measure, value, target, met, reference) rows, as ``benches/bench.py`` prints them."""
    c, m = r["churn"], r["read_merge_write"]
    rows = []
    for op in ("put", "get"):
        a, b = c["aostore"][f"{op}_ns"], c["baseline"][f"{op}_ns"]
        same, own = c["fixed"][f"{op}_ns"], c["fixed/80B-keys"][f"{op}_ns"]
        f = min(same, own)
        rows.append(
            (
                "T9",
                f"logprob churn {op}, variable / fixed store at the same bytes",
                a / f,
                "<= 1.5",
                a / f <= 1.5,
                f"{a:.0f} vs {f:.0f} ns/object (fixed: {same:.0f} with the same keys, {own:.0f} "
                f"with 80 B keys); Python variable store {b / a:.1f}x slower",
            )
        )
    held = c["fragmentation"]["held_over_arena"]
    rows.append(
        (
            "T9",
            "bytes held / arena bytes at steady state",
            held,
            ">= 0.85",
            held >= 0.85,
            f"chunks used {c['fragmentation']['used_over_arena']:.3f}, "
            f"{c['fragmentation']['mean_runs_per_object']:.2f} pieces/object",
        )
    )
    for op in ("get", "put"):
        a, b = m["aostore"][f"{op}_ns"], m["baseline"][f"{op}_ns"]
        rows.append(
            (
                "-",
                f"read-merge-write {op} per block, Python variable store / aostore",
                b / a,
                "-",
                True,
                f"{b / 1e3:.1f} vs {a / 1e3:.2f} µs",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", default="bench-out", help="folder for variable.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"machine": os.uname().machine, "cpus": os.cpu_count()}
    results.update(t9(args.quick))
    rows = t9_rows(results)
    results["targets"] = [
        {"id": r[0], "measure": r[1], "value": r[2], "target": r[3], "met": r[4], "note": r[5]}
        for r in rows
    ]
    print("| id | measure | aostore | target | met | reference in the same run |")
    print("|---|---|---|---|---|---|")
    for tid, measure, value, goal, met, note in rows:
        print(f"| {tid} | {measure} | {value:.2f} | {goal} | {'yes' if met else 'NO'} | {note} |")
    (out / "variable.json").write_text(json.dumps(results, indent=2))
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
