"""The vLLM plugin's Mooncake tier (``AOSTORE_VLLM_MOONCAKE``), on the plugin tests' throwaway
``vllm`` trees and against a real Mooncake master on 127.0.0.1.

With a valid config file the class the plugin installs for vLLM's ``BlockObjectStore`` builds a
``TieredBlockObjectStore`` whose local tier is the store it builds without the setting (same
class, profile and prefault); a bad file, or Mooncake not installed, is ignored with a WARNING
(as a bad ``AOSTORE_VLLM_PROFILE`` is); an unreachable master is a ``MooncakeError`` naming the
setting when vLLM builds its store. The ``mooncake``-marked tests start a master and a segment
holder (``tests/support/mooncake_util.py``) and skip with the install command when Mooncake is
missing.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aostore
import mooncake_util
import pytest
from aostore import vllm_plugin
from aostore.mooncake import (
    MooncakeBlockObjectStore,
    MooncakeConfig,
    MooncakeError,
    TieredBlockObjectStore,
)
from aostore.vllm import stores
from aostore.vllm.settings import ENV_MOONCAKE, ENV_PREFAULT, MooncakeTier
from mooncake_fakes import require_mooncake, run_worker
from vllm_trees import STORE, FakeTree, TreeMaker, make_tree  # noqa: F401  (a fixture)

NBYTES = 5888  # one GLM-4.5-Air block of routed-expert ids
LOGGER = "vllm.plugins.aostore"
ENV = ENV_MOONCAKE
LOCAL_CLASS = {
    "grow": vllm_plugin.GrowBlockObjectStore,
    "fail-closed": vllm_plugin.EngineBlockObjectStore,
}
TIER_CLASS = {
    "grow": vllm_plugin.TieredGrowBlockObjectStore,
    "fail-closed": vllm_plugin.TieredEngineBlockObjectStore,
}


@pytest.fixture(autouse=True)
def _no_tier_leaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts without the setting and without a tier registered by another test."""
    monkeypatch.delenv(ENV, raising=False)
    prefault, tier = stores.bound()
    stores.bind(prefault=prefault, tier=None)
    yield
    stores.bind(prefault=prefault, tier=tier)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mooncake_util.Cluster]:
    """One master and one segment holder for the module; stopped by PID at the end."""
    require_mooncake()
    with mooncake_util.cluster(
        tmp_path_factory.mktemp("mooncake"), holder_segment="256MB"
    ) as started:
        yield started


@pytest.fixture(params=["grow", "fail-closed"])
def tree(request: pytest.FixtureRequest, make_tree: TreeMaker) -> FakeTree:  # noqa: F811
    """vLLM 0.33's and 0.32's layouts, recognized as releases CI proves."""
    return make_tree(request.param, known=True)


def write_config(path: Path, values: Any) -> Path:
    path.write_text(values if isinstance(values, str) else json.dumps(values))
    return path


