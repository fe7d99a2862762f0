"""T14: R3 rows by reference (docs/r3-reference.md) against vLLM's rows, a server and a client
process.

vLLM answers a non-streaming ``/v1/completions`` with the routed experts as base64 ``.npy``
inside the JSON body; a trainer decodes them (``json.loads``, ``base64.b64decode``,
``np.load``). With ``AOSTORE_VLLM_R3_DELIVERY=reference`` the body carries a reference and the
trainer reads the rows from the frontend's arena with ``aostore.r3.fetch``. Per arm, a forked
server and a forked client, paired over the same requests and seeds, in ABBA order:

- ``vllm``: vLLM as shipped (its transport, its finish, ``numpy2base64``, Starlette's render);
- ``rows``: aostore's transport (T13) with vLLM's rows, for reference;
- ``reference``: aostore's transport with delivery by reference.

T15 (``--t15``; root, Mooncake installed) reads the references on another node: a Mooncake
master on loopback, the frontend publishing each reference to it (``AOSTORE_VLLM_R3_MOONCAKE``,
its own client's segment), and a client in a mount namespace of its own with an empty
``/dev/shm`` and another boot id, which reads through Mooncake (``AOSTORE_R3_MOONCAKE``):

- ``offnode``: the server's timed window ends once the publication is in Mooncake (its thread's
  CPU counted); the client's full read is set against Mooncake's own ``batch_get_into`` of the
  same objects into a buffer registered beforehand;
- ``stalled``: the master stopped (SIGSTOP) for the whole run: what the finish costs while
  publication cannot proceed (the client reads nothing).

The server is the API server's part of a finish with vLLM's own classes: the request's outputs
go through vLLM's ``OutputProcessor`` (untimed: the rows arrive as fresh arrays, as the
decoders give them), then, timed, the output that finishes it (its rows joined, or written into
the arena), the answer (``numpy2base64``, ``CompletionResponse``, ``JSONResponse(content=
response.model_dump())``) and the body's send over loopback TCP. The client receives the body,
``json.loads`` it and gets the rows: vLLM's recipe (``np.load(io.BytesIO(base64.b64decode(s)))``)
for rows, ``aostore.r3.fetch`` for references (one batched call for a batch). CPU is
whole-process (``getrusage``: every thread), server and client in lockstep (the client acks each
body), so neither's figure holds the other's work; the collector as vLLM leaves it
(``freeze_gc_heap`` in the server after set-up; the client's set-up frozen the same way, so that
no arm pays a full collection of the bench's own imports). Every request's rows are checked
afterwards against what was produced. The client's peak memory to get the rows is the peak of traced
allocations (``tracemalloc``; numpy's buffers are traced): a view maps the frontend's shared
pages, which are counted on the node (the orchestrator table), not in the client's heap.

Jobs:

- ``sample``: one 16k-token GLM-4.5-Air sample (700 prompt tokens, 16,384 output tokens:
  17,083 rows of 46 x 8 uint8, 6.0 MB), one row an output as vLLM's frontend gets them;
  ``--sample-reps`` repetitions a run (the first on a cold heap), one more traced;
- ``batch``: W3's 512 requests (``benches/worker.py``'s schedule: prompts of 200-1,200 tokens,
  outputs of 1k-16k), the client reading all 512 before it gets rows (in one ``fetch``), traced;
  their decode rows arrive 16 tokens an output (fewer chunks than vLLM joins in life: vLLM's
  finish is the cheaper for it);
- ``rollout``: one rollout of 100k tokens, for an orchestrator that buffers 3,800 of them: the
  bytes it holds per rollout (the body's ``routed_experts`` string) and the bytes held on the
  frontend's node (the arena's, until read).

Then, in the reference arm, a full read of the rows' bytes against a memcpy floor (``np.copyto``
of as many bytes between two warm buffers): the views touched (each copied into a warm buffer)
and ``fetch(..., out=)`` (one ``preadv`` a reference).

Targets (docs/workloads.md, T14): the routed-experts field at most 1 KB a sample; the server's
and the client's CPU per sample each at most 1/20 of vLLM's; a batch read within 1.5x of the memcpy
floor.

    python benches/r3_reference.py                 # one ABBA block
    python benches/r3_reference.py --quick         # tiny sizes, a smoke run
    python benches/r3_reference.py --reps 3 --out t14.json
    python benches/r3_reference.py --t15 --reps 2  # T15, as root

Run it with vLLM 0.33.0 or 0.34.0 and aostore installed (``.venv-vllm/bin/python``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import functools
import gc
import io
import itertools
import json
import multiprocessing
import os
import resource
import signal
import socket
import statistics
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import transport_hops as hops  # noqa: E402  (vLLM's classes, aostore's transport install)
import worker  # noqa: E402  (benches/worker.py: W3's schedule; sets AOSTORE_VLLM_PLUGIN=0)
from aostore.bench import replay  # noqa: E402

LAYERS, TOP_K = hops.LAYERS, hops.TOP_K
ROW_NBYTES = LAYERS * TOP_K
POOL = 4096
ROLLOUTS = 3_800  # the orchestrator's buffer (prime-rl#2796)
WAIT_S = 900.0
BUDGET = "AOSTORE_BENCH_R3_BUDGET"
"""The reference arm's arena: set per job to hold every pass's rows (none falls back)."""


def _reference(process: str) -> None:
    """aostore's plugin with delivery by reference, as a user turns it on: the arena starts
    with the processor."""
    from aostore.vllm.settings import ENV_R3_BUDGET, ENV_R3_DELIVERY, ENV_R3_TTL

    os.environ[ENV_R3_DELIVERY] = "reference"
    os.environ[ENV_R3_BUDGET] = os.environ[BUDGET]
    os.environ[ENV_R3_TTL] = "3600"
    hops.ARMS["aostore"].install(process)


def _offnode(process: str) -> None:
    """By reference, published to the bench's Mooncake master for readers on other nodes
    (``AOSTORE_VLLM_R3_MOONCAKE``: the frontend's client mounts a segment sized from the
    budget)."""
    from aostore.vllm.settings import ENV_R3_MOONCAKE

    os.environ[ENV_R3_MOONCAKE] = os.environ[MOONCAKE]
    _reference(process)


ARMS: dict[str, hops.Arm] = {
    "vllm": dataclasses.replace(hops.ARMS["vllm"], label="vLLM's rows"),
    "rows": dataclasses.replace(
        hops.ARMS["aostore"], name="rows", label="aostore's transport, rows"
    ),
    "reference": hops.Arm(
        "reference", "aostore's transport, by reference", r3=True, install=_reference
    ),
    "offnode": hops.Arm("offnode", "by reference, read on another node", r3=True, install=_offnode),
    "stalled": hops.Arm("stalled", "by reference, the master stalled", r3=True, install=_offnode),
}
T14_ARMS = ("vllm", "rows", "reference")
T15_ARMS = ("vllm", "offnode", "stalled")
OFF_NODE = ("offnode", "stalled")
"""Arms whose client runs as on another node (T15): its own mount namespace, an empty
``/dev/shm`` and another boot id, reading through Mooncake (``stalled``: the master is stopped
while the server finishes, and the client reads nothing)."""
MOONCAKE = "AOSTORE_BENCH_R3_MOONCAKE"
"""The bench's client config file (its master on loopback), for the off-node arms."""
MASTER_PID = "AOSTORE_BENCH_MASTER_PID"


