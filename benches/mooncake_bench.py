"""Cost per object of tiered reads: a local hit against a read served by Mooncake on loopback.

Starts a Mooncake master and a segment holder on 127.0.0.1 (``tests/support/mooncake_util.py``;
stopped by PID at the end), or uses a running cluster with ``--config mooncake.json``. Objects
of ``--nbytes`` (5,888 B: one GLM-4.5-Air block of routed-expert ids), batches of
``--batch`` (64) keys, ns per object (median of ``--repeats`` timed loops):

- ``tiered get_into, local hit``: every key in the local arena.
- ``tiered get_into, from Mooncake``: no key in the local arena (``keep_fetched=False``, so
  every call goes to Mooncake): the local probes, one ``batch_get_buffer``, the copies.
- ``Mooncake store get_into``: ``MooncakeBlockObjectStore`` alone.
- ``raw batch_get_buffer + copy``: the Mooncake client without aostore, the floor.
- ``tiered put_blocks``: what the caller's thread spends (local put, snapshot, queueing;
  median of single calls made with an empty queue: a caller that outruns Mooncake waits for
  the publisher instead), and ``Mooncake put_blocks`` (``put_batch`` of new keys: what the
  publisher thread spends).

With ``--engine``, the engine-thread targets' figures (docs/workloads.md) with the Mooncake tier on
(the store the vLLM plugin builds with ``AOSTORE_VLLM_MOONCAKE``: ``TieredGrowBlockObjectStore``, a
``GrowBlockObjectStore`` in front of Mooncake) beside the tier off (the plugin's
``GrowBlockObjectStore`` alone), both behind aostore's ``BackgroundBlockObjectStore`` as vLLM's
worker drives it (``benches/bench.py``'s W4 loop and T7 puts, same calibration):

- ``W4``: the engine loop's speed (about 200 µs of pure Python, then a put of 64 objects of
  5,888 B, 400 times) against the same loop with a no-op store; median and range of
  ``--w4-repeats`` alternating repetitions. ``tier on`` keeps the plugin's queues (W4's
  ``max_pending_batches=8``, the tier's 64): the loop offers about 1.9 GB/s, far more than
  Mooncake on loopback takes, so the engine waits for the publisher (backpressure); ``tier
  on, deep queues`` makes both queues hold the whole run, so only what the writer and the
  publisher take from the engine thread remains (the GIL and the two cores); ``publish a
  no-op`` is the same with the publisher's Mooncake calls replaced by nothing (the Python of
  the wrapper's writer, the tier and its publisher alone, without Mooncake's CPU).
- ``T7``: engine-thread µs per ``put`` (shape (a): 4 objects of 128 B, 8 retains, 4 releases;
  (b): 64 objects of 5,888 B), one put per ~200 µs of engine work, quiet and with another
  Python thread busy; deep queues for the tier (what a put costs the engine, not how long it
  waits for Mooncake; the publisher's throughput is reported apart).
- ``GIL``: how fast a pure-Python counting thread runs while the main thread is inside
  Mooncake's ``put_batch``/``upsert_batch`` of 512 objects, and while it waits in the tier's
  ``flush()`` for the publisher, relative to the same thread alone (1.0: Mooncake and the
  publisher take no GIL from it; about 0: they hold it).

    python benches/mooncake_bench.py [--batch 64] [--nbytes 5888] [--json out.json]
    python benches/mooncake_bench.py --engine [--t7-puts 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from aostore import BlockObject, BlockObjectStore
from aostore.mooncake import (
    MooncakeBlockObjectStore,
    MooncakeConfig,
    TieredBlockObjectStore,
    connect,
)

BENCHES_DIR = Path(__file__).resolve().parent
TESTS_DIR = BENCHES_DIR.parent / "tests" / "support"
DEEP = 1 << 20  # a queue that never fills in these runs
NO_MOONCAKE = "tier on, deep queues, publish a no-op"
KEY_SETS = 16  # batches of keys published for the remote reads


def time_call(call: Callable[[], object], seconds: float, repeats: int) -> float:
    """Median ns per call over ``repeats`` loops of about ``seconds / repeats`` each."""
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < 0.05 or calls < 3:
        call()
        calls += 1
    per_loop = max(1, int(seconds / repeats / ((time.perf_counter() - start) / calls)))
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter_ns()
        for _ in range(per_loop):
            call()
        samples.append((time.perf_counter_ns() - begin) / per_loop)
    return statistics.median(samples)


def time_each(call: Callable[[], object], before: Callable[[], object], count: int) -> float:
    """Median ns of ``count`` calls, each after an untimed ``before()``."""
    samples = []
    for _ in range(count):
        before()
        begin = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - begin)
    return statistics.median(samples)


@contextlib.contextmanager
def cluster_config(path: str | None, holder_segment: str) -> Iterator[dict[str, Any]]:
    if path is not None:
        yield json.loads(Path(path).read_text())
        return
    sys.path.insert(0, str(TESTS_DIR))
    import mooncake_util

    reason = mooncake_util.missing_reason()
    if reason is not None:
        raise SystemExit(reason)
    with (
        tempfile.TemporaryDirectory() as logs,
        mooncake_util.cluster(Path(logs), holder_segment=holder_segment) as started,
    ):
        yield started.config(local_buffer_size="32MB")


def payload(index: int, nbytes: int) -> bytes:
    return bytes([index % 251]) * nbytes


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    batch, nbytes = args.batch, args.nbytes
    rows: list[dict[str, Any]] = []

    def row(name: str, ns_per_call: float, note: str = "") -> None:
        rows.append({"measure": name, "ns_per_object": ns_per_call / batch, "note": note})

    with cluster_config(args.config, args.holder_segment) as values:
        config = MooncakeConfig.from_dict({**values, "key_prefix": "bench/"})
        client = connect(config)
        try:

            def remote_store() -> MooncakeBlockObjectStore:
                return MooncakeBlockObjectStore(
                    client,
                    object_nbytes=nbytes,
                    max_batch_bytes=config.batch_bytes,
                    key_prefix=config.key_prefix,
                    master_address=config.master_server_address,
                    close_client=False,
                )

            key_sets = [[f"r{s}:{i}" for i in range(batch)] for s in range(KEY_SETS)]
            publisher = remote_store()
            for keys in key_sets:
                publisher.put([BlockObject(k, payload(i, nbytes)) for i, k in enumerate(keys)])
            expected = b"".join(payload(i, nbytes) for i in range(batch))
            out = np.empty(batch * nbytes, dtype=np.uint8)
            cycle = itertools.cycle(key_sets)

            # Local hits: the tiered store's local arena holds the batch.
            local = BlockObjectStore(max_bytes=4 * batch * nbytes, object_nbytes=nbytes)
            tiered = TieredBlockObjectStore(local, remote_store())
            hot = [f"hot:{i}" for i in range(batch)]
            tiered.put([BlockObject(k, payload(i, nbytes)) for i, k in enumerate(hot)])
            tiered.flush()
            row(
                "tiered get_into, local hit",
                time_call(lambda: tiered.get_into(hot, out), args.seconds, args.repeats),
            )
            assert out.tobytes() == expected

            # Misses: an empty local arena that keeps nothing, so every read goes to Mooncake.
            cold_local = BlockObjectStore(max_bytes=4 * batch * nbytes, object_nbytes=nbytes)
            cold = TieredBlockObjectStore(cold_local, remote_store(), keep_fetched=False)
            row(
                "tiered get_into, from Mooncake",
                time_call(lambda: cold.get_into(next(cycle), out), args.seconds, args.repeats),
                "all keys miss locally",
            )
            assert out.tobytes() == expected
            assert cold.stats()["local_hit_objects"] == 0

            direct = remote_store()
            row(
                "Mooncake store get_into",
                time_call(lambda: direct.get_into(next(cycle), out), args.seconds, args.repeats),
            )
            assert out.tobytes() == expected

            view = out.data

            def raw_read() -> None:
                names = [config.key_prefix + k for k in next(cycle)]
                handles = client.batch_get_buffer(names)
                for i, handle in enumerate(handles):
                    view[i * nbytes : (i + 1) * nbytes] = memoryview(handle).cast("B")
                del handles

            row(
                "raw batch_get_buffer + copy",
                time_call(raw_read, args.seconds, args.repeats),
                "Mooncake client alone",
            )
            assert out.tobytes() == expected

            # Writes of new keys.
            counter = itertools.count()
            blocks = np.stack([np.full(nbytes, i % 251, dtype=np.uint8) for i in range(batch)])

            def tiered_put() -> None:
                n = next(counter)
                tiered.put_blocks([f"w{n}:{i}" for i in range(batch)], blocks)

            row(
                "tiered put_blocks (caller's thread)",
                time_each(tiered_put, tiered.flush, 50),
                "local put + snapshot + queue, queue empty",
            )
            tiered.flush()

            def mooncake_put() -> None:
                n = next(counter)
                direct.put_blocks([f"w{n}:{i}" for i in range(batch)], blocks)

            row(
                "Mooncake put_blocks (publisher's work)",
                time_call(mooncake_put, args.seconds, args.repeats),
                "put_batch of new keys",
            )
            for store in (tiered, cold):
                store.close()
            for remote in (publisher, direct):
                remote.close()
        finally:
            client.close()
    return rows


# -- Engine-thread figures (--engine) ---------------------------------------------------------


def _counter_ratio(work: Callable[[], object], seconds: float = 0.3) -> tuple[float, float]:
    """(seconds ``work`` took, a counting thread's speed during it / its speed alone)."""
    progress = [0]
    stop = threading.Event()

    def count() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            progress[0] = n

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        c0, t0 = progress[0], time.perf_counter()
        time.sleep(seconds)
        idle = (progress[0] - c0) / (time.perf_counter() - t0)
        c0, t0 = progress[0], time.perf_counter()
        work()
        took = time.perf_counter() - t0
        during = (progress[0] - c0) / took
    finally:
        stop.set()
        thread.join()
    return took, during / idle


def gil_figures(config: MooncakeConfig, nbytes: int) -> dict[str, Any]:
    """The counting thread's speed inside Mooncake's calls and during a tier's publication."""
    from aostore import vllm_plugin

    out: dict[str, Any] = {}
    count = 512
    values = [payload(i, nbytes) for i in range(count)]
    client = connect(config)
    try:
        for call in ("put_batch", "upsert_batch"):
            names = [f"{config.key_prefix}gil-{call}:{i}" for i in range(count)]
            method = getattr(client, call)
            took, ratio = _counter_ratio(lambda: method(names, values))  # noqa: B023 (run now)
            out[call] = {"objects": count, "us_per_object": took / count * 1e6, "counter": ratio}
    finally:
        client.close()
    tier = vllm_plugin.TieredGrowBlockObjectStore(
        max_bytes=4 * count * nbytes, object_nbytes=nbytes
    )
    try:
        objects = [BlockObject(f"gil-tier:{i}", values[i]) for i in range(count)]

        def publish() -> None:
            tier.put(objects)
            tier.flush()

        took, ratio = _counter_ratio(publish)
        out["tier put + flush"] = {
            "objects": count,
            "us_per_object": took / count * 1e6,
            "counter": ratio,
        }
    finally:
        tier.close()
    return out


def engine_run(args: argparse.Namespace, config: MooncakeConfig) -> dict[str, Any]:
    sys.path.insert(0, str(BENCHES_DIR))
    import bench  # benches/bench.py: the W4 loop, T7's puts, the calibration
    from aostore import BackgroundBlockObjectStore, vllm_plugin
    from aostore.bench.contenders import Contender
    from aostore.vllm import stores as vllm_stores
    from aostore.vllm.settings import MooncakeTier, Settings

    # What register() binds into the installed classes when AOSTORE_VLLM_MOONCAKE names config.
    tier_setting = MooncakeTier("(bench config)", config)
    vllm_stores.bind(prefault=Settings.from_env().prefault, tier=tier_setting)
    nbytes = bench.GLM_OBJECT_NBYTES

    def tier_on(deep: bool) -> Any:
        vllm_stores.TIER_PENDING_BATCHES = DEEP if deep else 64
        return vllm_plugin.TieredGrowBlockObjectStore

    iterations = bench.calibrate()
    rounds, slots = 400, 16_384
    result: dict[str, Any] = {"iterations": iterations, "w4": {}, "t7": {}}

    # W4: alternating repetitions, each store's speed against the no-op loop of its repetition.
    variants = {
        "tier off": (vllm_plugin.GrowBlockObjectStore, False, 8),
        "tier on": (vllm_plugin.TieredGrowBlockObjectStore, False, 8),
        "tier on, deep queues": (vllm_plugin.TieredGrowBlockObjectStore, True, DEEP),
        NO_MOONCAKE: (vllm_plugin.TieredGrowBlockObjectStore, True, DEEP),
    }
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.w4_repeats):
        noop = bench.w4_loop(bench.NoopStore(), BlockObject, iterations, rounds)
        for name, (cls, deep, queue) in variants.items():
            tier_on(deep)
            store = cls(max_bytes=slots * nbytes, object_nbytes=nbytes, prefault=True)
            if name == NO_MOONCAKE:  # the tier's Python alone: its publisher calls nothing
                store.remote.publish = lambda keys, values: None
            writer = BackgroundBlockObjectStore(store, max_pending_batches=queue)
            elapsed = bench.w4_loop(writer, BlockObject, iterations, rounds)
            speeds[name].append(noop / elapsed)
    for name, runs in speeds.items():
        result["w4"][name] = {
            "median": statistics.median(runs),
            "min": min(runs),
            "max": max(runs),
            "runs": runs,
        }

    # T7: the engine thread's cost of each put, quiet and busy; deep queues for the tier.
    contenders = {
        "tier off": vllm_plugin.GrowBlockObjectStore,
        "tier on": vllm_plugin.TieredGrowBlockObjectStore,
    }
    for shape in bench.T7_SHAPES:
        for busy in (False, True):
            for name, cls in contenders.items():
                tier_on(True)
                contender = Contender(
                    name=name,
                    label=name,
                    store_class=cls,
                    block_object=BlockObject,
                    background=BackgroundBlockObjectStore,
                )
                mode = "busy" if busy else "quiet"
                result["t7"][f"{shape.name}/{name}/{mode}"] = bench.t7_costs(
                    contender, shape, args.t7_puts, iterations, busy
                )

    # The publisher's throughput: objects per second it takes from a full queue.
    tier_on(True)
    store = vllm_plugin.TieredGrowBlockObjectStore(
        max_bytes=slots * nbytes, object_nbytes=nbytes, prefault=True
    )
    data = bench.payloads(nbytes)
    puts = 100
    for p in range(puts):
        store.put(
            [BlockObject(bench.key(p * bench.BATCH + i), data[i]) for i in range(bench.BATCH)]
        )
    begin = time.perf_counter()
    store.flush()
    result["publisher_objects_per_s"] = puts * bench.BATCH / (time.perf_counter() - begin)
    store.close()
    vllm_stores.TIER_PENDING_BATCHES = 64
    result["gil"] = gil_figures(config, nbytes)
    return result


