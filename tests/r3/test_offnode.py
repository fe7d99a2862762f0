"""R3 rows across nodes through Mooncake (issue 49; docs/r3-reference.md, "Across nodes"),
against a real ``mooncake_master`` on 127.0.0.1.

Another node without another machine: a reference whose ``boot`` field names another boot is
another node's to the reader (that is the check ``fetch`` makes, ``leases.boot_id()``), so the
tests make such references by rewriting that field of a real one; the Mooncake key does not
include the boot, so it reads the object the frontend published. One test also makes this
node's own references look foreign by monkeypatching ``leases.boot_id``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import mooncake_util
import numpy as np
import pytest
from aostore import r3
from aostore.mooncake import connect
from aostore.r3 import format as fmt
from aostore.r3 import leases, offnode
from aostore.r3.arena import Arena
from mooncake_fakes import require_mooncake
from other_node import elsewhere

ROW = (46, 8)
PREFIX = "r3-test/"  # the publisher's and the reader's key_prefix (each arena's keys are its own)


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (n, *ROW)).astype(np.uint8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    """A master and no segment holder: the frontend's client holds the only segment."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("r3"), holder_segment=None) as started:
        yield started


@pytest.fixture(scope="module")
def frontend_client(cluster: mooncake_util.Cluster) -> Iterator[Any]:
    client = connect(cluster.config(global_segment_size="32MB"))
    yield client
    client.close()


@pytest.fixture
def frontend(frontend_client: Any) -> Iterator[Any]:
    arena = Arena(4 << 20, ttl=60.0)
    publisher = offnode.Publisher(arena, frontend_client, prefix=PREFIX, retry=0.05)
    yield arena, publisher
    publisher.close()
    arena.close()


@pytest.fixture
def reader(cluster: mooncake_util.Cluster) -> Iterator[r3.Reader]:
    made = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX))
    yield made
    made.close()


@pytest.mark.mooncake
def test_another_nodes_references_read_through_mooncake_mixed_with_this_nodes(
    frontend, frontend_client, reader
) -> None:
    arena, publisher = frontend
    a, b, c, theirs = rows(3_000, 1), rows(0, 2), rows(9, 3), rows(5, 4)
    ra, rb, rc = arena.deliver(a), arena.deliver(b), arena.deliver(c)
    assert publisher.flush() and publisher.stats.published == 3
    assert publisher.stats.put_failures == 0
    # The object lies in the frontend's own segment (preferred_segment).
    name = offnode.key(publisher.prefix, arena.id, int(ra["slot"]), int(ra["generation"]))
    placed = frontend_client.get_replica_desc(name)[0].get_memory_descriptor()
    assert placed.buffer_descriptor.transport_endpoint == publisher.segment
    assert publisher.stats.misplaced == 0
    batch = [elsewhere(ra), ra, theirs, elsewhere(ra), elsewhere(rb), elsewhere(rc)]
    starts = [0, 10, 0, 2_999, 0, 4]
    want = [a, a[10:], theirs, a[2_999:], b, c[4:]]
    got = reader.fetch(batch, start=starts)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert not got[0].flags.writeable and not np.shares_memory(got[0], got[1])
    assert np.shares_memory(got[0], got[3]) and arena.leases() == 1  # ra here: leased
    assert reader.stats.offnode_references == 3  # a repeated: read once
    del got
    out = np.full((sum(len(w) for w in want), *ROW), 255, np.uint8)
    reader.fetch(batch, start=starts, out=out)
    assert np.array_equal(out, np.concatenate(want))
    assert reader.stats.leases == 0 and arena.leases() == 0


@pytest.mark.mooncake
def test_this_nodes_references_read_through_mooncake_when_the_boot_differs(
    frontend, reader, monkeypatch
) -> None:
    """The boot-id check made injectable: the reader believes it runs on another node."""
    arena, publisher = frontend
    want = rows(100, 5)
    reference = arena.deliver(want)
    assert publisher.flush()
    monkeypatch.setattr(leases, "boot_id", lambda: b"another-node-id!")
    assert np.array_equal(reader.fetch([reference])[0], want)
    assert reader.stats.offnode_references == 1 and arena.leases() == 0


