"""W1 on vLLM's Mooncake branch: its ``ShmBlockObjectStore`` (a model) against aostore's.

The branch's class (vllm#57968, ``vllm/distributed/aux_output_connector/shm.py``) is not on the
package index, so the first column is **a model of it**: ``aostore.bench.shm_model`` (which
``tests/stores/test_shm_differential.py`` checks against aostore), plain Python with the branch's
one
``OrderedDict`` for referenced and unreferenced keys and its eviction walk from the oldest key. It
is not the branch's code: its constant costs are its own, but its walk over the referenced keys is
the branch's.

W1 as in docs/workloads.md: a full store of 64-byte objects whose oldest 0% or 99% are
referenced, then evicting puts of 1 (or 64) new objects; the median time per put, and 99% / 0%.

    PYTHONPATH=python python benches/shm_bench.py [--slots 100000 300000] [--puts 100]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aostore
from aostore.bench import shm_model as model_shm

NBYTES = 64


@dataclass(frozen=True)
class Obj:
    key: str
    payload: bytes


def per_put_us(make: Callable[..., Any], slots: int, pct: int, batch: int, puts: int) -> float:
    store = make(max_bytes=slots * NBYTES, object_nbytes=NBYTES)
    payload = bytes(NBYTES)
    referenced = slots * pct // 100
    for start in range(0, slots, 4096):
        keys = [f"key-{i:08d}" for i in range(start, min(start + 4096, slots))]
        retained = [key for i, key in enumerate(keys, start) if i < referenced]
        store.put([Obj(key, payload) for key in keys], retain_keys=retained)
    batches = [[Obj(f"new-{p:06d}-{i:03d}", payload) for i in range(batch)] for p in range(puts)]
    gc.collect()
    times = []
    for objects in batches:
        t0 = time.perf_counter_ns()
        store.put(objects)
        times.append(time.perf_counter_ns() - t0)
    store.close()
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--puts", type=int, default=100)
    args = parser.parse_args()
    stores = (
        ("branch's ShmBlockObjectStore (model)", model_shm.ShmModel),
        ("aostore.ShmBlockObjectStore", aostore.ShmBlockObjectStore),
    )
    print("| store | slots | put of | 0% referenced | 99% referenced | 99% / 0% |")
    print("|---|---|---|---|---|---|")
    for slots in args.slots:
        for batch in (1, 64):
            for name, make in stores:
                low = per_put_us(make, slots, 0, batch, args.puts)
                high = per_put_us(make, slots, 99, batch, args.puts)
                print(
                    f"| {name} | {slots:,} | {batch} | {low:,.1f} µs | {high:,.1f} µs | "
                    f"{high / low:,.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
