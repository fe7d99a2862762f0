"""The vLLM plugin (SPEC section 7), against a throwaway ``vllm`` module tree and a real vLLM.

The fake tree mimics what matters in vLLM: a store module defining the four names, and worker,
routed-experts and connector modules that imported them before the plugin ran. The real-vLLM
test runs in a subprocess (vLLM imports torch; the swap must not leak into this process) and
skips when ``vllm`` is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

aostore = pytest.importorskip("aostore")
vllm_plugin = pytest.importorskip("aostore.vllm_plugin")

STORE = "vllm.distributed.aux_output_connector.store"
PACKAGE = "vllm.distributed.aux_output_connector"
NAMES = ("BlockObjectStore", "BlockObject", "BlockObjectStoreError", "BackgroundBlockObjectStore")


def _ours(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.") or name == "vllm_user_outside"


@dataclasses.dataclass
class FakeTree:
    kind: str
    originals: dict[str, Any]
    modules: dict[str, types.ModuleType]


def build_tree(kind: str) -> FakeTree:
    """Installs a fake vLLM whose store grows (``grow``), fails closed, or cannot be probed."""

    @dataclasses.dataclass(frozen=True)
    class BlockObject:
        key: str
        payload: bytes

    class BlockObjectStoreError(RuntimeError):
        pass

    class BackgroundBlockObjectStore:
        pass

    store_logger = logging.getLogger(STORE)

    class BlockObjectStore:
        def __init__(self, *, max_bytes: int, object_nbytes: int) -> None:
            if kind == "broken":
                raise TypeError("this store needs arguments the probe does not know")
            self.num_slots = max_bytes // object_nbytes

        def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
            stored = len(list(objects))
            if stored > self.num_slots:
                if kind == "fail-closed":
                    raise BlockObjectStoreError("cannot retain the requested batch")
                store_logger.warning("fake vLLM store grows")
                self.num_slots = max(stored, 2 * self.num_slots)

        def close(self) -> None:
            pass

    originals = {
        "BlockObjectStore": BlockObjectStore,
        "BlockObject": BlockObject,
        "BlockObjectStoreError": BlockObjectStoreError,
        "BackgroundBlockObjectStore": BackgroundBlockObjectStore,
    }

    def module(name: str, package: bool = False, **names: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        if package:
            mod.__path__ = []
        mod.__dict__.update(names)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, mod)
        return mod

    class Unrelated:
        pass

    modules = {
        "vllm": module("vllm", package=True),
        "vllm.distributed": module("vllm.distributed", package=True),
        PACKAGE: module(PACKAGE, package=True),
        STORE: module(STORE, **originals),
        "worker": module(
            f"{PACKAGE}.worker",
            BlockObjectStore=BlockObjectStore,
            BackgroundBlockObjectStore=BackgroundBlockObjectStore,
            OTHER=42,
        ),
        "routed": module(
            f"{PACKAGE}.routed_experts",
            BlockObject=BlockObject,
            BlockObjectStore=BlockObjectStore,
            BackgroundBlockObjectStore=BackgroundBlockObjectStore,
        ),
        "connector": module(f"{PACKAGE}.connector", BlockObjectStoreError=BlockObjectStoreError),
        # Same name, different object: must be left alone.
        "unrelated": module("vllm.unrelated", BlockObjectStore=Unrelated),
        # Holds the original but is not part of vLLM: out of the plugin's reach.
        "outside": module("vllm_user_outside", BlockObjectStore=BlockObjectStore),
    }
    sys.modules["vllm.placeholder"] = None  # type: ignore[assignment]  # as after a failed import
    return FakeTree(kind, originals, modules)


@pytest.fixture
def clean_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Removes any ``vllm`` modules for the test and puts them back afterwards."""
    monkeypatch.delenv(vllm_plugin.ENV_DISABLE, raising=False)
    monkeypatch.delenv(vllm_plugin.ENV_PROFILE, raising=False)
    saved = {name: mod for name, mod in sys.modules.items() if _ours(name)}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if _ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(params=["grow", "fail-closed"])
def tree(request: pytest.FixtureRequest, clean_vllm: None) -> FakeTree:
    return build_tree(request.param)


def plugin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aostore" and r.levelno >= logging.INFO]


def test_swaps_the_names_in_every_vllm_module(tree: FakeTree) -> None:
    vllm_plugin.register()
    mods, originals = tree.modules, tree.originals
    store_module = mods[STORE]
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert store_module.BlockObject is aostore.BlockObject
    assert store_module.BlockObjectStoreError is aostore.BlockObjectStoreError
    assert store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore
    for name in ("worker", "routed", "connector"):
        for attr in NAMES:
            if attr in vars(mods[name]):
                assert getattr(mods[name], attr) is getattr(store_module, attr), (name, attr)
    assert mods["worker"].OTHER == 42
    assert mods["unrelated"].BlockObjectStore is not store_module.BlockObjectStore
    assert mods["unrelated"].BlockObjectStore.__name__ == "Unrelated"
    assert mods["outside"].BlockObjectStore is originals["BlockObjectStore"]
    # A module importing the names afterwards gets aostore's as well.
    from vllm.distributed.aux_output_connector.store import BlockObject  # type: ignore[import-not-found]

    assert BlockObject is aostore.BlockObject


