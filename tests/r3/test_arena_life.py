"""The R3 arena's life beside other processes (the sixth review, issue 45): forks, containers
that share ``/dev/shm`` but not a PID namespace, restarts, full arenas and hostile files.

Each test names the defect it holds fixed. Tests that need root (a PID namespace, another uid)
skip off-CI with the reason; CI sets ``AOSTORE_REQUIRE_ROOT=1``, which turns that skip into a
failure.
"""

from __future__ import annotations

import base64
import fcntl
import gc
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from aostore import r3
from aostore.r3 import _reader, leases
from aostore.r3 import format as fmt
from aostore.r3.arena import Arena, sweep_stale

ROW = (46, 8)


def rows(n: int, value: int) -> np.ndarray:
    return np.full((n, *ROW), value, np.uint8)


def wire(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def needs_root() -> None:
    """Skip without root, unless CI asks for these tests (``AOSTORE_REQUIRE_ROOT=1``)."""
    if os.geteuid() == 0:
        return
    if os.environ.get("AOSTORE_REQUIRE_ROOT") == "1":
        pytest.fail("AOSTORE_REQUIRE_ROOT=1 but these tests run without root")
    pytest.skip("needs root (a PID namespace or another uid); CI runs it as root")


class Script:
    """A Python process of its own running ``code``, talking line by line."""

    def __init__(self, code: str, *args: str, prefix: list[str] | None = None) -> None:
        self.process = subprocess.Popen(
            [*(prefix or []), sys.executable, "-c", textwrap.dedent(code), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        assert self.process.stdout is not None
        got = self.process.stdout.readline().strip()
        assert got, f"the script ended (rc {self.process.poll()})"
        return got

    def say(self, text: str = "go") -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def wait(self) -> int:
        return self.process.wait(60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(60)

    def close(self) -> None:
        self.kill()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def scripts() -> Iterator[list[Script]]:
    made: list[Script] = []
    yield made
    for script in made:
        script.close()


def full_of_one_page_rows(arena: Arena, n: int) -> list[np.ndarray]:
    references = [arena.deliver(rows(8, i % 250)) for i in range(n)]
    assert all(r is not None for r in references)
    return references  # type: ignore[return-value]


# Forks: items 1, 8 and 13 ---------------------------------------------------------------------

FORKING_READER = """
import gc, os, sys, time
import numpy as np
from aostore import r3

batch = r3.fetch([sys.argv[1]])
view = batch[0]
assert int(view[0, 0, 0]) == 7
pid = os.fork()
if pid == 0:
    if sys.argv[2] == "drop":
        del view, batch  # the child's inherited batch goes: its own lease ends, not the parent's
        gc.collect()
        sys.exit(0)
    while not os.path.exists(sys.argv[3]):  # keeps the inherited views until told
        time.sleep(0.01)
    sys.exit(0 if int(view[0, 0, 0]) == 7 and int(view.sum()) == 7 * view.size else 1)
if sys.argv[2] == "drop":
    os.waitpid(pid, 0)
print("parent", flush=True)
sys.stdin.readline()
if sys.argv[2] == "keep":
    del view
    batch.release()  # the parent's lease ends; the child's views keep theirs
    print("released", flush=True)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)
print(int(view[0, 0, 0]), int(view.sum()) == 7 * view.size, flush=True)
"""


def test_a_forked_child_that_drops_its_inherited_batch_ends_no_lease_of_its_parent(
    scripts,
) -> None:
    """Item 1 (wrong rows): the child's exit used to end the parent's lease through their shared
    open file; the frontend then gave the slot to other rows under the parent's view."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 7))
        reader = Script(FORKING_READER, wire(reference), "drop")
        scripts.append(reader)
        assert reader.line() == "parent"  # the child has exited
        assert arena.leases() == 1
        assert arena.deliver(rows(8, 99)) is None  # the parent's lease still stands
        assert arena.stats()["leased_when_wanted"] >= 1
        reader.say()
        assert reader.line() == "7 True"
        assert reader.wait() == 0
        assert arena.leases() == 0
        assert arena.deliver(rows(8, 99)) is not None
        arena.check()


def test_a_forked_childs_inherited_views_keep_their_rows_under_its_own_lease(
    scripts, tmp_path
) -> None:
    """The fork rule's other half: the parent releases, the child's views still read their
    rows (the child leases them), and the child's exit ends that lease."""
    told = tmp_path / "go"
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 7))
        reader = Script(FORKING_READER, wire(reference), "keep", str(told))
        scripts.append(reader)
        assert reader.line() == "parent"
        reader.say()  # to the parent: release
        assert reader.line() == "released"
        assert arena.leases() == 1  # the child's
        assert arena.deliver(rows(8, 99)) is None
        told.touch()  # the child reads its views, then exits
        assert reader.line() == "child 0"
        assert reader.wait() == 0
        assert arena.leases() == 0
        assert arena.deliver(rows(8, 99)) is not None


KILLED_PARENT = """
import os, sys, time, gc
from aostore import r3

batch = r3.fetch([sys.argv[1]])
view = batch[0]
if os.fork() == 0:
    del view, batch
    gc.collect()
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_a_killed_reader_pins_nothing_while_its_child_lives(scripts) -> None:
    """Item 13: the child inherited the parent's mappings, which kept the parent's open (and
    its locks) alive after the parent was killed."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 7))
        reader = Script(KILLED_PARENT, wire(reference))
        scripts.append(reader)
        child = int(reader.line())
        try:
            assert arena.leases() == 1
            reader.process.send_signal(signal.SIGKILL)
            reader.wait()
            os.kill(child, 0)  # the child lives
            assert arena.leases() == 0
            assert arena.deliver(rows(8, 99)) is not None
        finally:
            os.kill(child, signal.SIGKILL)


FORK_WHILE_READING = """
import os, sys, threading, time
from aostore import r3

reader = r3.reader()
reader.fetch([sys.argv[1]]).release()
held = threading.Event()

def hold_the_lock():
    with reader._lock:  # another thread inside the reader, as a fetch would be
        held.set()
        time.sleep(0.5)

threading.Thread(target=hold_the_lock).start()
held.wait()
pid = os.fork()
if pid == 0:
    r3.fetch([sys.argv[1]]).release()  # the child's reader works, and its exit does not hang
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_child_forked_while_another_thread_reads_neither_hangs_nor_fails(scripts) -> None:
    """Item 8: the child inherited the reader's lock held by a thread it does not have."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 7))
        reader = Script(FORK_WHILE_READING, wire(reference))
        scripts.append(reader)
        assert reader.line() == "0"
        assert reader.wait() == 0


# Liveness and identity: items 2, 3, 4, 5, 11 and 17 ------------------------------------------

FRONTEND = """
import os, sys, time
import numpy as np
from aostore.r3.arena import Arena

arena = Arena(1 << 20, ttl=60.0)
print(arena.path, flush=True)
sys.stdin.readline()
"""


def test_a_frontend_in_another_pid_namespace_keeps_its_arena(scripts) -> None:
    """Item 2: the sweep took a live arena for a stale one when its owner's pid was of another
    PID namespace (containers sharing /dev/shm: --ipc=host, hostIPC, an emptyDir)."""
    needs_root()
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing")
    other = Script(FRONTEND, prefix=["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"])
    scripts.append(other)
    path = other.line()
    with Arena(fmt.PAGE, ttl=60.0):  # its start sweeps
        assert os.path.exists(path)
    assert sweep_stale() == 0 and os.path.exists(path)
    other.kill()  # killed (unshare --kill-child takes the frontend): its arena is stale now
    deadline = time.monotonic() + 30
    while os.path.exists(path) and time.monotonic() < deadline:
        sweep_stale()  # removes it once the kernel has let the frontend's lock go
        time.sleep(0.05)
    assert not os.path.exists(path)


SLOW_START = """
import os, sys
from aostore.r3.arena import Arena

reserve = os.posix_fallocate

def slowly(fd, offset, size):
    print("reserving", flush=True)
    sys.stdin.readline()  # the test sweeps here
    reserve(fd, offset, size)

os.posix_fallocate = slowly
arena = Arena(1 << 20, ttl=60.0)
print(arena.path, flush=True)
sys.stdin.readline()
"""


def arenas() -> set[str]:
    return {name for name in os.listdir(fmt.DIRECTORY) if name.startswith(fmt.PREFIX)}


def test_an_arena_is_named_only_once_complete_and_a_sweep_takes_nothing_half_made(
    scripts,
) -> None:
    """Item 3 (the deterministic case of ``--api-server-count 2``): a sweep met another
    frontend's arena file still 0 bytes and raised ``IndexError``; a frontend killed there left a
    0-byte file that blocked every later start. Item 11: one killed while reserving left the
    whole budget."""
    leftover = os.path.join(fmt.DIRECTORY, f"{fmt.PREFIX}{'0' * 32}")
    with open(leftover, "wb"):
        pass  # an old release's 0-byte leftover: nobody holds it, so it goes
    before = arenas() - {os.path.basename(leftover)}
    starting = Script(SLOW_START)
    scripts.append(starting)
    assert starting.line() == "reserving"
    assert arenas() - {os.path.basename(leftover)} == before
    with Arena(fmt.PAGE, ttl=60.0):  # sweeps while the other is half made: no error
        assert not os.path.exists(leftover)
    starting.say()
    path = starting.line()
    assert os.path.exists(path)  # not swept: named complete, its frontend alive
    sweep_stale()
    assert os.path.exists(path)
    starting.kill()
    assert sweep_stale() == 1 and not os.path.exists(path)  # killed once named: swept
    # Killed while reserving: nothing is left at all, no sweep needed.
    before = arenas()
    again = Script(SLOW_START)
    scripts.append(again)
    assert again.line() == "reserving"
    again.kill()
    assert arenas() == before


def test_two_frontends_start_side_by_side_and_each_keeps_its_arena(scripts) -> None:
    """Item 3's smoke test beside it: frontends starting together (``--api-server-count``)."""
    frontends = [Script(FRONTEND) for _ in range(4)]
    scripts.extend(frontends)
    paths = [f.line() for f in frontends]
    assert all(os.path.exists(p) for p in paths)
    for f in frontends:
        f.say()
        assert f.wait() == 0
    assert not any(os.path.exists(p) for p in paths)  # each removed its own at exit


def _squatter(path: str, content: bytes, uid: int) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            os.write(fd, content)
            os.fchmod(fd, 0o666)
            os.close(fd)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_another_user_cannot_answer_a_stale_reference() -> None:
    """Item 4: once the frontend exited, anyone could create a file under its arena's name and
    the trainer read that user's bytes (or died of SIGBUS when it was cut short)."""
    needs_root()
    arena = Arena(fmt.PAGE, ttl=60.0)
    reference = arena.deliver(rows(8, 7))
    with open(arena.path, "rb") as file:
        copy = file.read()  # the real arena's bytes, header and all: still refused
    arena.close()
    _squatter(arena.path, copy, 65534)
    try:
        assert os.stat(arena.path).st_uid == 65534
        with pytest.raises(r3.ReferenceGone, match="belongs to uid 65534"):
            r3.Reader().fetch([reference])
    finally:
        os.unlink(arena.path)


def test_a_symlink_or_a_cut_short_file_under_an_arenas_name_is_refused() -> None:
    arena = Arena(fmt.PAGE, ttl=60.0)
    reference = arena.deliver(rows(8, 7))
    arena.close()
    os.symlink("/etc/hostname", arena.path)
    try:
        with pytest.raises(r3.ReferenceGone, match="symbolic link"):
            r3.Reader().fetch([reference])
    finally:
        os.unlink(arena.path)
    with open(arena.path, "wb") as file:
        file.write(b"x" * 100)
    try:
        with pytest.raises(r3.ReferenceGone, match="cut short"):
            r3.Reader().fetch([reference])
    finally:
        os.unlink(arena.path)


def _held_after_removal(path: str) -> list[str]:
    """Where this process still holds the arena file ``path`` open (or mapped) after it was
    removed."""
    held = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target == f"{path} (deleted)":
            held.append(target)
    with open("/proc/self/maps") as maps:
        held += [line for line in maps if f"{path} (deleted)" in line]
    return held


DELIVERING_FRONTEND = """
import sys
import numpy as np
from aostore.r3.arena import Arena
import base64, io

arena = Arena(1 << 20, ttl=60.0)
buffer = io.BytesIO()
np.save(buffer, arena.deliver(np.full((8, 46, 8), 5, np.uint8)), allow_pickle=False)
print(base64.b64encode(buffer.getvalue()).decode(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("ending", ["exits", "is killed"])
def test_a_reader_lets_go_of_an_arena_whose_frontend_is_gone(scripts, ending) -> None:
    """Item 5: a long-lived trainer kept every arena it had read (1 GiB a frontend restart at
    the default budget), and its old references still read rows."""
    reader = r3.Reader()
    frontend = Script(DELIVERING_FRONTEND)
    scripts.append(frontend)
    reference = frontend.line()
    assert int(reader.fetch([reference], out=np.empty((8, *ROW), np.uint8))[0][0, 0, 0]) == 5
    batch = reader.fetch([reference])
    batch.release()
    if ending == "exits":
        frontend.say()
        assert frontend.wait() == 0
    else:
        frontend.kill()
    with pytest.raises(r3.ReferenceGone, match="frontend is gone"):
        reader.fetch([reference])
    assert reader.stats.arenas_let_go == 1
    gc.collect()
    path = fmt.path(fmt.ident(fmt.parse(reference)["arena"]))
    assert _held_after_removal(path) == []
    # A killed frontend's file went with the reader's look (the reader is its user).
    assert not os.path.exists(path)
    reader.close()


EXITS_UNDER_MULTIPROCESSING = """
import multiprocessing, sys
from aostore.r3.arena import Arena

def serve(where):
    arena = Arena(1 << 20, ttl=60.0)
    where.put(arena.path)  # no close(): multiprocessing ends the process with os._exit

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    where = context.Queue()
    child = context.Process(target=serve, args=(where,))
    child.start()
    path = where.get(timeout=60)
    child.join(60)
    print(path, child.exitcode, flush=True)
"""


def test_a_frontend_process_that_multiprocessing_ends_removes_its_arena(tmp_path) -> None:
    """Item 17: a normal stop of ``--api-server-count 2`` left both arenas until the next
    start (multiprocessing ends its processes with ``os._exit``, which runs no atexit)."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(EXITS_UNDER_MULTIPROCESSING))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    path, code = done.stdout.split()
    assert code == "0" and not os.path.exists(path)


# Placement and finishes: items 7, 9, 10, 12, 14, 15, 16 and 17 ------------------------------


class CountingFcntl:
    """Counts ``fcntl`` calls made by ``aostore.r3`` (locks and lock queries)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = fcntl.fcntl

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(leases.fcntl, "fcntl", counted)


@pytest.mark.parametrize("held", [100, 4000, 1 << 16])
def test_a_finish_and_a_scrape_cost_the_same_however_many_unread_references_are_held(
    monkeypatch, held
) -> None:
    """Item 7 and T17: placement walked every held slot twice per give-up and a scrape asked
    the kernel about each; now a full arena's fallback makes no lock call, a scrape none, and a
    give-up one lock for the slot it gives up."""
    with Arena(held * fmt.PAGE, ttl=60.0) as arena:
        held = min(held, len(arena._slots))  # full of slots or of pages, whichever first
        references = full_of_one_page_rows(arena, held)
        counting = CountingFcntl(monkeypatch)
        assert arena.deliver(rows(8, 1)) is None  # full of unread rows
        arena.stats()
        assert counting.calls == 0
        r3.Reader().fetch([references[held // 2]], out=np.empty((8, *ROW), np.uint8))
        counting.calls = 0
        assert arena.deliver(rows(8, 1)) is not None  # gives up the one read slot
        # The read slot's lock and unlock, the free slot's lock and unlock.
        assert counting.calls == 4
        assert arena.stats()["evictions"] == 1
        arena.check()


def test_placement_gives_up_only_rows_that_make_room_and_rows_need_no_hole(reader_) -> None:
    """Item 9: with read and unread rows interleaved, a delivery larger than any hole gave up
    every read slot and still fell back. Pages in runs need no hole: the read slots make room,
    and the rows read back as views and into out=. Rows that cannot make room give up none."""
    reader = reader_
    with Arena(8 * fmt.PAGE, ttl=60.0) as arena:
        references = full_of_one_page_rows(arena, 8)
        for i in range(0, 8, 2):  # every other one read: holes of one page each
            reader.fetch([references[i]], out=np.empty((8, *ROW), np.uint8))
        assert arena.deliver(rows(45, 1)) is None  # 5 pages: 4 read + 0 free cannot
        assert arena.stats()["evictions"] == 0  # and nothing was given up for it
        for i in range(8):
            reader.fetch([references[i]], out=np.empty((8, *ROW), np.uint8))  # all still read
        want = np.random.default_rng(3).integers(0, 128, (44, *ROW)).astype(np.uint8)
        big = arena.deliver(want)  # 4 pages from 4 read slots
        assert big is not None and arena.stats()["evictions"] == 4
        batch = reader.fetch([big])
        assert np.array_equal(batch[0], want)
        out = np.empty_like(want[3:])
        reader.fetch([big], start=3, out=out)
        assert np.array_equal(out, want[3:])
        del batch
        arena.check()


@pytest.fixture
def reader_() -> Iterator[r3.Reader]:
    made = r3.Reader()
    yield made
    made.close()


def test_a_refused_batch_marks_none_of_its_rows_read_and_names_the_gone_one(reader_) -> None:
    """Items 10 and 15: a batch refused for one gone reference marked its other rows read (so
    they were evicted first, though nobody got them), and the error did not say which."""
    with Arena(3 * fmt.PAGE, ttl=60.0) as arena:
        a, b, c = full_of_one_page_rows(arena, 3)
        reader_.fetch([a], out=np.empty((8, *ROW), np.uint8))  # a: read
        gone = b.copy()
        gone["generation"] += 1000
        with pytest.raises(r3.ReferenceGone, match="reference 1 of the batch") as error:
            reader_.fetch([c, gone])
        assert error.value.index == 1
        assert arena.deliver(rows(8, 9)) is not None  # a goes, not c
        assert arena.deliver(rows(8, 9)) is None  # c is unread: kept
        assert int(reader_.fetch([c])[0][0, 0, 0]) == 2


def test_a_fetch_that_fails_while_mapping_keeps_no_lease(monkeypatch, reader_) -> None:
    """Item 12: a mapping refused (ENOMEM) part way kept the unmapped rows' leases."""
    with Arena(4 * fmt.PAGE, ttl=60.0) as arena:
        references = full_of_one_page_rows(arena, 3)
        real, made = _reader._map_runs, []

        def fails_second(*args):  # type: ignore[no-untyped-def]
            if made:
                raise OSError(12, "Cannot allocate memory")
            made.append(1)
            return real(*args)

        monkeypatch.setattr(_reader, "_map_runs", fails_second)
        with pytest.raises(OSError, match="allocate"):
            reader_.fetch(references)
        assert reader_.stats.leases == 0 and arena.leases() == 0


def test_corrupted_reference_strings_are_foreign_references(reader_) -> None:
    """Item 14: a corrupted header raised ``tokenize.TokenError`` or ``SyntaxError``."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        raw = base64.b64decode(wire(arena.deliver(rows(8, 1))))
        header_end = raw.index(b"\n") + 1
        cases = [raw[:20] + b"(" + raw[21:], raw[:30] + b"'''" + raw[33:]]
        cases += [raw[: header_end - 10] + b")))))))))" + raw[header_end - 1 :]]
        cases += [raw[:12] + bytes([raw[12] ^ 0xFF]) + raw[13:]]
        for case in cases:
            with pytest.raises(r3.ForeignReference):
                reader_.fetch([base64.b64encode(case).decode()])


def test_a_finish_never_waits_on_a_reader_holding_a_slots_lock() -> None:
    """Item 16: a reader stopped between taking a free slot's lock (with a stale reference) and
    looking at its generation stopped every later finish of the API server."""
    with Arena(4 * fmt.PAGE, ttl=60.0) as arena:
        stale = leases.reopen(arena._fd)  # another open: a reader's
        try:
            for slot in range(len(arena._slots)):
                assert leases.lock(stale, slot, leases.READ)
            result: list[object] = []
            finish = threading.Thread(target=lambda: result.append(arena.deliver(rows(8, 1))))
            finish.start()
            finish.join(10)
            assert not finish.is_alive(), "the finish waited on the reader's lock"
            assert result == [None] and arena.stats()["slots_busy"] >= 1
            leases.lock(stale, 0, leases.UNLOCK)  # one free slot's lock let go: it is used
            assert arena.deliver(rows(8, 1)) is not None
        finally:
            os.close(stale)
        arena.check()


def test_lifetimes_are_finite_and_kept_on_the_boot_clock(monkeypatch, reader_) -> None:
    """Item 17: ``AOSTORE_VLLM_R3_TTL=inf`` was accepted; deadlines used the wall clock (an NTP
    step expired every unread reference at once)."""
    for bad in (float("inf"), float("nan"), 0, -5):
        with pytest.raises(ValueError, match="positive"):
            Arena(fmt.PAGE, ttl=bad)
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        kept = arena.deliver(rows(8, 4))
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 10**6)  # the wall clock steps
        assert arena.deliver(rows(8, 5)) is None  # nothing expired
        with pytest.raises(ValueError, match="finite"):
            reader_.renew([kept], seconds=float("inf"))


def test_renew_after_close_and_of_another_nodes_reference_say_so(reader_) -> None:
    """Item 17: ``renew`` after ``Reader.close()`` reopened the arena; another node's reference
    got ``ReferenceGone``, not ``OtherNode``."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 4))
        elsewhere = reference.copy()
        elsewhere["boot"] = np.arange(16, dtype=np.uint8)
        with pytest.raises(r3.OtherNode):
            reader_.renew([elsewhere])
        reader_.close()
        with pytest.raises(ValueError, match="closed"):
            reader_.renew([reference])


def test_start_counts_rows_and_the_error_says_so(reader_) -> None:
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        reference = arena.deliver(rows(8, 4))
        with pytest.raises(ValueError, match="start counts rows as vLLM sent them"):
            reader_.fetch([reference], start=9)


def test_a_forked_child_gets_a_clear_error_from_its_parents_arena() -> None:
    """A child may not write its parent's arena (its books are the parent's; r3-reference.md)."""
    with Arena(fmt.PAGE, ttl=60.0) as arena:
        pid = os.fork()
        if pid == 0:
            try:
                arena.deliver(rows(8, 1))
                os._exit(1)
            except r3.R3Error as error:
                os._exit(0 if "forked child" in str(error) else 2)
            except BaseException:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists(arena.path)  # the child's exit left it


def test_a_reservation_is_read_only_once_published_and_given_back_unpublished(reader_) -> None:
    """Rows over HTTP are written once into a reserved slot: no reference reads it, nothing
    gives it up, until the answer publishes it; one never rendered is given back, also from a
    garbage collection's callback (never under the arena's lock)."""
    want = np.random.default_rng(5).integers(0, 128, (30, *ROW)).astype(np.uint8)

    def write(targets: list[np.ndarray]) -> None:
        (target,) = targets
        target[...] = want.reshape(-1).view(np.uint8)

    with Arena(8 * fmt.PAGE, ttl=60.0) as arena:
        reserved = arena.reserve(want.dtype, want.shape, write)
        assert reserved is not None
        kept, rows = reserved
        assert np.array_equal(rows, want) and not rows.flags.writeable
        reserved = arena.reserve(want.dtype, want.shape, write)
        assert reserved is not None
        dropped = reserved[0]
        assert arena.reserve(want.dtype, want.shape, write) is None  # 3 pages, 2 free
        arena.check()
        assert arena.stats()["references"] == 0
        reference = kept.publish()
        assert reference is not None and kept.publish() is reference
        assert np.array_equal(reader_.fetch([reference])[0], want)
        dropped.withdraw()
        dropped.withdraw()  # once is enough
        assert dropped.publish() is None
        assert arena.stats()["slots_held"] == 1  # the withdrawn slot is free again
        arena.check()
        again = arena.reserve(want.dtype, want.shape, write)
        assert again is not None
        del again  # dropped without publish or withdraw: still held until withdrawn
        assert arena.stats()["slots_held"] == 2
