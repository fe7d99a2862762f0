"""Cost per object of tiered reads: a local hit against a read served by Mooncake on loopback.

Starts a Mooncake master and a segment holder on 127.0.0.1 (``tests/mooncake_util.py``;
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

    python benches/mooncake_bench.py [--batch 64] [--nbytes 5888] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
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

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="keys per call (default 64)")
    parser.add_argument("--nbytes", type=int, default=5888, help="bytes per object (5888)")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measure (1.0)")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per measure (5)")
    parser.add_argument("--config", help="a running cluster's client config (JSON file)")
    parser.add_argument("--holder-segment", default="512MB", help="segment holder size")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
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