def test_profile_matches_the_installed_vllm(tree: FakeTree) -> None:
    vllm_plugin.register()
    kind = tree.kind
    for module in (tree.modules[STORE], tree.modules["worker"]):
        store = module.BlockObjectStore(max_bytes=64, object_nbytes=8)
        assert store.profile == kind
        assert isinstance(store, aostore.BlockObjectStore)
        assert store.num_slots == 8
        store.close()
    # An explicit profile still wins, as with aostore's own class.
    other = "fail-closed" if kind == "grow" else "grow"
    store = tree.modules[STORE].BlockObjectStore(max_bytes=64, object_nbytes=8, profile=other)
    assert store.profile == other
    store.close()


def test_swapped_classes_work_together(tree: FakeTree) -> None:
    vllm_plugin.register()
    mod = tree.modules["routed"]
    writer = mod.BackgroundBlockObjectStore(
        mod.BlockObjectStore(max_bytes=16, object_nbytes=4), max_pending_batches=2
    )
    writer.put([mod.BlockObject(key="a", payload=b"aaaa")], retain_keys=["a"])
    assert writer.get_concatenated(["a"]) == b"aaaa"
    with pytest.raises(tree.modules["connector"].BlockObjectStoreError):
        writer.get_concatenated(["missing"])
    writer.close()


def test_idempotent_and_logs_once(tree: FakeTree, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="aostore"):
        vllm_plugin.register()
        swapped = tree.modules[STORE].BlockObjectStore
        # Something puts an original back: a second call must not touch anything.
        tree.modules["worker"].BlockObjectStore = tree.originals["BlockObjectStore"]
        vllm_plugin.register()
        vllm_plugin.register()
    assert tree.modules[STORE].BlockObjectStore is swapped
    assert tree.modules["worker"].BlockObjectStore is tree.originals["BlockObjectStore"]
    records = plugin_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert tree.kind in message
    assert f"{PACKAGE}.worker" in message
    assert f"{PACKAGE}.routed_experts" in message


