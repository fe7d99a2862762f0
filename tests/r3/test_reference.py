"""R3 rows by reference (``aostore.r3``): the frontend's arena and the trainer's reader, as two
processes on one node use them.

A reference reads its own rows or raises an error of its own, never other bytes; unread rows
last until their deadline (renewable), read rows until they are wanted for new ones, and no
slot is reused under a lease, which ends when the reader releases, drops its arrays, or dies.
"""

from __future__ import annotations

import base64
import io
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
from aostore import r3
from aostore.r3 import format as fmt
from aostore.r3.arena import Arena, sweep_stale
from aostore.vllm.transport.delivery import Delivery

ROW = (46, 8)


def rows(n: int, seed: int = 0, dtype: str = "uint8", row: tuple[int, ...] = ROW) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (n, *row)).astype(dtype)


def wire(array: np.ndarray) -> str:
    """vLLM's HTTP field for an array (its numpy2base64)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def vllm_recipe(text: str) -> np.ndarray:
    """vLLM's documented decode of the field."""
    return np.load(io.BytesIO(base64.b64decode(text)))


@pytest.fixture
def arena():
    with Arena(8 << 20, ttl=60.0) as made:
        yield made


@pytest.fixture
def reader():
    made = r3.Reader()
    yield made
    made.close()


@pytest.mark.parametrize(
    "want",
    [rows(17_083), rows(1), rows(0), rows(5, dtype="<i4"), rows(3, dtype=">u2", row=(7,))],
    ids=["16k", "one", "none", "int32", "be-uint16"],
)
def test_a_reference_reads_back_its_rows_as_views_or_into_out(arena, reader, want) -> None:
    reference = arena.deliver(want, token_start=0)
    assert reference is not None
    text = wire(reference)
    assert len(text) <= 1024  # T14: the field is at most 1 KB a sample
    for form in (reference, text):
        batch = reader.fetch([form])
        got = batch[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want) and not got.flags.writeable
        del got
        batch.release()
        out = np.empty_like(want)
        (copied,) = reader.fetch([form], out=out)
        assert (np.shares_memory(copied, out) or not want.size) and np.array_equal(out, want)
    assert reader.stats.leases == 0


def test_a_batch_larger_than_a_cache_is_read_into_out_the_same(reader) -> None:
    """``out=`` streams a batch of at least ``STREAM_FROM`` bytes past the cache: the same
    bytes, ranged reads included, at any position in ``out``."""
    from aostore.r3._reader import STREAM_FROM

    with Arena(STREAM_FROM + (8 << 20), ttl=60.0) as big:
        want = [rows(17_083 + i, seed=i) for i in range(6)]
        assert sum(w.nbytes for w in want) >= STREAM_FROM
        references = [big.deliver(w) for w in want]
        out = np.empty((sum(len(w) for w in want) - 5, *ROW), np.uint8)
        reader.fetch(references, start=[0, 5, 0, 0, 0, 0], out=out)
        assert np.array_equal(out, np.concatenate([want[0], want[1][5:], *want[2:]]))
        assert reader.stats.leases == 0


def test_vllms_recipe_decodes_a_reference_to_something_no_code_can_use_as_rows(arena) -> None:
    reference = arena.deliver(rows(10))
    decoded = vllm_recipe(wire(reference))
    assert decoded.shape == () and decoded.dtype.names is not None
    assert decoded["aostore_r3"] == b"reference"  # what it is, printed
    with pytest.raises(IndexError):
        decoded[0]
    with pytest.raises((TypeError, ValueError)):
        decoded.astype(np.int64)
    with pytest.raises((TypeError, ValueError)):
        np.asarray(decoded, dtype=np.uint8)
    torch = pytest.importorskip("torch", reason="torch is the optional extra aostore[torch]")
    with pytest.raises(TypeError):
        torch.from_numpy(decoded)