@pytest.mark.mooncake
def test_bad_keys_and_objects_read_as_reference_gone_never_as_rows(
    frontend, frontend_client, reader
) -> None:
    arena, publisher = frontend
    reference = elsewhere(arena.deliver(rows(20, 6)))
    assert publisher.flush()

    def forged(generation: int, payload: bytes) -> np.ndarray:
        made = reference.copy()
        made["generation"] = generation
        name = offnode.key(publisher.prefix, arena.id, int(made["slot"]), generation)
        assert frontend_client.put(name, payload) == 0
        return made

    nbytes = 20 * 46 * 8
    other = offnode.header(arena.id, int(reference["slot"]) + 1, 1_001, nbytes).tobytes()
    cases = [
        (reference.copy(), "Mooncake has no"),  # never published: the generation below
        (forged(1_000, b"x" * 10), "another size"),  # truncated
        (forged(1_002, b"x" * (64 + nbytes + 64)), "another size"),  # longer
        (forged(1_001, other + bytes(nbytes)), "another output's"),  # another slot's header
    ]
    cases[0][0]["generation"] = 999
    for bad, message in cases:
        with pytest.raises(r3.ReferenceGone, match=f"reference 1 of the batch: .*{message}"):
            reader.fetch([reference, bad])
    assert reader.stats.leases == 0
    assert reader.fetch([reference])[0].shape == (20, *ROW)
    # A reader whose config names another key_prefix (as another cluster would): no marker.
    astray = r3.Reader(mooncake=dataclasses.replace(reader._offnode.config, key_prefix="x/"))
    try:
        with pytest.raises(r3.ReferenceGone, match="names another cluster"):
            astray.fetch([reference])
    finally:
        astray.close()


@pytest.mark.mooncake
def test_a_slot_the_arena_gives_up_is_removed_from_mooncake(frontend_client, reader) -> None:
    with Arena(3 * fmt.PAGE, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, frontend_client, prefix=PREFIX, retry=0.05)
        try:
            one_page = rows(8, 7)  # 2,944 bytes: one page each
            made = [arena.deliver(one_page) for _ in range(3)]
            assert all(m is not None for m in made) and publisher.flush()
            r3.Reader().fetch([made[0]], out=np.empty_like(one_page))  # read here: may go
            assert arena.deliver(rows(8, 8)) is not None  # made[0]'s slot is given up
            assert publisher.flush() and publisher.stats.removed == 1
            name = offnode.key(PREFIX, arena.id, int(made[0]["slot"]), 1)
            assert frontend_client.is_exist(name) == 0
            with pytest.raises(r3.ReferenceGone, match="Mooncake has no"):
                reader.fetch([elsewhere(made[0])])
            assert np.array_equal(reader.fetch([elsewhere(made[1])])[0], one_page)
        finally:
            publisher.close()


class Refusing:
    """A Mooncake client whose first put fails and whose first removal meets a lease."""

    def __init__(self) -> None:
        self.puts: list[list[str]] = []
        self.removes: list[list[str]] = []

    def get_hostname(self) -> str:
        return "127.0.0.1:1"

    def batch_put_from_multi_buffers(self, keys: list[str], *_: Any) -> list[int]:
        self.puts.append(keys)
        return [-800 if len(self.puts) == 1 else 0 for _ in keys]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(key.endswith("/marker")) for key in keys]

    def put(self, key: str, *_: Any) -> int:
        assert key.endswith("/marker")
        return 0

    def get(self, key: str) -> bytes:
        raise AssertionError(f"no renewal was asked: {key}")

    def batch_remove(self, keys: list[str], force: bool) -> list[int]:
        assert not force
        self.removes.append(keys)
        return [offnode.OBJECT_HAS_LEASE if len(self.removes) == 1 else 0 for _ in keys]


@pytest.mark.mooncake
def test_failed_puts_and_removals_under_a_lease_are_retried_never_raised() -> None:
    require_mooncake()  # ReplicateConfig
    client = Refusing()
    with Arena(3 * fmt.PAGE, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, client, retry=0.05)
        try:
            first = arena.deliver(rows(8, 9))
            assert first is not None and publisher.flush()
            assert publisher.stats.put_failures == 1 and publisher.stats.published == 0
            for _ in range(100):
                if publisher.stats.published:
                    break
                time.sleep(0.02)
                publisher.flush()
            assert publisher.stats.published == 1 and len(client.puts) == 2
            r3.Reader().fetch([first], out=np.empty((8, *ROW), np.uint8))
            arena.deliver(rows(8, 10))
            arena.deliver(rows(8, 11))
            assert arena.deliver(rows(8, 12)) is not None  # first's slot goes
            for _ in range(100):
                publisher.flush()
                if publisher.stats.removed:
                    break
                time.sleep(0.02)
            assert publisher.stats.remove_retries == 1 and publisher.stats.removed == 1
            assert client.removes[0] == client.removes[1]
        finally:
            publisher.close()


