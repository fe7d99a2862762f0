"""aostore.mooncake (docs/mooncake.md) against a real Mooncake master on 127.0.0.1.

The ``mooncake``-marked tests start ``mooncake_master`` and a segment holder themselves (free
ports, loopback only) and stop them by PID. Without the Mooncake package they skip with the
install command; ``AOSTORE_REQUIRE_MOONCAKE=1`` (CI) turns that skip into a failure. Every wait
is bounded: subprocesses get timeouts and no test waits on Mooncake without a limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aostore
import branch_mooncake
import mooncake_util
import numpy as np
import pytest
from aostore import BlockObject, BlockObjectStore, BlockObjectStoreError
from aostore.mooncake import (
    MOONCAKE_PIP_PACKAGE,
    MooncakeBlockObjectStore,
    MooncakeConfig,
    MooncakeError,
    TieredBlockObjectStore,
    connect,
)
from mooncake_fakes import (
    NBYTES,
    SUBPROCESS_TIMEOUT,
    TESTS_DIR,
    FakeClient,
    Obj,
    blob,
    objects,
    require_mooncake,
    run_worker,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    """One master and one 64 MB segment holder for the module; stopped by PID at the end."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path_factory.mktemp("mooncake")) as started:
        yield started


@pytest.fixture(scope="module")
def client(cluster: mooncake_util.Cluster) -> Iterator[Any]:
    """One Mooncake client for the module's stores (a client takes about a second to close)."""
    shared = connect(cluster.config())
    yield shared
    shared.close()


@pytest.fixture
def make_remote(
    cluster: mooncake_util.Cluster, client: Any, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """Factory of Mooncake stores on the shared client, under a key prefix per test."""
    made: list[MooncakeBlockObjectStore] = []

    def factory(**kwargs: Any) -> MooncakeBlockObjectStore:
        store = MooncakeBlockObjectStore(
            client,
            object_nbytes=NBYTES,
            key_prefix=f"{request.node.name}/",
            master_address=cluster.master_address,
            close_client=False,
            **kwargs,
        )
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def remote(make_remote: Any) -> Any:
    return make_remote()


# -- without a cluster ---------------------------------------------------------------------


def test_import_does_not_load_mooncake() -> None:
    code = (
        "import sys, aostore.mooncake as m; "
        "assert 'mooncake' not in sys.modules and 'mooncake.store' not in sys.modules, "
        "sorted(k for k in sys.modules if k.startswith('mooncake')); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=TESTS_DIR,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_missing_package_names_pip_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match=re.escape(MOONCAKE_PIP_PACKAGE)):
        connect({"master_server_address": "127.0.0.1:1"})
    assert MOONCAKE_PIP_PACKAGE == mooncake_util.PIP_PACKAGE


def test_config_from_dict_and_file(tmp_path: Path) -> None:
    values = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "global_segment_size": "1GB",
        "local_buffer_size": "16 MiB",
        "protocol": "tcp",
        "device_name": "",
        "max_batch_bytes": 1 << 20,
    }
    config = MooncakeConfig.from_dict(values)
    assert config.global_segment_size == 1 << 30
    assert config.local_buffer_size == 16 << 20
    assert config.batch_bytes == 1 << 20
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(values))
    assert MooncakeConfig.from_file(path) == config
    assert MooncakeConfig.coerce(str(path)) == config
    # The batch bound never exceeds half of the local buffer.
    assert MooncakeConfig.from_dict({**values, "max_batch_bytes": "1GB"}).batch_bytes == 8 << 20


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "needs master_server_address"),
        ({"master_server_address": "127.0.0.1:1", "master_addr": "x"}, "unknown Mooncake"),
        ({"master_server_address": "no-port"}, "'host:port'"),
        ({"master_server_address": "h:1", "local_buffer_size": "lots"}, "size like '64MB'"),
        ({"master_server_address": "h:1", "local_buffer_size": 0}, "must be positive"),
        ({"master_server_address": "h:1", "connect_timeout_s": 0}, "positive number"),
        ({"master_server_address": "h:1", "protocol": ""}, "non-empty string"),
    ],
)
def test_config_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MooncakeConfig.from_dict(values)


def test_config_file_must_be_json_object(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        MooncakeConfig.from_file(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        MooncakeConfig.from_file(path)


# -- against a fake client (the paths a healthy master rarely takes) ------------------------


def fake_store(**kwargs: Any) -> tuple[MooncakeBlockObjectStore, FakeClient]:
    client = FakeClient()
    return MooncakeBlockObjectStore(client, object_nbytes=NBYTES, **kwargs), client


def test_reads_pass_each_key_once_in_bounded_batches() -> None:
    store, client = fake_store(max_batch_bytes=2 * NBYTES, key_prefix="p/")
    store.put(objects("k", range(5)))
    assert client.put_calls == [["p/k0", "p/k1"], ["p/k2", "p/k3"], ["p/k4"]]
    keys = ["k4", "k0", "k4", "k1", "k0"]
    assert store.get_concatenated(keys) == b"".join(blob(int(k[1])) for k in keys)
    assert client.get_calls == [["p/k4", "p/k0"], ["p/k1"]]


def test_present_key_that_batch_read_missed_is_read_alone() -> None:
    store, client = fake_store()
    store.put(objects("k", range(3)))
    client.unread = {"k1"}  # e.g. the local buffer was full
    assert store.get_concatenated(["k0", "k1", "k2"]) == blob(0) + blob(1) + blob(2)
    assert store.stats()["read_misses"] == 0


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (-200, r"-200 \(NO_AVAILABLE_HANDLE\).*no mounted segment has room"),
        (-600, r"-600 \(INVALID_PARAMS\).*local_buffer_size"),
        (-900, "is unreachable"),
        (-12345, r"-12345 \(unknown error\)"),
    ],
)
def test_put_errors_are_named(code: int, message: str) -> None:
    store, client = fake_store()
    client.put_code = code
    with pytest.raises(MooncakeError, match=message):
        store.put(objects("k", range(2)))


