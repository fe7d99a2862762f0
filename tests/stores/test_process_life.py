"""Process life (docs/guarantees.md): interpreter finalization and fork.

aostore loads into every vLLM process, and those processes fork workers and keep running for
seconds after the interpreter is finalized (CUDA, NCCL and torch teardown). Each case runs in a
fresh interpreter with a timeout, so a crash or a hang fails the test instead of the run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from scripts import PRELUDE, TIMEOUT, run_script

# A C `atexit` handler that keeps the process alive 1.5 s after `Py_FinalizeEx` returned, as
# vLLM's teardown does: loaded with ctypes, it runs when `exit()` runs, after finalization.
HOLD_AFTER_FINALIZE = r"""
#include <stdlib.h>
#include <unistd.h>
static void hold(void) { usleep(1500000); }
__attribute__((constructor)) static void at_load(void) { atexit(hold); }
"""


@pytest.fixture(scope="module")
def hold_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the atexit handler")
    folder = tmp_path_factory.mktemp("hold")
    source, library = folder / "hold.c", folder / "libhold.so"
    source.write_text(HOLD_AFTER_FINALIZE)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def test_a_writer_outliving_finalization_never_calls_into_the_interpreter(
    hold_library: Path,
) -> None:
    # A daemon thread holds the writer in its frame and keeps its queue full of large jobs; the
    # main thread returns, the interpreter is finalized, and the writer thread goes on finishing
    # jobs for 1.5 s. Scheduling their release with Py_AddPendingCall then crashed (SIGSEGV in
    # _PyEval_AddPendingCall with interp=NULL) in every run.
    code = PRELUDE + textwrap.dedent(
        f"""
        import ctypes
        ctypes.CDLL({str(hold_library)!r})

        def feed():
            # Jobs of 256 MiB: the queue holds about a second of copying when finalization ends.
            store = BlockObjectStore(max_bytes=512 << 20, object_nbytes=16 << 20)
            writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
            payloads = [np.full(16 << 20, i, dtype=np.uint8) for i in range(16)]
            i = 0
            while True:
                writer.put([BlockObject(f"k{{i}}-{{j}}", p) for j, p in enumerate(payloads)])
                i += 1

        threading.Thread(target=feed, daemon=True).start()
        time.sleep(0.5)
        print("main returns", flush=True)
        """
    )
    for _ in range(3):
        try:
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the process hung after finalization")
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
        assert "main returns" in done.stdout


# A store whose background prefault is still running when the process forks; 1 GiB takes the
# populator long enough (hundreds of ms) for the fork to land while it runs.
FORK_WHILE_POPULATING = """
import faulthandler
faulthandler.enable()
from aostore import VariableBlockObjectStore

ARENA = 1 << 30
def make(kind):
    if kind == "fixed":
        return BlockObjectStore(max_bytes=ARENA, object_nbytes=1 << 16, prefault="background")
    return VariableBlockObjectStore(max_bytes=ARENA, prefault="background")

kind, child_action = sys.argv[1], sys.argv[2]
store = make(kind)
pid = os.fork()
if pid == 0:
    if child_action == "own-writer":
        # As the README advises: the child builds its own store and writer first, whose thread
        # may reuse the memory of the parent's populator handle.
        own = BlockObjectStore(max_bytes=1 << 20, object_nbytes=1 << 10)
        writer = BackgroundBlockObjectStore(own, max_pending_batches=2)
        writer.put([BlockObject("c", bytes(1 << 10))])
        assert writer.get_concatenated(["c"]) == bytes(1 << 10)
    try:
        store.put([BlockObject("x", bytes(1 << 16))])
        print("child put worked", flush=True)
    except RuntimeError as error:
        print("child put refused:", "fork" in str(error), flush=True)
    del store
    gc.collect()
    if child_action == "own-writer":
        writer.close()
    print("child dropped the parent's store", flush=True)
    sys.stdout.flush()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child status", status, flush=True)