def test_vllms_rows_read_the_same_way_and_batches_mix_them(arena, reader) -> None:
    mine, theirs = rows(300, 1), rows(200, 2)
    batch = reader.fetch([wire(theirs), arena.deliver(mine), theirs], start=[10, 20, 0])
    assert np.array_equal(batch[0], theirs[10:])
    assert np.array_equal(batch[1], mine[20:])
    assert np.array_equal(batch[2], theirs)


def test_one_batch_reads_references_of_several_arenas_and_repeats_once(arena, reader) -> None:
    """Issue 49: one batch mixes arenas (one pass each) and vLLM's rows, in the caller's order;
    a reference repeated is leased and read once, and given at each of its places."""
    with Arena(1 << 20, ttl=60.0) as other:
        a, b, theirs = rows(300, 1), rows(40, 2), rows(7, 3)
        ra, rb = arena.deliver(a), other.deliver(b)
        batch = [ra, wire(rb), theirs, wire(ra), rb, ra]
        starts = [0, 5, 1, 100, 0, 299]
        want = [a, b[5:], theirs[1:], a[100:], b, a[299:]]
        got = reader.fetch(batch, start=starts)
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
        assert reader.stats.leases == 2 and arena.leases() == 1 and other.leases() == 1
        assert np.shares_memory(got[0], got[3]) and np.shares_memory(got[1], got[4])
        del got
        assert reader.stats.leases == 0 and arena.leases() == 0 and other.leases() == 0
        out = np.full((sum(len(w) for w in want), *ROW), 255, np.uint8)
        copied = reader.fetch(batch, start=starts, out=out)
        assert np.array_equal(out, np.concatenate(want))
        assert all(np.shares_memory(c, out) or not c.size for c in copied)
        assert reader.stats.leases == 0 and arena.leases() == 0 and other.leases() == 0
        assert reader.stats.references == 10 and reader.stats.fetches == 2


def test_a_batch_over_arenas_takes_every_lease_or_none(arena, reader) -> None:
    """A gone reference of one arena leaves the other arenas' references unleased and unread
    (their rows are not the first to make way), and the error names its place."""
    with Arena(1 << 20, ttl=60.0) as other:
        ra, rb = arena.deliver(rows(10, 1)), other.deliver(rows(10, 2))
        gone = rb.copy()
        gone["generation"] += 7
        with pytest.raises(r3.ReferenceGone, match="reference 2 of the batch") as error:
            reader.fetch([ra, rb, gone, ra])
        assert error.value.index == 2
        assert reader.stats.leases == 0 and arena.leases() == 0 and other.leases() == 0
        assert not arena._slots["read"].any() and not other._slots["read"].any()
    ghost = ra.copy()
    ghost["arena"] = np.frombuffer(os.urandom(16), np.uint8)
    with pytest.raises(r3.ReferenceGone, match="reference 1 of the batch: its R3 arena is not"):
        reader.fetch([ra, ghost])
    assert reader.stats.leases == 0 and arena.leases() == 0


def test_ranged_reads_start_at_a_token(arena, reader) -> None:
    want = rows(1_000, 3)
    reference = arena.deliver(want[400:], token_start=400)  # a later turn's rows
    assert np.array_equal(reader.fetch([reference], start=650)[0], want[650:])
    assert reader.fetch([reference], start=1_000)[0].shape == (0, *ROW)
    out = np.empty((600 + 100, *ROW), np.uint8)
    reader.fetch([reference, reference], start=[400, 900], out=out)
    assert np.array_equal(out, np.concatenate([want[400:], want[900:]]))
    for bad in (399, 1_001):
        with pytest.raises(ValueError, match="outside the rows"):
            reader.fetch([reference], start=bad)
    with pytest.raises(ValueError, match="2 starts for 1"):
        reader.fetch([reference], start=[400, 400])
    assert reader.stats.leases == 0