def test_lookup_error_and_wrong_size_fail_closed() -> None:
    store, client = fake_store()
    client.data["short"] = b"abc"
    with pytest.raises(MooncakeError, match="holds 3 bytes under 'short'"):
        store.get_concatenated(["short"])
    client.exist_code = -1
    with pytest.raises(MooncakeError, match="could not look up 'absent'"):
        store.get_concatenated(["absent"])


def test_publisher_joins_queued_batches() -> None:
    remote, client = fake_store()
    local = BlockObjectStore(max_bytes=16 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote, max_pending_batches=8)
    try:
        client.gate.clear()  # the publisher blocks in its first put_batch
        tiered.put(objects("a", range(2)))
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while tiered.stats()["pending_batches"] and time.monotonic() < deadline:
            time.sleep(0.01)
        for start in (2, 4, 6):
            tiered.put(objects("a", range(start, start + 2)))
        client.gate.set()
        tiered.flush()
        assert client.upsert_calls == [["a0", "a1"], [f"a{i}" for i in range(2, 8)]]
        assert tiered.stats()["publish_batches"] == 2
    finally:
        tiered.close()


def test_publication_overwrites_only_what_differs() -> None:
    remote, client = fake_store(key_prefix="p/")
    client.data.update({"p/same": blob(1), "p/other": blob(2)})
    remote.publish(["same", "other", "new"], [blob(1), blob(3), bytearray(blob(4))])
    assert client.upsert_calls == [["p/other", "p/new"]]  # "same" holds these bytes already
    assert client.data == {"p/same": blob(1), "p/other": blob(3), "p/new": blob(4)}
    stats = remote.stats()
    assert stats["objects_written"] == 2 and stats["objects_unchanged"] == 1
    client.exist_code = -900
    with pytest.raises(MooncakeError, match="unreachable"):
        remote.publish(["x"], [blob(5)])


def test_fetch_written_meanwhile_is_not_kept() -> None:
    """A put that writes a key while a read fetches it (and is evicted locally again before the
    read keeps its fetch): the fetched bytes predate the put, so keeping them would leave the
    local tier with bytes that Mooncake no longer holds."""
    remote, client = fake_store()
    client.data["k"] = blob(1)
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote)
    fetch = client.batch_get_buffer

    def racing_fetch(keys: list[str]) -> list[bytes | None]:
        held = fetch(keys)  # what Mooncake held when the read fetched
        client.batch_get_buffer = fetch  # type: ignore[method-assign]
        tiered.put([BlockObject("k", blob(2))])
        tiered.put(objects("other", range(2)))  # evicts k locally
        return held

    client.batch_get_buffer = racing_fetch  # type: ignore[method-assign]
    try:
        assert tiered.get_concatenated(["k"]) == blob(1)  # concurrent with the put: either
        assert not local.contains(["k"])[0]
        assert tiered.stats()["not_kept_objects"] == 1
        tiered.flush()
        assert client.data["k"] == blob(2)
        assert tiered.get_concatenated(["k"]) == blob(2)
    finally:
        tiered.close()


def test_put_that_raises_after_writing_still_publishes_what_it_wrote() -> None:
    """A policy whose ``on_remove`` raises: whether the local put is then applied or not, every
    key the local tier holds afterwards is published with the bytes it holds."""

    class Boom(Exception):
        pass

    class Policy:
        def on_reference_change(self, key: str, old: int, new: int) -> None:
            pass

        def select_victims(self, candidates: Any, count: int) -> list[str]:
            return [key for _, key in zip(range(count), candidates, strict=False)]

        def on_remove(self, keys: list[str], reason: str) -> None:
            raise Boom(reason)

    remote, client = fake_store()
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES, policy=Policy())
    tiered = TieredBlockObjectStore(local, remote)
    try:
        tiered.put(objects("k", range(2)))
        with pytest.raises(Exception, match="eviction"):
            tiered.put(objects("k", range(2, 4)))  # evicts k0 and k1
        tiered.flush()
        keys = [f"k{i}" for i in range(4)]
        for key, stored in zip(keys, local.contains(keys), strict=True):
            if stored:
                assert client.data[key] == local.get_concatenated([key])
    finally:
        tiered.close()


def test_tiered_keeps_what_fits_of_a_large_fetch() -> None:
    remote, _ = fake_store()
    remote.put(objects("r", range(6)))
    local = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote)
    try:
        keys = [f"r{i}" for i in range(6)]
        assert tiered.get_concatenated(keys) == b"".join(blob(i) for i in range(6))
        assert tiered.stats()["kept_objects"] == 4
        assert local.snapshot()["objects"].keys() >= {"r2", "r3", "r4", "r5"}
    finally:
        tiered.close()


# -- against a real master -----------------------------------------------------------------


@pytest.mark.mooncake
def test_unreachable_master_fails_fast() -> None:
    require_mooncake()
    port = mooncake_util.free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(MooncakeError, match=f"master at 127.0.0.1:{port} is unreachable"):
        MooncakeBlockObjectStore.from_config(
            {"master_server_address": f"127.0.0.1:{port}", "connect_timeout_s": 1.0},
            object_nbytes=NBYTES,
        )
    assert time.monotonic() - start < 5.0