def test_probe_of_vllms_store_is_quiet(tree: FakeTree, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        vllm_plugin.register()
    assert [r for r in caplog.records if r.name == STORE] == []
    # The filter that muted it is gone again.
    logging.getLogger(STORE).warning("after")
    assert [r.getMessage() for r in caplog.records if r.name == STORE] == ["after"]


@pytest.mark.parametrize("value", ["0", "false", "off", "no", " 0 ", "OFF"])
def test_environment_variable_turns_it_off(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv("AOSTORE_VLLM_PLUGIN", value)
    with caplog.at_level(logging.INFO, logger="aostore"):
        vllm_plugin.register()
    for name, original in tree.originals.items():
        assert getattr(tree.modules[STORE], name) is original
    assert tree.modules["worker"].BlockObjectStore is tree.originals["BlockObjectStore"]
    assert plugin_records(caplog) == []
    # It is read on every call: enabled again, the plugin works.
    monkeypatch.setenv("AOSTORE_VLLM_PLUGIN", "1")
    vllm_plugin.register()
    assert tree.modules["worker"].BlockObjectStore is not tree.originals["BlockObjectStore"]


@pytest.mark.parametrize("forced", ["grow", "fail-closed"])
def test_profile_can_be_forced(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, forced: str
) -> None:
    monkeypatch.setenv("AOSTORE_VLLM_PROFILE", forced)
    vllm_plugin.register()
    store = tree.modules[STORE].BlockObjectStore(max_bytes=8, object_nbytes=4)
    assert store.profile == forced
    store.close()


def test_bad_forced_profile_is_refused(tree: FakeTree, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AOSTORE_VLLM_PROFILE", "bigger")
    with pytest.raises(ValueError, match="AOSTORE_VLLM_PROFILE"):
        vllm_plugin.register()
    assert tree.modules[STORE].BlockObjectStore is tree.originals["BlockObjectStore"]


def test_probe_that_cannot_tell_falls_back_to_fail_closed(
    clean_vllm: None, caplog: pytest.LogCaptureFixture
) -> None:
    fake = build_tree("broken")
    with caplog.at_level(logging.INFO, logger="aostore"):
        vllm_plugin.register()
    store = fake.modules[STORE].BlockObjectStore(max_bytes=8, object_nbytes=4)
    assert store.profile == "fail-closed"
    store.close()
    assert any(r.levelno == logging.WARNING for r in plugin_records(caplog))


def test_store_module_missing_a_name_is_left_alone(
    tree: FakeTree, caplog: pytest.LogCaptureFixture
) -> None:
    del tree.modules[STORE].BackgroundBlockObjectStore
    with caplog.at_level(logging.INFO, logger="aostore"):
        vllm_plugin.register()
        vllm_plugin.register()
    assert tree.modules[STORE].BlockObjectStore is tree.originals["BlockObjectStore"]
    assert tree.modules["worker"].BlockObjectStore is tree.originals["BlockObjectStore"]
    records = plugin_records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "BackgroundBlockObjectStore" in records[0].getMessage()


def test_vllm_without_the_store_module_is_left_alone(clean_vllm: None) -> None:
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    sys.modules["vllm"] = vllm
    vllm_plugin.register()  # no exception, nothing to do
    assert STORE not in sys.modules


def test_entry_point_is_declared() -> None:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.exists():
        table = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
        assert table["vllm.general_plugins"] == {"aostore": "aostore.vllm_plugin:register"}
    try:
        distribution = importlib.metadata.distribution("aostore")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("aostore is not installed; pyproject.toml checked only")
    points = [ep for ep in distribution.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in points] == [("aostore", "aostore.vllm_plugin:register")]
    assert points[0].load() is vllm_plugin.register


REAL_VLLM_SCRIPT = textwrap.dedent(
    """
    import importlib, json, logging, sys
    logging.basicConfig(level=logging.INFO)
    order = sys.argv[1]
    parts = ["worker", "routed_experts"]
    base = "vllm.distributed.aux_output_connector."
    imported = {}
    if order == "modules-first":
        for part in parts:
            try:
                imported[part] = importlib.import_module(base + part)
            except Exception as error:  # e.g. a CPU-only machine
                imported[part] = repr(error)
    import vllm, vllm.plugins
    vllm.plugins.load_general_plugins()
    import aostore
    store_module = importlib.import_module(base + "store")
    if order == "plugin-first":
        for part in parts:
            try:
                imported[part] = importlib.import_module(base + part)
            except Exception as error:
                imported[part] = repr(error)
    originals = getattr(store_module, "__aostore_originals__", {})
    grows = None
    if originals:
        probe = originals["BlockObjectStore"](max_bytes=1, object_nbytes=1)
        try:
            probe.put([originals["BlockObject"](k, b"0") for k in "ab"], retain_keys=["a", "b"])
            grows = probe.num_slots >= 2
        except originals["BlockObjectStoreError"]:
            grows = False
    store = store_module.BlockObjectStore(max_bytes=64, object_nbytes=8)
    roundtrip = None
    routed = imported.get("routed_experts")
    if not isinstance(routed, str):
        # vLLM's own publish and materialize code, through the swapped names.
        import numpy as np
        block, per_token = 4, (3, 2)
        writer = routed.BackgroundBlockObjectStore(
            routed.BlockObjectStore(max_bytes=2 * block * 6 * 2, object_nbytes=block * 6 * 2),
            max_pending_batches=2,
        )
        keys = routed.routed_experts_keys([bytes([1]) * 8, bytes([2]) * 8], "aostore-test")
        data = np.arange(2 * block * 6, dtype=np.int16).reshape(2 * block, *per_token)
        routed.publish_routed_experts(
            writer,
            batches=[(keys, [(0, data[:block]), (block, data[block:])])],
            block_size=block,
            retain_keys=keys,
        )
        out = routed.materialize_routed_experts(
            writer, keys, shape_per_token=per_token, dtype=np.dtype(np.int16)
        )
        roundtrip = bool(np.array_equal(out, data))
        writer.close()
    modules = {}
    for part, module in imported.items():
        if isinstance(module, str):
            modules[part] = module
            continue
        modules[part] = {
            name: getattr(module, name) is getattr(store_module, name)
            for name in ("BlockObjectStore", "BlockObject", "BackgroundBlockObjectStore")
            if name in vars(module)
        }
    print(json.dumps({
        "vllm": vllm.__version__,
        "marked": bool(originals),
        "store_is_aostore": issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore),
        "object_is_aostore": store_module.BlockObject is aostore.BlockObject,
        "error_is_aostore": store_module.BlockObjectStoreError is aostore.BlockObjectStoreError,
        "background_is_aostore":
            store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore,
        "profile": store.profile,
        "vllm_store_grows": grows,
        "vllm_roundtrip": roundtrip,
        "modules": modules,
    }))
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (install vllm==0.33.0 beside aostore to run this)",
)
@pytest.mark.parametrize("order", ["modules-first", "plugin-first"])
def test_real_vllm_loads_the_plugin(order: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AOSTORE_", "VLLM_PLUGINS"))}
    done = subprocess.run(
        [sys.executable, "-c", REAL_VLLM_SCRIPT, order],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    assert result["marked"], "vllm.plugins.load_general_plugins() did not run aostore's plugin"
    assert result["store_is_aostore"]
    assert result["object_is_aostore"]
    assert result["error_is_aostore"]
    assert result["background_is_aostore"]
    assert result["profile"] == ("grow" if result["vllm_store_grows"] else "fail-closed")
    if result["vllm"].startswith("0.33."):
        assert result["profile"] == "grow"
    assert result["vllm_roundtrip"] in (True, None)
    for part, names in result["modules"].items():
        if isinstance(names, str):
            pytest.skip(f"vllm's {part} module does not import here: {names}")
        assert names and all(names.values()), (part, names)
    assert "aostore vLLM plugin: replaced" in done.stderr
