"""T11: the variable-size store through its background wrapper, as the engine thread sees it.

Logprob-like rows of 1.3-4.5 KB under 110-130-byte keys. Contenders, in one run:

- ``variable/rust``: ``VariableBlockObjectStore`` behind ``BackgroundBlockObjectStore``, whose
  writer thread is the Rust one (it never takes the GIL);
- ``variable/python``: the same store behind a Python writer thread, as vLLM's own
  ``BackgroundBlockObjectStore`` gives it (vLLM's class when ``vllm`` is importable, else
  aostore's Python writer, which is the same queue-and-thread design);
- ``fixed/rust``: the fixed store behind the Rust writer with objects of the rows' mean size,
  the reference T11 is judged against (docs/workloads.md: "as T4 and T7 for the fixed store").

W4: ~200 µs of pure-Python engine work, then a put of 64 rows, 400 times; speed against the
same loop with a no-op store run beside it (median of 15 pairs, in alternating order). T7: the
engine-thread cost of one put, (a) 4 rows + 8 retains + 4 releases and (b) 64 rows, median
quiet and p99 while another Python thread keeps the interpreter busy.

    python benches/t11.py            # the table
    python benches/t11.py --quick    # tiny sizes
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aostore import (
    BackgroundBlockObjectStore,
    BlockObject,
    BlockObjectStore,
    VariableBlockObjectStore,
)
from bench import (
    W4_REPETITIONS,
    NoopStore,
    busy_interpreter,
    calibrate,
    engine_work,
    paired_speeds,
    percentile,
    speed_summary,
)
from variable_bench import logprob_key, logprob_nbytes

BATCH = 64


class _PythonWritten(VariableBlockObjectStore):
    """The variable store with a ``put`` of its own, which a Rust writer must honour: the
    background wrapper then runs its Python writer thread."""

    __slots__ = ()

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        super().put(objects, retain_keys=retain_keys, release_keys=release_keys)


def python_background() -> tuple[str, Callable[..., Any]]:
    try:
        from vllm.distributed.aux_output_connector.store import (
            BackgroundBlockObjectStore as VllmBackground,
        )
    except Exception:
        return "aostore's Python writer", BackgroundBlockObjectStore
    return "vLLM's BackgroundBlockObjectStore", VllmBackground


def rows(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes([i % 251]) * logprob_nbytes(rng) for i in range(count)]


def contenders(max_bytes: int, mean: int) -> dict[str, Callable[[int], Any]]:
    label, background = python_background()

    def variable_rust(queue: int) -> Any:
        return BackgroundBlockObjectStore(
            VariableBlockObjectStore(max_bytes=max_bytes, prefault=True), max_pending_batches=queue
        )

    def variable_python(queue: int) -> Any:
        store = _PythonWritten(max_bytes=max_bytes, prefault=True)
        return background(store, max_pending_batches=queue)

    def fixed_rust(queue: int) -> Any:
        store = BlockObjectStore(max_bytes=max_bytes, object_nbytes=mean, prefault=True)
        return BackgroundBlockObjectStore(store, max_pending_batches=queue)

    variable_python.__doc__ = label
    return {
        "variable/rust": variable_rust,
        "variable/python": variable_python,
        "fixed/rust": fixed_rust,
    }


def batches(rounds: int, per_put: int, data: list[bytes], fixed: int | None) -> list[list[Any]]:
    out = []
    for r in range(rounds):
        objects = []
        for i in range(per_put):
            payload = data[(r * per_put + i) % len(data)]
            if fixed is not None:
                payload = payload[:fixed].ljust(fixed, b"\0")
            objects.append(BlockObject(logprob_key(r * per_put + i), payload))
        out.append(objects)
    return out


def w4(quick: bool) -> dict[str, Any]:
    iterations = calibrate()
    rounds = 40 if quick else 400
    data = rows(1_024)
    mean = int(statistics.mean(len(d) for d in data))
    max_bytes = (2_048 if quick else 16_384) * mean
    made = contenders(max_bytes, mean)
    plans = {
        name: batches(rounds, BATCH, data, mean if name.startswith("fixed") else None)
        for name in made
    }

    def loop(store: Any, plan: list[list[Any]]) -> float:
        gc.collect()
        t0 = time.perf_counter()
        for objects in plan:
            engine_work(iterations)
            store.put(objects)
        elapsed = time.perf_counter() - t0
        store.close()
        return elapsed

    def noop_loop() -> float:
        return loop(NoopStore(), plans["fixed/rust"])

    def store_loop(name: str) -> Callable[[], float]:
        return lambda: loop(made[name](8), plans[name])

    repetitions = 5 if quick else W4_REPETITIONS
    return {
        name: speed_summary(paired_speeds(noop_loop, store_loop(name), repetitions))
        for name in made
    }


def t7(quick: bool) -> dict[str, Any]:
    iterations = calibrate()
    puts = 200 if quick else 2_000
    data = rows(1_024, seed=1)
    mean = int(statistics.mean(len(d) for d in data))
    out: dict[str, Any] = {}
    for shape, per_put, refs in (("a", 4, True), ("b", BATCH, False)):
        max_bytes = (1_024 if shape == "a" else 4_096) * mean
        for name, build in contenders(max_bytes, mean).items():
            plan = batches(puts + 200, per_put, data, mean if name.startswith("fixed") else None)
            for busy in (False, True):
                writer = build(1_024)
                costs = []
                clock = time.perf_counter_ns
                gc.collect()
                with busy_interpreter(busy):
                    for n, objects in enumerate(plan):
                        keys = [o.key for o in objects]
                        retains = keys * 2 if refs else []
                        engine_work(iterations)
                        t0 = clock()
                        writer.put(objects, retain_keys=retains, release_keys=keys if refs else [])
                        t1 = clock()
                        if refs:
                            writer.put([], release_keys=keys)
                        if n >= 200:
                            costs.append(t1 - t0)
                    writer.close()
                mode = "busy" if busy else "quiet"
                out[f"{shape}/{name}/{mode}"] = {
                    "median_us": statistics.median(costs) / 1e3,
                    "p99_us": percentile(costs, 99) / 1e3,
                }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = parser.parse_args(argv)
    label, _ = python_background()
    print(f"variable/python: {label}")
    speeds = w4(args.quick)
    costs = t7(args.quick)
    print("| measure | variable/rust | variable/python | fixed/rust | target |")
    print("|---|---|---|---|---|")
    cells = [
        f"{speeds[n]['median']:.3f} ({speeds[n]['min']:.2f}-{speeds[n]['max']:.2f})" for n in speeds
    ]
    print(f"| W4 engine-thread speed / no-op (median, range) | {' | '.join(cells)} | >= 0.95 |")
    for shape in ("a", "b"):
        for mode, stat in (("quiet", "median_us"), ("busy", "p99_us")):
            cells = [f"{costs[f'{shape}/{n}/{mode}'][stat]:.1f}" for n in speeds]
            what = "median" if mode == "quiet" else "p99 busy"
            print(f"| T7 ({shape}) {what}, µs | {' | '.join(cells)} | <= fixed/rust |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
