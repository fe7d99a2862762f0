"""``python -m aostore``: replay an RL rollout against aostore, vLLM's own store and a replica.
``python -m aostore`` (or ``aostore``) runs W3 (docs/workloads.md) with its defaults, one
rollout driven as vLLM's worker drives the store, and prints writer time and put latency of
aostore, of vLLM's own ``BlockObjectStore`` (when ``vllm`` is importable, else its column says
why not; ``--no-vllm`` skips it) and of the pure-Python replica of it, all from the same run,
judged against the targets (``aostore.bench.report``); ``churn`` exercises a full store in
steady state instead, in ns per object, and ``vllm-check`` is a dry run of the vLLM plugin
(exit status 0 when aostore would be used, 1 when not); ``vllm-fingerprint`` prints the
installed vLLM's files beside each release record (docs/adding-a-vllm-release.md).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from aostore import BlockObject, BlockObjectStore

_BATCH = 64


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


class Progress:
    """Progress of the long loops, on stderr (or ``stream``): on a terminal a bar redrawn in
    place; anywhere else (a log file, a CI log) one short line when a loop starts and one at
    each further tenth, so a log gets about a dozen lines per loop and no ``\\r``."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        # label -> (the last tenth printed, the last count seen)
        self._shown: dict[str, tuple[int, int]] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        total = max(total, 1)
        if _is_terminal(stream):
            width = 30
            filled = width * min(done, total) // total
            bar = "#" * filled + "-" * (width - filled)
            end = "\n" if done >= total else ""
            print(f"\r{label:<8} [{bar}] {done}/{total}", end=end, file=stream, flush=True)
            return
        tenth = 10 if done >= total else 10 * done // total
        last = self._shown.get(label)
        if last is not None and done >= last[1] and tenth <= last[0]:
            self._shown[label] = (last[0], done)
            return
        self._shown[label] = (tenth, done)
        percent = 100 if done >= total else 100 * done // total
        print(f"{label}: {done:,}/{total:,} ({percent}%)", file=stream, flush=True)


def _key(i: int) -> str:
    # Block-hash-like keys: 64 hex digits plus vLLM's group suffix.
    return f"{i * 0x9E3779B97F4A7C15 % (1 << 256):064x}:0"


