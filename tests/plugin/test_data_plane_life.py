"""The data plane's life outside the happy path, without vLLM: driven off the main thread while
the main thread waits in C, in a forked child, and the properties of its outputs that vLLM's
code gives them (docs/guarantees.md, the data plane).

A forked child runs under a 10 s limit and is killed past it, so a regression fails instead of
hanging the suite.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from planes import BLOCK, SHAPE, Plane, metadata, rows_of
from scripts import run_script

CHILD_LIMIT_S = 10.0


def in_child(body: Callable[[], list[str]]) -> list[str]:
    """Runs ``body`` in a forked child; returns the lines it produced (or how it raised)."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            lines = body()
        except BaseException as error:  # reported to the parent
            lines = [f"raised {type(error).__name__}: {error}"]
        os.write(write, "\n".join(lines).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            pytest.fail(f"the forked child hung (no exit within {CHILD_LIMIT_S} s)")
        time.sleep(0.01)
    with os.fdopen(read, "rb") as pipe:
        return pipe.read().decode().splitlines()


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except RuntimeError as error:
        return "fork" if "fork" in str(error) else f"RuntimeError: {error}"
    except BaseException as error:  # compared by the test
        return f"{type(error).__name__}: {error}"
    return "returned"


def publish_and_finish(plane: Plane, steps: int) -> None:
    """``steps`` requests, each prefilled with two keyed blocks and then finished."""
    for step in range(steps):
        request = f"r{step}"
        hashes = [bytes([step % 256, step // 256, 0]), bytes([step % 256, step // 256, 1])]
        plane.plane.begin_step(metadata({request: 0}, {request: hashes}))
        plane.step([(request, 0, rows_of(step % 7, 0, 2 * BLOCK))])
        plane.plane.begin_step(metadata({}, {}, finished=(request,)))


def test_the_writer_drops_the_planes_publications_while_the_main_thread_waits_in_join() -> None:
    # An in-process engine driven from a worker thread: the main thread sits in join() and runs
    # no bytecode, so nothing parked for it would ever be dropped.
    plane = Plane()
    parked: list[int] = []

    def drive() -> None:
        publish_and_finish(plane, 200)
        parked.append(plane.background._writer._parked_owned_jobs())

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    # 600 store calls were applied; none waits for the main thread.
    assert parked == [0]
    assert plane.plane.steps == 200
    assert len(plane.stored()) == 64  # the store is full of released blocks, as vLLM's


def test_a_forked_child_gets_the_writers_error_from_every_plane_method() -> None:
    plane = Plane()
    publish_and_finish(plane, 2)
    hashes = [bytes([7, 7])]

    def child() -> list[str]:
        pending = plane.prepare  # each call below must refuse before reaching the plane
        return [
            outcome(lambda: plane.plane.begin_step(metadata({"c": 0}, {"c": hashes}))),
            outcome(lambda: plane.plane.prepare_output(["c"])),
            outcome(lambda: plane.process(pending([("c", 0, rows_of(1, 0, BLOCK))]))),
            outcome(lambda: plane.plane.counts()),
            outcome(lambda: plane.plane.close()),
            outcome(lambda: plane.background._writer._parked_owned_jobs()),
        ]

    assert in_child(child) == ["fork"] * 6
    # The parent's plane is untouched by the child.
    assert plane.plane.counts()[0] == 0
    publish_and_finish(plane, 1)
    assert plane.plane.steps == 3


def test_a_child_forked_while_a_parent_thread_holds_the_plane_raises_instead_of_hanging() -> None:
    # The parent's thread waits for room in a full writer queue inside begin_step, holding the
    # plane's lock, when the process forks: the child's first call must not wait for that lock.
    plane = Plane(max_pending_batches=1)
    writer = plane.background._writer
    writer._hold_back(0.5)
    inside = threading.Event()

    def publish() -> None:
        inside.set()
        for step in range(4):
            keys = [bytes([9, step])]
            plane.plane.begin_step(metadata({f"p{step}": 0}, {f"p{step}": keys}))

    thread = threading.Thread(target=publish)
    thread.start()
    inside.wait()
    time.sleep(0.2)  # the first call is being applied, the second queued, the third waits

    def child() -> list[str]:
        return [outcome(lambda: plane.plane.begin_step(metadata({"c": 0}, {})))]

    try:
        assert in_child(child) == ["fork"]
    finally:
        writer._hold_back(0)
        thread.join(timeout=30)
    assert plane.plane.counts()[0] == 4


def test_token_start_and_rows_have_the_types_and_flags_vllms_code_gives_them() -> None:
    plane = Plane()
    shared, own = bytes([5, 0]), bytes([5, 1])
    plane.plane.begin_step(metadata({"a": 0}, {"a": [shared]}))
    first = plane.step([("a", 0, rows_of(1, 0, BLOCK + 1))])["a"]
    # The first output's start is the scheduler's emit cursor (a Python int); from the second
    # on it is vLLM's `token_start + len(rows)`, an item of the int32 `token_starts` plus an int.
    assert type(first.token_start) is int
    assert first.rows.flags.writeable and first.rows.flags.c_contiguous
    plane.plane.begin_step(metadata({}, {}))
    second = plane.step([("a", BLOCK + 1, rows_of(1, BLOCK + 1, 1))])["a"]
    assert type(second.token_start) is type(np.int32(BLOCK) + 1)
    assert second.token_start == BLOCK + 1
    # A prefix hit whose rows all come back from the store: vLLM's rows are a slice of
    # `np.frombuffer` over the store's bytes, read-only.
    plane.plane.begin_step(metadata({"b": 0}, {"b": [shared, own]}))
    hit = plane.step([("b", BLOCK, rows_of(2, BLOCK, BLOCK))])["b"]
    assert type(hit.token_start) is int and hit.token_start == 0
    assert hit.rows.shape == (2 * BLOCK, *SHAPE)
    assert not hit.rows.flags.writeable and hit.rows.flags.c_contiguous
    # One that ends in the buffer's tail is a fresh concatenation in vLLM: writable.
    plane.plane.begin_step(metadata({"c": 0}, {"c": [shared]}))
    tail = plane.step([("c", BLOCK, rows_of(3, BLOCK, 2))])["c"]
    assert tail.rows.flags.writeable and tail.rows.shape == (BLOCK + 2, *SHAPE)


def test_the_staging_pool_commits_no_memory_when_built() -> None:
    # vLLM's buffer is `np.empty`: pages are committed as slots are written. GLM-4.5-Air's
    # shape (46 layers x top-8, uint8), 65,536 tokens a step, 1,024 sequences.
    out = run_script(
        """
        from aostore._native import NativeDataPlane

        background = BackgroundBlockObjectStore(
            BlockObjectStore(max_bytes=64 * 64 * 368, object_nbytes=64 * 368), max_pending_batches=4
        )
        gc.collect()
        before = rss()
        plane = NativeDataPlane(
            background._writer, layout="0.34", block_size=64, shape_per_token=(46, 8),
            dtype=np.uint8, max_num_seqs=1024, max_num_batched_tokens=65536,
            max_concurrent_batches=2, output_class=tuple,
        )
        print(plane.counts()[2], (rss() - before) >> 10)
        """
    )
    free_slots, grown_kib = (int(word) for word in out.split())
    assert free_slots * 64 * 368 > 32 << 20  # the pool is large ...
    assert grown_kib <= 1024, f"building the plane committed {grown_kib} KiB"  # ... and lazy
