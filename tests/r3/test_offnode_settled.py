"""The arena's settled generation (issue 49 item 5: an off-node read waits for a publication in
flight "only for keys the arena announced"): a missing object at or below it is gone at once,
above it the reader waits up to ``publish_wait``. Against a real master on loopback."""

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

PREFIX = "r3-settled/"
PATIENT_S = 5.0


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (n, 6, 4)).astype(np.uint8)


def elsewhere(reference: np.ndarray) -> np.ndarray:
    moved = reference.copy()
    moved["boot"] = np.frombuffer(b"another-node-id!", np.uint8)
    return moved


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("settled"), holder_segment=None) as made:
        yield made


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