@pytest.mark.mooncake
def test_mooncake_store_round_trip(remote: MooncakeBlockObjectStore) -> None:
    remote.put(objects("a", range(10)), retain_keys=["a1", "a2"], release_keys=["a2"])
    assert remote.get_concatenated([]) == b""
    assert remote.get_concatenated(["a3", "a1", "a3"]) == blob(3) + blob(1) + blob(3)
    # Blocks from one array; a key given twice keeps its last payload (dict semantics).
    rows = np.arange(4 * NBYTES, dtype=np.uint32).astype(np.uint8).reshape(4, NBYTES)
    remote.put_blocks(["b0", "b1", "b2", "b3"], rows)
    remote.put([BlockObject("c", blob(1)), BlockObject("c", bytearray(blob(2)))])
    out = np.zeros((5, NBYTES), dtype=np.uint8)
    assert remote.get_into(["b0", "b1", "b2", "b3", "c"], out) is out
    np.testing.assert_array_equal(out[:4], rows)
    assert bytes(out[4]) == blob(2)
    array = remote.get_array(["b1", "b1"], dtype=np.uint8, shape_per_token=(46, 8))
    assert array.shape == (2 * NBYTES // 368, 46, 8)
    # Objects are immutable in Mooncake as in the local store: a re-put keeps the bytes.
    remote.put([BlockObject("a1", blob(99))])
    assert remote.get_concatenated(["a1"]) == blob(1)
    stats = remote.stats()
    assert stats["retains"] == 2 and stats["releases"] == 1  # accepted and counted
    assert stats["objects_written"] == 10 + 4 + 1 + 1
    assert stats["objects_read"] == 2 + 5 + 1 + 1  # each key once per call


@pytest.mark.mooncake
def test_mooncake_store_batches_are_bounded(make_remote: Any) -> None:
    # 3 objects per batch: 20 objects take 7 put_batch calls and 7 batch_get_buffer calls.
    store = make_remote(max_batch_bytes=3 * NBYTES + 100)
    store.put(objects("k", range(20)))
    keys = [f"k{i}" for i in range(20)]
    assert store.get_concatenated(keys) == b"".join(blob(i) for i in range(20))
    stats = store.stats()
    assert stats["put_batches"] == 7
    assert stats["get_batches"] == 7
    with pytest.raises(ValueError, match="must hold at least one object"):
        make_remote(max_batch_bytes=NBYTES - 1)


@pytest.mark.mooncake
def test_mooncake_store_miss_fails_closed(remote: MooncakeBlockObjectStore) -> None:
    remote.put(objects("m", range(2)))
    with pytest.raises(BlockObjectStoreError, match='"absent-key" does not exist in Mooncake'):
        remote.get_concatenated(["m0", "absent-key", "m1"])
    out = bytearray(2 * NBYTES)
    with pytest.raises(BlockObjectStoreError, match="does not exist"):
        remote.get_into(["m0", "other-absent"], out)
    assert remote.stats()["read_misses"] == 2


@pytest.mark.mooncake
def test_mooncake_store_bad_input(remote: MooncakeBlockObjectStore) -> None:
    with pytest.raises(TypeError, match="keys must be str"):
        remote.put([Obj(7, blob(1))])
    with pytest.raises(ValueError, match=r"'short' holds 3 bytes, expected object_nbytes=5888"):
        remote.put([BlockObject("ok", blob(1)), BlockObject("short", b"abc")])
    with pytest.raises(TypeError, match="C-contiguous buffer"):
        remote.put([Obj("obj", object())])
    with pytest.raises(ValueError, match=r"blocks must have shape \(2, \.\.\.\)"):
        remote.put_blocks(["x", "y"], np.zeros((3, NBYTES), dtype=np.uint8))
    with pytest.raises(ValueError, match="out holds"):
        remote.get_into(["ok"], bytearray(3))
    # Nothing was written by the calls that failed validation.
    with pytest.raises(BlockObjectStoreError, match='"ok" does not exist'):
        remote.get_concatenated(["ok"])
    assert remote.stats()["objects_written"] == 0


@pytest.mark.mooncake
def test_closed_mooncake_store(make_remote: Any, client: Any) -> None:
    store = make_remote()
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.put([])
    with pytest.raises(RuntimeError, match="closed"):
        store.put_blocks([], b"")
    with pytest.raises(RuntimeError, match="closed"):
        store.get_concatenated([])
    with pytest.raises(RuntimeError, match="closed"):
        store.get_into([], bytearray())
    assert client.health_check() == 0  # close_client=False left the shared client open


@pytest.mark.mooncake
def test_config_file_and_p2p_handshake(tmp_path: Path) -> None:
    """P2P handshake mode (no metadata server), set up from a JSON file: a writer that mounts
    a segment, as engines that contribute memory do, and a reader that mounts none. Metadata
    modes do not mix in one cluster (a P2P client cannot reach a segment registered over
    HTTP), so this test has a master of its own and no segment holder."""
    require_mooncake()
    with mooncake_util.cluster(tmp_path, holder_segment=None) as own:
        path = tmp_path / "mooncake.json"
        values = own.config(metadata_server="P2PHANDSHAKE", global_segment_size="16MB")
        path.write_text(json.dumps(values))
        writer = MooncakeBlockObjectStore.from_config(path, object_nbytes=NBYTES)
        reader = MooncakeBlockObjectStore.from_config(
            {**values, "global_segment_size": 0}, object_nbytes=NBYTES
        )
        try:
            writer.put(objects("p2p-", range(8)))
            keys = [f"p2p-{i}" for i in range(8)]
            assert reader.get_concatenated(keys) == b"".join(blob(i) for i in range(8))
        finally:
            reader.close()
            writer.close()


@pytest.mark.mooncake
def test_tiered_round_trip(make_remote: Any) -> None:
    local = BlockObjectStore(max_bytes=64 * NBYTES, object_nbytes=NBYTES)
    remote = make_remote()
    tiered = TieredBlockObjectStore(local, remote, max_pending_batches=2)
    try:
        mutable = bytearray(blob(5))
        tiered.put([BlockObject("t0", mutable), BlockObject("t1", blob(1))], retain_keys=["t0"])
        mutable[:] = blob(6)  # the caller reuses its buffer: what was put is published
        rows = np.stack([np.full(NBYTES, i, dtype=np.uint8) for i in range(2, 6)])
        tiered.put_blocks(["t2", "t3", "t4", "t5"], rows, release_keys=["t0"])
        tiered.flush()
        keys = [f"t{i}" for i in range(6)]
        expected = blob(5) + b"".join(blob(i) for i in range(1, 6))
        assert tiered.get_concatenated(keys) == expected  # local hits
        assert remote.get_concatenated(keys) == expected  # and published
        assert local.stats()["referenced"] == 0
        stats = tiered.stats()
        assert stats["published_objects"] == 6
        assert stats["local_hit_objects"] == 6
        assert stats["remote_hit_objects"] == 0
        out = np.empty(6 * NBYTES, dtype=np.uint8)
        assert bytes(tiered.get_into(keys, out)) == expected
        # A BackgroundBlockObjectStore takes the tiered store like any store.
        writer = aostore.BackgroundBlockObjectStore(tiered, max_pending_batches=2)
        writer.put([BlockObject("t6", blob(6))])
        assert writer.get_concatenated(["t6"]) == blob(6)
        writer.close()  # closes the tiered store, which publishes t6 first
        assert remote.closed
    finally:
        tiered.close()
    assert remote.closed and local.closed


@pytest.mark.mooncake
@pytest.mark.parametrize("flush_between", [False, True])
def test_tiered_tiers_agree_on_a_key_put_twice(make_remote: Any, flush_between: bool) -> None:
    # The local tier keeps the first stored bytes of a key (fail-closed: objects are immutable);
    # Mooncake must end up with the same bytes, whatever the batching, and a local eviction
    # must not change what the engine reads.
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES)
    remote = make_remote()
    tiered = TieredBlockObjectStore(local, remote, max_pending_batches=8)
    try:
        tiered.put([BlockObject("k", blob(1))])
        if flush_between:
            tiered.flush()
        tiered.put([BlockObject("k", blob(2)), BlockObject("k", blob(3))])
        tiered.put_blocks(["k"], np.full((1, NBYTES), 4, dtype=np.uint8))
        tiered.flush()
        assert tiered.get_concatenated(["k"]) == blob(1)
        assert remote.get_concatenated(["k"]) == blob(1)
        tiered.put(objects("other", range(2)))  # evicts k locally
        with pytest.raises(BlockObjectStoreError, match="does not exist"):
            local.get_concatenated(["k"])
        assert tiered.get_concatenated(["k"]) == blob(1)  # from Mooncake: the same bytes
    finally:
        tiered.close()