@dataclasses.dataclass(frozen=True)
class Job:
    """Requests of (prompt tokens, output tokens); decode rows ``chunk`` tokens an output;
    ``reps`` timed passes and one more under tracemalloc (0 reps: one pass, timed and
    traced)."""

    name: str
    requests: tuple[tuple[int, int], ...]
    chunk: int
    reps: int

    @property
    def rows(self) -> int:
        return sum(p + o - 1 for p, o in self.requests)

    @property
    def passes(self) -> int:
        return self.reps + 1 if self.reps else 1

    @property
    def timed(self) -> int:
        """The passes whose CPU counts: the first ``timed``."""
        return max(self.reps, 1)


@functools.cache
def _pool() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 128, (POOL, LAYERS, TOP_K), np.uint8)


def expected(index: int, n: int) -> np.ndarray:
    """Request ``index``'s rows (a function of it, so the client checks without being told)."""
    rows: np.ndarray = _pool()[(index * 7919 + np.arange(n)) % POOL]
    return rows


def _cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    data = bytearray(n)
    view = memoryview(data)
    got = 0
    while got < n:
        took = sock.recv_into(view[got:])
        if not took:
            raise ConnectionError("the server went away")
        got += took
    return data


# -- The server ---------------------------------------------------------------------------------


def server(arm: hops.Arm, job: Job, port_out: Connection) -> dict[str, Any]:
    """vLLM's frontend and API server for ``job``'s requests, one at a time; the answers sent
    over TCP, one body per ack."""
    import starlette.responses  # noqa: F401  (vLLM's API server imports it before plugins)

    arm.install("frontend")
    hops.import_answer_classes()
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.serial_utils import numpy2base64
    from vllm.v1 import engine as v1_engine
    from vllm.v1.engine import output_processor as op_module

    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    processor = op_module.OutputProcessor(None, log_stats=False)  # the arena starts here
    from aostore.vllm.transport import delivery

    held = delivery.installed()
    publisher = held.publisher if held is not None else None
    if arm.name in OFF_NODE:
        held.start()  # the arena and its publisher, connected while the master answers
        publisher = held.publisher
        assert publisher is not None, "the off-node arms publish"
    stalled = arm.name == "stalled"
    if stalled:
        os.kill(int(os.environ[MASTER_PID]), signal.SIGSTOP)
    freeze_gc_heap()
    clock = time.thread_time_ns
    figures: list[dict[str, Any]] = []
    for number in range(job.passes):
        for index, (prompt_len, out_len) in enumerate(job.requests):
            rid = f"req-{number}-{index}"
            rows = expected(index, prompt_len + out_len - 1)
            processor.add_request(hops.engine_request(rid, prompt_len, out_len), None)
            outputs = _outputs(v1_engine, rid, rows, prompt_len, out_len, job.chunk)
            for output in outputs[:-1]:  # the request running: untimed
                processor.process_outputs([output], None, None)
            last = outputs[-1]
            del outputs, rows
            cpu0, t0 = _cpu_ns(), clock()
            (finished,) = processor.process_outputs([last], None, None).request_outputs
            t1 = clock()
            completion = finished.outputs[0]
            field = numpy2base64(completion.routed_experts)
            body = hops.completion_body(completion, field, prompt_len, out_len)
            t2 = clock()
            conn.sendall(struct.pack("<Q", len(body)) + body)
            if publisher is not None and not stalled:
                # Its publication's CPU (the publisher's thread) counts in the server's.
                publisher.flush()
            t3, cpu1 = clock(), _cpu_ns()
            figures.append(
                {
                    "pass": number,
                    "finish_ns": t1 - t0,
                    "answer_ns": t2 - t1,
                    "send_ns": t3 - t2,
                    "cpu_ns": cpu1 - cpu0,
                    "body_bytes": len(body),
                    "field_bytes": len(field),
                }
            )
            del finished, completion, field, body
            if conn.recv(1) != b"k":
                raise ConnectionError("the client did not ack")
    if stalled:
        os.kill(int(os.environ[MASTER_PID]), signal.SIGCONT)
    arena = held.stats() if held is not None else None
    conn.recv(1)  # the client is done reading: the arena may go
    if publisher is not None:
        publisher.close(timeout=10.0)
    if held is not None and held.arena is not None:
        held.arena.close()  # this process ends with os._exit: no finalizers
    conn.close()
    listener.close()
    return {"answers": figures, "arena": arena}