def test_bad_input_gets_a_clear_error_and_takes_no_lease(arena, reader) -> None:
    reference = arena.deliver(rows(50))
    other = Arena(1 << 20, ttl=60.0)
    try:
        foreign = other.deliver(rows(5))
        cases: list[tuple[object, type[BaseException], str]] = [
            (["not base64!"], r3.ForeignReference, "neither rows nor"),
            ([base64.b64encode(b"\x93NUMPY junk").decode()], r3.ForeignReference, "neither"),
            ([wire(np.zeros((), [("a", "<i4"), ("b", "<i4")]))], r3.ForeignReference, "not an"),
            ([wire(np.array(["text"]))], r3.ForeignReference, "not routed experts"),
            ([3], TypeError, "a str .* or a numpy array"),
            (wire(reference), TypeError, "a sequence of references"),
            ([reference, foreign, "not base64!"], r3.ForeignReference, "neither rows nor"),
        ]
        later = reference.copy()
        later["version"] = fmt.REFERENCE_VERSION + 1
        cases.append(([later], r3.ForeignReference, f"format {fmt.REFERENCE_VERSION + 1}"))
        elsewhere = reference.copy()
        elsewhere["boot"] = np.arange(16, dtype=np.uint8)
        cases.append(([elsewhere], r3.OtherNode, "another node"))
        for references, error, message in cases:
            with pytest.raises(error, match=message):
                reader.fetch(references)  # type: ignore[arg-type]
        for out, message in [
            (np.empty((49, *ROW), np.uint8), "the batch's rows are"),
            (np.empty((50, *ROW), np.int16), "the batch's rows are"),
            (np.empty((50, *ROW), np.uint8)[::-1], "C-contiguous"),
            (np.broadcast_to(np.uint8(0), (50, *ROW)), "writable"),
        ]:
            with pytest.raises(ValueError, match=message):
                reader.fetch([reference], out=out)
        with pytest.raises(TypeError, match="out= is a numpy array"):
            reader.fetch([reference], out=bytearray(50 * 368))  # type: ignore[arg-type]
        assert reader.stats.leases == 0 and reader.stats.fetches == 0
    finally:
        other.close()


def later_format(reference: np.ndarray, version: int, fields: list[tuple[str, str]]) -> np.ndarray:
    """``reference`` as a format of its ``version`` with ``fields`` added, the rest kept, as a
    later aostore could write one."""
    later = np.zeros((), np.dtype(fmt.REFERENCE.descr + fields))
    for name in fmt.REFERENCE.names or ():
        later[name] = reference[name]
    later["version"] = version
    return later


def test_a_reference_of_a_newer_format_is_told_by_its_version(arena, reader) -> None:
    """The version policy (``aostore.r3.format``): a reference of a newer format is refused
    naming both versions, whatever fields that format added, as an array and as vLLM's string;
    one of this format with other fields is not an aostore reference."""
    reference = arena.deliver(rows(5))
    newer = later_format(reference, fmt.REFERENCE_VERSION + 1, [("checksum", "<u8")])
    assert fmt.REFERENCE_VERSION == 1  # the messages below name 2 and 1
    for value in (newer, wire(newer)):
        with pytest.raises(r3.ForeignReference, match=r"format 2; this aostore reads format 1"):
            fmt.parse(value)
        with pytest.raises(r3.ForeignReference, match="upgrade aostore on the reader's side"):
            reader.fetch([value])
    same = later_format(reference, fmt.REFERENCE_VERSION, [("checksum", "<u8")])
    for value in (same, wire(same)):
        with pytest.raises(r3.ForeignReference, match="not an aostore reference"):
            fmt.parse(value)
    none = later_format(reference, 0, [("checksum", "<u8")])
    for value in (none, wire(none)):
        with pytest.raises(r3.ForeignReference, match="malformed aostore reference"):
            fmt.parse(value)
    assert reader.stats.leases == 0 and reader.stats.fetches == 0