def second_client_reads(cluster: mooncake_util.Cluster, prefix: str, key: str) -> bytes:
    """``key`` as another Mooncake client (its own connection) reads it."""
    other = MooncakeBlockObjectStore.from_config(
        cluster.config(key_prefix=prefix), object_nbytes=NBYTES
    )
    try:
        return other.get_concatenated([key])
    finally:
        other.close()


def other_engine_digest(cluster: mooncake_util.Cluster, prefix: str, name: str) -> str:
    """The SHA-256 of ``f"{name}:0"`` as another engine process reads it through its own
    tiered store (an empty local tier)."""
    result = run_worker("digest", cluster.config(key_prefix=prefix), name, 1)
    digest: str = result["sha256"][0]
    return digest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.mooncake
@pytest.mark.parametrize("flush_between", [False, True])
def test_tiered_fail_closed_re_put_after_eviction_wins_everywhere(
    cluster: mooncake_util.Cluster, flush_between: bool
) -> None:
    """fail-closed: a published key evicted locally and put again with other bytes (a prefix
    block recomputed with other routing). The rule: the latest write through the tier wins, in
    both tiers; every read before and after each local eviction returns it, and so do another
    client and another engine process. Without the flush the two publications may be joined."""
    prefix = f"fc-re-put-{flush_between}/"
    remote = MooncakeBlockObjectStore.from_config(
        cluster.config(key_prefix=prefix), object_nbytes=NBYTES
    )
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote)
    key = "block:0"
    try:
        tiered.put([BlockObject(key, blob(1))])
        if flush_between:
            tiered.flush()
        tiered.put(objects("a", range(2)))  # evicts the key locally
        assert not local.contains([key])[0]
        tiered.put([BlockObject(key, blob(2))])  # written locally again, with other bytes
        assert local.contains([key])[0]
        reads = [tiered.get_concatenated([key])]  # local
        tiered.flush()
        reads.append(remote.get_concatenated([key]))
        for fill in (3, 5):
            tiered.put(objects("b", range(fill, fill + 2)))  # evicts it again
            assert not local.contains([key])[0]
            reads.append(tiered.get_concatenated([key]))  # from Mooncake (kept locally)
            reads.append(tiered.get_concatenated([key]))  # local
        assert reads == [blob(2)] * len(reads)
        assert second_client_reads(cluster, prefix, key) == blob(2)
        assert other_engine_digest(cluster, prefix, "block") == sha(blob(2))
        # A put of the stored key keeps its bytes (fail-closed) in both tiers.
        tiered.put([BlockObject(key, blob(9))])
        tiered.flush()
        assert tiered.get_concatenated([key]) == blob(2)
        assert remote.get_concatenated([key]) == blob(2)
    finally:
        tiered.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("flush_between", [False, True])