def print_engine(result: dict[str, Any]) -> None:
    print("\nW4 engine speed, writer / no-op store (median, range)")
    for name, w4 in result["w4"].items():
        print(f"  {name:<24} {w4['median']:.3f} ({w4['min']:.3f}-{w4['max']:.3f})")
    print("\nT7 engine-thread us per put: median / p99 (quiet; busy)")
    names = sorted({key.split("/")[1] for key in result["t7"]})
    for shape in ("a", "b"):
        for name in names:
            quiet, busy = (result["t7"][f"{shape}/{name}/{mode}"] for mode in ("quiet", "busy"))
            print(
                f"  ({shape}) {name:<10} {quiet['median_us']:8.1f} / {quiet['p99_us']:8.1f};"
                f" {busy['median_us']:8.1f} / {busy['p99_us']:8.1f}"
            )
    print(f"\npublisher: {result['publisher_objects_per_s']:,.0f} objects/s from a full queue")
    print("\nGIL: a counting thread's speed while Mooncake works / alone")
    for name, row in result["gil"].items():
        print(
            f"  {name:<14} {row['counter']:.2f} ({row['objects']} objects, "
            f"{row['us_per_object']:.0f} us/object)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="keys per call (default 64)")
    parser.add_argument("--nbytes", type=int, default=5888, help="bytes per object (5888)")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measure (1.0)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per measure (5)")
    parser.add_argument("--config", help="a running cluster's client config (JSON file)")
    parser.add_argument("--holder-segment", default="512MB", help="segment holder size")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--engine", action="store_true", help="W4, T7 and GIL, tier on/off")
    parser.add_argument("--w4-repeats", type=int, default=5, help="W4 repetitions (5)")
    parser.add_argument("--t7-puts", type=int, default=500, help="timed T7 puts (500)")
    args = parser.parse_args(argv)
    if args.engine:
        with cluster_config(args.config, args.holder_segment) as values:
            result = engine_run(args, MooncakeConfig.from_dict({**values, "key_prefix": "bench/"}))
        print_engine(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    rows = run(args)
    local = rows[0]["ns_per_object"]
    print(f"\n{args.batch} objects of {args.nbytes} B per call, loopback, ns per object")
    print(f"{'measure':<40} {'ns/object':>10} {'x local hit':>12}  note")
    for item in rows:
        ratio = item["ns_per_object"] / local
        print(
            f"{item['measure']:<40} {item['ns_per_object']:>10,.0f} {ratio:>12.1f}  {item['note']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
