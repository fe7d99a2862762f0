"""The vLLM plugin's gate proves behaviour and reads vLLM's files on disk (issue #27, items 4, 5).

- On a vLLM it does not recognize by content, a store whose names and signatures are aostore's
  but whose behaviour is not (it ignores a release of an unreferenced key, evicts in another
  order, raises another error class) stays vLLM's: the scripted differential
  (``aostore.vllm.compat.differential``) finds the difference, and the start-up line says which.
- On a release it recognizes, vLLM code outside the store package, on disk and not imported,
  that aostore's classes cannot serve (vLLM's error class held in a tuple, ``dataclasses``
  functions on ``BlockObject``, private names aostore's lacks) keeps the class it touches.

The fake vLLM trees are ``test_plugin.py``'s (``make_tree``), whose stores behave as vLLM
0.33.0's (``grow``) and 0.32.0's (``fail-closed``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

aostore = pytest.importorskip("aostore")
vllm_plugin = pytest.importorskip("aostore.vllm_plugin")
differential_module = pytest.importorskip("aostore.vllm.compat.differential")

from aostore.vllm import plan as vllm_plan  # noqa: E402
from aostore.vllm import settings as vllm_settings  # noqa: E402
from vllm_trees import (  # noqa: E402
    PACKAGE,
    STORE,
    FakeTree,
    TreeMaker,
    make_tree,  # noqa: F401  (a fixture)
    plugin_records,
)

KINDS = ["grow", "fail-closed"]
STORES = ("BlockObjectStore", "BlockObjectStoreError", "BackgroundBlockObjectStore")

# Edits to the fake store's source (test_plugin._FIXED) that change one behaviour each.
IGNORES_UNREFERENCED_RELEASE = (
    (
        "            count = self._references[key] - 1\n",
        "            if key not in self._references:\n"
        "                continue  # the changed behaviour\n"
        "            count = self._references[key] - 1\n",
    ),
)
EVICTS_NEWEST_FIRST = (
    (
        "victims = [k for k in self._lru if",
        "victims = [k for k in reversed(self._lru) if",
    ),
)
MISSING_READ_RAISES_KEY_ERROR = (
    (
        "            raise BlockObjectStoreError(\n"
        '                "auxiliary output object does not exist;',
        '            raise KeyError(\n                "auxiliary output object does not exist;',
    ),
)


def _line(caplog: pytest.LogCaptureFixture) -> str:
    (record,) = plugin_records(caplog)
    assert record.levelno == logging.WARNING
    return record.getMessage()


def _kept(fake: FakeTree, *names: str) -> None:
    for name in names:
        assert getattr(fake.modules[STORE], name) is fake.originals[name], name
        if name in vars(fake.modules["worker"]):
            assert getattr(fake.modules["worker"], name) is fake.originals[name], name


@pytest.fixture
def trees(make_tree: TreeMaker) -> TreeMaker:  # noqa: F811  (test_plugin's fixture)
    """test_plugin's fake vLLM trees."""
    return make_tree


# -- Item 4: the behavioural differential --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_store_that_ignores_a_release_of_an_unreferenced_key_stays_vllms(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    fake = trees(kind, store_edits=IGNORES_UNREFERENCED_RELEASE)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    message = _line(caplog)
    assert "replaced nothing" in message
    assert (
        f"kept vLLM's BlockObjectStore: behaves unlike aostore's BlockObjectStore (profile "
        f"'{kind}') in the scripted differential: after put(['a', 'b', 'a'], retain_keys=['a']) "
        "(call 1 of the script): release 2 of 'a' (put([], release_keys=['a'])) returns in "
        "vLLM's, raises KeyError in aostore's"
    ) in message
    # What depends on the kept store stays vLLM's too, and the line says so.
    assert "kept vLLM's BlockObjectStoreError: no store is replaced by aostore's" in message
    assert "kept vLLM's BackgroundBlockObjectStore: it would wrap vLLM's BlockObjectStore" in (
        message
    )