def _outputs(
    v1_engine: Any, rid: str, rows: np.ndarray, prompt_len: int, out_len: int, chunk: int
) -> list[Any]:
    """The request's outputs as the frontend gets them: the prefill's with the prompt's rows,
    then ``chunk`` tokens an output (each with its rows, a fresh array), the last finishing."""
    made = []
    done = 1
    made.append((1, rows[:prompt_len]))
    at = prompt_len
    while done < out_len:
        n = min(chunk, out_len - done)
        made.append((n, rows[at : at + n]))
        at += n
        done += n
    outputs = []
    for i, (n, part) in enumerate(made):
        outputs.append(
            v1_engine.EngineCoreOutput(
                request_id=rid,
                new_token_ids=[hops.TOKEN] * n,
                finish_reason=v1_engine.FinishReason.LENGTH if i == len(made) - 1 else None,
                routed_experts=part.copy(),
            )
        )
    return outputs


# -- The client ---------------------------------------------------------------------------------


def client(arm: hops.Arm, job: Job, port: int) -> dict[str, Any]:
    """The trainer's side: each body received and parsed, the rows got; the figures, then the
    rows checked."""
    import tracemalloc

    from aostore import r3

    # The bench's own imports (vLLM, torch: ~630k tracked objects) frozen, as the server's are:
    # else the first arm to allocate after them pays a full collection of that heap (0.4 s,
    # most of a batch's fetch), wherever the collector's count happens to fall.
    if arm.name in OFF_NODE:
        elsewhere()
    gc.collect()
    gc.freeze()
    sock = socket.create_connection(("127.0.0.1", port))
    by_reference = arm.name in ("reference", "offnode")
    passes: list[dict[str, Any]] = []
    read: dict[str, float] = {}
    held_strings: list[int] = []
    for number in range(job.passes):
        traced = number == job.passes - 1
        if traced:
            tracemalloc.start()
        cpu0 = _cpu_ns()
        fields: list[str] = []
        got: list[np.ndarray] = []
        for _ in job.requests:
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            answer = json.loads(_recv_exact(sock, size))
            field = answer["choices"][0]["routed_experts"]
            del answer
            if by_reference or arm.name == "stalled":
                fields.append(field)  # read in one batch below (stalled: not read)
            else:
                got.append(np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False))
            if number == 0:
                held_strings.append(sys.getsizeof(field))
            del field
            sock.sendall(b"k")
        batch = r3.fetch(fields) if by_reference else None
        if batch is not None:
            got = list(batch)
        cpu1 = _cpu_ns()
        figures = {"cpu_ns": cpu1 - cpu0}
        if traced:
            figures["peak_bytes"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        passes.append(figures)
        if arm.name != "stalled":
            check(arm, job, got)
        if batch is not None and traced:
            read = full_read(got, fields, r3)
            if arm.name == "offnode":
                read |= mooncake_read(fields)
        del got
        if batch is not None:
            batch.release()
    sock.sendall(b"d")
    sock.close()
    return {"passes": passes, "read": read, "held_string_bytes": held_strings}


def check(arm: hops.Arm, job: Job, got: list[np.ndarray]) -> None:
    for index, ((prompt_len, out_len), rows) in enumerate(zip(job.requests, got, strict=True)):
        if not np.array_equal(rows, expected(index, prompt_len + out_len - 1)):
            raise AssertionError(f"{arm.name}: wrong rows for request {index}")


def full_read(views: list[np.ndarray], fields: list[str], r3: Any) -> dict[str, float]:
    """Every byte of the batch's rows read, best of three: ``fetch`` with ``out=``, and the
    views copied into a warm buffer one by one; against two memcpy floors between warm
    ordinary buffers: the batch's bytes in one ``np.copyto`` (glibc streams a copy that large
    past the cache), and the same copies one sample at a time (which it does not)."""
    total = sum(v.shape[0] for v in views)
    out = np.empty((total, *views[0].shape[1:]), views[0].dtype)
    source = np.empty_like(out)
    source.fill(1)
    out.fill(0)
    bounds = np.cumsum([0, *(len(v) for v in views)])
    timings: dict[str, list[int]] = {"floor": [], "floor_pieces": [], "views": [], "out": []}

    def pieces(parts: Any) -> None:
        for (a, b), part in zip(itertools.pairwise(bounds), parts, strict=True):
            np.copyto(out[a:b], part)

    for _ in range(3):
        t0 = time.perf_counter_ns()
        np.copyto(out, source)
        t1 = time.perf_counter_ns()
        pieces(source[a:b] for a, b in itertools.pairwise(bounds))
        t2 = time.perf_counter_ns()
        pieces(views)
        t3 = time.perf_counter_ns()
        r3.fetch(fields, out=out)
        t4 = time.perf_counter_ns()
        for name, ns in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            timings[name].append(ns)
    return {"bytes": int(out.nbytes)} | {f"{k}_ms": min(v) / 1e6 for k, v in timings.items()}


def elsewhere() -> None:
    """This process as a reader on another node (``tests/support/other_node.py``)."""
    sys.path.insert(0, str(HERE.parent / "tests" / "support"))
    import other_node

    missing = other_node.missing_reason()
    if missing:
        raise RuntimeError(f"the off-node arms: {missing}")
    other_node.become_another_node()


def mooncake_read(fields: list[str]) -> dict[str, float]:
    """Mooncake's own read of the batch's objects (the same keys and bytes the reader reads)
    into one buffer registered beforehand, best of three: the off-node read's floor."""
    from aostore.mooncake.client import connect
    from aostore.mooncake.config import MooncakeConfig
    from aostore.r3 import format as fmt
    from aostore.r3 import offnode

    config = MooncakeConfig.from_file(os.environ[offnode.SETTING])
    names, sizes = [], []
    for field in fields:
        item = fmt.parse(field)
        dtype, shape = fmt.rows_of(item)
        ident = fmt.ident(item["arena"])
        names.append(
            offnode.key(config.key_prefix, ident, int(item["slot"]), int(item["generation"]))
        )
        sizes.append(offnode.HEADER.itemsize + dtype.itemsize * int(np.prod(shape)))
    offsets = np.cumsum([0, *(-(-size // 64) * 64 for size in sizes)])
    staging = np.zeros(int(offsets[-1]), np.uint8)
    client = connect(config)
    base = staging.ctypes.data
    if client.register_buffer(base, staging.nbytes) != 0:
        raise RuntimeError("Mooncake did not register the floor's buffer")
    timings = []
    try:
        for _ in range(3):
            t0 = time.perf_counter_ns()
            codes = client.batch_get_into(names, [base + int(o) for o in offsets[:-1]], sizes)
            timings.append(time.perf_counter_ns() - t0)
            if list(codes) != sizes:
                raise RuntimeError(f"Mooncake's own read failed: {set(codes) - set(sizes)}")
    finally:
        client.unregister_buffer(base)
        client.close()
    return {"mooncake_ms": min(timings) / 1e6}


# -- One run ------------------------------------------------------------------------------------


def _child(result_path: str, body: Callable[..., dict[str, Any]], *args: Any) -> None:
    try:
        result = body(*args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(result))
    os._exit(0)


def run_arm(arm: hops.Arm, job: Job, number: int) -> dict[str, Any]:
    """``job`` with ``arm``: a server and a client, each forked fresh."""
    context = multiprocessing.get_context("fork")
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    paths = {side: scratch / f"aostore-t14-{os.getpid()}-{number}-{side}.json" for side in "sc"}
    port_in, port_out = context.Pipe(duplex=False)
    pages = sum(-(-(p + o - 1) * ROW_NBYTES // 4096) for p, o in job.requests)
    os.environ[BUDGET] = str(pages * 4096 * job.passes + (16 << 20))
    serving = context.Process(target=_child, args=(str(paths["s"]), server, arm, job, port_out))
    serving.start()
    if not port_in.poll(WAIT_S):
        serving.kill()
        raise RuntimeError(f"{arm.name}: the server did not start")
    port = port_in.recv()
    reading = context.Process(target=_child, args=(str(paths["c"]), client, arm, job, port))
    reading.start()
    results = {}
    for side, process in (("client", reading), ("server", serving)):
        process.join(WAIT_S)
        if process.is_alive():
            process.kill()
        path = paths[side[0]]
        try:
            results[side] = json.loads(path.read_text())
        except FileNotFoundError:
            results[side] = {"error": f"exited with {process.exitcode}, no result"}
        finally:
            path.unlink(missing_ok=True)
    errors = [f"{side}: {r['error']}" for side, r in results.items() if "error" in r]
    if errors:
        held = results["server"].get("arena")
        said = f"\nthe server's arena and publisher: {held}" if held else ""
        raise RuntimeError(f"{arm.name} {job.name}: " + "\n".join(errors) + said)
    arena = results["server"]["arena"]
    if arena is not None and arena["fallbacks"]:
        raise RuntimeError(f"{arm.name} {job.name}: {arena['fallbacks']} rows fell back")
    return {"arm": arm.name, "job": job.name, **results}


# -- Figures ------------------------------------------------------------------------------------


def summarize(job: Job, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: per sample (a request; for the batch, the batch's total over its requests)
    the server's CPU (median over timed passes; the cold pass: each run's first), its parts,
    the client's CPU, the field's and the body's bytes, the client's traced peak."""
    arms: dict[str, Any] = {}
    n = len(job.requests)
    for name in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == name]
        timed = [a for r in mine for a in r["server"]["answers"] if a["pass"] < job.timed]
        per_pass: dict[tuple[int, int], float] = {}
        for i, r in enumerate(mine):
            for a in r["server"]["answers"]:
                if a["pass"] < job.timed:
                    per_pass[(i, a["pass"])] = per_pass.get((i, a["pass"]), 0) + a["cpu_ns"]
        first = [a for r in mine for a in r["server"]["answers"] if a["pass"] == 0]
        client_timed = [p["cpu_ns"] for r in mine for p in r["client"]["passes"][: job.timed]]
        f: dict[str, Any] = {
            "requests": n,
            "rows": job.rows,
            "runs": len(mine),
            "server_ms": statistics.median(per_pass.values()) / 1e6,
            "server_cold_ms": statistics.median(
                sum(a["cpu_ns"] for a in r["server"]["answers"] if a["pass"] == 0) for r in mine
            )
            / 1e6,
            "client_ms": statistics.median(client_timed) / 1e6,
            "field_bytes_max": max(a["field_bytes"] for a in timed),
            "body_bytes": sum(a["body_bytes"] for a in first) / len(mine),
            "client_peak_mib": max(r["client"]["passes"][-1]["peak_bytes"] for r in mine) / 2**20,
            "orchestrator_bytes": statistics.median(
                sum(r["client"]["held_string_bytes"]) for r in mine
            ),
        }
        for part in ("finish", "answer", "send"):
            f[f"{part}_ms"] = (
                statistics.median(
                    sum(a[f"{part}_ns"] for a in r["server"]["answers"] if a["pass"] == p)
                    for r in mine
                    for p in range(job.timed)
                )
                / 1e6
            )
        arena = mine[0]["server"]["arena"]
        f["node_bytes"] = arena["bytes_held"] / job.passes if arena else 0
        reads = [r["client"]["read"] for r in mine if r["client"]["read"]]
        if reads:
            f["read"] = {k: statistics.median(r[k] for r in reads) for k in reads[0]}
        arms[name] = f
    return arms


def table(job: Job, arms: dict[str, Any]) -> str:
    lines = [
        f"{job.name}: {len(job.requests):,} request(s), {job.rows:,} rows "
        f"({job.rows * ROW_NBYTES / 1e6:,.1f} MB)",
        "| arm | server CPU ms (cold) | finish / answer / send ms | client CPU ms | "
        "field bytes | body bytes | client peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in arms.items():
        lines.append(
            f"| {ARMS[name].label} | {f['server_ms']:.2f} ({f['server_cold_ms']:.2f}) | "
            f"{f['finish_ms']:.2f} / {f['answer_ms']:.2f} / {f['send_ms']:.2f} | "
            f"{f['client_ms']:.2f} | {f['field_bytes_max']:,} | {f['body_bytes']:,.0f} | "
            f"{f['client_peak_mib']:.1f} |"
        )
    read = arms.get("reference", {}).get("read")
    if read:
        floor, pieces = read["floor_ms"], read["floor_pieces_ms"]
        lines.append(
            f"full read of {read['bytes'] / 1e6:,.1f} MB: fetch(out=) {read['out_ms']:.2f} ms "
            f"({read['out_ms'] / floor:.2f}x the memcpy floor of {floor:.2f} ms); the views "
            f"copied one by one {read['views_ms']:.2f} ms ({read['views_ms'] / floor:.2f}x; "
            f"{read['views_ms'] / pieces:.2f}x the same copies between ordinary buffers, "
            f"{pieces:.2f} ms)"
        )
    read = arms.get("offnode", {}).get("read")
    if read:
        floor = read["mooncake_ms"]
        lines.append(
            f"off-node read of {read['bytes'] / 1e6:,.1f} MB: fetch(out=) {read['out_ms']:.2f} "
            f"ms ({read['out_ms'] / floor:.2f}x Mooncake's own batch_get_into of the same "
            f"objects into a registered buffer, {floor:.2f} ms)"
        )
    return "\n".join(lines)


def t15(jobs: dict[str, Any]) -> dict[str, Any]:
    """The targets: the server's CPU a sample with publication at most 1/10 of vLLM's rows; an
    off-node batch read at most 1.25x Mooncake's own; the finish with the master stalled at
    most 1.1x the healthy one; the field at most 1 KB."""
    figures: dict[str, Any] = {}
    for name, arms in jobs.items():
        if "vllm" not in arms or "offnode" not in arms:
            continue
        ours, theirs = arms["offnode"], arms["vllm"]
        f = {
            "field_bytes": ours["field_bytes_max"],
            "server_ratio": ours["server_ms"] / theirs["server_ms"],
            "client_ratio": ours["client_ms"] / theirs["client_ms"],
        }
        read = ours.get("read")
        if read:
            f["read_ratio"] = read["out_ms"] / read["mooncake_ms"]
        if "stalled" in arms:
            f["stall_ratio"] = arms["stalled"]["finish_ms"] / ours["finish_ms"]
        figures[name] = f
    return figures


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def t15_lines(figures: dict[str, Any]) -> list[str]:
    lines = []
    for name, f in figures.items():
        line = (
            f"T15 {name}: field {f['field_bytes']} B (<= 1,024: {met(f['field_bytes'] <= 1024)})"
            f"; server CPU with publication {f['server_ratio']:.3f} of vLLM's rows (<= 1/10: "
            f"{met(f['server_ratio'] <= 0.1)}); the off-node client's CPU "
            f"{f['client_ratio']:.3f} of vLLM's"
        )
        if "read_ratio" in f:
            line += (
                f"; off-node read {f['read_ratio']:.2f}x Mooncake's own (<= 1.25x: "
                f"{met(f['read_ratio'] <= 1.25)})"
            )
        if "stall_ratio" in f:
            line += (
                f"; the finish with the master stalled {f['stall_ratio']:.2f}x healthy "
                f"(<= 1.1x: {met(f['stall_ratio'] <= 1.1)})"
            )
        lines.append(line)
    return lines


def t14(jobs: dict[str, Any]) -> dict[str, Any]:
    """The targets: field at most 1 KB; server and client CPU at most 1/20 of vLLM's per
    sample; a batch read within 1.5x of the floor."""
    figures: dict[str, Any] = {}
    for name, arms in jobs.items():
        if "vllm" not in arms or "reference" not in arms:
            continue
        ours, theirs = arms["reference"], arms["vllm"]
        figures[name] = {
            "field_bytes": ours["field_bytes_max"],
            "server_ratio": ours["server_ms"] / theirs["server_ms"],
            "client_ratio": ours["client_ms"] / theirs["client_ms"],
            "client_peak_ratio": ours["client_peak_mib"] / max(theirs["client_peak_mib"], 1e-9),
        }
        read = ours.get("read")
        if read:
            figures[name]["read_out"] = read["out_ms"] / read["floor_ms"]
            figures[name]["read_views"] = read["views_ms"] / read["floor_ms"]
            figures[name]["read_views_pieces"] = read["views_ms"] / read["floor_pieces_ms"]
    return figures


def t14_lines(figures: dict[str, Any]) -> list[str]:
    lines = []
    for name, f in figures.items():
        line = (
            f"T14 {name}: field {f['field_bytes']} B (<= 1,024: {met(f['field_bytes'] <= 1024)})"
            f"; server CPU {f['server_ratio']:.3f} of vLLM's, client CPU "
            f"{f['client_ratio']:.3f} (<= 1/20: "
            f"{met(max(f['server_ratio'], f['client_ratio']) <= 0.05)})"
        )
        if "read_out" in f:
            line += (
                f"; a full read with out= {f['read_out']:.2f}x the memcpy floor (<= 1.5x: "
                f"{met(f['read_out'] <= 1.5)}; views copied one by one "
                f"{f['read_views']:.2f}x, {f['read_views_pieces']:.2f}x the same copies)"
            )
        lines.append(line)
    return lines


def orchestrator_lines(jobs: dict[str, Any]) -> list[str]:
    arms = jobs.get("rollout")
    if not arms:
        return []
    lines = [
        f"orchestrator buffering {ROLLOUTS:,} rollouts of {ROLLOUT_TOKENS // 1000}k tokens:",
        "| arm | held by the orchestrator, a rollout | x 3,800 | held on the frontend's node,"
        " a rollout until read | x 3,800 |",
        "|---|---|---|---|---|",
    ]
    for name, f in arms.items():
        held, node = f["orchestrator_bytes"], f["node_bytes"]
        lines.append(
            f"| {ARMS[name].label} | {held / 2**20:,.2f} MiB | {held * ROLLOUTS / 2**30:,.1f} GiB |"
            f" {node / 2**20:,.2f} MiB | {node * ROLLOUTS / 2**30:,.1f} GiB |"
        )
    return lines


# -- Main ---------------------------------------------------------------------------------------

ROLLOUT_TOKENS = 100_000


def jobs_of(args: argparse.Namespace) -> list[Job]:
    if args.quick:
        shaped = worker.parse_args(["--quick", "--seed", str(args.seed)]).shape
        batch = [(r.prompt_len, r.out_len) for r in worker.schedule(shaped)][:16]
        return [
            Job("sample", ((100, 1000),), 1, 2),
            Job("batch", tuple(batch), 16, 0),
            Job("rollout", ((100, 2000),), 16, 0),
        ]
    shape = replay.RolloutShape(prompts=64, samples=8, seed=args.seed)
    batch = [(r.prompt_len, r.out_len) for r in worker.schedule(shape)]
    made = [Job("sample", ((700, 16_384),), 1, args.sample_reps)]
    if not args.sample_only:
        made += [
            Job("batch", tuple(batch), 16, 0),
            Job("rollout", ((1000, ROLLOUT_TOKENS - 999),), 16, 0),
        ]
    return made


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--reps", type=int, default=1, help="ABBA blocks (each: every arm x2)")
    parser.add_argument("--arms", nargs="+", default=list(T14_ARMS), choices=list(ARMS))
    parser.add_argument(
        "--t15",
        action="store_true",
        help="T15: the arms " + ", ".join(T15_ARMS) + " (a Mooncake master on loopback; root)",
    )
    parser.add_argument("--sample-reps", type=int, default=3, help="timed passes a run")
    parser.add_argument("--sample-only", action="store_true", help="the 16k sample alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.t15:
        args.arms = list(T15_ARMS)
    return args


@contextlib.contextmanager
def mooncake_cluster(arms: list[str]) -> Iterator[None]:
    """For the off-node arms: a Mooncake master on loopback (no segment holder: the
    frontend's client holds the only segment), the frontend's and the reader's config files
    in the environment the runs are forked with."""
    if not set(arms) & set(OFF_NODE):
        yield
        return
    import tempfile

    sys.path.insert(0, str(HERE.parent / "tests" / "support"))
    import mooncake_util
    from aostore.r3 import offnode

    missing = mooncake_util.missing_reason()
    if missing:
        raise SystemExit(f"the off-node arms need Mooncake: {missing}")
    with (
        tempfile.TemporaryDirectory(prefix="aostore-t15-") as where,
        mooncake_util.cluster(Path(where), holder_segment=None) as cluster,
    ):
        config = Path(where) / "mooncake.json"
        config.write_text(json.dumps(cluster.config(key_prefix="t15/")))
        os.environ[MOONCAKE] = os.environ[offnode.SETTING] = str(config)
        os.environ[MASTER_PID] = str(cluster.master.pid)
        try:
            yield
        finally:
            for name in (MOONCAKE, offnode.SETTING, MASTER_PID):
                os.environ.pop(name, None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = jobs_of(args)
    order = [*args.arms, *reversed(args.arms)]
    for module in ("vllm.v1.engine.output_processor", "vllm.utils.serial_utils", "fastapi"):
        __import__(module)  # imported once, before the forks
    summary: dict[str, Any] = {}
    raw: dict[str, list[Any]] = {}
    started = time.perf_counter()
    total = len(jobs) * args.reps * len(order)
    done = 0
    with mooncake_cluster(args.arms):
        for job in jobs:
            runs = run_job(job, args, order, started, done, total)
            done += args.reps * len(order)
            summary[job.name] = summarize(job, runs)
            raw[job.name] = runs
            print(table(job, summary[job.name]), flush=True)
    figures = t14(summary)
    print("\n".join(orchestrator_lines(summary)))
    for line in t14_lines(figures):
        print(line)
    late = t15(summary)
    for line in t15_lines(late):
        print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"summary": summary, "t14": figures, "t15": late, "runs": raw}, indent=1)
            + "\n"
        )
    print(f"r3_reference.py: done in {time.perf_counter() - started:.0f} s")
    return 0


def run_job(
    job: Job, args: argparse.Namespace, order: list[str], started: float, done: int, total: int
) -> list[dict[str, Any]]:
    """Every block of ``job``, its arms in ABBA order, rotated by one arm a block: a run right
    after a big run's exit is slower on this VM (the kernel frees gigabytes meanwhile), so no
    arm always follows the same one (T15's stall arm, always after the off-node arm, read
    1.20x; first in its block, 0.81x)."""
    runs: list[dict[str, Any]] = []
    half = order[: len(order) // 2]
    for block in range(args.reps):
        turned = half[block % len(half) :] + half[: block % len(half)]
        for position, name in enumerate([*turned, *reversed(turned)]):
            done += 1
            print(
                f"[{done}/{total}] {job.name} {name} (block {block + 1}, "
                f"{time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            runs.append(run_arm(ARMS[name], job, block * len(order) + position))
    return runs


if __name__ == "__main__":
    sys.exit(main())