def churn(
    slots: int,
    object_nbytes: int,
    batches: int,
    seed: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[tuple[str, float, str]]:
    """Runs the workload; returns (measure, value, unit) rows."""
    _progress = progress or Progress()
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


def replay(args: argparse.Namespace) -> int:
    from aostore.bench import report
    from aostore.bench.contenders import contenders, plugin_contender
    from aostore.bench.measure import compare, pool, writer_floor
    from aostore.bench.replay import RolloutShape, generate

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
    results = compare(
        shape, steps, rows, prefault=args.prefault, progress=Progress(), stores=stores
    )
    # T5's reference: the same objects copied by numpy into an arena like aostore's.
    floor = writer_floor(shape, steps, rows, prefault=args.prefault)
    print(
        report.replay_table(
            results, why, floor_seconds=floor, prefault=args.prefault, steps=steps, rows=rows
        )
    )
    if args.json:
        import json

        payload: dict[str, Any] = {
            r.name: {
                "label": r.label,
                "puts": r.puts,
                "objects": r.objects,
                "objects_read": r.objects_read,
                "writer_seconds": r.writer_seconds,
                "writer_store_seconds": r.writer_store_seconds,
                "read_seconds": r.read_seconds,
                "p50_us": r.percentile_us(50),
                "p99_us": r.percentile_us(99),
                "worst_us": r.worst_us,
                "worst_index": r.worst_index,
                "worst_cpu_us": r.worst_cpu_us,
                "worst_store_us": r.worst_store_us,
                "worst_store_index": r.worst_store_index,
                "stalls": len(r.stalls),
            }
            for r in results
        }
        if why:
            payload["vllm"] = {"missing": why}
        targets = {
            j.id: {"target": j.target, "value": j.value, "met": j.met}
            for j in report.judge(results, floor).values()
        }
        with open(args.json, "w") as f:
            json.dump(
                {
                    "shape": shape.__dict__,
                    "prefault": args.prefault,
                    "floor_seconds": floor,
                    "targets": targets,
                    "results": payload,
                },
                f,
                indent=2,
            )
    if args.plot:
        report.plot(results, args.plot)
    return 0


DESCRIPTION = """\
Replays W3 (docs/workloads.md: one RL rollout of GLM-4.5-Air, 167,341 slots x 5,888 B) as
vLLM's worker drives its store, against aostore, vLLM's own store (when vllm imports; --no-vllm
skips it) and a pure-Python replica of vLLM's store, all in the same run, and prints writer
time and put latency of each. Two rows are judged against their targets: writer time against
the memcpy floor (T5) and the worst put (T8). Exit status 0 once the replay ran, whether the
targets were met or NOT MET; 2 for bad arguments. The subcommands below do other things.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``aostore`` (``python -m aostore``), every option described."""
    parser = argparse.ArgumentParser(
        prog="aostore",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated rollout, and of churn's reads (before COMMAND; default 0)",
    )
    parser.add_argument("--scale", action="store_true", help="three rollouts, one after another")
    parser.add_argument(
        "--prefault", action="store_true", help="commit both arenas before the replay"
    )
    parser.add_argument(
        "--no-vllm", action="store_true", help="do not import vLLM to replay its store too"
    )
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write the put-latency plot")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="instead of the replay (COMMAND -h: its options)"
    )
    churn_parser = sub.add_parser(
        "churn",
        help="steady churn of a full store, ns per object",
        description="Fills a store, then puts and reads batches of 64 objects in steady "
        "state (every put evicts), and prints ns per object and GB/s of puts and gets.",
    )
    churn_parser.add_argument(
        "--slots", type=int, default=167_341, help="capacity in objects, >= 64 (default 167,341)"
    )
    churn_parser.add_argument(
        "--object-nbytes", type=int, default=5_888, help="bytes per object (default 5,888)"
    )
    churn_parser.add_argument(
        "--batches", type=int, default=2_000, help="batches of 64 objects (default 2,000)"
    )
    check_parser = sub.add_parser(
        "vllm-check",
        help="dry run of the vLLM plugin: what it would replace here (exit 0) or keep (exit 1)",
        description="Runs the vLLM plugin's gate on the installed vLLM without starting an "
        "engine and prints what it would replace, or keep and why. Exit status 0: aostore's "
        "store will be used; 1: it will not.",
    )
    check_parser.add_argument(
        "--json", dest="as_json", action="store_true", help="print the report as JSON"
    )
    check_parser.add_argument(
        "--verbose", action="store_true", help="show what importing vLLM and torch writes"
    )
    fingerprint_parser = sub.add_parser(
        "vllm-fingerprint",
        help="the installed vLLM's files beside each release record (exit 0: one record's)",
        description="Prints the installed vLLM's files beside each release record "
        "(docs/adding-a-vllm-release.md), or with --draft a first record for a release "
        "that has none. Exit status 0: the files are one record's for every feature; "
        "1: a partial match or none; 2: no vLLM, or not a vLLM package.",
    )
    fingerprint_parser.add_argument(
        "--root", metavar="DIR", help="a vLLM package directory instead of the installed one"
    )
    fingerprint_parser.add_argument(
        "--draft",
        metavar="WHEEL|DIR",
        help="draft a record for the vLLM release in this wheel or tree",
    )
    fingerprint_parser.add_argument(
        "--against",
        metavar="WHEEL|DIR",
        help="with --draft: the nearest release's wheel or tree, for diff statistics",
    )
    return parser


def sub_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, so that its errors print its own usage."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "vllm-fingerprint":
        from pathlib import Path

        from aostore.vllm.compat import releases

        if args.against and not args.draft:
            sub_parser(parser, "vllm-fingerprint").error("--against needs --draft")
        if args.draft:
            from aostore.vllm.compat import draft

            try:
                tree = draft.open_tree(args.draft)
                against = draft.open_tree(args.against) if args.against else None
            except draft.NotAVllmTree as error:
                print(f"aostore vllm-fingerprint: {error}", file=sys.stderr)
                return 2
            print("\n".join(draft.describe(tree, against)))
            return 0
        root = Path(args.root) if args.root else releases.vllm_root()
        if root is not None and not releases.is_vllm_tree(root):
            print(
                f"aostore vllm-fingerprint: {root} is not a vLLM package "
                "(no __init__.py with a distributed/ beside it)",
                file=sys.stderr,
            )
            return 2
        lines, status = releases.describe(root)
        print("\n".join(lines))
        return status
    if args.command == "vllm-check":
        from aostore.vllm import report

        return report.run(as_json=args.as_json, verbose=args.verbose)
    if args.command != "churn":
        return replay(args)
    if args.slots < _BATCH or args.object_nbytes < 1 or args.batches < 1:
        churn_parser = sub_parser(parser, "churn")
        churn_parser.error("--slots must be >= 64, --object-nbytes and --batches >= 1")
    rows = churn(args.slots, args.object_nbytes, args.batches, args.seed)
    print(f"aostore: {args.slots:,} slots x {args.object_nbytes:,} B, {args.batches:,} batches")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