def test_a_reader_without_a_mooncake_config_says_which_setting(monkeypatch, tmp_path) -> None:
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = elsewhere(arena.deliver(rows(1, 1)))
        monkeypatch.delenv(offnode.SETTING, raising=False)
        plain = r3.Reader()
        try:
            with pytest.raises(r3.OtherNode, match=offnode.SETTING):
                plain.fetch([reference])
        finally:
            plain.close()
    no_host = {"master_server_address": "127.0.0.1:1"}
    with pytest.raises(ValueError, match="needs local_hostname"):
        r3.Reader(mooncake=no_host)
    monkeypatch.setenv(offnode.SETTING, json.dumps(no_host))
    with pytest.raises(ValueError, match=f"{offnode.SETTING}: .*needs local_hostname"):
        r3.Reader()
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**no_host, "local_hostname": "127.0.0.1", "typo": 1}))
    monkeypatch.setenv(offnode.SETTING, str(path))
    with pytest.raises(ValueError, match="unknown Mooncake config keys"):
        r3.Reader()
    monkeypatch.setenv(offnode.SETTING, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="not a readable JSON file"):
        r3.Reader()
    assert os.environ[offnode.SETTING]


@pytest.mark.mooncake
def test_a_dead_or_stalled_master_never_reaches_the_finish(tmp_path, caplog) -> None:
    """Finishes go on at their own pace while the master is stopped (SIGSTOP) or killed; the
    failures are counted with one WARNING per outage, and the retries publish once a master
    answers again. A restarted master starts empty: the publisher sees its marker gone and
    publishes every reference held again."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path, holder_segment=None) as own:
        client = connect(own.config(global_segment_size="16MB"))
        arena = Arena(2 << 20, ttl=60.0)
        publisher = offnode.Publisher(arena, client, prefix=PREFIX, retry=0.2)
        try:
            own.pause_master()
            started = time.perf_counter()
            stalled = [arena.deliver(rows(50, i)) for i in range(20)]
            assert time.perf_counter() - started < 0.5  # 20 finishes; Mooncake not waited on
            own.resume_master()
            assert publisher.flush(30.0)
            own.kill_master()
            started = time.perf_counter()
            killed = [arena.deliver(rows(50, 100 + i)) for i in range(20)]
            assert time.perf_counter() - started < 0.5
            deadline = time.monotonic() + 30.0
            while publisher.stats.put_failures == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert publisher.stats.put_failures > 0
            own.restart_master()
            deadline = time.monotonic() + 60.0
            while publisher.stats.published < 40 and time.monotonic() < deadline:
                time.sleep(0.1)
            # The restarted master had no marker: the 20 published before were put again.
            while publisher.stats.republished < 20 and time.monotonic() < deadline:
                time.sleep(0.1)
            # (Puts that reached the new master before the marker was missed are put again
            # too: OBJECT_ALREADY_EXISTS counts as published.) The republications can all land
            # before the last retries of the puts the dead master refused: wait for those too
            # (a CI run read published=56, republished=20, pending=4).
            while publisher.stats.published < 60 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert publisher.stats.published >= 60, publisher.stats
            assert publisher.stats.republished >= 20 and publisher.stats.restarts == 1
            warnings = [r for r in caplog.records if "refused R3 rows" in r.getMessage()]
            assert len(warnings) == publisher.stats.outages >= 1
            reader = r3.Reader(mooncake=own.config(key_prefix=PREFIX))
            try:
                # Every reference held reads after the restart: those published before it too.
                got = reader.fetch([elsewhere(r) for r in stalled + killed])
                seeds = [*range(20), *range(100, 120)]
                assert all(np.array_equal(g, rows(50, i)) for g, i in zip(got, seeds, strict=True))
            finally:
                reader.close()
        finally:
            publisher.close()
            arena.close()
            client.close()


def _count_for(seconds: float) -> int:
    done, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        done += 1
    return done


@pytest.mark.mooncake
def test_the_mooncake_calls_r3_uses_release_the_gil_while_they_wait(tmp_path) -> None:
    """With the master stopped, each call blocks in Mooncake; a Python thread (the engine's)
    keeps its pace meanwhile (held, it would count nothing)."""
    require_mooncake()
    import mooncake.store

    with mooncake_util.cluster(tmp_path, holder_segment=None) as own:
        client = connect(own.config(global_segment_size="16MB"))
        try:
            data = np.ones(1 << 16, np.uint8)
            config = mooncake.store.ReplicateConfig()
            config.preferred_segment = client.get_hostname()
            assert client.put_from("gil", data.ctypes.data, data.nbytes, config) == 0
            into = np.zeros_like(data)
            calls = {
                "batch_put_from_multi_buffers": lambda: client.batch_put_from_multi_buffers(
                    ["gil-2"], [[data.ctypes.data]], [[data.nbytes]], config
                ),
                "batch_get_into_multi_buffers": lambda: client.batch_get_into_multi_buffers(
                    ["gil"], [[into.ctypes.data]], [[into.nbytes]]
                ),
                "get_size": lambda: client.get_size("gil"),
                "register_buffer": lambda: client.register_buffer(into.ctypes.data, into.nbytes),
                "batch_remove": lambda: client.batch_remove(["gil"], False),
            }
            for name, call in calls.items():
                # Up to 3 tries (two other people build on this machine's 2 cores): a call that
                # held the GIL would fail every one.
                seen = []
                for _ in range(3):
                    alone = _count_for(0.3)
                    own.pause_master()
                    try:
                        thread = threading.Thread(target=call, daemon=True)
                        thread.start()
                        time.sleep(0.05)
                        counted = _count_for(0.3)
                        blocked = thread.is_alive()
                    finally:
                        own.resume_master()
                    thread.join(60)
                    seen.append((blocked, counted, alone))
                    if blocked and counted > 0.3 * alone:
                        break
                else:
                    pytest.fail(f"{name} held the GIL or did not wait: {seen}")
        finally:
            client.close()


@pytest.mark.mooncake
def test_rows_read_off_node_make_way_through_the_read_channel(frontend_client, reader) -> None:
    """Issue 49, item 4: the reader's read objects tell the frontend; rows read off-node go
    first, unread ones stay. Sustained: more than the budget's worth read off-node, with no
    fallback to rows."""
    with Arena(4 * fmt.PAGE, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, frontend_client, prefix=PREFIX, poll=0.02)
        try:
            one_page = [rows(8, i) for i in range(40)]  # 10x the budget
            made = [arena.deliver(one_page[i]) for i in range(4)]
            assert publisher.flush()
            assert arena.deliver(one_page[4]) is None  # full of unread rows: a fallback
            for i in range(4, 40):
                got = reader.fetch([elsewhere(made[-4])], out=np.empty((8, *ROW), np.uint8))
                assert np.array_equal(got[0], one_page[i - 4])
                deadline = time.monotonic() + 10.0
                while publisher.stats.read_offnode < i - 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                made.append(arena.deliver(one_page[i]))
                assert made[-1] is not None, (i, publisher.stats, arena.stats())
                assert publisher.flush()
            stats = arena.stats()
            assert stats["fallbacks"] == 1 and stats["evictions"] == 36, stats
            assert publisher.stats.read_offnode == 36 and reader.stats.offnode_marks_failed == 0
            # The evicted rows' objects: each was read just now, under Mooncake's lease (10 s),
            # so its removal is refused (-706), never forced, and retried until it passes.
            assert publisher.stats.remove_retries >= 36
            deadline = time.monotonic() + 30.0
            while publisher.stats.removed < 36 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert publisher.stats.removed == 36, publisher.stats
            name = offnode.read_key(PREFIX, arena.id, int(made[0]["slot"]), 1)
            deadline = time.monotonic() + 10.0
            while frontend_client.is_exist(name) != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert frontend_client.is_exist(name) == 0  # the read objects are taken away
        finally:
            publisher.close()


@pytest.mark.mooncake
def test_this_nodes_reference_whose_arena_is_not_seen_here_reads_through_mooncake(
    frontend, reader, monkeypatch
) -> None:
    """A process of this node that does not share the frontend's /dev/shm (another container)
    reads through Mooncake; without a Mooncake config it gets ReferenceGone, as before."""
    arena, publisher = frontend
    want = rows(30, 12)
    reference = arena.deliver(want)
    assert publisher.flush()
    monkeypatch.setattr(fmt, "path", lambda ident: f"/dev/shm/not-here-{ident.hex()}")
    assert np.array_equal(reader.fetch([reference])[0], want)
    assert reader.stats.offnode_references == 1 and arena.leases() == 0
    monkeypatch.delenv(offnode.SETTING, raising=False)
    plain = r3.Reader()
    try:
        with pytest.raises(r3.ReferenceGone, match="not in this node's /dev/shm"):
            plain.fetch([reference])
    finally:
        plain.close()


@pytest.mark.mooncake
def test_a_full_arena_of_unread_rows_is_read_off_node_whole(tmp_path) -> None:
    """The master evicts objects once its memory passes a watermark (0.9 by default; a full
    arena's segment, the budget x 1.1, reaches it: T15's batch of 512 lost its oldest rows).
    The rows' objects are hard-pinned: the master evicts none, the arena's life decides.
    Here a master whose watermark is 0.5 and whose leases last 0.1 s evicts at once."""
    from aostore.mooncake import MooncakeConfig

    require_mooncake()
    flags = ("--default_kv_lease_ttl=100", "--eviction_high_watermark_ratio=0.5")
    with mooncake_util.cluster(tmp_path, holder_segment=None, master_flags=flags) as eager:
        budget = 16 << 20
        arena = Arena(budget, ttl=600.0)
        config = MooncakeConfig.from_dict(eager.config(key_prefix=PREFIX))
        publisher = offnode.connect_publisher(arena, config, setting="TEST")
        made = []
        try:
            while (reference := arena.deliver(rows(2_000, len(made)))) is not None:
                made.append(reference)
            assert len(made) * 2_000 * 46 * 8 > 0.8 * budget
            assert publisher.flush() and publisher.stats.published == len(made)
            time.sleep(1.0)  # leases over, the master's eviction has run
            reader = r3.Reader(mooncake=eager.config(key_prefix=PREFIX))
            try:
                got = reader.fetch([elsewhere(reference) for reference in made])
                assert all(np.array_equal(g, rows(2_000, i)) for i, g in enumerate(got))
            finally:
                reader.close()
        finally:
            publisher.close()
            arena.close()


@pytest.mark.mooncake
def test_vllms_delivery_publishes_with_its_setting_and_an_unreachable_master_stops_it(
    cluster, reader
) -> None:
    """``AOSTORE_VLLM_R3_MOONCAKE``'s config: the frontend's arena gets a publisher on a
    client of its own, whose segment is sized from the budget; no master: start-up stops
    with an error naming the setting, and no arena is left."""
    from aostore.mooncake import MooncakeConfig
    from aostore.vllm.transport.delivery import Delivery

    config = MooncakeConfig.from_dict(cluster.config(key_prefix=PREFIX))
    delivery = Delivery("reference", 1 << 20, 60.0, config)
    arena = delivery.start()
    try:
        assert delivery.publisher is not None and arena.offnode is delivery.publisher
        # Its segment (the budget x 1.1, at least 16 MiB) is committed at start, as the arena
        # is: a put copies into pages already there.
        assert delivery.publisher.stats.segment_committed >= 16 << 20
        want = rows(12, 13)
        reference = delivery.deliver(want)
        assert delivery.publisher.flush() and delivery.publisher.stats.published == 1
        assert np.array_equal(reader.fetch([elsewhere(reference)])[0], want)
        stats = delivery.stats()
        assert stats is not None and stats["offnode_published"] == 1 and stats["references"] == 1
        prometheus = pytest.importorskip("prometheus_client")
        from aostore.metrics import register_store

        registry = prometheus.CollectorRegistry()
        register_store(lambda: delivery.stats() or {}, registry=registry, prefix="aostore_r3_")
        assert registry.get_sample_value("aostore_r3_offnode_published_total") == 1.0
        assert registry.get_sample_value("aostore_r3_offnode_pending") == 0.0
        assert registry.get_sample_value("aostore_r3_offnode_segment_committed") >= 16 << 20
    finally:
        delivery.publisher.close()
        arena.close()
    nowhere = MooncakeConfig.from_dict(
        {**cluster.config(), "master_server_address": f"127.0.0.1:{mooncake_util.free_port()}"}
    )
    nowhere = dataclasses.replace(nowhere, connect_timeout_s=0.5)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(r3.OffNodeError, match="AOSTORE_VLLM_R3_MOONCAKE"):
        Delivery("reference", 1 << 20, 60.0, nowhere).start()
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("aostore-r3")}


@pytest.mark.mooncake
def test_a_put_the_master_places_outside_the_frontends_segment_is_counted(
    cluster, frontend_client, caplog
) -> None:
    """``preferred_segment`` is a preference: a frontend whose client mounts no segment (or a
    full one) gets its rows placed in another segment; that is counted, with one WARNING."""
    with Arena(1 << 20, ttl=60.0) as arena:
        bare = connect(cluster.config())  # no segment of its own
        publisher = offnode.Publisher(arena, bare, prefix=PREFIX)
        try:
            arena.deliver(rows(10, 14))
            arena.deliver(rows(10, 15))
            assert publisher.flush() and publisher.stats.published == 2
            assert publisher.stats.misplaced == 1  # its marker
            said = [r for r in caplog.records if "not this frontend's" in r.getMessage()]
            assert len(said) == 1
        finally:
            publisher.close()
            bare.close()


@pytest.mark.mooncake
def test_renew_off_node_moves_the_frontends_deadline_through_mooncake(
    frontend_client, reader
) -> None:
    """``renew`` of another node's reference puts a renewal object; the publisher's poll moves
    the slot's deadline (so an unread reference outlives its TTL); a gone one is
    ``ReferenceGone``, naming it."""
    with Arena(2 * fmt.PAGE, ttl=0.5) as arena:
        publisher = offnode.Publisher(arena, frontend_client, prefix=PREFIX, poll=0.02)
        try:
            kept, lapsed = arena.deliver(rows(8, 16)), arena.deliver(rows(8, 17))
            assert publisher.flush()
            reader.renew([elsewhere(kept)], seconds=60.0)
            deadline = time.monotonic() + 10.0
            while publisher.stats.renewed_offnode < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert publisher.stats.renewed_offnode == 1
            time.sleep(0.6)  # past the TTL: the renewed one stays, the other may go
            assert arena.deliver(rows(8, 18)) is not None
            assert arena.stats()["expiries"] == 1
            assert arena.deliver(rows(8, 19)) is None  # kept is unread and renewed: no room
            assert np.array_equal(reader.fetch([elsewhere(kept)])[0], rows(8, 16))
            # The expired one's object goes once Mooncake lets it (a lease may put it off).
            deadline = time.monotonic() + 30.0
            while publisher.stats.removed < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert publisher.stats.renewed_offnode == 1  # applied once, though polled often
            with pytest.raises(r3.ReferenceGone, match="reference 1 of the batch"):
                reader.renew([elsewhere(kept), elsewhere(lapsed)])
        finally:
            publisher.close()


FRONTEND = """
import atexit, json, sys
import numpy as np
from aostore.mooncake import MooncakeConfig
from aostore.vllm.transport.delivery import Delivery

# Registered first, so it runs last: after aostore's own exit handler.
atexit.register(lambda: print("closed at exit:", not delivery.publisher._thread.is_alive()))
config = MooncakeConfig.from_dict(json.loads(sys.argv[1]))
delivery = Delivery("reference", 1 << 20, 60.0, config)
reference = delivery.deliver(np.full((8, 46, 8), 7, np.uint8))
assert delivery.publisher.flush()
print(json.dumps({"arena": reference["arena"].tobytes().hex(), "slot": int(reference["slot"]),
                  "generation": int(reference["generation"])}), flush=True)
"""


@pytest.mark.mooncake
def test_a_frontend_that_exits_takes_its_objects_with_it_in_bounded_time(
    cluster, frontend_client
) -> None:
    """The publisher is closed at exit (bounded: its thread stopped, its client closed), and
    the rows it published go with the frontend (Mooncake then has none of them)."""
    config = json.dumps(cluster.config(key_prefix=PREFIX))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", FRONTEND, config], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 30
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "closed at exit: True"
    said = json.loads(lines[-2])
    name = offnode.key(PREFIX, bytes.fromhex(said["arena"]), said["slot"], said["generation"])
    deadline = time.monotonic() + 10.0
    while frontend_client.is_exist(name) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert frontend_client.is_exist(name) == 0


READER_ELSEWHERE = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[2])
import other_node
other_node.become_another_node()
from aostore import r3
from aostore.r3 import format as fmt
config, fields = json.loads(sys.argv[1])
reader = r3.Reader(mooncake=config)
import os
assert not os.path.exists(fmt.path(fmt.ident(fmt.parse(fields[0])["arena"])))  # not its /dev/shm
batch = reader.fetch(fields)
print(json.dumps([hashlib.sha256(rows.tobytes()).hexdigest() for rows in batch]))
batch.release()
try:
    r3.fetch(fields[:1])  # no Mooncake setting: another node's reference names it
except r3.OtherNode as error:
    print(json.dumps(str(error)))
"""


@pytest.mark.mooncake
def test_a_reader_in_another_nodes_view_reads_through_mooncake(cluster, frontend) -> None:
    """The other-node path with nothing rewritten: the reader runs in a mount namespace of its
    own, with an empty /dev/shm and another boot id (tests/support/other_node.py), and reads
    the frontend's answers' strings as a trainer on another node gets them."""
    import base64
    import hashlib

    import other_node

    missing = other_node.missing_reason()
    if missing:
        pytest.skip(missing)
    arena, publisher = frontend
    wanted = [rows(40, 41), rows(1, 42), rows(700, 43)]
    references = [arena.deliver(want) for want in wanted]
    assert publisher.flush()
    fields = [base64.b64encode(fmt.npy_of(ref)).decode() for ref in references]
    support = os.path.dirname(other_node.__file__)
    argv = json.dumps([cluster.config(key_prefix=PREFIX), [fields[2], fields[0], fields[1]]])
    done = subprocess.run(
        [sys.executable, "-c", READER_ELSEWHERE, argv, support],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != offnode.SETTING},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    digests, refused = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert digests == [hashlib.sha256(w.tobytes()).hexdigest() for w in wanted[2:] + wanted[:2]]
    assert offnode.SETTING in refused
    # The read channel: the frontend learns of the reads with its next poll.
    deadline = time.monotonic() + 10.0
    while publisher.stats.read_offnode < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert publisher.stats.read_offnode == 3


class Late:
    """The frontend's client, whose puts take ``delay`` seconds more (a publication in
    flight when the trainer asks)."""

    def __init__(self, client: Any, delay: float) -> None:
        self._client, self._delay = client, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_put_from_multi_buffers(self, *args: Any) -> Any:
        time.sleep(self._delay)
        return self._client.batch_put_from_multi_buffers(*args)


@pytest.mark.mooncake
def test_an_off_node_read_waits_a_bounded_time_for_a_publication_in_flight(
    cluster, frontend_client, reader
) -> None:
    with Arena(1 << 20, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, Late(frontend_client, 0.0), prefix=PREFIX)
        try:
            arena.deliver(rows(4, 20))
            assert publisher.flush()  # the marker is in Mooncake
            publisher._client._delay = 0.5
            want = rows(9, 21)
            in_flight = arena.deliver(want)
            started = time.monotonic()
            assert np.array_equal(reader.fetch([elsewhere(in_flight)])[0], want)
            assert 0.2 < time.monotonic() - started < 2.0
            hasty = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX), publish_wait=0.1)
            try:
                later = arena.deliver(want)
                # Gone from the master's books or mid-put, either way not within the wait.
                with pytest.raises(r3.ReferenceGone, match=r"(nor within|in flight after) 0\.1 s"):
                    hasty.fetch([elsewhere(later)])
            finally:
                hasty.close()
            with pytest.raises(ValueError, match="finite number of seconds"):
                r3.Reader(mooncake=cluster.config(), publish_wait=float("inf"))
        finally:
            publisher.close()


