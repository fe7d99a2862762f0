"""T17: the R3 arena under load (docs/r3-reference.md), a finish's placement and a
``/metrics`` scrape with the arena full against the same with room, in one run.

The frontend's finish (``Arena.deliver`` of one sample's rows, 16 KiB: the default budget's
share of each of its 65,536 slots) and the collector's scrape (``Arena.stats``) run on vLLM's
event loop under the lock every finish needs; the sixth review measured 68 ms a finish and
63 ms a scrape with the arena full of unread references (the placement walked every held slot
twice per give-up; the scrape asked the kernel about each). Cases, each the median of
``--ops`` operations:

- ``finish, room``: an arena with room (a few held), a finish that fits;
- ``finish, full of unread``: every slot held by an unread reference: the finish falls back to
  rows (nothing may give way);
- ``give-up, few held`` / ``give-up, all held``: every slot held by a read reference (read by a
  reader through ``fetch(out=)``), each finish gives one up: a small arena against a full one;
- ``scrape, room`` / ``scrape, full``.

Target (docs/workloads.md, T17): full / room about equal (<= 2x) for a finish and a scrape;
a give-up's cost independent of the number held (all held / few held <= 2x).

    python benches/r3_arena.py               # the default budget (1 GiB, 65,536 slots)
    python benches/r3_arena.py --quick       # 64 MiB, a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from aostore import r3
from aostore.r3.arena import Arena

ROW = (46, 8)
SAMPLE_ROWS = 44  # 16,192 bytes: four pages, the default budget's share of a slot
FEW = 64


def sample(value: int) -> np.ndarray:
    return np.full((SAMPLE_ROWS, *ROW), value % 251, np.uint8)


def median_us(operation: Callable[[], object], ops: int) -> float:
    times = []
    for _ in range(ops):
        start = time.perf_counter_ns()
        operation()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def fill(arena: Arena, count: int) -> list[np.ndarray]:
    references = []
    for i in range(count):
        reference = arena.deliver(sample(i))
        assert reference is not None, f"the arena took only {i} samples"
        references.append(reference)
    return references


def read_all(reader: r3.Reader, references: list[np.ndarray]) -> None:
    out = np.empty((SAMPLE_ROWS * 512, *ROW), np.uint8)
    for at in range(0, len(references), 512):
        part = references[at : at + 512]
        reader.fetch(part, out=out[: SAMPLE_ROWS * len(part)])


def give_ups_us(arena: Arena, ops: int) -> float:
    """The median finish that gives up one read slot, every slot held by a read reference (each
    new reference is read, untimed, before the next finish)."""
    reader = r3.Reader()
    read_all(reader, fill(arena, len(arena._slots)))
    out = np.empty((SAMPLE_ROWS, *ROW), np.uint8)
    times = []
    for i in range(ops):
        start = time.perf_counter_ns()
        reference = arena.deliver(sample(i))
        times.append(time.perf_counter_ns() - start)
        assert reference is not None
        reader.fetch([reference], out=out)
    assert arena.stats()["evictions"] == ops
    reader.close()
    return statistics.median(times) / 1000


def measure(budget: int, ops: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    with Arena(budget, ttl=3600.0) as arena:
        slots = len(arena._slots)
        fill(arena, FEW)
        figures["finish, room"] = median_us(lambda: arena.deliver(sample(1)), ops)
        figures["scrape, room"] = median_us(arena.stats, ops)
    with Arena(budget, ttl=3600.0) as arena:
        fill(arena, slots)
        assert arena.deliver(sample(1)) is None
        figures["finish, full of unread"] = median_us(lambda: arena.deliver(sample(1)), ops)
        figures["scrape, full"] = median_us(arena.stats, ops)
        figures["held"] = float(arena.stats()["slots_held"])
    with Arena(FEW * 4 * 4096, ttl=3600.0) as small:
        figures["give-up, few held"] = give_ups_us(small, ops)
    with Arena(budget, ttl=3600.0) as arena:
        figures["give-up, all held"] = give_ups_us(arena, ops)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB, fewer operations")
    parser.add_argument("--budget", type=int, default=1 << 30)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    budget, ops = (64 << 20, 200) if args.quick else (args.budget, args.ops)
    figures = measure(budget, ops)
    ratios = {
        "finish: full of unread / room": figures["finish, full of unread"]
        / figures["finish, room"],
        "scrape: full / room": figures["scrape, full"] / figures["scrape, room"],
        "give-up: all held / few held": figures["give-up, all held"] / figures["give-up, few held"],
    }
    print(f"T17, an arena of {budget:,} bytes, {int(figures['held']):,} slots held when full")
    print(f"| {'case':<28} | {'median, us':>10} |")
    print(f"|{'-' * 30}|{'-' * 12}|")
    for name, value in figures.items():
        if name != "held":
            print(f"| {name:<28} | {value:>10.1f} |")
    print()
    print(f"| {'ratio':<30} | {'value':>6} | target |")
    print(f"|{'-' * 32}|{'-' * 8}|--------|")
    for name, value in ratios.items():
        print(f"| {name:<30} | {value:>6.2f} | <= 2   |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "t17.json").write_text(
            json.dumps({"budget": budget, "figures": figures, "ratios": ratios}, indent=1)
        )


if __name__ == "__main__":
    main()