def test_tiered_grow_re_put_wins_everywhere(
    cluster: mooncake_util.Cluster, flush_between: bool
) -> None:
    """grow: a re-put of a stored unreferenced key replaces its bytes locally (as vLLM 0.33);
    the new bytes are what every read returns, before and after a local eviction, and what
    another client and another engine process read. A re-put of a referenced key keeps its
    bytes in both tiers."""
    prefix = f"grow-re-put-{flush_between}/"
    remote = MooncakeBlockObjectStore.from_config(
        cluster.config(key_prefix=prefix), object_nbytes=NBYTES
    )
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES, profile="grow")
    tiered = TieredBlockObjectStore(local, remote)
    key = "block:0"
    try:
        tiered.put([BlockObject(key, blob(1))])
        if flush_between:
            tiered.flush()
        tiered.put([BlockObject(key, blob(2))])  # replaced locally
        reads = [tiered.get_concatenated([key])]
        tiered.flush()
        reads.append(remote.get_concatenated([key]))
        tiered.put(objects("a", range(2)))  # evicts it locally
        assert not local.contains([key])[0]
        reads.append(tiered.get_concatenated([key]))  # from Mooncake, kept locally
        reads.append(tiered.get_concatenated([key]))
        assert reads == [blob(2)] * len(reads)
        assert second_client_reads(cluster, prefix, key) == blob(2)
        assert other_engine_digest(cluster, prefix, "block") == sha(blob(2))
        # Referenced: the re-put keeps the bytes, locally and in Mooncake.
        tiered.put([], retain_keys=[key])
        tiered.put([BlockObject(key, blob(3))])
        tiered.flush()
        assert tiered.get_concatenated([key]) == blob(2)
        assert remote.get_concatenated([key]) == blob(2)
        assert local.num_slots == 2
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_tiered_read_never_grows_a_grow_arena(
    make_remote: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Every local object referenced: a read of a key only Mooncake holds returns it and
    keeps nothing (no slot without growing); num_slots stays, nothing logs "grew". With room
    (one key released), the fetch is kept as far as it fits."""
    local = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES, profile="grow")
    remote = make_remote()
    tiered = TieredBlockObjectStore(local, remote)
    try:
        held = [f"g{i}" for i in range(4)]
        tiered.put(objects("g", range(4)), retain_keys=held)
        remote.put(objects("far", range(3)))  # only in Mooncake
        caplog.set_level(logging.DEBUG)
        assert tiered.get_concatenated(["far0"]) == blob(0)
        assert tiered.get_concatenated(["g1", "far1", "far2"]) == blob(1) + blob(1) + blob(2)
        assert local.num_slots == 4 and tiered.num_slots == 4
        assert local.stats()["growths"] == 0
        assert not [r for r in caplog.records if "grew" in r.getMessage()]
        stats = tiered.stats()
        assert stats["kept_objects"] == 0 and stats["not_kept_objects"] == 3
        assert not any(local.contains(["far0", "far1", "far2"]))
        tiered.put([], release_keys=["g3"])  # one evictable object: room for one
        assert tiered.get_concatenated(["far1", "far2"]) == blob(1) + blob(2)
        assert local.contains(["far1", "far2", "g3"]) == [False, True, False]
        assert tiered.stats()["kept_objects"] == 1
        assert local.num_slots == 4 and local.stats()["growths"] == 0
        assert not [r for r in caplog.records if "grew" in r.getMessage()]
        local.check()
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_tiered_local_eviction_served_from_mooncake(make_remote: Any) -> None:
    local = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES)
    remote = make_remote()
    tiered = TieredBlockObjectStore(local, remote)
    try:
        for start in (0, 4, 8):  # 12 objects through a local tier of 4: 8 evicted locally
            tiered.put(objects("e", range(start, start + 4)))
        assert local.stats()["evictions"] == 8
        with pytest.raises(BlockObjectStoreError, match="does not exist"):
            local.get_concatenated(["e0"])
        # One read of evicted and resident keys (one repeated): the misses come from
        # Mooncake in one batch, after the queued publications.
        keys = ["e0", "e9", "e1", "e0", "e11"]
        assert tiered.get_concatenated(keys) == b"".join(blob(int(k[1:])) for k in keys)
        stats = tiered.stats()
        assert stats["remote_hit_objects"] == 2
        assert stats["remote_get_batches"] == 1
        assert stats["kept_objects"] == 2
        # Kept locally: the next read of them is a local hit.
        assert tiered.get_concatenated(["e0", "e1"]) == blob(0) + blob(1)
        assert tiered.stats()["remote_hit_objects"] == 2
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_tiered_miss_in_both_fails_closed(make_remote: Any) -> None:
    local = BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES)
    remote = make_remote()
    tiered = TieredBlockObjectStore(local, remote, keep_fetched=False)
    try:
        tiered.put(objects("x", range(2)))
        with pytest.raises(
            BlockObjectStoreError, match='"nowhere" does not exist in the local store or in Moon'
        ):
            tiered.get_concatenated(["x0", "nowhere", "x1"])
        out = np.zeros(2 * NBYTES, dtype=np.uint8)
        with pytest.raises(BlockObjectStoreError, match="does not exist"):
            tiered.get_into(["x1", "nowhere-else"], out)
        assert tiered.stats()["read_misses"] == 2
        assert tiered.get_concatenated(["x1"]) == blob(1)  # the store still works
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_second_process_reads_what_the_first_published(cluster: mooncake_util.Cluster) -> None:
    """Engine A publishes through its tiered store and exits; engine B, another process with
    an empty local tier, reads every object from Mooncake. Engines mount no memory
    (global_segment_size=0): the segment holder keeps what A published after A is gone."""
    config = cluster.config(key_prefix="two-process/")
    published = run_worker("publish", config, "engine-a", 200)
    assert published == {"published": 200, "published_objects": 200, "remote_hit_objects": 0}
    read = run_worker("read", config, "engine-a", 200)
    assert read["equal"] is True
    assert read["remote_hit_objects"] == 200
    # And this process sees them too.
    remote = MooncakeBlockObjectStore.from_config(config, object_nbytes=NBYTES)
    try:
        data = remote.get_concatenated(["engine-a:0", "engine-a:199"])
        assert data == mooncake_util.payload("engine-a", 0, NBYTES) + mooncake_util.payload(
            "engine-a", 199, NBYTES
        )
    finally:
        remote.close()


@pytest.mark.mooncake
def test_master_stopped_mid_run_fails_clearly(tmp_path: Path) -> None:
    """``on_publish_error="raise"`` (the opt-in fatal mode): the master goes away under
    running stores: local hits still work; a read miss, a publication and a direct put raise a
    clear error (the put after Mooncake's own RPC timeout, about 4 s); close returns;
    connecting again fails within its timeout. (The default mode survives the same fault:
    tests/tier/test_mooncake_faults.py.)"""
    require_mooncake()
    with mooncake_util.cluster(tmp_path) as own:
        local = BlockObjectStore(max_bytes=8 * NBYTES, object_nbytes=NBYTES)
        remote = MooncakeBlockObjectStore.from_config(own.config(), object_nbytes=NBYTES)
        direct = MooncakeBlockObjectStore.from_config(own.config(), object_nbytes=NBYTES)
        tiered = TieredBlockObjectStore(local, remote, on_publish_error="raise")
        unreachable = r"Mooncake master at 127\.0\.0\.1:\d+ is unreachable"
        try:
            tiered.put(objects("s", range(4)))
            tiered.flush()
            own.stop_master()
            assert not own.master.running()
            assert tiered.get_concatenated(["s0", "s3"]) == blob(0) + blob(3)  # local hits

            start = time.monotonic()
            with pytest.raises(MooncakeError, match=unreachable):
                tiered.get_concatenated(["s0", "not-local"])
            tiered.put(objects("s", range(4, 6)))
            with pytest.raises(BlockObjectStoreError, match="publication failed") as failed:
                tiered.flush()
            assert isinstance(failed.value.__cause__, MooncakeError)
            assert "unreachable" in str(failed.value.__cause__)
            assert time.monotonic() - start < 5.0

            start = time.monotonic()
            with pytest.raises(MooncakeError, match=unreachable):
                direct.put(objects("d", range(2)))
            with pytest.raises(MooncakeError, match=unreachable):
                direct.get_concatenated(["s0"])
            assert time.monotonic() - start < 15.0

            start = time.monotonic()
            with pytest.raises(BlockObjectStoreError, match="publication failed"):
                tiered.close()  # closes both stores, then raises the latched error
            direct.close()
            assert time.monotonic() - start < 15.0
            assert local.closed and remote.closed

            start = time.monotonic()
            with pytest.raises(MooncakeError, match=unreachable):
                connect(own.config(connect_timeout_s=1.0))
            assert time.monotonic() - start < 5.0
        finally:
            with contextlib.suppress(BlockObjectStoreError):
                tiered.close()
            direct.close()


# -- interop with vLLM's Mooncake branch (docs/mooncake.md) ---------------------------------
#
# tests/support/branch_mooncake.py uses Mooncake as the branch's MooncakeBlockObjectStore does (its
# docstring lists the calls, batching, keys and values). aostore's stores and it must read each
# other's objects byte for byte. A block here is 16 rows of 368 bytes (46 layers x 8 experts).

ROW_NBYTES = 368
BLOCK_ROWS = NBYTES // ROW_NBYTES
SHAPE_PER_TOKEN = (46, 8)
BUFFER = 8 << 20  # the clients' local_buffer_size (Cluster.config's "8MB")
THREE = 3 * NBYTES + 100  # a batch bound of three objects


def block_hash(namespace: str, index: int) -> bytes:
    return hashlib.sha256(f"{namespace}/{index}".encode()).digest()


def branch_keys(namespace: str, count: int) -> list[str]:
    return [branch_mooncake.block_key(namespace, block_hash(namespace, i)) for i in range(count)]


def request_rows(count: int, seed: int) -> np.ndarray:
    """``count`` token rows of routed-expert ids, shape ``(count, 46, 8)``, uint8."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 128, size=(count, *SHAPE_PER_TOKEN), dtype=np.uint8)


def blocks_of(rows: np.ndarray) -> list[bytes]:
    """The full blocks of ``rows`` as the branch stores them (C order)."""
    return [
        rows[i : i + BLOCK_ROWS].tobytes(order="C")
        for i in range(0, len(rows) - BLOCK_ROWS + 1, BLOCK_ROWS)
    ]


def run_branch(mode: str, cluster: mooncake_util.Cluster, items: Any, *extra: int) -> Any:
    """``branch_mooncake.py`` in another process, with its own Mooncake client."""
    config = cluster.config(local_buffer_size=BUFFER)
    done = subprocess.run(
        [
            sys.executable,
            str(TESTS_DIR / "branch_mooncake.py"),
            mode,
            json.dumps(config),
            json.dumps(items),
            str(NBYTES),
            *(str(value) for value in extra),
        ],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT,
        cwd=TESTS_DIR,
    )
    assert done.returncode == 0, f"branch {mode} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def aostore_remote(
    cluster: mooncake_util.Cluster, client: Any, **kwargs: Any
) -> MooncakeBlockObjectStore:
    return MooncakeBlockObjectStore(
        client,
        object_nbytes=NBYTES,
        master_address=cluster.master_address,
        close_client=False,
        **kwargs,
    )


@pytest.mark.mooncake
def test_branch_reader_reads_the_mooncake_store(
    cluster: mooncake_util.Cluster, client: Any
) -> None:
    """Blocks that aostore's MooncakeBlockObjectStore put (``put`` and ``put_blocks``, each
    key as given: no prefix) read back byte for byte through the branch's calls, here and in
    another process; aostore writes with put_batch in batches of max_batch_bytes, as the
    branch does."""
    rows = request_rows(11 * BLOCK_ROWS, seed=1)
    blocks = blocks_of(rows)
    keys = branch_keys("interop-store", 11)
    writes = branch_mooncake.Recorder(client)
    store = aostore_remote(cluster, writes, max_batch_bytes=THREE)
    store.put([BlockObject(key, block) for key, block in zip(keys[:7], blocks[:7], strict=True)])
    store.put_blocks(keys[7:], rows[7 * BLOCK_ROWS :].reshape(4, NBYTES))
    assert writes.sizes("put_batch") == [3, 3, 1, 3, 1]
    assert writes.keys("put_batch") == keys  # under the key itself
    assert not writes.sizes("upsert_batch")

    reads = branch_mooncake.Recorder(client)
    branch = branch_mooncake.BranchStore(reads, object_nbytes=NBYTES, max_batch_bytes=THREE)
    assert branch.get_concatenated(keys) == rows.tobytes()
    assert reads.sizes("batch_get_buffer") == [3, 3, 3, 2]
    assert reads.keys("batch_get_buffer") == keys
    got = branch_mooncake.read_rows(branch, keys, dtype=np.uint8, shape_per_token=SHAPE_PER_TOKEN)
    np.testing.assert_array_equal(got, rows)

    other = run_branch("read", cluster, keys)
    assert other["sizes"] == [NBYTES] * 11
    assert other["sha256"] == [sha(block) for block in blocks]
    assert other["total_sha256"] == sha(rows.tobytes())
    assert other["get_batches"] == [11]  # min(64 MiB, local_buffer_size) holds all 11
    store.close()


@pytest.mark.mooncake
def test_branch_reader_reads_what_the_tier_published(
    cluster: mooncake_util.Cluster, client: Any
) -> None:
    """The tier publishes what its local tier writes; the branch reads it under
    ``key_prefix + key`` (a prefix of ``vllm-artifact/{namespace}/`` and the block hash in hex
    as the key give the branch's own key), after local evictions too, and a block re-put with
    other bytes after its local eviction reads with the new bytes (the tier's rule)."""
    namespace = "interop-tier"
    prefix = f"vllm-artifact/{namespace}/"
    rows = request_rows(6 * BLOCK_ROWS, seed=2)
    blocks = blocks_of(rows)
    hexes = [block_hash(namespace, i).hex() for i in range(6)]
    remote = aostore_remote(cluster, client, key_prefix=prefix, max_batch_bytes=THREE)
    local = BlockObjectStore(max_bytes=2 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote)
    keys = branch_keys(namespace, 6)
    assert keys == [prefix + h for h in hexes]
    branch = branch_mooncake.BranchStore(client, object_nbytes=NBYTES, max_batch_bytes=THREE)
    try:
        for start in (0, 2):  # two blocks per put: the local tier holds two
            pairs = zip(hexes[start : start + 2], blocks[start : start + 2], strict=True)
            tiered.put([BlockObject(h, b) for h, b in pairs])
        tiered.put_blocks(hexes[4:], rows[4 * BLOCK_ROWS :].reshape(2, NBYTES))
        tiered.flush()
        assert local.stats()["evictions"] == 4  # only two stay local; Mooncake has all six
        assert branch.get_concatenated(keys) == rows.tobytes()

        recomputed = request_rows(BLOCK_ROWS, seed=3).tobytes()  # other routing, same block
        tiered.put([BlockObject(hexes[0], recomputed)])  # evicted locally: written again
        tiered.flush()
        assert branch.get_concatenated(keys[:2]) == recomputed + blocks[1]
        assert tiered.get_concatenated(hexes[:1]) == recomputed
        other = run_branch("read", cluster, keys)
        assert other["sha256"] == [sha(recomputed), *(sha(b) for b in blocks[1:])]
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_branch_terminal_output_over_aostore_blocks(
    cluster: mooncake_util.Cluster, client: Any
) -> None:
    """A finished request's terminal output, the branch's way: the ordered keys of its full
    blocks (published here by aostore's tier, as the plugin's engine does) and of its tail
    rows (written the branch's way: shorter objects under ``r3-tail:`` keys). The branch's
    reader rebuilds every row. aostore's stores hold objects of exactly ``object_nbytes``: they
    read the full blocks of that list and refuse a shorter tail object by name and size."""
    namespace = "interop-terminal"
    rows = request_rows(3 * BLOCK_ROWS + BLOCK_ROWS + 5, seed=4)  # 3 blocks, tail of 21 rows
    full = 3 * BLOCK_ROWS
    local = BlockObjectStore(max_bytes=8 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, aostore_remote(cluster, client))
    block_keys = branch_keys(namespace, 3)
    branch = branch_mooncake.BranchStore(
        client, object_nbytes=NBYTES, max_batch_bytes=branch_mooncake.branch_batch_bytes(BUFFER)
    )
    try:
        tiered.put_blocks(block_keys, rows[:full].reshape(3, NBYTES))
        tiered.flush()
        tail = branch_mooncake.tail_objects(rows[full:].tobytes(), NBYTES)
        assert [len(payload) for _, payload in tail] == [NBYTES, 5 * ROW_NBYTES]
        branch.put(tail)
        terminal = block_keys + [key for key, _ in tail]
        got = branch_mooncake.read_rows(
            branch, terminal, dtype=np.uint8, shape_per_token=SHAPE_PER_TOKEN
        )
        np.testing.assert_array_equal(got, rows)

        reader = aostore_remote(cluster, client)
        assert reader.get_concatenated(terminal[:4]) == rows[: full + BLOCK_ROWS].tobytes()
        with pytest.raises(
            MooncakeError, match=rf"holds {5 * ROW_NBYTES} bytes under '{terminal[4]}'"
        ):
            reader.get_concatenated(terminal)
        reader.close()
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_mooncake_store_reads_what_a_branch_writer_published(
    cluster: mooncake_util.Cluster, client: Any
) -> None:
    """Another process writes blocks the branch's way (put_batch per batch of max_batch_bytes
    // object_nbytes keys; a key given twice keeps its last payload) and exits. aostore's
    Mooncake store reads them byte for byte, under the key itself or with the namespace as
    key_prefix, as rows, and a tiered store with an empty local tier serves them from
    Mooncake."""
    namespace = "interop-writer"
    keys = branch_keys(namespace, 10)
    items = [[key, namespace, i, NBYTES] for i, key in enumerate(keys)]
    items.insert(5, [keys[2], "overwritten", 2, NBYTES])
    items.append([keys[2], "latest", 2, NBYTES])  # the last payload of a key given twice
    written = run_branch("write", cluster, items, THREE)
    assert written["put_batches"] == [3, 3, 3, 1]
    expected = [mooncake_util.payload(namespace, i, NBYTES) for i in range(10)]
    expected[2] = mooncake_util.payload("latest", 2, NBYTES)

    store = aostore_remote(cluster, client)
    assert store.get_concatenated(keys) == b"".join(expected)
    assert store.get_concatenated([keys[3], keys[2], keys[3]]) == (
        expected[3] + expected[2] + expected[3]
    )
    array = store.get_array(keys, dtype=np.uint8, shape_per_token=SHAPE_PER_TOKEN)
    assert array.shape == (10 * BLOCK_ROWS, *SHAPE_PER_TOKEN)
    assert array.tobytes() == b"".join(expected)
    prefixed = aostore_remote(cluster, client, key_prefix=f"vllm-artifact/{namespace}/")
    hexes = [block_hash(namespace, i).hex() for i in range(10)]
    assert prefixed.get_concatenated(hexes[::-1]) == b"".join(expected[::-1])
    store.close()

    local = BlockObjectStore(max_bytes=16 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, prefixed)
    try:
        assert tiered.get_concatenated(hexes) == b"".join(expected)
        stats = tiered.stats()
        assert stats["remote_hit_objects"] == 10 and stats["kept_objects"] == 10
        assert stats["published_objects"] == 0  # a fetch publishes nothing
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_which_write_wins_between_branch_and_aostore(
    cluster: mooncake_util.Cluster, client: Any
) -> None:
    """One value per key in Mooncake, and who keeps it: put_batch (the branch, and aostore's
    MooncakeBlockObjectStore) keeps the bytes a key holds; the tier's publication (upsert)
    replaces them."""
    keys = branch_keys("interop-wins", 3)
    branch = branch_mooncake.BranchStore(client, object_nbytes=NBYTES, max_batch_bytes=THREE)
    store = aostore_remote(cluster, client)
    # aostore first, then the branch: the branch's put_batch keeps aostore's bytes.
    store.put([BlockObject(keys[0], blob(1))])
    branch.put([(keys[0], blob(2))])
    assert branch.get_concatenated(keys[:1]) == blob(1)
    # The branch first, then aostore's Mooncake store: the branch's bytes stay.
    branch.put([(keys[1], blob(3))])
    store.put([BlockObject(keys[1], blob(4))])
    assert store.get_concatenated(keys[1:2]) == blob(3)
    # The branch first, then a tier whose local tier writes the key: the tier's bytes win.
    branch.put([(keys[2], blob(5))])
    tiered = TieredBlockObjectStore(
        BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES), store
    )
    try:
        tiered.put([BlockObject(keys[2], blob(6))])
        tiered.flush()
        assert branch.get_concatenated(keys[2:]) == blob(6)
    finally:
        tiered.close()