def start_up_line(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    records = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    assert len(records) == 1, [r.getMessage() for r in records]
    return records[0]


def register(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    return start_up_line(caplog)


# -- without a cluster: the setting off, or ignored -------------------------------------------


@pytest.mark.parametrize("value", [None, "", "   "])
def test_unset_or_empty_changes_nothing(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str | None,
) -> None:
    if value is not None:
        monkeypatch.setenv(ENV, value)
    line = register(caplog)
    assert line.levelno == logging.INFO
    assert "Mooncake" not in line.getMessage()
    installed = tree.modules[STORE].BlockObjectStore
    assert installed is LOCAL_CLASS[tree.kind]
    store = tree.modules["worker"].BlockObjectStore(max_bytes=8 * 64, object_nbytes=64)
    assert type(store) is LOCAL_CLASS[tree.kind]
    store.close()


def _bad_configs(tmp: Path) -> dict[str, Path]:
    return {
        "missing file": tmp / "nowhere" / "mooncake.json",
        "a directory": tmp,
        "not JSON": write_config(tmp / "bad.json", "{master_server_address: 1"),
        "not an object": write_config(tmp / "list.json", ["127.0.0.1:50051"]),
        "no master": write_config(tmp / "empty.json", {}),
        "an unknown key": write_config(
            tmp / "typo.json", {"master_server_address": "127.0.0.1:1", "master_port": 1}
        ),
        "a bad address": write_config(tmp / "address.json", {"master_server_address": "nohost"}),
        "a bad size": write_config(
            tmp / "size.json", {"master_server_address": "127.0.0.1:1", "local_buffer_size": -1}
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "a directory",
        "not JSON",
        "not an object",
        "no master",
        "an unknown key",
        "a bad address",
        "a bad size",
    ],
)
def test_bad_config_is_ignored_with_a_warning_naming_the_setting_and_the_path(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    case: str,
) -> None:
    path = _bad_configs(tmp_path)[case]
    monkeypatch.setenv(ENV, str(path))
    line = register(caplog)
    message = line.getMessage()
    assert line.levelno == logging.WARNING
    assert f"ignored {ENV}='{path}'" in message
    assert "Mooncake tier off" in message
    if mooncake_util.missing_reason() is None:
        assert str(path) in message.split("ignored", 1)[1].split("(", 1)[1]
    # The plugin still installs, and vLLM still gets, the store it gets without the setting.
    assert tree.modules[STORE].BlockObjectStore is LOCAL_CLASS[tree.kind]
    store = tree.modules["worker"].BlockObjectStore(max_bytes=8 * 64, object_nbytes=64)
    assert type(store) is LOCAL_CLASS[tree.kind]
    store.close()
    assert stores.bound()[1] is None


def test_missing_mooncake_package_is_ignored_with_the_pip_command(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path / "mooncake.json", {"master_server_address": "127.0.0.1:1"})
    monkeypatch.setenv(ENV, str(path))
    monkeypatch.setitem(sys.modules, "mooncake", None)  # find_spec says: not installed
    line = register(caplog)
    assert line.levelno == logging.WARNING
    assert "Mooncake is not installed: pip install 'mooncake-transfer-engine-non-cuda" in (
        line.getMessage()
    )
    assert tree.modules[STORE].BlockObjectStore is LOCAL_CLASS[tree.kind]


def test_branch_layout_ignores_the_setting_with_a_warning(
    make_tree: TreeMaker,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    require_mooncake()  # so that the file is the reason, not the package
    tree = make_tree("shm")
    path = write_config(tmp_path / "mooncake.json", {"master_server_address": "127.0.0.1:1"})
    monkeypatch.setenv(ENV, str(path))
    line = register(caplog)
    message = line.getMessage()
    assert line.levelno == logging.WARNING
    assert f"ignored {ENV}={path}" in message and "has no BlockObjectStore" in message
    assert "Mooncake tier off" in message
    shm = tree.modules["shm"]
    assert shm.ShmBlockObjectStore is vllm_plugin.EngineShmBlockObjectStore
    assert stores.bound()[1] is None


def test_dry_run_shows_the_tiered_class_without_connecting(
    make_tree: TreeMaker,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    require_mooncake()
    make_tree("grow", known=True)
    path = write_config(tmp_path / "mooncake.json", {"master_server_address": "127.0.0.1:1"})
    monkeypatch.setenv(ENV, str(path))
    result = vllm_plugin.dry_run()
    assert result.decision is not None
    assert result.decision.replace["BlockObjectStore"] is vllm_plugin.TieredGrowBlockObjectStore
    assert result.decision.mooncake is not None
    assert result.decision.mooncake.path == str(path)
    assert "master 127.0.0.1:1" in result.decision.mooncake_said
    assert stores.bound()[1] is None  # a dry run sets nothing


def test_vllm_check_names_the_tier_or_why_it_is_ignored(
    make_tree: TreeMaker,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aostore.vllm import report as _vllm_check

    require_mooncake()
    make_tree("grow", known=True)
    path = write_config(tmp_path / "mooncake.json", {"master_server_address": "127.0.0.1:1"})
    monkeypatch.setenv(ENV, str(path))
    assert _vllm_check.run() == 0
    out = capsys.readouterr().out
    assert "mooncake:    Mooncake tier on" in out and "master 127.0.0.1:1" in out, out
    assert _vllm_check.check()["mooncake"].startswith("Mooncake tier on")
    # The settings table gives the config's master and metadata server, as the start-up line.
    said = _vllm_check.check()["settings"][ENV]
    assert said["set"] == str(path) and said["ignored"] is None
    assert said["effective"].startswith("Mooncake tier on") and "127.0.0.1:1" in said["effective"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv(ENV, str(bad))
    assert _vllm_check.run() == 0  # the local store is still aostore's
    out = capsys.readouterr().out
    assert f"ignored {ENV}='{bad}'" in out and "Mooncake tier off" in out, out
    assert _vllm_check.check()["ignored"][ENV].startswith(f"ignored {ENV}=")
    monkeypatch.delenv(ENV)
    assert _vllm_check.check()["mooncake"] == ""


# -- against a real master -------------------------------------------------------------------


@pytest.mark.mooncake
def test_tier_from_the_setting_is_the_plugins_store_in_front_of_mooncake(
    tree: FakeTree,
    cluster: mooncake_util.Cluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    prefix = f"plugin-{tree.kind}"
    config = cluster.config(key_prefix=f"{prefix}/")
    path = write_config(tmp_path / "mooncake.json", config)
    monkeypatch.setenv(ENV, str(path))
    monkeypatch.setenv(ENV_PREFAULT, "0")
    line = register(caplog)
    message = line.getMessage()
    assert line.levelno == logging.INFO, message
    assert (
        f"Mooncake tier on ({ENV}={path}): master {cluster.master_address}, metadata "
        f"{cluster.metadata_server}, key prefix '{prefix}/'"
    ) in message
    assert tree.modules[STORE].BlockObjectStore is TIER_CLASS[tree.kind]

    # The local tier is built exactly as the plugin builds its store without the setting.
    built: list[tuple[type, dict[str, Any]]] = []
    original = aostore.BlockObjectStore.__new__

    def spy(cls: Any, **kwargs: Any) -> Any:
        built.append((cls, kwargs))
        return original(cls, **kwargs)

    monkeypatch.setattr(aostore.BlockObjectStore, "__new__", spy)
    worker = tree.modules["worker"]
    store = worker.BlockObjectStore(max_bytes=64 * NBYTES, object_nbytes=NBYTES)
    assert isinstance(store, TieredBlockObjectStore)
    assert type(store.local) is LOCAL_CLASS[tree.kind]
    assert store.local.profile == tree.kind
    assert store.num_slots == 64
    assert [cls for cls, _ in built] == [LOCAL_CLASS[tree.kind]]
    assert built[0][1]["prefault"] is False  # AOSTORE_VLLM_PREFAULT=0, as without the tier
    assert isinstance(store.remote, MooncakeBlockObjectStore)
    assert store.remote.master_address == cluster.master_address

    # vLLM's worker drives it behind the background wrapper; closing that closes the tier.
    writer = worker.BackgroundBlockObjectStore(store, max_pending_batches=4)
    count = 40
    keys = [f"{prefix}:{i}" for i in range(count)]
    payloads = [mooncake_util.payload(prefix, i, NBYTES) for i in range(count)]
    objects = [
        tree.modules[STORE].BlockObject(key=k, payload=p)
        for k, p in zip(keys, payloads, strict=True)
    ]
    writer.put(objects[:20], retain_keys=keys[:20])
    writer.put(objects[20:], release_keys=keys[:20])
    assert writer.get_concatenated(keys[:3]) == b"".join(payloads[:3])
    writer.close()
    assert store.closed and store.local.closed and store.remote.closed
    assert store.stats()["published_objects"] == count

    # Another process, with an empty local tier of its own, reads every byte from Mooncake.
    read = run_worker("read", config, prefix, count)
    assert read["equal"] is True
    assert read["remote_hit_objects"] == count


@pytest.mark.mooncake
def test_unreachable_master_is_an_error_naming_the_setting_at_construction(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    require_mooncake()
    address = f"127.0.0.1:{mooncake_util.free_port()}"  # nothing listens there
    path = write_config(
        tmp_path / "mooncake.json", {"master_server_address": address, "connect_timeout_s": 0.5}
    )
    monkeypatch.setenv(ENV, str(path))
    line = register(caplog)
    assert f"master {address}" in line.getMessage()
    locals_built: list[Any] = []
    original = aostore.BlockObjectStore.__new__

    def spy(cls: Any, **kwargs: Any) -> Any:
        store = original(cls, **kwargs)
        locals_built.append(store)
        return store

    monkeypatch.setattr(aostore.BlockObjectStore, "__new__", spy)
    with pytest.raises(MooncakeError) as caught:
        tree.modules["worker"].BlockObjectStore(max_bytes=8 * NBYTES, object_nbytes=NBYTES)
    text = str(caught.value)
    assert f"{ENV}={path}" in text and address in text and "unreachable" in text
    assert len(locals_built) == 1 and locals_built[0].closed  # nothing left open


@pytest.mark.mooncake
def test_objects_too_large_for_the_mooncake_buffer_are_an_error_naming_the_setting(
    tree: FakeTree,
    cluster: mooncake_util.Cluster,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path / "mooncake.json", cluster.config(local_buffer_size="1MB"))
    monkeypatch.setenv(ENV, str(path))
    register(caplog)
    with pytest.raises(MooncakeError, match=f"{ENV}={path}.*raise local_buffer_size"):
        tree.modules["worker"].BlockObjectStore(max_bytes=4 << 20, object_nbytes=1 << 20)


# -- the publisher and the GIL ------------------------------------------------------------------


def _counter_speed(work: Any) -> float:
    """How fast a pure-Python counting thread (the engine thread's stand-in) runs while the
    main thread does ``work``, relative to its speed just before, alone."""
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
        time.sleep(0.3)
        alone = (progress[0] - c0) / (time.perf_counter() - t0)
        c0, t0 = progress[0], time.perf_counter()
        work()
        during = (progress[0] - c0) / (time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
    return during / alone


def _gil_holder(seconds: float) -> Any:
    """A call that runs C code never releasing the GIL (``sum`` over a ``range``) for about
    ``seconds``: what a Mooncake binding that kept the GIL would do to other threads."""
    n, took = 1 << 16, 0.0
    while took < 0.05:
        n *= 2
        begin = time.perf_counter()
        sum(range(n))
        took = time.perf_counter() - begin
    count = int(n * seconds / took)
    return lambda keys, values: sum(range(count))


# The counting thread's speed while the tier publishes: measured at 0.4-0.75 on a 2-core VM
# (the rest is CPU taken by Mooncake's own threads and servers, as when the same put_batch
# loop runs in another process), and about 0 when the publisher holds the GIL. The threshold
# sits far from both.
MIN_COUNTER_SPEED = 0.1


@pytest.mark.mooncake
def test_publishing_leaves_the_engine_thread_running(
    cluster: mooncake_util.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier the plugin builds, publishing 512 objects of 5,888 B to a real master: a
    Python thread keeps running meanwhile. The same test with a publisher that holds the GIL
    for its work (the control) finds the thread stopped, so the measure can tell."""
    config = cluster.config(key_prefix="gil/")
    stores.bind(  # undone by the autouse fixture
        prefault=stores.bound()[0],
        tier=MooncakeTier("(test)", MooncakeConfig.from_dict(config)),
    )
    count = 512
    payloads = [mooncake_util.payload("gil", i, NBYTES) for i in range(count)]

    def publish_through(tier: Any, name: str) -> float:
        objects = [aostore.BlockObject(f"{name}:{i}", payloads[i]) for i in range(count)]

        def work() -> None:
            tier.put(objects)
            tier.flush()

        return _counter_speed(work)

    tier = vllm_plugin.TieredGrowBlockObjectStore(
        max_bytes=2 * count * NBYTES, object_nbytes=NBYTES
    )
    try:
        speed = publish_through(tier, "real")
        assert tier.stats()["published_objects"] == count
        # The control: the same tier, its Mooncake calls replaced by GIL-holding work.
        monkeypatch.setattr(tier.remote, "publish", _gil_holder(1.0))
        control = publish_through(tier, "control")
    finally:
        tier.close()
    print(f"counter speed while publishing: {speed:.2f}; with the GIL held: {control:.2f}")
    assert control < MIN_COUNTER_SPEED, f"the control should stop the counter: {control:.2f}"
    assert speed > MIN_COUNTER_SPEED, (
        f"a Python thread ran at {speed:.2f} of its speed while the tier published "
        f"(control, GIL held: {control:.2f}): the publisher holds the GIL while Mooncake works"
    )
