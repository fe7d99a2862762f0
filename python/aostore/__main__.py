"""``python -m aostore``: exercise a store at vLLM scale and print ns per object.

The shape is GLM-4.5-Air's routed experts on one GB200 node: 167,341 slots of 5,888 bytes
(46 MoE layers x top-8 x uint8 x 16 tokens). The store is filled, then driven as vLLM's
worker does in steady state: batches of 64 new blocks with 64 retains and 64 releases, and
reads of 64 random live blocks.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence

from aostore import BlockObject, BlockObjectStore

_BATCH = 64


def _progress(label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done >= total else ""
    print(f"\r{label:<8} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)


def _key(i: int) -> str:
    # Block-hash-like keys: 64 hex digits plus vLLM's group suffix.
    return f"{i * 0x9E3779B97F4A7C15 % (1 << 256):064x}:0"


def run(slots: int, object_nbytes: int, batches: int, seed: int) -> list[tuple[str, float, str]]:
    """Runs the workload; returns (measure, value, unit) rows."""
    rng = random.Random(seed)
    store = BlockObjectStore(max_bytes=slots * object_nbytes, object_nbytes=object_nbytes)
    payloads = [bytes([i]) * object_nbytes for i in range(_BATCH)]
    next_key = 0
    steps = -(-slots // _BATCH)
    for step in range(steps):
        n = min(_BATCH, slots - next_key)
        store.put([BlockObject(_key(next_key + i), payloads[i]) for i in range(n)])
        next_key += n
        if step % 256 == 0 or step == steps - 1:
            _progress("fill", step + 1, steps)

    live: list[int] = list(range(next_key))
    referenced: list[int] = []
    put_ns = 0
    get_ns = 0
    for step in range(batches):
        new = [BlockObject(_key(next_key + i), payloads[i]) for i in range(_BATCH)]
        retains = [_key(next_key + i) for i in range(_BATCH)]
        releases = [_key(k) for k in referenced[-_BATCH:]]
        t0 = time.perf_counter_ns()
        store.put(new, retain_keys=retains, release_keys=releases)
        put_ns += time.perf_counter_ns() - t0
        del referenced[-_BATCH:]
        referenced.extend(range(next_key, next_key + _BATCH))
        live.extend(range(next_key, next_key + _BATCH))
        next_key += _BATCH
        # Eviction takes the oldest unreferenced keys and a read makes a key newer, so keys in
        # the newest half of the store are always live.
        low = max(0, len(live) - slots // 2)
        wanted = [_key(live[rng.randrange(low, len(live))]) for _ in range(_BATCH)]
        t0 = time.perf_counter_ns()
        data = store.get_concatenated(wanted)
        get_ns += time.perf_counter_ns() - t0
        assert len(data) == _BATCH * object_nbytes
        if step % 64 == 0 or step == batches - 1:
            _progress("steady", step + 1, batches)
    store.check()
    stats = store.stats()
    store.close()
    objects = batches * _BATCH
    moved = objects * object_nbytes
    return [
        ("put ns/object", put_ns / objects, "ns"),
        ("get ns/object", get_ns / objects, "ns"),
        ("put bandwidth", moved / put_ns, "GB/s"),
        ("get bandwidth", moved / get_ns, "GB/s"),
        ("evictions", float(stats["evictions"]), ""),
        ("stored", float(stats["stored"]), ""),
    ]


def _table(rows: Sequence[tuple[str, float, str]]) -> str:
    lines = [f"{'measure':<16} {'value':>12}  unit", "-" * 36]
    for name, value, unit in rows:
        text = f"{value:,.0f}" if unit in ("", "ns") else f"{value:,.2f}"
        lines.append(f"{name:<16} {text:>12}  {unit}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aostore", description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=167_341, help="store capacity in objects")
    parser.add_argument("--object-nbytes", type=int, default=5_888, help="bytes per object")
    parser.add_argument("--batches", type=int, default=2_000, help="steady-state batches of 64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.slots < _BATCH or args.object_nbytes < 1 or args.batches < 1:
        parser.error("--slots must be >= 64, --object-nbytes and --batches >= 1")
    rows = run(args.slots, args.object_nbytes, args.batches, args.seed)
    print(f"aostore: {args.slots:,} slots x {args.object_nbytes:,} B, {args.batches:,} batches")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