def test_rows_the_arena_cannot_take_or_write_change_nothing(arena, reader) -> None:
    """Rows that are not numeric, of too many dimensions, or whose writer fails part way: an
    error, no reference, nothing held; the space is there for the next rows."""
    before = arena.stats()
    for bad, error, message in [
        (np.array([object()] * 4), TypeError, "numeric array"),
        (np.zeros(3, [("a", "u1")]), TypeError, "numeric array"),
        (np.uint8(3), TypeError, "numeric array"),
        (np.zeros((1,) * 9, np.uint8), ValueError, "at most 8"),
        (np.zeros((4, 2), np.complex64), TypeError, "numeric array"),
        (np.array(["ab", "cd"]), TypeError, "numeric array"),
    ]:
        with pytest.raises(error, match=message):
            arena.deliver(np.asarray(bad))
        # The same rule at the frontend's delivery: such rows go as rows, whole, never an error.
        delivery, array = Delivery("reference", 8 << 20, 60.0), np.asarray(bad)
        assert delivery.deliver(array) is array
        assert delivery.arena is None  # no arena made: nothing to write

    def half_then_fail(targets: list[np.ndarray]) -> None:
        targets[0][: len(targets[0]) // 2] = 7
        raise OSError("the pages went away")

    for _ in range(3):  # a slot lost per failure would show in the stats
        with pytest.raises(OSError, match="went away"):
            arena.deliver_written(np.dtype(np.uint8), (4096, *ROW), half_then_fail)
    assert arena.stats() == before
    want = rows(4096, seed=9)
    assert np.array_equal(reader.fetch([arena.deliver(want)])[0], want)


def test_release_twice_and_a_closed_reader_or_arena_are_errors(arena, reader) -> None:
    reference = arena.deliver(rows(50))
    batch = reader.fetch([reference])
    batch.release()
    with pytest.raises(ValueError, match="released"):
        batch.release()
    with pytest.raises(ValueError, match="released"):
        batch[0]
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.fetch([reference])
    arena.close()
    with pytest.raises(r3.ReferenceGone, match="not in this node's /dev/shm"):
        r3.Reader().fetch([reference])
    with pytest.raises(r3.R3Error, match="closed"):
        arena.deliver(rows(1))


def test_release_with_a_view_still_alive_changes_nothing(arena, reader) -> None:
    want = rows(80, 4)
    batch = reader.fetch([arena.deliver(want)])
    tail = batch[0][40:]
    with pytest.raises(BufferError, match=r"arrays \[0\]"):
        batch.release()
    assert np.array_equal(tail, want[40:]) and reader.stats.leases == 1
    del tail
    batch.release()
    assert reader.stats.leases == 0


def test_read_rows_are_evicted_for_new_ones_and_unread_rows_are_not(reader) -> None:
    # 3 pages of rows fit: each 8 rows of 46 x 8 takes a page.
    with Arena(3 * fmt.PAGE, ttl=60.0) as arena:
        a, b, c = (arena.deliver(rows(8, i)) for i in range(3))
        assert arena.deliver(rows(8, 9)) is None  # all unread: the new rows go as rows
        assert arena.stats()["fallbacks"] == 1
        batch = reader.fetch([a])
        assert arena.leases() == 1
        assert arena.deliver(rows(8, 9)) is None  # read, but leased
        assert arena.stats()["leased_when_wanted"] >= 1
        batch.release()
        assert arena.leases() == 0
        d = arena.deliver(rows(8, 5))
        assert d is not None and arena.stats()["evictions"] == 1
        with pytest.raises(r3.ReferenceGone, match="gone"):
            reader.fetch([a])
        assert reader.stats.misses == 1
        # The slot a had may now hold d's rows: each reference reads its own or nothing.
        for reference, seed in ((b, 1), (c, 2), (d, 5)):
            assert np.array_equal(reader.fetch([reference])[0], rows(8, seed))


def test_unread_rows_expire_past_their_deadline_unless_renewed(reader) -> None:
    with Arena(2 * fmt.PAGE, ttl=0.2) as arena:
        kept, dropped = arena.deliver(rows(8, 0)), arena.deliver(rows(8, 1))
        reader.renew([kept], seconds=60.0)
        time.sleep(0.3)
        assert arena.deliver(rows(8, 2)) is not None and arena.stats()["expiries"] == 1
        assert arena.deliver(rows(8, 3)) is None  # kept's deadline was renewed
        with pytest.raises(r3.ReferenceGone):
            reader.fetch([dropped])
        with pytest.raises(r3.ReferenceGone):
            reader.renew([dropped])
        assert np.array_equal(reader.fetch([kept])[0], rows(8, 0))
        with pytest.raises(ValueError, match="positive"):
            reader.renew([kept], seconds=0)


def _hold_views(text: str, ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    batch = r3.fetch([text])
    assert int(batch[0].sum()) >= 0
    ready.set()
    time.sleep(600)


def test_a_reader_killed_while_holding_views_pins_nothing() -> None:
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        text = wire(arena.deliver(rows(8, 0)))
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        child = context.Process(target=_hold_views, args=(text, ready))
        child.start()
        try:
            assert ready.wait(60)
            assert arena.deliver(rows(8, 1)) is None  # read, but leased by the child
            assert arena.leases() == 1
            os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
            child.join(30)
            assert arena.leases() == 0  # the kernel dropped the lease
            fresh = arena.deliver(rows(8, 1))
            assert fresh is not None and arena.stats()["evictions"] == 1
        finally:
            if child.is_alive():
                child.kill()


def _fetch_as(uid: int, text: str, result: multiprocessing.queues.Queue) -> None:  # type: ignore[name-defined]
    os.setgid(uid)
    os.setuid(uid)
    try:
        r3.Reader().fetch([text])
        result.put("read")
    except PermissionError as error:
        result.put(str(error))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_the_arena_is_its_users_only() -> None:
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        text = wire(arena.deliver(rows(8, 0)))
        assert os.stat(arena.path).st_mode & 0o777 == 0o600
        context = multiprocessing.get_context("fork")
        result = context.Queue()
        child = context.Process(target=_fetch_as, args=(65534, text, result))
        child.start()
        child.join(60)
        got = result.get(timeout=10)
        assert "readable by its user only" in got, got


def test_a_budget_the_node_cannot_reserve_stops_start_up_and_leaves_nothing() -> None:
    before = set(os.listdir(fmt.DIRECTORY))
    with pytest.raises(OSError, match=r"AOSTORE_TEST_BUDGET=.*cannot reserve|cannot reserve"):
        Arena(1 << 50, ttl=60.0, setting="AOSTORE_TEST_BUDGET")
    assert set(os.listdir(fmt.DIRECTORY)) == before
    with pytest.raises(ValueError, match="at least"):
        Arena(100, ttl=60.0)
    with pytest.raises(ValueError, match="positive"):
        Arena(fmt.PAGE, ttl=0)


def _make_and_die(
    ready: multiprocessing.synchronize.Event, path: multiprocessing.queues.Queue
) -> None:  # type: ignore[name-defined]
    arena = Arena(fmt.PAGE, ttl=60.0)
    path.put(arena.path)
    ready.set()
    time.sleep(600)


EXITS = """
import os, sys
from aostore.r3.arena import Arena

arena = Arena(1 << 20, ttl=60.0)
print(arena.path, flush=True)
if os.fork() == 0:
    sys.exit(0)  # a forked child that exits normally: the parent's arena stays
os.wait()
print(os.path.exists(arena.path), flush=True)
sys.exit(0)  # no close(): the arena goes with the process
"""


def test_a_frontend_that_exits_without_closing_removes_its_arena() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=60, check=True
    )
    path, alive_after_child = done.stdout.split()
    assert alive_after_child == "True"
    assert not os.path.exists(path)


def test_a_killed_frontends_arena_is_swept_by_the_next() -> None:
    context = multiprocessing.get_context("spawn")
    ready, where = context.Event(), context.Queue()
    child = context.Process(target=_make_and_die, args=(ready, where))
    child.start()
    assert ready.wait(60)
    left = where.get(timeout=10)
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join(30)
    assert os.path.exists(left)
    with Arena(fmt.PAGE, ttl=60.0) as arena:  # its start sweeps
        assert not os.path.exists(left) and os.path.exists(arena.path)
    assert sweep_stale() == 0