class NotReady:
    """The reader's client, whose reads of each object answer REPLICA_IS_NOT_READY ``times``
    times first: the window between a put's start and its end, which the real master shows
    only when a read lands in it (CI met it once)."""

    def __init__(self, client: Any, times: int) -> None:
        self._client, self._times = client, times
        self.answered: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_get_into_multi_buffers(
        self, names: list[str], buffers: list[list[int]], sizes: list[list[int]]
    ) -> Any:
        codes = list(self._client.batch_get_into_multi_buffers(names, buffers, sizes))
        for i, name in enumerate(names):
            seen = self.answered.get(name, 0)
            self.answered[name] = seen + 1
            if seen < self._times:
                codes[i] = offnode.REPLICA_IS_NOT_READY
        return codes


@pytest.mark.mooncake
def test_an_object_mid_put_is_read_once_its_put_ends_or_named_in_flight(cluster, frontend) -> None:
    arena, publisher = frontend
    want = rows(7, 31)
    reference = elsewhere(arena.deliver(want))
    assert publisher.flush()
    patient = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX), publish_wait=5.0)
    hasty = r3.Reader(mooncake=cluster.config(key_prefix=PREFIX), publish_wait=0.0)
    try:
        for made in (patient, hasty):
            assert made._offnode is not None
            made._offnode._client = NotReady(made._offnode._connected(), times=3)
        assert np.array_equal(patient.fetch([reference])[0], want)
        assert max(patient._offnode._client.answered.values()) == 4  # three not ready, then read
        with pytest.raises(r3.ReferenceGone, match="still in flight") as raised:
            hasty.fetch([reference])
        assert raised.value.index == 0
    finally:
        patient.close()
        hasty.close()


