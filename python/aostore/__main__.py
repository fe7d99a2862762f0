"""``python -m aostore``: replay an RL rollout against aostore, vLLM's own store and a replica.

``python -m aostore`` (or ``aostore``) runs the workload replay W3 with its defaults: one
rollout of the seed's GLM-4.5-Air benchmark (64 prompts x 8 samples, 1k-16k output tokens,
167,341 store slots of 5,888 bytes), driven as vLLM's worker drives the store, then prints
writer time and put latency of aostore, of vLLM's own ``BlockObjectStore`` (the store you would
otherwise run; when ``vllm`` is importable, else its column says why not) and of the pure-Python
replica of it, all from the same run. ``--no-vllm`` skips vLLM's store (importing vLLM takes
seconds). ``--scale`` replays the seed's three rollouts; ``--json`` and ``--plot`` write the
figures and a latency plot.

``python -m aostore churn`` exercises a full store in steady state instead: batches of 64 new
blocks with 64 retains and 64 releases, and reads of 64 random live blocks, in ns per object.

``python -m aostore vllm-check`` (or ``aostore vllm-check``) is a dry run of the vLLM plugin:
it imports the installed vLLM's store module, runs the plugin's gate without starting an
engine or swapping anything, and prints what would be replaced (with which profile and
prefault) or kept and why; exit status 0 when aostore would be used, 1 when not.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

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


def churn(slots: int, object_nbytes: int, batches: int, seed: int) -> list[tuple[str, float, str]]:
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


def _fmt(value: float, unit: str) -> str:
    return f"{value:,.0f}" if not unit else f"{value:,.3f} {unit}"


def replay(args: argparse.Namespace) -> int:
    from aostore.bench.replay import (
        RolloutShape,
        compare,
        contenders,
        generate,
        plugin_contender,
        pool,
    )

    shape = RolloutShape(rollout_steps=3 if args.scale else 1, seed=args.seed)
    # aostore as the vLLM plugin builds it for vLLM 0.33 (profile "grow"; nothing grows here),
    # or with prefault=True when every arena is committed first.
    stores, why = contenders(vllm=not args.no_vllm, profile="grow")
    if not args.prefault:
        stores[0] = plugin_contender()
    print(
        f"replaying {shape.rollout_steps} rollout(s) of {shape.prompts} prompts x "
        f"{shape.samples} samples; store of {shape.store_slots:,} slots x "
        f"{shape.object_nbytes:,} B; stores: {', '.join(c.label for c in stores)}",
        file=sys.stderr,
    )
    steps = generate(shape)
    rows = pool(shape.object_nbytes, shape.seed)
    results = compare(shape, steps, rows, prefault=args.prefault, progress=_progress, stores=stores)
    print(_replay_table(results, why))
    if args.json:
        import json

        payload = {
            r.name: {
                "label": r.label,
                "puts": r.puts,
                "objects": r.objects,
                "objects_read": r.objects_read,
                "writer_seconds": r.writer_seconds,
                "read_seconds": r.read_seconds,
                "p50_us": r.percentile_us(50),
                "p99_us": r.percentile_us(99),
                "worst_us": r.worst_us,
                "worst_cpu_us": r.worst_cpu_us,
            }
            for r in results
        }
        if why:
            payload["vllm"] = {"missing": why}
        with open(args.json, "w") as f:
            json.dump({"shape": shape.__dict__, "results": payload}, f, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _replay_table(results: Sequence[Any], vllm_missing: str) -> str:
    """Figures of each store side by side, then each reference's time / aostore's."""
    ours, others = results[0], results[1:]
    measures: list[tuple[str, str, Any]] = [
        ("puts", "", lambda r: float(r.puts)),
        ("objects written", "", lambda r: float(r.objects)),
        ("objects read", "", lambda r: float(r.objects_read)),
        ("writer time", "s", lambda r: r.writer_seconds),
        ("put p50", "us", lambda r: r.percentile_us(50)),
        ("put p99", "us", lambda r: r.percentile_us(99)),
        ("worst put", "us", lambda r: r.worst_us),
        ("worst on CPU", "us", lambda r: r.worst_cpu_us),
        ("read time", "s", lambda r: r.read_seconds),
    ]
    columns = [r.label for r in results]
    if vllm_missing:
        columns.insert(1, "vLLM")
    ratios = [f"{r.label}/aostore" for r in others]
    head = f"{'measure':<16}" + "".join(f" {c:>14}" for c in columns)
    head += "".join(f" {c:>22}" for c in ratios)
    lines = [head, "-" * len(head)]
    for label, unit, figure in measures:
        cells = [_fmt(figure(r), unit) for r in results]
        if vllm_missing:
            cells.insert(1, "-")
        line = f"{label:<16}" + "".join(f" {c:>14}" for c in cells)
        ours_value = figure(ours)
        for r in others:
            ratio = f"{figure(r) / ours_value:.1f}x" if unit and ours_value else ""
            line += f" {ratio:>22}"
        lines.append(line)
    if vllm_missing:
        lines.append(
            f"vLLM's store: {vllm_missing}; the references in this run are the pure-Python "
            "replica only (pip install vllm==0.33.0 to compare with the store vLLM runs)"
        )
    return "\n".join(lines)


def _plot(results: list[Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        lat = np.sort(np.asarray(r.put_ns)) / 1e3
        ax.plot(lat, np.linspace(0, 1, len(lat)), label=r.label)
    ax.set_xscale("log")
    ax.set_xlabel("put latency (µs)")
    ax.set_ylabel("fraction of puts")
    ax.set_title("RL-rollout replay: put latency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aostore", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", action="store_true", help="the seed's three rollouts")
    parser.add_argument(
        "--prefault", action="store_true", help="commit both arenas before the replay"
    )
    parser.add_argument(
        "--no-vllm", action="store_true", help="do not import vLLM to replay its store too"
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write the put-latency plot")
    sub = parser.add_subparsers(dest="command")
    churn_parser = sub.add_parser("churn", help="steady churn of a full store, ns per object")
    churn_parser.add_argument("--slots", type=int, default=167_341, help="capacity in objects")
    churn_parser.add_argument("--object-nbytes", type=int, default=5_888, help="bytes per object")
    churn_parser.add_argument("--batches", type=int, default=2_000, help="batches of 64")
    check_parser = sub.add_parser(
        "vllm-check",
        help="dry run of the vLLM plugin: what it would replace here (exit 0) or keep (exit 1)",
    )
    check_parser.add_argument(
        "--json", dest="as_json", action="store_true", help="print the report as JSON"
    )
    args = parser.parse_args(argv)
    if args.command == "vllm-check":
        from aostore import _vllm_check

        return _vllm_check.run(as_json=args.as_json)
    if args.command != "churn":
        return replay(args)
    if args.slots < _BATCH or args.object_nbytes < 1 or args.batches < 1:
        parser.error("--slots must be >= 64, --object-nbytes and --batches >= 1")
    rows = churn(args.slots, args.object_nbytes, args.batches, args.seed)
    print(f"aostore: {args.slots:,} slots x {args.object_nbytes:,} B, {args.batches:,} batches")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
