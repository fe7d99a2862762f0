"""Tensor façade speed: ``put_blocks`` / ``get_into`` against the ``bytes`` path vLLM uses.

For one batch of ``--blocks`` blocks of ``--nbytes`` bytes (default 64 x 5,888 B: 16 tokens x
46 layers x top-8 routed-expert ids in uint8), in one run:

- write: ``store.put_blocks(keys, array)`` against ``store.put([BlockObject(k, row.tobytes())])``
- read: ``store.get_into(keys, out)`` into a preallocated numpy array against
  ``np.frombuffer(store.get_concatenated(keys), dtype)``

Every write goes to keys that are not stored (the store evicts an older batch), so each one
copies its payloads. Prints ns per batch (median of ``--repeats`` loops, the two calls of a
row alternating so both see the same load) and the ratios.

    python benches/tensor_bench.py [--blocks 64] [--nbytes 5888] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from aostore import BlockObject, BlockObjectStore

KEY_SETS = 8  # batches of keys cycled through
RESIDENT = 4  # batches the store holds: the read batch and the last 3 written


def loops_for(call: Callable[[], object], seconds: float) -> int:
    """How many calls of ``call`` take about ``seconds``."""
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < 0.05 or calls < 3:
        call()
        calls += 1
    return max(1, int(seconds / ((time.perf_counter() - start) / calls)))


def time_pair(
    fast: Callable[[], object], slow: Callable[[], object], seconds: float, repeats: int
) -> tuple[float, float]:
    """Median ns per call of each, timed in alternating loops so both see the same machine load."""
    loops = [loops_for(call, seconds / repeats / 2) for call in (fast, slow)]
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for call, count, out in zip((fast, slow), loops, samples, strict=True):
            begin = time.perf_counter_ns()
            for _ in range(count):
                call()
            out.append((time.perf_counter_ns() - begin) / count)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per batch (default 64)")
    parser.add_argument("--nbytes", type=int, default=5888, help="bytes per block (default 5888)")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="seconds per call timed (default 1.0)"
    )
    parser.add_argument(
        "--repeats", type=int, default=9, help="alternating timed loops (default 9)"
    )
    args = parser.parse_args(argv)
    blocks, nbytes = args.blocks, args.nbytes

    store = BlockObjectStore(max_bytes=RESIDENT * blocks * nbytes, object_nbytes=nbytes)
    key_sets = [[f"batch{s}/block{i}" for i in range(blocks)] for s in range(KEY_SETS)]
    read_keys = [f"read/block{i}" for i in range(blocks)]
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    rounds = {"put_blocks": 0, "put": 0}

    def next_keys(case: str) -> list[str]:
        rounds[case] += 1
        return key_sets[rounds[case] % KEY_SETS]

    def put_blocks() -> None:
        store.put_blocks(next_keys("put_blocks"), array)

    def put_tobytes() -> None:
        keys = next_keys("put")
        store.put([BlockObject(key, array[i].tobytes()) for i, key in enumerate(keys)])

    # The read batch is referenced, so it stays while the writes cycle through the other slots.
    store.put_blocks(read_keys, array, retain_keys=read_keys)
    out = np.empty((blocks, nbytes), dtype=np.uint8)

    def get_into() -> None:
        store.get_into(read_keys, out)

    def get_frombuffer() -> None:
        np.frombuffer(store.get_concatenated(read_keys), dtype=np.uint8).reshape(blocks, nbytes)

    rows = []
    for label, fast, slow in [
        ("write", put_blocks, put_tobytes),
        ("read", get_into, get_frombuffer),
    ]:
        fast_ns, slow_ns = time_pair(fast, slow, 2 * args.seconds, args.repeats)
        rows.append((label, fast.__name__, fast_ns, slow.__name__, slow_ns))

    names = {
        "put_blocks": "put_blocks(keys, array)",
        "put_tobytes": "put([BlockObject(k, row.tobytes())])",
        "get_into": "get_into(keys, out)",
        "get_frombuffer": "np.frombuffer(get_concatenated(keys))",
    }
    assert bytes(out) == array.tobytes()  # the reads read what was written
    print(
        f"{blocks} blocks of {nbytes:,} B per batch; median of {args.repeats} loops; "
        f"Python {sys.version.split()[0]}, numpy {np.__version__}"
    )
    print()
    print("| op | aostore façade | ns/batch | bytes path | ns/batch | speedup |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for label, fast_name, fast_ns, slow_name, slow_ns in rows:
        print(
            f"| {label} | `{names[fast_name]}` | {fast_ns:,.0f} | `{names[slow_name]}` | "
            f"{slow_ns:,.0f} | {slow_ns / fast_ns:.2f}x |"
        )
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
