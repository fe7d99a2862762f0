"""Off-node reads, against a real master on loopback: a trainer's layout from references of
this node and of others (issue 50 item 1: "mixed, any arenas and nodes"), read in one Mooncake
batch beside this node's arenas; the arena's settled generation (issue 49 item 5: a reader
waits for a publication in flight "only for keys the arena announced": a missing object at or
below it is gone at once, above it the reader waits up to ``publish_wait``); and a master
stalled past the budget's fill."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mooncake_util
import numpy as np
import pytest
from aostore import r3
from aostore.mooncake import connect
from aostore.r3 import format as fmt
from aostore.r3 import offnode
from aostore.r3.arena import Arena
from mooncake_fakes import require_mooncake
from other_node import elsewhere

PREFIX = "r3-reads/"
PATIENT_S = 5.0


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (n, 6, 4)).astype(np.uint8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    """A master and no segment holder: the frontend's client holds the only segment."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("r3"), holder_segment=None) as started:
        yield started


@pytest.fixture
def frontend(cluster: mooncake_util.Cluster) -> Iterator[tuple[Arena, Any]]:
    client = connect(cluster.config(global_segment_size="16MB"))
    arena = Arena(1 << 20, ttl=60.0)
    publisher = offnode.Publisher(arena, client, prefix=PREFIX, retry=0.05)
    yield arena, publisher
    publisher.close()
    arena.close()
    client.close()


@pytest.mark.mooncake
def test_a_layout_reads_other_nodes_references_in_one_mooncake_batch(
    cluster, frontend, monkeypatch
) -> None:
    arena, publisher = frontend
    a, b, c = rows(30, 1), rows(12, 2), rows(7, 3)
    ra, rb = arena.deliver(a), arena.deliver(b)
    assert publisher.flush()
    reader = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX), publish_wait=0.1)
    try:
        # Another node's a and b, this node's b, vLLM's rows, and a stitched sample of
        # another node's segments.
        batch = [
            elsewhere(ra),
            rb,
            c,
            [(elsewhere(rb), 0, 5), (elsewhere(ra), 10, None)],
        ]
        got = r3.padded(batch, 40, dtype=np.int16, reader=reader)
        want = np.zeros((4, 40, 6, 4), np.int16)
        for i, sample in enumerate([a, b, c, np.concatenate([b[:5], a[10:]])]):
            want[i, : len(sample)] = sample
        assert np.array_equal(got.routes, want)
        assert reader.stats.offnode_references == 2  # a and b, each read once
        assert reader.stats.leases == 0 and arena.leases() == 0
        # A reference Mooncake has no object for, beside one it has: named, not raised.
        forged = elsewhere(rb)
        forged["generation"] += 1000
        report = r3.packed([elsewhere(ra), forged], fill=-1, missing="report", reader=reader)
        assert list(report.missing) == [1] and isinstance(report.missing[1], r3.ReferenceGone)
        assert np.array_equal(report.routes[:30], a) and (report.routes[30:] == -1).all()
        with pytest.raises(r3.ReferenceGone, match="sample 1: "):
            r3.packed([elsewhere(ra), forged], reader=reader)
    finally:
        reader.close()
    # Without a Mooncake client another node's reference is OtherNode, naming the setting.
    monkeypatch.delenv(offnode.SETTING, raising=False)
    local = r3.Reader()
    try:
        with pytest.raises(r3.OtherNode, match=f"sample 0: .*{offnode.SETTING}"):
            r3.padded([elsewhere(ra)], 40, reader=local)
    finally:
        local.close()


class Late:
    """The frontend's client, whose puts take ``delay`` seconds more."""

    def __init__(self, client: Any) -> None:
        self._client, self.delay = client, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_put_from_multi_buffers(self, *args: Any) -> Any:
        time.sleep(self.delay)
        return self._client.batch_put_from_multi_buffers(*args)


def settled(client: Any, arena: Arena) -> int:
    raw = client.get(offnode.settled_key(PREFIX, arena.id))
    return int(np.frombuffer(raw, "<u8")[0]) if len(raw) == 8 else 0


