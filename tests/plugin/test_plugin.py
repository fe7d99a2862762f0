"""The vLLM plugin (docs/vllm-plugin.md), against throwaway ``vllm`` trees and a real vLLM.

Each fake tree is written to disk and imported like the real package, so the plugin sees real
modules, source files and classes. Layouts:

- ``fail-closed`` (vLLM 0.32) and ``grow`` (vLLM 0.33): ``store.py`` defines the four names and
  the worker, routed-experts and connector modules import them before the plugin runs;
- ``variable``: a branch whose ``store.py`` also defines ``VariableBlockObjectStore`` and whose
  background wrapper has ``get_optional`` and ``flush``;
- ``shm``: vLLM's Mooncake branch (vllm#57968): the fixed store lives in ``shm.py``
  (``ShmBlockObjectStore``, fail-closed, one LRU for every key), ``store.py`` keeps
  ``BlockObject``, ``BlockObjectStoreError`` and a wrapper with ``flush()``, ``mooncake.py``
  defines ``MooncakeBlockObjectStore`` and ``MooncakeOutputPublisher``, and the worker builds
  either store behind the wrapper and calls it through ``routed_experts.py``, as the branch's
  does (``shm_grows`` makes its fixed store grow instead);
- ``broken``: a store that the profile probe cannot construct.

The real-vLLM test runs in a subprocess (vLLM imports torch; the swap must not leak into this
process) and skips when ``vllm`` is not installed (``make test-vllm`` runs it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

aostore = pytest.importorskip("aostore")
vllm_plugin = pytest.importorskip("aostore.vllm_plugin")
from aostore import _log  # noqa: E402
from aostore.vllm import install as vllm_install  # noqa: E402
from aostore.vllm import plan as vllm_plan  # noqa: E402
from aostore.vllm import settings as vllm_settings  # noqa: E402
from aostore.vllm import stores as vllm_stores  # noqa: E402
from aostore.vllm.compat import compare as compat_compare  # noqa: E402
from aostore.vllm.compat import fingerprint as compat_fingerprint  # noqa: E402
from aostore.vllm.compat import references as compat_references  # noqa: E402
from aostore.vllm.compat import surface as compat_surface  # noqa: E402
from vllm_trees import (  # noqa: E402
    NAMES,
    PACKAGE,
    STORE,
    FakeTree,
    TreeMaker,
    make_tree,
    plugin_records,
    tree,
)

__all__ = ["make_tree", "tree"]  # the fixtures, used by name


def test_swaps_the_names_in_every_vllm_module(tree: FakeTree) -> None:
    vllm_plugin.register()
    mods, originals = tree.modules, tree.originals
    store_module = mods[STORE]
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert store_module.BlockObject is aostore.BlockObject
    assert store_module.BlockObjectStoreError is aostore.BlockObjectStoreError
    assert store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore
    for name in ("worker", "routed_experts", "connector"):
        for attr in NAMES:
            if attr in vars(mods[name]):
                assert getattr(mods[name], attr) is getattr(store_module, attr), (name, attr)
    assert mods["worker"].OTHER == 42
    assert mods["unrelated"].BlockObjectStore is not store_module.BlockObjectStore
    assert mods["unrelated"].BlockObjectStore.__module__ == "vllm.unrelated"
    assert mods["outside"].BlockObject is originals["BlockObject"]
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
    mod = tree.modules["routed_experts"]
    writer = mod.BackgroundBlockObjectStore(
        mod.BlockObjectStore(max_bytes=16, object_nbytes=4), max_pending_batches=2
    )
    writer.put([mod.BlockObject(key="a", payload=b"aaaa")], retain_keys=["a"])
    assert writer.get_concatenated(["a"]) == b"aaaa"
    with pytest.raises(tree.modules["connector"].BlockObjectStoreError):
        writer.get_concatenated(["missing"])
    writer.close()


def test_idempotent_and_logs_once(tree: FakeTree, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
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
    assert records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert f"profile '{tree.kind}'" in message
    for name in NAMES:
        assert name in message
    assert f"{PACKAGE}.worker" in message
    assert f"{PACKAGE}.routed_experts" in message
    assert "kept" not in message


def test_start_up_line_shows_on_vllms_default_handler(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM's default logging: one handler on the "vllm" logger, level INFO, no propagation.
    vllm_logger = logging.getLogger("vllm")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("VLLM-HANDLER %(levelname)s %(message)s"))
    saved = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate
    vllm_logger.handlers[:] = [handler]
    vllm_logger.setLevel(logging.INFO)
    vllm_logger.propagate = False
    try:
        vllm_plugin.register()
    finally:
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved
    lines = [line for line in capsys.readouterr().out.splitlines() if "aostore" in line]
    assert len(lines) == 1
    assert lines[0].startswith("VLLM-HANDLER INFO aostore vLLM plugin: replaced ")


def test_start_up_line_is_a_warning_where_nothing_shows_info(
    tree: FakeTree, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in vLLM's front end, which loads plugins before it configures logging.
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.handlers[:], vllm_logger.propagate
    vllm_logger.handlers[:] = []
    vllm_logger.propagate = False
    try:
        vllm_plugin.register()
    finally:
        vllm_logger.handlers[:], vllm_logger.propagate = saved
    # Python's last-resort handler prints WARNING records to standard error.
    lines = [line for line in capsys.readouterr().err.splitlines() if "aostore" in line]
    assert len(lines) == 1
    assert lines[0].startswith("aostore vLLM plugin: replaced ")


def test_probe_of_vllms_store_is_quiet(tree: FakeTree, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        vllm_plugin.register()
    assert [r for r in caplog.records if r.name == STORE] == []
    # The filter that muted it is gone again.
    logging.getLogger(STORE).warning("after")
    assert [r.getMessage() for r in caplog.records if r.name == STORE] == ["after"]


def test_r3_by_reference_refused_is_a_warning(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 47: a refused R3 setting was said at INFO at the end of a long line; the docs
    promise a WARNING for any setting ignored."""
    monkeypatch.setenv("AOSTORE_VLLM_R3_DELIVERY", "reference")
    monkeypatch.setenv("AOSTORE_VLLM_R3_TTL", "-5")
    with caplog.at_level(logging.DEBUG):
        vllm_plugin.register()
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert "AOSTORE_VLLM_R3_TTL='-5' is not a positive" in record.getMessage()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AOSTORE_VLLM_PLUGIN", "maybe"),
        ("AOSTORE_VLLM_DATA_PLANE", "nah"),
        ("AOSTORE_VLLM_TRANSPORT", "2"),
        ("AOSTORE_VLLM_PREFAULT", "eager"),
    ],
)
def test_an_ignored_switch_is_a_warning_and_keeps_the_default(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    value: str,
) -> None:
    """Issue 47: a switch set to neither on nor off was read as on without a word."""
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.DEBUG):
        vllm_plugin.register()
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert f"{name}: ignored {value!r}" in record.getMessage()
    # The rest of the plugin went in as without the setting.
    assert tree.modules[STORE].BlockObjectStore is not tree.originals["BlockObjectStore"]


