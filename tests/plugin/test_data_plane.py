"""The data plane without vLLM: ``NativeDataPlane`` driven as the connector subclass drives it,
and the plugin's decision whether to install it.

The step-by-step sameness with vLLM's connector is ``tests/connector_differential`` (it needs
vLLM); these pin the binding's contract: arguments read as vLLM passes them, the outputs dict,
the store calls, and bad input that raises vLLM's class and changes nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from aostore import BackgroundBlockObjectStore, VariableBlockObjectStore
from aostore._native import Layout, NativeDataPlane
from aostore.vllm import plan
from aostore.vllm.compat import releases
from aostore.vllm.settings import ENV_DATA_PLANE, Settings
from planes import BLOCK, SHAPE, Output, Plane, metadata, rows_of


def test_a_prefill_emits_views_and_publishes_its_keyed_blocks() -> None:
    plane = Plane()
    hashes = [bytes([1, 0]), bytes([1, 1])]
    plane.plane.begin_step(metadata({"a": 0}, {"a": hashes}))
    rows = rows_of(1, 0, 2 * BLOCK + 1)
    outputs = plane.step([("a", 0, rows)])
    assert list(outputs) == ["a"]
    assert type(outputs["a"]) is Output and outputs["a"].token_start == 0
    assert outputs["a"].rows.dtype == np.uint8 and outputs["a"].rows.shape == rows.shape
    assert outputs["a"].rows.tobytes() == rows.tobytes()
    stored = plane.stored()
    assert stored == {
        "vllm-artifact/0/0100": rows[:BLOCK].tobytes(),
        "vllm-artifact/0/0101": rows[BLOCK : 2 * BLOCK].tobytes(),
    }
    assert plane.background.store.snapshot()["references"] == {
        "vllm-artifact/0/0100": 1,
        "vllm-artifact/0/0101": 1,
    }
    assert plane.plane.steps == 1 and plane.plane.outputs == 1


def test_a_prefix_hit_reads_the_shared_block_back() -> None:
    plane = Plane()
    shared = [bytes([9, 9])]
    plane.plane.begin_step(metadata({"a": 0}, {"a": shared}))
    first = rows_of(1, 0, BLOCK + 1)
    plane.step([("a", 0, first)])
    plane.plane.begin_step(metadata({"b": 0}, {"b": shared}))
    second = rows_of(2, BLOCK, 2)
    outputs = plane.step([("b", BLOCK, second)])
    assert outputs["b"].token_start == 0
    expected = np.concatenate((first[:BLOCK], second))
    assert outputs["b"].rows.tobytes() == expected.tobytes()
    # Finished: the keys are released newest first, and the store holds them unreferenced.
    plane.plane.begin_step(metadata({}, {}, finished=("a", "b")))
    assert plane.plane.counts()[0] == 0
    plane.background.flush()
    assert plane.background.store.snapshot()["references"] == {}


def test_outputs_of_any_dataclass_class_are_that_class() -> None:
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        token_start: int
        rows: np.ndarray

    plane = Plane(output_class=Frozen)
    plane.plane.begin_step(metadata({"a": 0}, {}))
    outputs = plane.step([("a", 0, rows_of(1, 0, 2))])
    assert type(outputs["a"]) is Frozen and outputs["a"].token_start == 0


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ({"routed_experts": np.zeros((3, *SHAPE), dtype=np.int32)}, AssertionError),
        ({"num_rejected": np.asarray([-1], dtype=np.int32)}, AssertionError),
        ({"num_rejected": np.asarray([4], dtype=np.int32)}, AssertionError),
        ({"routed_experts": None}, AssertionError),
        ({"token_starts": np.asarray([-BLOCK], dtype=np.int32)}, ValueError),
        ({"num_sampled": np.ones(2, dtype=np.int32)}, ValueError),
    ],
    ids=["dtype", "rejected-negative", "rejected-too-many", "no-copy", "negative-start", "zip"],
)
def test_bad_step_input_raises_vllms_class_and_publishes_nothing(
    override: dict[str, Any], error: type[BaseException]
) -> None:
    plane = Plane()
    plane.plane.begin_step(metadata({"a": 0}, {"a": [bytes([1, 0])]}))
    with pytest.raises(error):
        plane.step([("a", 0, rows_of(1, 0, 3))], **override)
    assert plane.stored() == {}
    # The step left those in flight, as vLLM's `finally` removes it.
    assert plane.plane.counts()[1] == 0


def test_unknown_requests_and_bad_metadata_raise_as_vllm() -> None:
    plane = Plane()
    with pytest.raises(KeyError):
        plane.plane.prepare_output(["nobody"])
    other = Plane()
    with pytest.raises(AssertionError, match="run and finish"):
        other.plane.begin_step(metadata({"a": 0}, {}, finished=("a",)))
    with pytest.raises(KeyError):
        other.plane.begin_step(metadata({}, {"ghost": [b"\x01"]}))
    never_prepared = SimpleNamespace(
        request_ids=[],
        token_starts=[],
        query_start_loc=[0],
        routed_experts=None,
        num_sampled=None,
        num_rejected=None,
    )
    with pytest.raises(ValueError, match="not in list"):
        other.plane.process_output(never_prepared, 2**64 - 1)
    assert other.stored() == {}


def test_the_plane_needs_aostores_rust_writer_in_front_of_a_fixed_store() -> None:
    kwargs: dict[str, Any] = dict(
        layout="0.33",
        block_size=BLOCK,
        shape_per_token=SHAPE,
        dtype=np.uint8,
        max_num_seqs=1,
        max_num_batched_tokens=4,
        max_concurrent_batches=1,
        output_class=Output,
    )
    with pytest.raises(TypeError, match="NativeWriter"):
        NativeDataPlane(object(), **kwargs)
    variable = BackgroundBlockObjectStore(
        VariableBlockObjectStore(max_bytes=1 << 16), max_pending_batches=1
    )
    with pytest.raises(TypeError, match="fixed-size"):
        NativeDataPlane(variable._writer, **kwargs)
    fixed = Plane().background
    with pytest.raises(ValueError):
        NativeDataPlane(fixed._writer, **{**kwargs, "block_size": 0})
    with pytest.raises(ValueError, match=r"unknown vLLM layout '0\.99'"):
        NativeDataPlane(fixed._writer, **{**kwargs, "layout": "0.99"})


def _plan(**fields: Any) -> plan.Plan:
    result = plan.Plan(vllm={})
    result.replace = {"BlockObjectStore": object, "BackgroundBlockObjectStore": object}
    for name, value in fields.items():
        setattr(result, name, value)
    return result


def test_a_cycle_through_the_plane_is_collected() -> None:
    """The plane takes part in GC: a cycle through it (its output class holding it) goes at
    the next collection, not with the process."""

    @dataclasses.dataclass
    class Held:
        token_start: int
        rows: Any

    plane = Plane(output_class=Held)
    Held.plane = plane.plane  # type: ignore[attr-defined]
    gone = weakref.ref(Held)
    del Held, plane
    gc.collect()
    assert gone() is None


def test_the_plugin_says_why_the_data_plane_is_off() -> None:
    off = Settings.from_env({ENV_DATA_PLANE: "off"})
    assert not off.data_plane and Settings.from_env({}).data_plane
    assert plan._data_plane(_plan(release="vLLM 0.33.0"), off) == (
        (),
        f"data plane off ({ENV_DATA_PLANE}=off)",
    )
    on = Settings()
    kept = _plan(release="vLLM 0.33.0")
    kept.replace = {}
    assert plan._data_plane(kept, on) == ((), "data plane off (vLLM's store is kept)")
    tier = _plan(release="vLLM 0.33.0", mooncake=object())
    assert "Mooncake tier" in plan._data_plane(tier, on)[1]
    assert "not a release CI proves" in plan._data_plane(_plan(release=None), on)[1]
    assert "no record for vLLM 9.9" in plan._data_plane(_plan(release="vLLM 9.9"), on)[1]


def _tree(root: Path, record: releases.Release, feature: str) -> None:
    """Files under ``root`` whose sha256 are ``record``'s for ``feature``: the record is
    rewritten to the bytes written (a test cannot hold vLLM's files)."""
    for relative in record.files(feature):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(f"# {relative}\n")


def _record_of(root: Path, name: str = "vLLM 9.0.0", layout: str = "0.34") -> releases.Release:
    """A record whose hashes are the files under ``root`` (as ``_tree`` wrote them)."""
    base = releases.RELEASES[0]
    package_dir = root / releases.PACKAGE_DIR

    def hashed(paths: Any, under: Path) -> dict[str, str]:
        return {path: releases.digest(under / path) or "" for path in paths}

    return releases.Release(
        name=name,
        distributions=("vllm==9.0.0",),
        layout=layout,
        package=hashed(base.package, package_dir),
        worker=hashed(base.worker, root),
        scheduler=hashed(base.scheduler, root),
        transport=hashed(base.transport or {}, root),
    )


def _installed_tree(root: Path, monkeypatch: pytest.MonkeyPatch) -> releases.Release:
    """A vLLM tree under ``root`` whose files are a record's for every feature (returned), and
    the tree taken for the installed vLLM."""
    for feature in releases.FEATURES:
        _tree(root, releases.RELEASES[0], feature)
    record = _record_of(root)
    monkeypatch.setattr(releases, "vllm_root", lambda: root)
    return record


def test_a_release_is_recognized_per_feature(tmp_path: Path) -> None:
    for feature in releases.FEATURES:
        _tree(tmp_path, releases.RELEASES[0], feature)
    record = _record_of(tmp_path)
    for feature in releases.FEATURES:
        assert releases.recognized(record, feature, tmp_path) is None
    # A patched model runner: the worker plane is not recognized, the scheduler side still is.
    (tmp_path / "v1/worker/gpu/model_runner.py").write_text("# patched\n")
    why = releases.recognized(record, releases.WORKER, tmp_path)
    assert why == "vllm/v1/worker/gpu/model_runner.py differs from vLLM 9.0.0's record"
    assert releases.recognized(record, releases.SCHEDULER, tmp_path) is None
    # A file the package gains is not the record's either; a missing one is named.
    (tmp_path / releases.PACKAGE_DIR / "extra.py").write_text("")
    store = releases.recognized(record, releases.STORE, tmp_path)
    assert store is not None and "extra.py is not in vLLM 9.0.0's record" in store
    (tmp_path / "v1/request.py").unlink()
    scheduler = releases.recognized(record, releases.SCHEDULER, tmp_path)
    assert scheduler is not None and "vllm/v1/request.py is missing" in scheduler
    # The transport: its own files (a patched output processor), and a record without them.
    (tmp_path / releases.PACKAGE_DIR / "extra.py").unlink()
    assert releases.recognized(record, releases.TRANSPORT, tmp_path) is None
    (tmp_path / "v1/engine/output_processor.py").write_text("# patched\n")
    transport = releases.recognized(record, releases.TRANSPORT, tmp_path)
    assert transport == "vllm/v1/engine/output_processor.py differs from vLLM 9.0.0's record"
    bare = dataclasses.replace(record, name="vLLM 9.0.1", transport=None)
    assert releases.recognized(bare, releases.TRANSPORT, tmp_path) == (
        "vLLM 9.0.1's record has no transport files"
    )
    assert releases.installed(releases.TRANSPORT, tmp_path) is None


def test_the_transport_goes_in_where_recognized_and_switched_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _installed_tree(tmp_path, monkeypatch)
    decision = _plan(release=record.name, record=record)
    decision.data_plane = (releases.WORKER, releases.SCHEDULER)
    assert plan._transport(decision, Settings()) == (
        True,
        "transport on (vLLM 9.0.0's transport files recognized)",
    )
    decision.data_plane = ()
    on, said = plan._transport(decision, Settings())
    assert on and said.endswith("rows unpacked: no data plane)")
    off = Settings.from_env({"AOSTORE_VLLM_TRANSPORT": "off"})
    assert not off.transport
    assert plan._transport(decision, off) == (False, "transport off (AOSTORE_VLLM_TRANSPORT=off)")
    (tmp_path / "v1/serial_utils.py").write_text("# patched\n")
    assert plan._transport(decision, Settings()) == (
        False,
        "transport off (vllm/v1/serial_utils.py differs from vLLM 9.0.0's record)",
    )


def test_the_plugin_installs_the_features_a_release_is_recognized_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _installed_tree(tmp_path, monkeypatch)
    on = Settings()
    features, said = plan._data_plane(_plan(release=record.name, record=record), on)
    assert features == (releases.WORKER, releases.SCHEDULER)
    assert said == "data plane on (vLLM 9.0.0's worker and scheduler files recognized)"
    (tmp_path / "v1/outputs.py").write_text("# patched\n")
    features, said = plan._data_plane(_plan(release=record.name, record=record), on)
    assert features == (releases.SCHEDULER,)
    assert said == (
        "data plane on for the scheduler side only (worker plane off: "
        "vllm/v1/outputs.py differs from vLLM 9.0.0's record)"
    )
    (tmp_path / "v1/core/sched/scheduler.py").write_text("# patched\n")
    features, said = plan._data_plane(_plan(release=record.name, record=record), on)
    assert features == ()
    assert said == "data plane off (vllm/v1/outputs.py differs from vLLM 9.0.0's record)"


def test_every_record_names_a_layout_the_rust_side_knows() -> None:
    assert [record.name for record in releases.RELEASES] == [
        "vLLM 0.34.0",
        "vLLM 0.33.0",
        "vLLM 0.32.0",
        "vLLM 0.31.0",
    ]
    for record in releases.RELEASES:
        layout = Layout(record.layout)
        assert layout.name == record.layout
        assert layout.kv_events == (record.layout not in ("0.31", "0.32"))
        assert layout.caps_prompt_start == (record.layout != "0.31")
        assert layout.builds_storage_in_two_phases == (record.layout == "0.34")
        assert all(
            len(digest) == 64 for f in releases.FEATURES for digest in record.files(f).values()
        )
    assert Layout("0.34").reads_pending_blocks and not Layout("0.33").reads_pending_blocks
    with pytest.raises(ValueError, match=r"unknown vLLM layout '0\.99'"):
        Layout("0.99")


def test_an_installed_vllm_is_recognized_or_told_why_not() -> None:
    """With vLLM installed (``make test-vllm`` runs this file in its environment): a release CI
    proves is its record's for every feature; another record's files are named as differing."""
    vllm = pytest.importorskip("vllm")
    name = f"vLLM {vllm.__version__.split('+')[0]}"
    if name not in releases.BY_NAME:
        pytest.skip(f"{name} is not a release the data plane knows")
    release = releases.BY_NAME[name]
    for feature in releases.FEATURES:
        assert releases.recognized(release, feature) is None, feature
    other = next(record for record in releases.RELEASES if record.name != name)
    why = releases.recognized(other, releases.WORKER)
    assert why is not None and f"differs from {other.name}'s record" in why
    lines, status = releases.describe(releases.vllm_root())
    assert status == 0 and lines[-1].startswith(f"result: this tree is {name}'s"), lines


def _decode(plane: Plane, steps: int, process: Any, room: Any = None) -> None:
    """Four requests decode a token a step; each block's hash arrives the step after it fills;
    all finish at the end. ``process(pending)`` consumes each prepared step; ``room`` (a
    semaphore) is taken before each prepare, as vLLM bounds the steps in flight."""
    requests = [f"r{i}" for i in range(4)]
    for token in range(steps):
        done = token > 0 and token % BLOCK == 0
        hashes = {rid: [bytes([i, token // BLOCK])] for i, rid in enumerate(requests)}
        plane.plane.begin_step(metadata(dict.fromkeys(requests, token), hashes if done else {}))
        batch = [(rid, token, rows_of(i, token, 1)) for i, rid in enumerate(requests)]
        if room is not None:
            room.acquire()
        process(plane.prepare(batch))
    process(None)
    plane.plane.begin_step(metadata({}, {}, finished=requests))


def test_the_engine_and_output_threads_as_vllm_runs_them() -> None:
    """``prepare_output`` on the engine thread, ``process_output`` on an output thread with two
    steps in flight, while a third thread keeps the GIL busy: no deadlock, and the outputs and
    stored blocks of running both on one thread."""
    steps = 6 * BLOCK + 1
    one = Plane()
    alone: list[Any] = []
    _decode(one, steps, lambda pending: pending is not None and alone.append(one.process(pending)))

    two = Plane(in_flight=2)
    handed: queue.Queue[Any] = queue.Queue()
    room = threading.Semaphore(2)
    threaded: list[Any] = []
    stop = threading.Event()

    def output_thread() -> None:
        while (pending := handed.get()) is not None:
            threaded.append(two.process(pending))
            room.release()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1_000))

    workers = [threading.Thread(target=output_thread), threading.Thread(target=busy)]
    for worker in workers:
        worker.start()

    try:
        _decode(two, steps, handed.put, room)
    finally:
        stop.set()
        handed.put(None)
        for worker in workers:
            worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers), "a thread hung"
    assert len(threaded) == len(alone) == steps
    for mine, theirs in zip(alone, threaded, strict=True):
        assert list(mine) == list(theirs)
        for rid in mine:
            assert mine[rid].token_start == theirs[rid].token_start
            assert mine[rid].rows.tobytes() == theirs[rid].rows.tobytes()
    assert one.stored() == two.stored() and len(one.stored()) == 4 * 6
    # Every request torn down, nothing in flight, every staging slot free (vLLM's pool size:
    # in flight x (16 / 4 + 4 sequences) + 4 tails).
    assert one.plane.counts() == (0, 0, 1 * 8 + 4)
    assert two.plane.counts() == (0, 0, 2 * 8 + 4)