def wait_until(check: Any, what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.mooncake
def test_a_gone_reference_is_gone_at_once_and_one_in_flight_is_waited_for(cluster) -> None:
    client = connect(cluster.config(global_segment_size="16MB"))
    late = Late(client)
    reader = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX), publish_wait=PATIENT_S)
    with Arena(2 * fmt.PAGE, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, late, prefix=PREFIX, retry=0.05, poll=0.05)
        try:
            first_rows = rows(200, 1)
            first = arena.deliver(first_rows)
            assert publisher.flush()
            wait_until(lambda: settled(client, arena) >= int(first["generation"]), "announced")
            # Read here (it may make way), then pushed out by a newer reference: its slot went,
            # and its object with it.
            r3.fetch([first]).release()
            second = arena.deliver(rows(200, 2))
            assert second is not None and arena.stats()["evictions"] == 1
            assert publisher.flush()
            wait_until(lambda: publisher.stats.removed >= 1, "the first object removed")
            wait_until(lambda: settled(client, arena) >= int(second["generation"]), "announced")
            for gone in (first, _another_slot(second)):
                started = time.monotonic()
                with pytest.raises(r3.ReferenceGone, match="gone"):
                    reader.fetch([elsewhere(gone)])
                assert time.monotonic() - started < PATIENT_S / 2  # not the publish wait
            # A reference whose put is slow: above the settled generation, waited for.
            late.delay = 0.5
            r3.fetch([second]).release()  # read: it makes way for the third
            third_rows = rows(200, 3)
            third = arena.deliver(third_rows)
            assert third is not None
            started = time.monotonic()
            assert np.array_equal(reader.fetch([elsewhere(third)])[0], third_rows)
            assert 0.2 < time.monotonic() - started < PATIENT_S
        finally:
            publisher.close()
            reader.close()
            client.close()


def _another_slot(reference: np.ndarray) -> np.ndarray:
    """A forged reference: a generation the arena settled, at a slot that never held it."""
    forged = reference.copy()
    forged["slot"] += 7
    return forged


@pytest.mark.mooncake
def test_a_stall_past_the_budgets_fill_falls_back_to_rows_and_publishes_after(tmp_path) -> None:
    """The master stopped (SIGSTOP) for longer than the budget takes to fill: finishes go on at
    their pace, the arena fills with unread references (readable here), then answers carry rows
    (counted). Once the master answers, what the arena holds is published, and the settled
    generation covers it."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path, holder_segment=None) as own:
        client = connect(own.config(global_segment_size="16MB"))
        arena = Arena(4 * fmt.PAGE, ttl=60.0)
        publisher = offnode.Publisher(arena, client, prefix=PREFIX, retry=0.1, poll=0.05)
        reader = r3.Reader(mooncake=own.config(key_prefix=PREFIX), publish_wait=0.2)
        try:
            warm = arena.deliver(rows(100, 0))  # published: the marker is there
            assert publisher.flush()
            r3.fetch([warm]).release()  # read: it makes way
            own.pause_master()
            started = time.perf_counter()
            sent = [arena.deliver(rows(100, i)) for i in range(1, 11)]
            assert time.perf_counter() - started < 0.5  # ten finishes, no Mooncake waited on
            held = [(i, ref) for i, ref in enumerate(sent, 1) if ref is not None]
            assert len(held) == 4 and arena.stats()["fallbacks"] == 6
            assert all(np.array_equal(r3.fetch([ref])[0], rows(100, i)) for i, ref in held)
            own.resume_master()
            wait_until(lambda: publisher.stats.published >= 5, "the stalled puts published")
            wait_until(
                lambda: settled(client, arena) >= max(int(r["generation"]) for _, r in held),
                "the settled generation past them",
            )
            got = reader.fetch([elsewhere(ref) for _, ref in held])
            assert all(np.array_equal(g, rows(100, i)) for g, (i, _) in zip(got, held, strict=True))
        finally:
            own.resume_master()
            reader.close()
            publisher.close()
            arena.close()
            client.close()