@pytest.mark.parametrize("kind", KINDS)
def test_store_that_evicts_in_another_order_stays_vllms(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    fake = trees(kind, store_edits=EVICTS_NEWEST_FIRST)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    message = _line(caplog)
    assert "kept vLLM's BlockObjectStore: behaves unlike aostore's BlockObjectStore" in message
    assert "filler put(s)" in message  # found by filling the store: the eviction order


@pytest.mark.parametrize("kind", KINDS)
def test_store_that_raises_another_error_class_stays_vllms(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    fake = trees(kind, store_edits=MISSING_READ_RAISES_KEY_ERROR)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    assert (
        "(call 1 of the script): get_concatenated(['c']) raises KeyError in vLLM's, "
        "ObjectMissingError in aostore's, which is not a builtins.KeyError"
    ) in _line(caplog)


@pytest.mark.parametrize("kind", KINDS)
def test_store_that_behaves_as_aostores_is_replaced_after_the_differential(
    trees: TreeMaker,
    kind: str,
) -> None:
    fake = trees(kind)
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.release is None
    assert set(STORES) <= set(decision.replace)
    verdict = decision.differentials["BlockObjectStore"]
    # aostore's misses raise ObjectMissingError, a subclass of the error class the swap maps
    # vLLM's BlockObjectStoreError to: the same behaviour for vLLM's except clauses.
    assert verdict.same and verdict.calls > 100
    # The differential chose the profile the plugin installs, and register() reuses it.
    assert decision.profile_choice is not None and decision.profile_choice[0] == kind


def test_forced_profile_unlike_vllms_store_keeps_it_on_an_unknown_vllm(
    trees: TreeMaker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The differential compares the store the plugin would install: a forced profile that
    # behaves unlike vLLM's store is not a drop-in there (a recognized release honours it).
    fake = trees("fail-closed")
    monkeypatch.setenv(vllm_settings.ENV_PROFILE, "grow")
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    assert (
        "kept vLLM's BlockObjectStore: behaves unlike aostore's BlockObjectStore (profile "
        "'grow') in the scripted differential: after put(['b']) (call 4 of the script): "
        "get_concatenated(['b']) returns b'\\x02\\x02\\x02\\x02' in vLLM's, returns "
        "b'\\x06\\x06\\x06\\x06' in aostore's"
    ) in _line(caplog)


def test_branch_shm_store_that_ignores_a_release_stays_vllms(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    edits = (
        (
            "            count = self._references[key] - 1\n",
            "            if key not in self._references:\n"
            "                continue\n"
            "            count = self._references[key] - 1\n",
        ),
    )
    fake = trees("shm", store_edits=edits)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    shm = fake.modules["shm"]
    assert shm.ShmBlockObjectStore.__module__ == f"{PACKAGE}.shm"
    message = _line(caplog)
    assert (
        "kept vLLM's ShmBlockObjectStore: behaves unlike aostore's ShmBlockObjectStore in the "
        "scripted differential"
    ) in message
    assert "returns in vLLM's, raises KeyError in aostore's" in message


def test_a_store_that_breaks_the_differential_stays_vllms(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A store whose behaviour changes from one instance to the next: the replays disagree.
    edits = (
        (
            "        self.object_nbytes = object_nbytes\n",
            "        self.object_nbytes = object_nbytes\n"
            "        type(self).built = getattr(type(self), 'built', 0) + 1\n"
            "        if type(self).built > 3:\n"
            "            self.put = None\n",
        ),
    )
    fake = trees("grow", store_edits=edits)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()  # never raises
    _kept(fake, *STORES)
    assert "kept vLLM's BlockObjectStore: behaviour not proven: the scripted differential" in (
        _line(caplog)
    )


def test_a_failure_inside_the_differential_keeps_vllms_classes(
    trees: TreeMaker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = trees("grow")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected in the differential")

    monkeypatch.setattr(differential_module._Run, "run", broken)
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    assert (
        "behaviour not proven: the scripted differential could not run (RuntimeError: injected "
        "in the differential)"
    ) in _line(caplog)


def test_differential_against_model_stores_directly() -> None:
    # The module on its own: aostore's two profiles differ from each other where docs/semantics.md
    # says.
    def store(profile: str) -> Any:
        return lambda **sizes: aostore.BlockObjectStore(profile=profile, **sizes)

    errors = {aostore.BlockObjectStoreError: aostore.BlockObjectStoreError}
    same = differential_module.differential(
        store("grow"), store("grow"), make_object=aostore.BlockObject, errors=errors
    )
    assert same.same, same
    other = differential_module.differential(
        store("fail-closed"), store("grow"), make_object=aostore.BlockObject, errors=errors
    )
    assert other.difference is not None and "call 4 of the script" in other.difference


# -- Item 5: vLLM's files on disk, on a recognized release too ------------------------------------

_OUTSIDE = "vllm/v1/patched_worker.py"
_ERROR_IN_A_TUPLE = f"""
from {STORE} import BlockObjectStoreError

MISS_ERRORS = (BlockObjectStoreError, KeyError)


def read(store, keys):
    try:
        return store.get_concatenated(keys)
    except MISS_ERRORS:
        return None
"""
_ERROR_IN_AN_EXCEPT_TUPLE = f"""
from {STORE} import BlockObjectStoreError


def read(store, keys):
    try:
        return store.get_concatenated(keys)
    except (BlockObjectStoreError, KeyError):
        return None
"""
_DATACLASS_REPLACE = f"""
import dataclasses

from {STORE} import BlockObject


def renamed(obj: BlockObject, key: str) -> BlockObject:
    return dataclasses.replace(obj, key=key)
"""
_PRIVATE_NAMES = f"""
from {PACKAGE}.store import BlockObjectStore


def depth(store: BlockObjectStore) -> int:
    return len(store._lru)
"""


@pytest.mark.parametrize("source", [_ERROR_IN_A_TUPLE, _ERROR_IN_AN_EXCEPT_TUPLE])
def test_recognized_release_keeps_the_error_class_held_outside_the_package(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
    source: str,
) -> None:
    fake = trees("grow", known=True, extra_files={_OUTSIDE: source})
    assert "vllm.v1.patched_worker" not in sys.modules  # on disk only
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, *STORES)
    message = _line(caplog)
    assert "is fake vLLM (grow)'s, which CI proves" in message
    assert "kept vLLM's BlockObjectStoreError: vLLM code that aostore's BlockObjectStoreError " in (
        message
    )
    assert "vllm/v1/patched_worker.py:" in message
    # The stores raise aostore's error class: they stay too, and BlockObject with them.
    assert "kept vLLM's BlockObjectStore: aostore's stores raise aostore's" in message


def test_recognized_release_keeps_block_object_when_code_outside_needs_a_dataclass(
    trees: TreeMaker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = trees("grow", known=True, extra_files={_OUTSIDE: _DATACLASS_REPLACE})
    with caplog.at_level(logging.INFO):
        vllm_plugin.register()
    _kept(fake, "BlockObject")
    store_module = fake.modules[STORE]
    assert issubclass(store_module.BlockObjectStore, aostore.BlockObjectStore)
    assert store_module.BlockObjectStoreError is aostore.BlockObjectStoreError
    assert store_module.BackgroundBlockObjectStore is aostore.BackgroundBlockObjectStore
    assert (
        "kept vLLM's BlockObject: vLLM code that aostore's BlockObject cannot serve: "
        "vllm/v1/patched_worker.py:8 calls replace() (needs a dataclass)"
    ) in _line(caplog)
    # aostore's stores take vLLM's BlockObject.
    store = store_module.BlockObjectStore(max_bytes=8, object_nbytes=4)
    store.put([store_module.BlockObject("a", b"aaaa")])
    assert store.get_concatenated(["a"]) == b"aaaa"
    store.close()


def test_recognized_release_keeps_a_store_whose_private_names_code_outside_reads(
    trees: TreeMaker,
) -> None:
    fake = trees("grow", known=True, extra_files={_OUTSIDE: _PRIVATE_NAMES})
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep["BlockObjectStore"] == (
        f"vLLM code outside {PACKAGE} uses _lru, which aostore's lacks"
    )


def test_recognized_release_keeps_a_class_an_imported_module_holds(trees: TreeMaker) -> None:
    fake = trees("grow", known=True, extra_files={_OUTSIDE: _ERROR_IN_A_TUPLE})
    __import__("vllm.v1.patched_worker")
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep["BlockObjectStoreError"] == (
        "vLLM's BlockObjectStoreError is also held where the swap cannot reach "
        "(vllm.v1.patched_worker.MISS_ERRORS)"
    )


def test_recognized_release_with_nothing_outside_is_replaced_in_full(trees: TreeMaker) -> None:
    # Code outside the package that uses only what aostore's classes serve changes nothing.
    harmless = f"""
from {STORE} import BlockObject, BlockObjectStoreError


def publish(store, key, payload):
    try:
        store.put([BlockObject(key, payload)], retain_keys=[key])
    except BlockObjectStoreError:
        raise
"""
    fake = trees("grow", known=True, extra_files={_OUTSIDE: harmless})
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep == {}
    assert sorted(decision.replace) == sorted([*STORES, "BlockObject"])


def test_unknown_vllm_reads_files_on_disk_too(trees: TreeMaker) -> None:
    fake = trees("grow", extra_files={_OUTSIDE: _PRIVATE_NAMES})
    decision = vllm_plan.plan(fake.modules[STORE])
    assert decision.keep["BlockObjectStore"] == "aostore's BlockObjectStore lacks _lru"