@pytest.mark.mooncake
def test_a_slot_the_frontend_holds_for_a_moment_is_published_once_let_go(
    frontend_client, reader
) -> None:
    """The publisher's lease on a slot can meet the frontend's write lock (a look at a slot it
    then keeps): the put is tried again, not dropped as gone."""
    with Arena(1 << 20, ttl=60.0) as arena:
        publisher = offnode.Publisher(arena, Late(frontend_client, 0.3), prefix=PREFIX, retry=0.05)
        frontend = leases.reopen(arena._fd)
        try:
            arena.deliver(rows(4, 22))  # the publisher's thread is in its put for 0.3 s
            want = rows(6, 23)
            reference = arena.deliver(want)
            assert leases.lock(frontend, int(reference["slot"]), leases.WRITE)
            time.sleep(0.6)  # the put of it met the lock
            leases.lock(frontend, int(reference["slot"]), leases.UNLOCK)
            deadline = time.monotonic() + 10.0
            while publisher.stats.published < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert publisher.stats.published == 2 and publisher.stats.gone_before_put == 0
            assert np.array_equal(reader.fetch([elsewhere(reference)])[0], want)
        finally:
            os.close(frontend)
            publisher.close()


@pytest.mark.mooncake
def test_r3_across_nodes_has_a_setting_of_its_own(tmp_path) -> None:
    """Issue 49: ``AOSTORE_VLLM_R3_MOONCAKE`` (not the store's ``AOSTORE_VLLM_MOONCAKE``); a
    bad one turns R3 by reference off, saying why, rather than publish nowhere."""
    require_mooncake()  # the setting is taken only where Mooncake is installed
    from aostore.vllm.settings import Settings

    config = tmp_path / "r3.json"
    config.write_text('{"master_server_address": "127.0.0.1:50051", "key_prefix": "m/"}')
    env = {"AOSTORE_VLLM_R3_DELIVERY": "reference", "AOSTORE_VLLM_R3_MOONCAKE": str(config)}
    good = Settings.from_env(env)
    assert good.r3_delivery == "reference" and good.tier is None
    assert good.r3_mooncake is not None and good.r3_mooncake.config.key_prefix == "m/"
    assert "127.0.0.1:50051" in good.effective()["AOSTORE_VLLM_R3_MOONCAKE"]
    for bad in ("/nonexistent/r3.json", str(tmp_path)):
        settings = Settings.from_env({**env, "AOSTORE_VLLM_R3_MOONCAKE": bad})
        assert settings.r3_delivery is None and settings.r3_mooncake is None
        assert "AOSTORE_VLLM_R3_MOONCAKE" in settings.r3_said
        assert "R3 off" in settings.ignored["AOSTORE_VLLM_R3_MOONCAKE"]