@pytest.mark.parametrize("value", ["0", "false", "off", "no", " 0 ", "OFF"])
def test_environment_variable_turns_it_off(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    monkeypatch.setenv("AOSTORE_VLLM_PLUGIN", value)
    with caplog.at_level(logging.INFO):
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


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("GROW", "grow"),
        ("Grow", "grow"),
        (" grow ", "grow"),
        ("fail_closed", "fail-closed"),
        ("FAIL_CLOSED", "fail-closed"),
        ("Fail-Closed", "fail-closed"),
    ],
)
def test_forced_profile_is_read_in_any_case_with_underscores(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str,
    expected: str,
) -> None:
    # Issue 16, item 5: these made register() raise ValueError, which stops vLLM at start-up.
    monkeypatch.setenv("AOSTORE_VLLM_PROFILE", value)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store = tree.modules[STORE].BlockObjectStore(max_bytes=8, object_nbytes=4)
    assert store.profile == expected
    store.close()
    (record,) = plugin_records(caplog)
    assert f"profile '{expected}' (AOSTORE_VLLM_PROFILE={value.strip()})" in record.getMessage()


@pytest.mark.parametrize("value", ["bigger", "grow!", "1", "fail closed", "\u00e9"])
def test_unknown_forced_profile_is_ignored_with_a_warning(
    tree: FakeTree,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str,
) -> None:
    monkeypatch.setenv("AOSTORE_VLLM_PROFILE", value)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()  # never raises into vLLM's load_general_plugins()
    # The probe decides, as if the variable were not set.
    store = tree.modules[STORE].BlockObjectStore(max_bytes=8, object_nbytes=4)
    assert store.profile == tree.kind
    store.close()
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert f"ignored AOSTORE_VLLM_PROFILE={value!r}" in record.getMessage()


def _assert_untouched(tree: FakeTree) -> None:
    for module in tree.modules.values():
        for name, original in tree.originals.items():
            if name in vars(module) and module.__name__.startswith("vllm."):
                current = vars(module)[name]
                if current is not original:
                    assert current.__module__ == "vllm.unrelated", (module.__name__, name)
    assert not hasattr(tree.modules[STORE], "__aostore_originals__")


def _one_failure_warning(caplog: pytest.LogCaptureFixture, what: str) -> None:
    records = plugin_records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert message.startswith("aostore vLLM plugin: replaced nothing, vLLM's classes kept: ")
    assert what in message


