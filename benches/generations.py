"""Costs over an RL run (docs/guarantees.md): vLLM's key namespace carries a generation that every
prefix-cache reset (every weight sync) bumps. T2-shaped puts (64 new objects of 64 B, 64
retains, 64 releases, vLLM-shaped keys) into a full store, at generation 0 and after the store
went through 10,000 generations, alternated in one run; and T6's memory beyond the arena per
key (T6's reading: RSS from before construction, less the arena), each in a fresh process.

    python benches/generations.py [--slots N] [--generations G]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, mmap, sys, time
from aostore import BlockObject, BlockObjectStore

slots, generations, target = (int(a) for a in sys.argv[1:4])
payload = b"x" * 64

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE

def key(generation, i):
    return f"vllm-artifact/{generation}/{i * 0x9E3779B97F4A7C15 % (1 << 256):064x}"

before = rss()
store = BlockObjectStore(max_bytes=slots * 64, object_nbytes=64, prefault=True)
for generation in range(generations):  # one 64-key put a generation, as weight syncs come
    store.put([BlockObject(key(generation, i), payload) for i in range(64)])
for start in range(0, slots, 1024):
    end = min(start + 1024, slots)
    store.put([BlockObject(key(target, i), payload) for i in range(start, end)])
after = rss()
arena = -(-store.num_slots * 64 // mmap.PAGESIZE) * mmap.PAGESIZE
held, times = [], []
for n in range(2_020):
    base = slots + n * 64
    keys = [key(target, base + i) for i in range(64)]
    objects = [BlockObject(k, payload) for k in keys]
    released = held[:64] if len(held) >= 64 else []
    start = time.perf_counter_ns()
    store.put(objects, retain_keys=keys, release_keys=released)
    times.append(time.perf_counter_ns() - start)
    held = held[len(released):] + keys
store.check()
print(json.dumps({"put_ns_per_object": sorted(times[20:])[len(times[20:]) // 2] / 64,
                  "bytes_per_key_beyond_arena": (after - before - arena) / slots}))
"""


def run(slots: int, generations: int, target: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(slots), str(generations), str(target)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=167_341)
    parser.add_argument("--generations", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    zero: list[dict[str, float]] = []
    late: list[dict[str, float]] = []
    for _ in range(args.rounds):  # alternated, so the machine's drift hits both alike
        zero.append(run(args.slots, 0, 0))
        late.append(run(args.slots, args.generations, args.generations))
    rows = []
    for name in ("put_ns_per_object", "bytes_per_key_beyond_arena"):
        a = statistics.median(r[name] for r in zero)
        b = statistics.median(r[name] for r in late)
        rows.append((name, a, b, b / a if a else float("nan")))
    print(
        f"{'measure':28} {'generation 0':>14} {f'generation {args.generations:,}':>18} {'ratio':>7}"
    )
    for name, a, b, ratio in rows:
        print(f"{name:28} {a:14.1f} {b:18.1f} {ratio:7.2f}")
    started = time.strftime("%Y-%m-%d")
    print(f"({args.rounds} alternated rounds, medians, {started})")


if __name__ == "__main__":
    main()