@pytest.mark.mooncake
def test_batch_bounds_branch_and_aostore(cluster: mooncake_util.Cluster, client: Any) -> None:
    """The batch bounds differ. The branch's is min(64 MiB, local_buffer_size); aostore's is
    max_batch_bytes (4 MiB by default) and at most half of local_buffer_size. Mooncake stages
    a batch in the local buffer with some overhead per object, so a batch of a whole buffer
    fails: put_batch returns -600 for all of it, and batch_get_buffer gives None for the keys
    that did not fit, which the branch's reader reports as unavailable. aostore writes and
    reads the same objects."""
    config = MooncakeConfig.from_dict(cluster.config())
    assert config.local_buffer_size == BUFFER
    count = BUFFER // NBYTES  # what the branch puts in one batch
    keys = branch_keys("interop-bounds", count)
    values = [blob(i) for i in range(count)]
    calls = branch_mooncake.Recorder(client)
    branch = branch_mooncake.BranchStore(
        calls, object_nbytes=NBYTES, max_batch_bytes=branch_mooncake.branch_batch_bytes(BUFFER)
    )
    with pytest.raises(branch_mooncake.BranchStoreError, match="put_batch failed: -600"):
        branch.put(list(zip(keys, values, strict=True)))
    assert calls.sizes("put_batch") == [count]

    store = aostore_remote(cluster, calls, max_batch_bytes=config.batch_bytes)
    store.put([BlockObject(key, value) for key, value in zip(keys, values, strict=True)])
    half = (BUFFER // 2) // NBYTES
    assert calls.sizes("put_batch") == [count, half, count - half]
    assert store.get_concatenated(keys) == b"".join(values)
    assert calls.sizes("batch_get_buffer") == [half, count - half]
    with pytest.raises(branch_mooncake.BranchStoreError, match="unavailable"):
        branch.get_concatenated(keys)
    # In batches that fit, the branch's reader reads them all.
    small = branch_mooncake.BranchStore(
        client, object_nbytes=NBYTES, max_batch_bytes=config.batch_bytes
    )
    assert small.get_concatenated(keys) == b"".join(values)
    store.close()


def test_a_forked_child_gets_a_clear_error_from_the_tier_never_a_hang() -> None:
    # The child inherits the queued publications but not the publisher: flush() waited for ever.
    remote, client = fake_store()
    local = BlockObjectStore(max_bytes=16 * NBYTES, object_nbytes=NBYTES)
    tiered = TieredBlockObjectStore(local, remote, max_pending_batches=8)
    client.gate.clear()  # the publisher blocks in its first put, so a batch stays queued
    try:
        tiered.put(objects("a", range(2)))
        tiered.put(objects("b", range(2)))
        pid = os.fork()
        if pid == 0:
            outcome = 0
            for call in (tiered.flush, lambda: tiered.get_concatenated(["a0"]), tiered.close):
                try:
                    call()
                    outcome |= 1
                except RuntimeError as error:
                    outcome |= 0 if "fork()" in str(error) else 2
            os._exit(outcome)
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the tier")
        assert os.waitstatus_to_exitcode(status) == 0, "a call in the child did not raise"
    finally:
        client.gate.set()
        tiered.close()
    assert sorted(client.data) == ["a0", "a1", "b0", "b1"]