def test_failure_while_planning_keeps_vllms_classes(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(module: Any, settings: Any) -> Any:
        raise RuntimeError("injected in plan()")

    monkeypatch.setattr(vllm_plan, "plan", broken)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()  # no exception
    _assert_untouched(tree)
    _one_failure_warning(caplog, "RuntimeError: injected in plan()")
    # Not marked: once the fault is gone, a later call works.
    monkeypatch.undo()
    monkeypatch.delenv(vllm_settings.ENV_PROFILE, raising=False)
    vllm_plugin.register()
    assert issubclass(tree.modules["worker"].BlockObjectStore, aostore.BlockObjectStore)


def test_failure_half_way_through_the_swap_is_undone(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = vllm_install.patch_namespace
    calls: list[bool] = []

    def flaky(namespace: dict[str, Any], swaps: Any, undo: Any) -> bool:
        hit = real(namespace, swaps, undo)
        calls.append(hit)
        if sum(calls) == 2:  # two modules already patched
            raise KeyError("injected in the swap")
        return hit

    monkeypatch.setattr(vllm_install, "patch_namespace", flaky)
    targets = _log.growth_targets()
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    assert sum(calls) == 2
    _assert_untouched(tree)
    assert _log.growth_targets() == targets
    _one_failure_warning(caplog, "KeyError: 'injected in the swap'")


def test_failure_after_the_swap_is_undone(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(target: Any) -> None:
        raise TypeError("injected after the swap")

    monkeypatch.setattr(_log, "add_growth_target", broken)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _assert_untouched(tree)
    _one_failure_warning(caplog, "TypeError: injected after the swap")


def test_failure_with_an_unprintable_exception_still_says_why(
    tree: FakeTree, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    def broken(module: Any, settings: Any) -> Any:
        raise Unprintable

    monkeypatch.setattr(vllm_plan, "plan", broken)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _assert_untouched(tree)
    _one_failure_warning(caplog, "Unprintable")


def test_probe_that_cannot_tell_falls_back_to_fail_closed(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_tree("broken", known=True)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store = fake.modules[STORE].BlockObjectStore(max_bytes=8, object_nbytes=4)
    assert store.profile == "fail-closed"
    store.close()
    assert any(r.levelno == logging.WARNING for r in plugin_records(caplog))


def test_store_the_differential_cannot_build_stays_vllms(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # On a vLLM checked class by class, a store the differential cannot run is not proven.
    fake = make_tree("broken")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()  # never raises
    assert fake.modules[STORE].BlockObjectStore is fake.originals["BlockObjectStore"]
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert (
        "kept vLLM's BlockObjectStore: behaviour not proven: the scripted differential could "
        "not run (cannot build vLLM's BlockObjectStore(max_bytes=16, object_nbytes=4): "
        "TypeError: this store needs arguments the probe does not know)"
    ) in record.getMessage()


def test_vllm_without_the_store_module_is_left_alone(make_tree: TreeMaker) -> None:
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    sys.modules["vllm"] = vllm
    vllm_plugin.register()  # no exception, nothing to do
    assert STORE not in sys.modules


# -- The surface check (docs/vllm-plugin.md) -------------------------------------------------------


def test_surface_reads_methods_instance_attributes_fields_and_keywords(
    make_tree: TreeMaker,
) -> None:
    store_module = make_tree("variable").modules[STORE]
    store = compat_surface.surface(store_module.BlockObjectStore)
    assert {"put", "get_concatenated", "close", "num_slots", "object_nbytes"} <= store
    assert {"max_bytes=", "object_nbytes="} <= store
    assert not any(name.startswith("_") for name in store)
    assert {"key", "payload", "key=", "payload="} <= compat_surface.surface(
        store_module.BlockObject
    )
    wrapper = compat_surface.surface(store_module.BackgroundBlockObjectStore)
    assert {"get_optional", "flush", "store=", "max_pending_batches="} <= wrapper
    assert "max_bytes" in compat_surface.surface(store_module.VariableBlockObjectStore)


def test_aostore_side_is_read_from_aostores_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    table = vllm_plan.aostore_classes(["VariableBlockObjectStore", "Nonexistent"])
    assert table["BlockObjectStore"] is aostore.BlockObjectStore
    assert table["BackgroundBlockObjectStore"] is aostore.BackgroundBlockObjectStore
    assert "Nonexistent" not in table
    assert ("VariableBlockObjectStore" in table) == hasattr(aostore, "VariableBlockObjectStore")
    ours = compat_surface.surface(aostore.BlockObjectStore)
    assert {"put", "get_concatenated", "close", "num_slots", "object_nbytes"} <= ours
    assert {"max_bytes=", "object_nbytes=", "policy=", "profile="} <= ours
    # The fixed store of either profile offers the same surface.
    assert compat_surface.surface(vllm_plugin.GrowBlockObjectStore) == ours
    assert {"key", "payload", "key=", "payload="} <= compat_surface.surface(aostore.BlockObject)


@pytest.mark.parametrize("kind", ["fail-closed", "grow"])
def test_released_vllm_is_covered_in_full(make_tree: TreeMaker, kind: str) -> None:
    decision = vllm_plan.plan(make_tree(kind, known=True).modules[STORE])
    assert decision.release == f"fake vLLM ({kind})"
    assert sorted(decision.replace) == sorted(NAMES)
    assert decision.keep == {}
    assert decision.note == ""


@pytest.mark.parametrize("kind", ["fail-closed", "grow"])
def test_unknown_vllm_that_aostore_covers_gets_all_but_block_object(
    make_tree: TreeMaker, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The same layouts, not recognized: the class-by-class check passes for the stores, the
    # wrapper and the error class (same signatures, kinds and bases as aostore's), and vLLM's
    # BlockObject stays, which aostore's stores take as it is.
    fake = make_tree(kind)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module, originals = fake.modules[STORE], fake.originals
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore
    assert store_module.BlockObjectStoreError is aostore.BlockObjectStoreError
    assert store_module.BlockObject is originals["BlockObject"]
    mod = fake.modules["routed_experts"]
    writer = mod.BackgroundBlockObjectStore(
        mod.BlockObjectStore(max_bytes=16, object_nbytes=4), max_pending_batches=2
    )
    writer.put([mod.BlockObject(key="a", payload=b"aaaa")], retain_keys=["a"])
    assert writer.get_concatenated(["a"]) == b"aaaa"
    with pytest.raises(fake.modules["connector"].BlockObjectStoreError):
        writer.get_concatenated(["missing"])
    writer.close()
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "is not a release CI proves: checked class by class" in message
    assert message.count("kept vLLM's") == 1
    assert "kept vLLM's BlockObject: not replaced on a vLLM that CI does not prove" in message


def _variable_stand_in() -> type:
    class VariableBlockObjectStore:
        """A stand-in for aostore's variable-size store, with the branch's surface."""

        def __init__(self, *, max_bytes: int) -> None:
            self.max_bytes = max_bytes

        def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
            pass

        def get_concatenated(self, keys: Any) -> bytes:
            return b""

        def get_optional(self, key: str) -> bytes | None:
            return None

        def close(self) -> None:
            pass

    return VariableBlockObjectStore


class _LeanWrapper:
    """A stand-in for an aostore wrapper with vLLM 0.33's surface only (no get_optional/flush)."""

    def __init__(self, store: Any, *, max_pending_batches: int) -> None:
        self._store = store

    def put(self, objects: Any, *, retain_keys: Any = (), release_keys: Any = ()) -> None:
        pass

    def get_concatenated(self, keys: Any) -> bytes:
        return b""

    def close(self) -> None:
        pass


def test_branch_with_a_variable_store_aostore_lacks(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(aostore, "VariableBlockObjectStore", raising=False)
    monkeypatch.setattr(aostore, "BackgroundBlockObjectStore", _LeanWrapper)
    fake = make_tree("variable")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module, originals = fake.modules[STORE], fake.originals
    # The fixed store and the error class are aostore's (a branch is not a release CI proves:
    # vLLM's BlockObject stays) ...
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert fake.modules["worker"].BlockObjectStore is store_module.BlockObjectStore
    assert store_module.BlockObject is originals["BlockObject"]
    assert store_module.BlockObjectStoreError is aostore.BlockObjectStoreError
    # ... the variable store stays vLLM's, and so does the wrapper (this aostore's has no
    # get_optional/flush, and it would wrap vLLM's variable store).
    for name in ("VariableBlockObjectStore", "BackgroundBlockObjectStore"):
        assert getattr(store_module, name) is originals[name]
        assert getattr(fake.modules["worker"], name) is originals[name]
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "kept vLLM's VariableBlockObjectStore: aostore has no VariableBlockObjectStore" in (
        message
    )
    assert "kept vLLM's BackgroundBlockObjectStore: aostore's BackgroundBlockObjectStore lacks" in (
        message
    )
    assert "lacks flush, get_optional" in message
    assert "profile 'grow'" in message


def test_branch_with_a_variable_store_aostore_has(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stand_in = _variable_stand_in()
    monkeypatch.setattr(aostore, "VariableBlockObjectStore", stand_in, raising=False)
    monkeypatch.setattr(aostore, "BackgroundBlockObjectStore", _LeanWrapper)
    fake = make_tree("variable")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module = fake.modules[STORE]
    assert store_module.VariableBlockObjectStore is stand_in
    assert fake.modules["worker"].VariableBlockObjectStore is stand_in
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    # This wrapper lacks get_optional/flush: vLLM's wraps both of aostore's stores.
    assert store_module.BackgroundBlockObjectStore is fake.originals["BackgroundBlockObjectStore"]
    (record,) = plugin_records(caplog)
    assert "kept vLLM's VariableBlockObjectStore" not in record.getMessage()
    assert "kept vLLM's BackgroundBlockObjectStore" in record.getMessage()


class _FullWrapper(aostore.BackgroundBlockObjectStore):  # type: ignore[misc]
    """A stand-in for an aostore wrapper with the branch's ``get_optional`` and ``flush``."""

    def get_optional(self, key: str) -> bytes | None:
        return None

    def flush(self) -> None:
        pass


def test_wrapper_that_would_wrap_a_vllm_store_stays_vllms(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(aostore, "VariableBlockObjectStore", raising=False)
    monkeypatch.setattr(aostore, "BackgroundBlockObjectStore", _FullWrapper)
    decision = vllm_plan.plan(make_tree("variable").modules[STORE])
    assert decision.keep == {
        "BlockObject": (
            "not replaced on a vLLM that CI does not prove: aostore's stores take vLLM's "
            "(any object with .key and .payload)"
        ),
        "VariableBlockObjectStore": "aostore has no VariableBlockObjectStore",
        "BackgroundBlockObjectStore": "it would wrap vLLM's VariableBlockObjectStore",
    }
    assert sorted(decision.replace) == ["BlockObjectStore", "BlockObjectStoreError"]


def test_branch_covered_in_full_once_aostore_has_both(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Wrapper = _FullWrapper
    monkeypatch.setattr(aostore, "VariableBlockObjectStore", _variable_stand_in(), raising=False)
    monkeypatch.setattr(aostore, "BackgroundBlockObjectStore", Wrapper)
    fake = make_tree("variable")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    assert fake.modules["worker"].BackgroundBlockObjectStore is Wrapper
    (record,) = plugin_records(caplog)
    # A branch is not a release CI proves: only vLLM's BlockObject stays.
    assert record.getMessage().count("kept") == 1
    assert "kept vLLM's BlockObject:" in record.getMessage()


def test_branch_recognized_as_a_release_is_covered_in_full(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Wrapper = _FullWrapper
    monkeypatch.setattr(aostore, "VariableBlockObjectStore", _variable_stand_in(), raising=False)
    monkeypatch.setattr(aostore, "BackgroundBlockObjectStore", Wrapper)
    fake = make_tree("variable", known=True)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    assert fake.modules["worker"].BackgroundBlockObjectStore is Wrapper
    assert fake.modules[STORE].BlockObject is aostore.BlockObject
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.INFO
    assert "kept" not in record.getMessage()


def test_stand_in_missing_a_method_is_not_used(
    make_tree: TreeMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    partial = _variable_stand_in()
    del partial.get_optional  # type: ignore[attr-defined]
    monkeypatch.setattr(aostore, "VariableBlockObjectStore", partial, raising=False)
    fake = make_tree("variable")
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep["VariableBlockObjectStore"] == (
        "aostore's VariableBlockObjectStore lacks get_optional"
    )


class _Native:
    """A Mooncake client for the branch's ``MooncakeBlockObjectStore``: a dict, or failing."""

    def __init__(self, result: int = 0) -> None:
        self.objects: dict[str, bytes] = {}
        self.result = result
        self.closed = 0

    def put_batch(self, keys: list[str], values: list[bytes]) -> int:
        if self.result == 0:
            self.objects.update(zip(keys, values, strict=True))
        return self.result

    def batch_get_buffer(self, keys: list[str]) -> list[bytes | None]:
        return [self.objects.get(key) for key in keys]

    def close(self) -> None:
        self.closed += 1


def test_branch_layout_replaces_the_shm_store_and_the_wrapper(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_tree("shm")
    shm, mooncake, worker = (fake.modules[name] for name in ("shm", "mooncake", "worker"))
    vllm_classes = {
        "ShmBlockObjectStore": shm.ShmBlockObjectStore,
        "MooncakeBlockObjectStore": mooncake.MooncakeBlockObjectStore,
        "MooncakeOutputPublisher": mooncake.MooncakeOutputPublisher,
    }
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module = fake.modules[STORE]
    ours = vllm_plugin.EngineShmBlockObjectStore
    assert shm.ShmBlockObjectStore is worker.ShmBlockObjectStore is ours
    assert issubclass(ours, aostore.ShmBlockObjectStore)
    wrapper = aostore.BackgroundBlockObjectStore
    assert store_module.BackgroundBlockObjectStore is worker.BackgroundBlockObjectStore is wrapper
    for module in (store_module, shm, mooncake, fake.modules["connector"]):
        assert module.BlockObjectStoreError is aostore.BlockObjectStoreError
    # vLLM's BlockObject stays (as on every vLLM CI does not prove), and so does Mooncake.
    assert store_module.BlockObject is fake.originals["BlockObject"]
    assert fake.modules["routed_experts"].BlockObject is fake.originals["BlockObject"]
    assert mooncake.MooncakeBlockObjectStore is vllm_classes["MooncakeBlockObjectStore"]
    assert worker.MooncakeBlockObjectStore is vllm_classes["MooncakeBlockObjectStore"]
    assert mooncake.MooncakeOutputPublisher is vllm_classes["MooncakeOutputPublisher"]

    (record,) = plugin_records(caplog)
    message = record.getMessage()
    assert message.startswith(
        "aostore vLLM plugin: replaced BlockObjectStoreError, BackgroundBlockObjectStore, "
        "ShmBlockObjectStore in "
    ), message
    assert f"the fixed store is {PACKAGE}.shm.ShmBlockObjectStore (Mooncake branch layout)" in (
        message
    )
    assert "kept vLLM's MooncakeBlockObjectStore: aostore has no MooncakeBlockObjectStore" in (
        message
    )
    assert "kept vLLM's MooncakeOutputPublisher: aostore has no MooncakeOutputPublisher" in message
    assert record.levelno == logging.WARNING  # some classes stay vLLM's
    assert vllm_install.store_module_logger not in _log.growth_targets()

    # The worker, with the shm backend, as the branch makes its calls: through the wrapper.
    BlockObject = store_module.BlockObject
    connector = worker.AuxOutputWorkerConnector(backend="shm", max_bytes=12, object_nbytes=4)
    store = connector._store.store
    assert isinstance(store, ours) and store.num_slots == 3
    connector.publish(["a", "b"], [b"aaaa", b"bbbb"], retain_keys=["a", "b", "c"])
    connector.publish(["c"], [b"cccc"], release_keys=["c", "b", "a"])
    assert connector.materialize(["a", "b", "c"]) == b"aaaabbbbcccc"
    assert not store._references
    connector.publish(["d"], [b"dddd"])  # released c, b, a (LRU c, b, a), read a, b, c: a goes
    with pytest.raises(aostore.BlockObjectStoreError, match="does not exist") as missing:
        connector.materialize(["b", "a"])
    assert repr(missing.value.__cause__) == "KeyError('a')"
    # A put the store cannot hold is latched; the next read flushes and raises it. As in vLLM,
    # the put checks for a latched error after queueing too, so a writer quick enough to fail
    # first makes the put itself raise (CI saw it): both are right, the next call raises either way.
    try:
        connector.publish(["e", "f", "g", "h"], [b"eeee"] * 4, retain_keys=["e", "f", "g", "h"])
    except aostore.BlockObjectStoreError as error:
        assert "publication failed" in str(error), repr(error)
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as failed:
        connector.materialize(["a"])
    assert "cannot retain the requested batch: limit=3 objects" in str(failed.value.__cause__)
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
        connector.close()
    assert store.closed

    # The Mooncake backend: vLLM's store behind aostore's wrapper, which flushes before reads.
    native = _Native()
    connector = worker.AuxOutputWorkerConnector(
        backend="mooncake", max_bytes=0, object_nbytes=4, native=native
    )
    rows = [bytes([i]) * 4 for i in range(9)]
    connector.publish([f"k{i}" for i in range(9)], rows, retain_keys=["k0"])
    assert connector.materialize(["k8", "k0", "k8"]) == rows[8] + rows[0] + rows[8]
    connector._store.flush()
    connector.close()
    connector.close()
    assert native.closed == 1
    failing = _Native(result=-800)
    connector = worker.AuxOutputWorkerConnector(
        backend="mooncake", max_bytes=0, object_nbytes=4, native=failing
    )
    with contextlib.suppress(aostore.BlockObjectStoreError):
        connector.publish(["a"], [b"aaaa"])
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed") as failed:
        connector._store.flush()
    assert "Mooncake publication failed: -800" in str(failed.value.__cause__)
    with pytest.raises(aostore.BlockObjectStoreError, match="publication failed"):
        connector.close()
    assert failing.closed == 1
    assert BlockObject("x", b"x").key == "x"


def test_branch_layout_dry_run_says_the_same(make_tree: TreeMaker) -> None:
    make_tree("shm")
    report = vllm_plugin.dry_run()
    assert report.replaced == [
        "BlockObjectStoreError",
        "BackgroundBlockObjectStore",
        "ShmBlockObjectStore",
    ]
    assert report.decision is not None
    assert report.decision.replace["ShmBlockObjectStore"] is vllm_plugin.EngineShmBlockObjectStore


def test_branch_layout_without_the_mooncake_client_still_gets_the_shm_store(
    make_tree: TreeMaker,
) -> None:
    # vLLM imports mooncake.py only when that backend is configured; where its client library
    # is missing, the import fails, and the plugin must still plan the rest of the layout.
    fake = make_tree("shm")
    store_module = fake.modules[STORE]
    mooncake = Path(store_module.__file__).parent / "mooncake.py"
    mooncake.write_text("raise ImportError('no Mooncake client here')\n")
    sys.modules.pop(f"{PACKAGE}.mooncake", None)
    decision = vllm_plan.plan(store_module)
    assert "ShmBlockObjectStore" in decision.replace
    assert "BackgroundBlockObjectStore" in decision.replace
    assert not any("Mooncake" in name for name in [*decision.replace, *decision.keep])


def test_branch_shm_store_that_grows_is_kept(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_tree("shm_grows")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    for name, original in fake.originals.items():
        assert getattr(fake.modules[STORE], name) is original
    shm = fake.modules["shm"]
    assert fake.modules["worker"].ShmBlockObjectStore is shm.ShmBlockObjectStore
    assert shm.ShmBlockObjectStore.__module__ == f"{PACKAGE}.shm"
    (record,) = plugin_records(caplog)
    message = record.getMessage()
    assert message.startswith("aostore vLLM plugin: replaced nothing; ")
    assert "kept vLLM's ShmBlockObjectStore: vLLM's ShmBlockObjectStore grows" in message
    assert "kept vLLM's BackgroundBlockObjectStore: it would wrap vLLM's" in message
    assert "kept vLLM's BlockObjectStoreError: no store is replaced by aostore's" in message


def test_branch_shm_store_with_a_keyword_aostore_lacks_is_kept(make_tree: TreeMaker) -> None:
    source = """
    def _with_name(self, *, max_bytes, object_nbytes, shm_name=None):
        pass
    """
    fake = make_tree("shm", store_extra=textwrap.dedent(source))
    shm = fake.modules["shm"]
    original = shm.ShmBlockObjectStore
    original.__init__ = shm._with_name
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep["ShmBlockObjectStore"] == (
        "ShmBlockObjectStore(): aostore's has no parameter shm_name"
    )
    assert decision.keep["BackgroundBlockObjectStore"].startswith("it would wrap vLLM's")
    assert decision.replace == {}


def test_constructor_keyword_aostore_lacks_keeps_vllms_store(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_tree("grow", store_keywords=", shm_name=None")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    for name, original in fake.originals.items():
        assert getattr(fake.modules[STORE], name) is original, name
    assert fake.modules["worker"].BlockObjectStore is fake.originals["BlockObjectStore"]
    (record,) = plugin_records(caplog)
    message = record.getMessage()
    assert "replaced nothing" in message
    assert (
        "kept vLLM's BlockObjectStore: BlockObjectStore(): aostore's has no parameter shm_name"
        in message
    )
    assert "kept vLLM's BackgroundBlockObjectStore: it would wrap vLLM's BlockObjectStore" in (
        message
    )
    assert "kept vLLM's BlockObjectStoreError: no store is replaced by aostore's" in message


def test_recognized_release_still_needs_every_name(make_tree: TreeMaker) -> None:
    decision = vllm_plan.plan(
        make_tree("grow", known=True, store_keywords=", x=None").modules[STORE]
    )
    assert decision.release == "fake vLLM (grow)"
    assert decision.keep["BlockObjectStore"] == "aostore's BlockObjectStore lacks x="


def test_method_aostore_lacks_keeps_vllms_store(make_tree: TreeMaker) -> None:
    extra = "\n    def evict_all(self):\n        self._objects.clear()\n"
    fake = make_tree("grow", store_extra=extra)
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.replace == {}
    assert decision.keep["BlockObjectStore"] == "aostore's BlockObjectStore lacks evict_all"


def test_store_module_without_a_wrapper_still_gets_aostores_store(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_tree("grow", known=True)
    del fake.modules[STORE].BackgroundBlockObjectStore
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module = fake.modules[STORE]
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert not hasattr(store_module, "BackgroundBlockObjectStore")
    # The worker imported vLLM's wrapper before it disappeared: not the store module's any more,
    # so it is not the plugin's to replace.
    wrapper = fake.originals["BackgroundBlockObjectStore"]
    assert fake.modules["worker"].BackgroundBlockObjectStore is wrapper
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.INFO
    assert "BackgroundBlockObjectStore" not in record.getMessage()


def test_growth_warnings_reach_the_store_modules_logger(make_tree: TreeMaker) -> None:
    fake = make_tree("grow")
    vllm_plugin.register()
    store_module = fake.modules[STORE]
    # Looked up at each growth, as vLLM's test patches it after the plugin ran.
    with patch.object(store_module.logger, "warning") as warning:
        _log.store_grew(8)
    warning.assert_called_once_with(_log.GROWTH_MESSAGE, 8)
    # Without a store module there is nowhere else to send it, and nothing fails.
    del sys.modules[STORE]
    _log.store_grew(9)


def test_compat_references_view(make_tree: TreeMaker) -> None:
    fake = make_tree("grow")
    vllm_plugin.register()
    store = fake.modules[STORE].BlockObjectStore(max_bytes=16, object_nbytes=4)
    store.put([aostore.BlockObject("a", b"aaaa")], retain_keys=["a", "b", "b"])
    references = store._references
    assert dict(references) == {"a": 1, "b": 2}
    assert references["b"] == 2 and "c" not in references and references
    with pytest.raises(TypeError):
        references["a"] = 5  # type: ignore[index]
    store.put([], release_keys=["a", "b", "b"])
    assert not store._references
    assert dict(references) == {"a": 1, "b": 2}  # a copy taken at the time
    store.close()


def test_entry_point_is_declared() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
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
    from aostore import vllm_plugin
    from aostore.vllm.compat import fingerprint as compat_fingerprint
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
        # vLLM's original class raises the module's error name, which is aostore's by now
        # (a store that fails closed: 0.31.0 and 0.32.0).
        except (originals["BlockObjectStoreError"], store_module.BlockObjectStoreError):
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
        "release": compat_fingerprint.recognize(store_module),
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
    # The releases CI proves are recognized by content (KNOWN_RELEASES), so swapped in full.
    for version in ("0.31.0", "0.32.0", "0.33.0", "0.34.0"):
        if result["vllm"].startswith(version):
            assert result["release"] == f"vLLM {version}", result
    assert result["store_is_aostore"]
    assert result["object_is_aostore"]
    assert result["error_is_aostore"]
    assert result["background_is_aostore"]
    assert result["profile"] == ("grow" if result["vllm_store_grows"] else "fail-closed")
    if result["vllm"].startswith(("0.33.", "0.34.")):
        assert result["profile"] == "grow"
    if result["vllm"].startswith(("0.31.", "0.32.")):
        assert result["profile"] == "fail-closed"
    assert result["vllm_roundtrip"] in (True, None)
    for part, names in result["modules"].items():
        if isinstance(names, str):
            pytest.skip(f"vllm's {part} module does not import here: {names}")
        assert names and all(names.values()), (part, names)
    # On vLLM's handler (standard output by default, VLLM_LOGGING_STREAM).
    assert "aostore vLLM plugin: replaced" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "background"), ("background", "background"), ("0", False), ("off", False), ("1", True)],
)
def test_engine_stores_commit_their_arena_as_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: object
) -> None:
    from aostore import vllm_plugin

    if value is None:
        monkeypatch.delenv(vllm_settings.ENV_PREFAULT, raising=False)
    else:
        monkeypatch.setenv(vllm_settings.ENV_PREFAULT, value)
    seen: list[object] = []
    original = aostore.BlockObjectStore.__new__

    def spy(cls: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["prefault"])
        return original(cls, **kwargs)

    monkeypatch.setattr(aostore.BlockObjectStore, "__new__", spy)
    # What register() does: the settings read once, bound into the installed classes.
    settings = vllm_settings.Settings.from_env()
    unbind = vllm_stores.bind(prefault=settings.prefault, tier=None)
    try:
        # Read once: a later change of the environment does not reach the classes.
        monkeypatch.setenv(vllm_settings.ENV_PREFAULT, "1" if expected is False else "0")
        for cls, profile in (
            (vllm_plugin.EngineBlockObjectStore, "fail-closed"),
            (vllm_plugin.GrowBlockObjectStore, "grow"),
        ):
            store = cls(max_bytes=1 << 16, object_nbytes=64)
            assert store.profile == profile
            store.put([aostore.BlockObject("k", bytes(64))])
            store.close()
    finally:
        unbind()
    assert seen == [expected, expected]


def test_branch_with_a_variable_store_gets_aostores_real_classes(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture
) -> None:
    # aostore's own VariableBlockObjectStore and wrapper (with get_optional and flush) cover
    # what the branch defines and calls: everything is replaced, and the stores work there.
    fake = make_tree("variable")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    store_module = fake.modules[STORE]
    assert store_module.VariableBlockObjectStore is aostore.VariableBlockObjectStore
    assert fake.modules["worker"].VariableBlockObjectStore is aostore.VariableBlockObjectStore
    assert store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore
    (record,) = plugin_records(caplog)
    # A branch is not a release CI proves: vLLM's BlockObject stays, and only it.
    assert record.getMessage().count("kept vLLM's") == 1, record.getMessage()
    assert "kept vLLM's BlockObject:" in record.getMessage()
    variable = store_module.VariableBlockObjectStore(max_bytes=1 << 16)
    writer = store_module.BackgroundBlockObjectStore(variable, max_pending_batches=2)
    writer.put([store_module.BlockObject("row", b"logprobs" * 100)])
    writer.flush()
    assert writer.get_optional("row") == b"logprobs" * 100
    assert writer.get_optional("missing") is None
    writer.close()


# -- Seven throwaway vLLMs whose worker works with vLLM's classes (issue 16, item 2) -----------
#
# Each tree's worker uses vLLM's classes in a way aostore's do not support. The old plugin,
# which compared names only, swapped in each of them and the worker then failed; the plugin
# must keep the class at fault (and what depends on it) as vLLM's, and the worker must work.

_WORKER_IMPORTS = f"""
import dataclasses
from {STORE} import (
    BackgroundBlockObjectStore, BlockObject, BlockObjectStore, BlockObjectStoreError,
)
"""

DEFECT_TREES: dict[str, dict[str, str]] = {
    "positional-arguments": {
        "store_params": "max_bytes, object_nbytes",
        "worker_extra": """
            def run():
                store = BlockObjectStore(64, 8)  # vLLM's parameters are positional-or-keyword
                store.put([BlockObject("a", b"a" * 8)])
                return store.get_concatenated(["a"])
        """,
    },
    "constructor-default": {
        "store_params": "*, max_bytes, object_nbytes=8",
        "worker_extra": """
            def run():
                store = BlockObjectStore(max_bytes=64)  # object_nbytes has a default in vLLM's
                store.put([BlockObject("a", b"a" * 8)])
                return store.get_concatenated(["a"])
        """,
    },
    "forwarding-wrapper": {
        "wrapper_extra": """
    def __getattr__(self, name):
        return getattr(self._store, name)
""",
        "worker_extra": """
            def run():
                writer = BackgroundBlockObjectStore(
                    BlockObjectStore(max_bytes=64, object_nbytes=8), max_pending_batches=2
                )
                writer.put([BlockObject("a", b"a" * 8)])
                slots = writer.num_slots  # forwarded to the store by vLLM's __getattr__
                data = writer.get_concatenated(["a"])
                writer.close()
                return slots, data
        """,
    },
    "property-stats": {
        "store_extra": """
    @property
    def stats(self):
        return {"stored": len(self._slots)}
""",
        "worker_extra": """
            def run():
                store = BlockObjectStore(max_bytes=64, object_nbytes=8)
                store.put([BlockObject("a", b"a" * 8)])
                return store.stats["stored"]  # a property in vLLM's, a method in aostore's
        """,
    },
    "frozen-dataclass-object": {
        "worker_extra": """
            def run():
                first = BlockObject("a", b"a" * 8)
                second = dataclasses.replace(first, key="b")
                match second:
                    case BlockObject(key, payload):
                        pass
                store = BlockObjectStore(max_bytes=64, object_nbytes=8)
                store.put([first, second], retain_keys=[key])
                data = store.get_concatenated([key])
                store.close()
                return dataclasses.asdict(second), payload, data
        """,
    },
    "private-names": {
        "worker_extra": """
            def run():
                writer = BackgroundBlockObjectStore(
                    BlockObjectStore(max_bytes=64, object_nbytes=8), max_pending_batches=2
                )
                writer.put([BlockObject("a", b"a" * 8)])
                writer._raise_if_failed()  # vLLM 0.33's wrapper has these three
                state = (writer._error, writer._queue.maxsize)
                writer.close()
                return state
        """,
    },
    "error-in-a-container": {
        "worker_extra": """
            MISS_ERRORS = (BlockObjectStoreError, KeyError)

            def run():
                store = BlockObjectStore(max_bytes=64, object_nbytes=8)
                try:
                    store.get_concatenated(["missing"])
                except MISS_ERRORS:
                    return "recomputed"
        """,
    },
}

# What each tree's worker returns with vLLM's classes (and must still return).
DEFECT_RESULTS: dict[str, Any] = {
    "positional-arguments": b"a" * 8,
    "constructor-default": b"a" * 8,
    "forwarding-wrapper": (8, b"a" * 8),
    "property-stats": 1,
    "frozen-dataclass-object": ({"key": "b", "payload": b"a" * 8}, b"a" * 8, b"a" * 8),
    "private-names": (None, 2),
    "error-in-a-container": "recomputed",
}

# The classes that must stay vLLM's in each tree, and words of the reason the line gives.
DEFECT_KEPT: dict[str, tuple[tuple[str, ...], str]] = {
    "positional-arguments": (
        ("BlockObjectStore", "BackgroundBlockObjectStore", "BlockObjectStoreError"),
        "parameter max_bytes is positional-or-keyword in vLLM's, keyword-only in aostore's",
    ),
    "constructor-default": (
        ("BlockObjectStore", "BackgroundBlockObjectStore", "BlockObjectStoreError"),
        "parameter object_nbytes has default 8 in vLLM's, no default in aostore's",
    ),
    "forwarding-wrapper": (("BackgroundBlockObjectStore",), "defines __getattr__"),
    "property-stats": (
        ("BlockObjectStore", "BackgroundBlockObjectStore", "BlockObjectStoreError"),
        "BlockObjectStore.stats: a property in vLLM's, a method in aostore's",
    ),
    "frozen-dataclass-object": (("BlockObject",), "not replaced on a vLLM that CI does not"),
    "private-names": (
        ("BackgroundBlockObjectStore",),
        "aostore's BackgroundBlockObjectStore lacks _error, _queue, _raise_if_failed",
    ),
    "error-in-a-container": (
        ("BlockObjectStoreError", "BlockObjectStore", "BackgroundBlockObjectStore"),
        f"held where the swap cannot reach ({PACKAGE}.worker.MISS_ERRORS)",
    ),
}


@pytest.mark.parametrize("defect", sorted(DEFECT_TREES))
def test_worker_that_works_with_vllms_classes_still_works(
    make_tree: TreeMaker, caplog: pytest.LogCaptureFixture, defect: str
) -> None:
    options = dict(DEFECT_TREES[defect])
    options["worker_extra"] = _WORKER_IMPORTS + textwrap.dedent(options["worker_extra"])
    fake = make_tree("grow", **options)
    worker, store_module = fake.modules["worker"], fake.modules[STORE]
    # With vLLM's own classes, before the plugin: the worker works.
    assert worker.run() == DEFECT_RESULTS[defect]
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    # After it: the worker still works (it failed after the old plugin's swap) ...
    assert worker.run() == DEFECT_RESULTS[defect]
    # ... because the class at fault, and what depends on it, stayed vLLM's.
    kept, why = DEFECT_KEPT[defect]
    for name in kept:
        assert getattr(store_module, name) is fake.originals[name], name
        assert getattr(worker, name) is fake.originals[name], name
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    assert why in record.getMessage(), record.getMessage()


# -- The class-by-class check, piece by piece ---------------------------------------------------


def test_any_changed_file_of_the_package_is_no_longer_the_release(make_tree: TreeMaker) -> None:
    fake = make_tree("grow", known=True)
    store_module = fake.modules[STORE]
    assert compat_fingerprint.recognize(store_module) == "fake vLLM (grow)"
    directory = Path(store_module.__file__).parent
    (directory / "shm.py").write_text("# a file the release does not have\n")
    assert compat_fingerprint.recognize(store_module) is None
    (directory / "shm.py").unlink()
    with (directory / "worker.py").open("a") as worker:
        worker.write("# changed\n")
    assert compat_fingerprint.recognize(store_module) is None
    assert vllm_plan.plan(store_module).release is None


def test_known_releases_name_the_files_ci_runs() -> None:
    assert set(compat_fingerprint.KNOWN_RELEASES) == {
        "vLLM 0.31.0",
        "vLLM 0.32.0",
        "vLLM 0.33.0",
        "vLLM 0.34.0",
    }
    for files in compat_fingerprint.KNOWN_RELEASES.values():
        assert {"store.py", "worker.py", "routed_experts.py"} <= set(files)
        assert all(len(digest) == 64 for digest in files.values())


def test_hidden_references_are_found_wherever_the_swap_cannot_reach(
    make_tree: TreeMaker,
) -> None:
    fake = make_tree("grow")
    error, store = fake.originals["BlockObjectStoreError"], fake.originals["BlockObjectStore"]
    holder = types.ModuleType("vllm.holder")
    holder.__dict__.update(
        ERRORS={"miss": [error]},
        by_default=eval("lambda errors=(1, (error,)): errors", {"error": error}),
        Handler=type("Handler", (), {"__module__": "vllm.holder", "store_class": store}),
        plain=error,  # a module global: the swap updates it
    )
    enclosing = error

    def closure() -> Any:
        return enclosing

    holder.__dict__["closure"] = closure
    sys.modules["vllm.holder"] = holder
    found = compat_references.hidden_references(fake.originals)
    assert sorted(found["BlockObjectStoreError"]) == [
        "vllm.holder.ERRORS",
        "vllm.holder.by_default",
        "vllm.holder.closure",
    ]
    assert found["BlockObjectStore"] == ["vllm.holder.Handler.store_class"]
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.replace == {}
    assert "vllm.holder.Handler.store_class" in decision.keep["BlockObjectStore"]


def test_a_method_calling_super_is_not_a_hidden_reference(make_tree: TreeMaker) -> None:
    extra = "\n    def __repr__(self):\n        return super().__repr__()\n"
    fake = make_tree("grow", store_extra=extra)
    assert "BlockObjectStore" in vllm_plan.plan(fake.modules[STORE]).replace


def test_subclassed_vllm_class_is_kept(make_tree: TreeMaker) -> None:
    worker = f"""
        from {STORE} import BlockObjectStoreError

        class MissError(BlockObjectStoreError):
            pass
    """
    decision = vllm_plan.plan(make_tree("grow", worker_extra=worker).modules[STORE])
    assert decision.keep["BlockObjectStoreError"] == (
        f"vLLM's BlockObjectStoreError is subclassed ({PACKAGE}.worker.MissError)"
    )
    assert decision.replace == {}


def test_getattr_strings_count_as_uses(make_tree: TreeMaker) -> None:
    worker = "def depth(writer):\n    return getattr(writer, '_queue').qsize()\n"
    decision = vllm_plan.plan(make_tree("grow", worker_extra=worker).modules[STORE])
    assert decision.keep["BackgroundBlockObjectStore"] == (
        "aostore's BackgroundBlockObjectStore lacks _queue"
    )
    assert "BlockObjectStore" in decision.replace


def _signature(text: str) -> inspect.Signature:
    namespace: dict[str, Any] = {}
    exec(f"def f({text}): pass", namespace)
    return inspect.signature(namespace["f"])


@pytest.mark.parametrize(
    ("theirs", "ours", "gap"),
    [
        ("*, a, b", "*, a, b, c=1", None),
        ("*, a, b", "*, b, a", None),
        ("x, *, r=()", "x, *, r=()", None),
        ("x, *, retain_keys=()", "x, /, *, retain_keys=None", "parameter 1 is x"),
        ("x, *, retain_keys=()", "x, *, retain_keys=None", None),
        ("x, *, other=()", "x, *, other=None", "parameter other has default ()"),
        ("a, b", "*, a, b", "parameter a is positional-or-keyword in vLLM's, keyword-only"),
        ("*, a, b=8", "*, a, b", "parameter b has default 8 in vLLM's, no default"),
        ("*, a", "*, a, c", "aostore's needs parameter c"),
        ("*, a", "", "aostore's has no parameter a"),
        ("a", "b", "parameter 1 is a (positional-or-keyword) in vLLM's, b"),
        ("a", "a, b=1", "aostore's has an extra positional parameter b"),
        ("*args", "", "aostore's takes no *args"),
        ("**kw", "*, a=1", "aostore's takes no **kwargs"),
    ],
)
def test_signature_gap(theirs: str, ours: str, gap: str | None) -> None:
    found = compat_compare.signature_gap(_signature(theirs), _signature(ours))
    if gap is None:
        assert found is None
    else:
        assert found is not None and found.startswith(gap), found