store.put([BlockObject("p", bytes(1 << 16))])
store.close()
print("parent ok", flush=True)
"""


@pytest.mark.parametrize("child_action", ["drop", "own-writer"])
@pytest.mark.parametrize("kind", ["fixed", "variable"])
def test_a_child_forked_during_background_prefault_drops_the_store_cleanly(
    kind: str, child_action: str
) -> None:
    # The child has no populator thread: dropping the parent's store joined a handle that names
    # no thread of its own (a panic in tp_dealloc, or, once the child had started a writer
    # thread, a join of that thread that never returned, holding the GIL).
    code = PRELUDE + textwrap.dedent(FORK_WHILE_POPULATING)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, kind, child_action],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"hung: {timeout.stdout!r} {timeout.stderr!r}")
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert "panicked" not in done.stderr, done.stderr
    assert "child put refused: True" in out, out
    assert "child dropped the parent's store" in out, out
    assert "child status 0" in out, out
    assert "parent ok" in out, out


def test_a_forked_child_can_build_and_use_its_own_background_prefault_store() -> None:
    out = run_script(
        """
        from aostore import VariableBlockObjectStore
        store = BlockObjectStore(max_bytes=1 << 30, object_nbytes=1 << 16, prefault="background")
        pid = os.fork()
        if pid == 0:
            mine = BlockObjectStore(max_bytes=1 << 28, object_nbytes=1 << 16, prefault="background")
            mine.put([BlockObject("k", bytes([3]) * (1 << 16))])
            ok = mine.get_concatenated(["k"]) == bytes([3]) * (1 << 16)
            mine.close()
            rows = VariableBlockObjectStore(max_bytes=1 << 24, prefault="background")
            rows.put([BlockObject("r", b"row")])
            ok = ok and rows.get_concatenated(["r"]) == b"row"
            rows.close()
            print("child", ok, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        store.close()
        print("status", status)
        """
    )
    assert "child True" in out, out
    assert "status 0" in out, out


# --------------------------------------------------------------------- fork and exit with a writer


# The store (and writer) a busy thread keeps locked at fork time, and what the child tries.
FORK_SCRIPT = """
SETUP
payload = bytes(NBYTES)
stop = threading.Event()

def busy():  # keeps the store lock (and the writer, if any) busy at fork time
    i = 0
    while not stop.is_set():
        BUSY.put([BlockObject(f"k{i % 64}", payload)])
        i += 1

thread = threading.Thread(target=busy)
thread.start()
time.sleep(0.2)
pid = os.fork()
if pid == 0:
    outcomes = []
    for call in (CALLS):
        try:
            call()
            outcomes.append("worked")
        except RuntimeError as error:
            outcomes.append("fork" in str(error))
    print("child", outcomes, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
stop.set()
thread.join()
TEARDOWN
print("parent ok", flush=True)
"""
FORKED = {
    "fixed-writer": {
        "SETUP": "store = BlockObjectStore(max_bytes=64 << 16, object_nbytes=1 << 16)\n"
        "writer = BackgroundBlockObjectStore(store, max_pending_batches=1)",
        "NBYTES": "1 << 16",
        "BUSY": "writer",
        "CALLS": 'lambda: store.put([BlockObject("c", payload)]), '
        'lambda: store.get_concatenated(["k1"]), '
        'lambda: writer.put([BlockObject("c", payload)]), '
        'lambda: writer.get_concatenated(["k1"]), '
        "lambda: writer.close()",
        "TEARDOWN": "writer.close()",
    },
    "variable": {
        "SETUP": "from aostore import VariableBlockObjectStore\n"
        'store = VariableBlockObjectStore(max_bytes=1 << 22, prefault="background")',
        "NBYTES": "3000",
        "BUSY": "store",
        "CALLS": 'lambda: store.put([BlockObject("c", payload)]), '
        'lambda: store.get_concatenated(["k1"]), '
        'lambda: store.get_many(["k1"]), '
        'lambda: store.contains(["k1"]), '
        "lambda: store.stats()",
        "TEARDOWN": "store.check()\nstore.close()",
    },
}


@pytest.mark.parametrize("kind", list(FORKED))
def test_a_forked_child_gets_a_clear_error_never_a_hang(kind):
    script = FORK_SCRIPT
    for name, text in FORKED[kind].items():
        script = script.replace(name, text)
    out = run_script(script, timeout=60)
    assert "child [True, True, True, True, True]" in out, out
    assert "parent ok" in out, out


def test_a_python_writer_in_a_forked_child_raises():
    out = run_script(
        """
        class Slow:
            def put(self, objects, *, retain_keys=(), release_keys=()):
                time.sleep(5)
            def get_concatenated(self, keys):
                return b""
            def close(self):
                pass

        writer = BackgroundBlockObjectStore(Slow(), max_pending_batches=4)
        writer.put([BlockObject("a", b"x")])
        pid = os.fork()
        if pid == 0:
            try:
                writer.get_concatenated(["a"])
                print("child worked", flush=True)
            except RuntimeError as error:
                print("child", "fork" in str(error), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        """
    )
    assert "child True" in out, out


def test_an_abandoned_writer_at_interpreter_exit_exits_cleanly():
    for _ in range(3):
        out = run_script(
            """
            store = BlockObjectStore(max_bytes=64 << 16, object_nbytes=1 << 16)
            writer = BackgroundBlockObjectStore(store, max_pending_batches=8)
            for i in range(32):
                writer.put([BlockObject(f"k{i}", bytearray(1 << 16))])
            keep = [writer]  # module globals: torn down during interpreter finalization
            print("end")
            """
        )
        assert "end" in out


# Many writers finishing jobs all the time: at any fork, one of them likely holds its state lock
# or is between its exit-gate check and `Py_AddPendingCall`, and the interpreter likely has
# one of their release calls queued, which CPython 3.11 copies into the child and runs there.
FORK_WHILE_WRITERS_FINISH = """
import select
import signal

stores = [BlockObjectStore(max_bytes=64 * 4096, object_nbytes=4096) for _ in range(24)]
writers = [BackgroundBlockObjectStore(s, max_pending_batches=4) for s in stores]
payloads = [bytes([i]) * 4096 for i in range(8)]
stop = threading.Event()

def feed():
    i = 0
    while not stop.is_set():
        for w in writers:
            w.put([BlockObject(f"k{i}-{j}", p) for j, p in enumerate(payloads)])
        i += 1

feeder = threading.Thread(target=feed, daemon=True)
feeder.start()
time.sleep(0.2)
hung = 0
for trial in range(TRIALS):
    time.sleep(0.003 * (trial % 7))
    pid = os.fork()
    if pid == 0:
        # Python code runs the queued pending calls; a normal exit runs the atexit hook.
        total = sum(range(20_000))
        sys.exit(0 if total else 1)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            break
        time.sleep(0.005)
    else:
        hung += 1
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
stop.set()
feeder.join()
for w in writers:
    w.close()
print("hung", hung)
"""


def test_forked_children_never_hang_on_the_parents_writers() -> None:
    # Two hangs with one cause, a lock taken in the child that a parent thread held at fork:
    # the queued release of finished jobs locked the writer's state (14 of 80 children hung),
    # and the exit hook waited on a read lock a writer thread held across the fork.
    out = run_script("TRIALS = 120\n" + FORK_WHILE_WRITERS_FINISH, timeout=240)
    assert out.split()[-2:] == ["hung", "0"], out


def test_a_subinterpreter_cannot_import_aostore_or_stop_payload_release() -> None:
    # Loaded in a subinterpreter, the module registered its exit hook there too; ending that
    # interpreter ran it, and from then on no writer in the process released payloads.
    out = run_script(
        """
        import _xxsubinterpreters as interpreters

        sub = interpreters.create()
        try:
            interpreters.run_string(sub, "import aostore")
        except interpreters.RunFailedError as error:
            print("refused:", error)
        interpreters.destroy(sub)

        store = BlockObjectStore(max_bytes=4 * 64, object_nbytes=64)
        writer = BackgroundBlockObjectStore(store, max_pending_batches=2)
        payload = bytearray(64)
        writer.put([BlockObject("k", payload)])
        # The writer's pending call releases the export once the batch is applied; no call
        # into the writer does it here.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                payload.extend(b"x")
                break
            except BufferError:
                time.sleep(0.01)
        print("released", len(payload) == 65)
        writer.close()
        """
    )
    assert "aostore cannot be imported in a subinterpreter" in out, out
    assert "released True" in out, out
