"""Soak: millions of mixed operations on a bounded working set; RSS must stay flat.

The workload plays an engine: requests retain fresh block keys and publish their payloads
(``put`` with retains, or ``put_blocks``), some requests hit the prefix of an earlier one
(retain and read its keys, which may have been evicted), random recent keys are read back
(``get_concatenated`` and ``get_into``), and finished requests release their keys in reverse.
Keys are always new, so key entries are created and freed all the time; the number of live
objects is bounded by the store and the number of referenced keys by the running requests.

RSS is sampled from ``/proc/self/statm``. After warm-up (the arena full, every structure at its
steady size) it must stay flat. ``tests/stores/test_soak.py`` runs a short version in CI; run the
long
one by hand::

    .venv/bin/python benches/soak.py --ops 5000000
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aostore import BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_SIZE


@dataclass
class SoakResult:
    ops: int = 0
    seconds: float = 0.0
    calls: int = 0
    misses: int = 0
    samples: list[tuple[int, float, int]] = field(default_factory=list)  # (ops, seconds, rss)
    warm_rss: int = 0
    peak_rss: int = 0
    final_rss: int = 0
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def growth(self) -> int:
        """RSS growth after warm-up: the largest sample since then minus the first."""
        return self.peak_rss - self.warm_rss

    def flat(self, max_bytes: int = 5 << 20, max_fraction: float = 0.05) -> bool:
        return self.growth < max_bytes or self.growth < max_fraction * self.warm_rss

    def summary(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "calls": self.calls,
            "seconds": round(self.seconds, 2),
            "ops_per_second": round(self.ops / max(self.seconds, 1e-9)),
            "read_misses": self.misses,
            "warm_rss_mib": round(self.warm_rss / 2**20, 2),
            "peak_rss_mib": round(self.peak_rss / 2**20, 2),
            "final_rss_mib": round(self.final_rss / 2**20, 2),
            "growth_after_warmup_kib": round(self.growth / 1024),
            "evictions": self.stats.get("evictions", 0),
            "objects_written": self.stats.get("objects_written", 0),
        }


def run_soak(
    *,
    ops: int,
    slots: int = 8192,
    object_nbytes: int = 512,
    batch: int = 16,
    max_requests: int = 48,
    warmup_ops: int | None = None,
    samples: int = 50,
    seed: int = 0,
    via_writer: bool = False,
    on_sample: Callable[[int, float, int], None] | None = None,
) -> SoakResult:
    """Runs about ``ops`` key operations (a key put, retained, released or read is one).

    With ``via_writer`` every call goes through a ``BackgroundBlockObjectStore`` (the Rust
    writer thread); reads wait for the queue as they do there."""
    rng = random.Random(seed)
    store = BlockObjectStore(max_bytes=slots * object_nbytes, object_nbytes=object_nbytes)
    target: Any = store
    if via_writer:
        target = BackgroundBlockObjectStore(store, max_pending_batches=8)
    payloads = [bytes([value]) * object_nbytes for value in range(256)]
    rows = np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads[:batch]])
    out = np.empty(batch * object_nbytes, dtype=np.uint8)
    running: collections.deque[list[str]] = collections.deque()
    finished: collections.deque[list[str]] = collections.deque(maxlen=64)
    recent: collections.deque[str] = collections.deque(maxlen=4 * slots)
    result = SoakResult()
    warmup_ops = max(ops // 5, 4 * slots) if warmup_ops is None else warmup_ops
    sample_every = max(ops // samples, 1)
    next_sample = warmup_ops
    counter = 0
    started = time.perf_counter()

    def fresh(count: int) -> list[str]:
        nonlocal counter
        counter += count
        return [f"blk-{counter - i:x}" for i in range(count)]

    def value_of(key: str) -> int:
        return int(key[4:], 16) % batch  # the keys of one batch take every value once

    def expect(keys: list[str], data: Any) -> None:
        view = memoryview(data)
        for i, key in enumerate(keys):
            value = value_of(key)
            if view[i * object_nbytes] != value or view[(i + 1) * object_nbytes - 1] != value:
                raise AssertionError(f"wrong bytes for {key}")

    while result.ops < ops:
        action = rng.random()
        if action < 0.35 or not running:  # a request publishes new blocks
            keys = fresh(batch)
            if rng.random() < 0.5:
                ordered = sorted(keys, key=value_of)
                target.put_blocks(ordered, rows, retain_keys=ordered)
                keys = ordered
            else:
                target.put(
                    [BlockObject(k, payloads[value_of(k)]) for k in keys],
                    retain_keys=keys,
                )
            running.append(keys)
            recent.extend(keys)
            result.ops += 2 * batch
        elif action < 0.55 or len(running) > max_requests:  # a request finishes
            keys = running.popleft()
            target.put([], release_keys=keys[::-1])
            finished.append(keys)
            result.ops += len(keys)
        elif action < 0.65 and finished:  # a prefix-cache hit on an earlier request
            prefix = rng.choice(finished)[: rng.randrange(1, batch + 1)]
            target.put([], retain_keys=prefix)
            try:
                expect(prefix, target.get_concatenated(prefix))
            except BlockObjectStoreError:
                result.misses += 1
            running.append(prefix)
            result.ops += 2 * len(prefix)
        else:  # reads of recent keys, some of them evicted
            keys = [rng.choice(recent) for _ in range(batch)]
            try:
                if action < 0.85:
                    expect(keys, target.get_concatenated(keys))
                else:
                    target.get_into(keys, out)
                    expect(keys, out)
            except BlockObjectStoreError:
                result.misses += 1
            result.ops += batch
        result.calls += 1
        if result.ops >= next_sample:
            rss = rss_bytes()
            elapsed = time.perf_counter() - started
            if not result.samples:
                result.warm_rss = rss
            result.peak_rss = max(result.peak_rss, rss)
            result.samples.append((result.ops, elapsed, rss))
            if on_sample is not None:
                on_sample(result.ops, elapsed, rss)
            next_sample += sample_every
    while running:
        target.put([], release_keys=running.popleft()[::-1])
    if via_writer:
        target.get_concatenated([])  # drains the queue; raises a latched error
    result.seconds = time.perf_counter() - started
    result.final_rss = rss_bytes()
    store.check()
    assert store.snapshot()["references"] == {}, "balanced retains and releases leave no count"
    result.stats = store.stats()
    target.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=5_000_000, help="key operations to run")
    parser.add_argument("--slots", type=int, default=8192, help="store capacity in objects")
    parser.add_argument("--object-nbytes", type=int, default=512, help="bytes per object")
    parser.add_argument("--batch", type=int, default=16, help="keys per call")
    parser.add_argument("--samples", type=int, default=40, help="RSS samples after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--writer", action="store_true", help="go through BackgroundBlockObjectStore"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)

    print(f"{'ops':>12} {'seconds':>9} {'RSS MiB':>9}")

    def show(ops: int, seconds: float, rss: int) -> None:
        print(f"{ops:>12,} {seconds:>9.1f} {rss / 2**20:>9.2f}", flush=True)

    result = run_soak(
        ops=args.ops,
        slots=args.slots,
        object_nbytes=args.object_nbytes,
        batch=args.batch,
        samples=args.samples,
        seed=args.seed,
        via_writer=args.writer,
        on_sample=show,
    )
    summary = result.summary()
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**summary, "samples": result.samples}, out, indent=2)
    if not result.flat():
        print("RSS grew after warm-up", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
