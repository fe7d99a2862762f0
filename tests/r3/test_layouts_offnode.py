"""A trainer's layout from references of this node and of others (issue 50 item 1: "mixed, any
arenas and nodes"): other nodes' references are read in one Mooncake batch, beside this node's
arenas, against a real master on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mooncake_util
import numpy as np
import pytest
from aostore import r3
from aostore.mooncake import connect
from aostore.r3 import offnode
from aostore.r3.arena import Arena
from mooncake_fakes import require_mooncake

PREFIX = "r3-layouts/"


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (n, 6, 4)).astype(np.uint8)


def elsewhere(reference: np.ndarray) -> np.ndarray:
    """The reference as a reader on another node holds it (another boot id)."""
    moved = reference.copy()
    moved["boot"] = np.frombuffer(b"another-node-id!", np.uint8)
    return moved


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("layouts"), holder_segment=None) as made:
        yield made


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
