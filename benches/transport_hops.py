"""The three processes of one ``benches/transport.py`` run: vLLM's worker, engine core and
frontend, each with vLLM 0.33.0's own classes for its hops, in lockstep (one step at a time).

Per step, in order (a process that waits blocks on a pipe or a ZMQ socket, never spins):

- engine core: admits the step's new requests (vLLM ``Request`` objects), tells the worker to
  run the step;
- worker: builds the step's ``ModelRunnerOutput`` (untimed: the model runner and, R3 on, the
  worker connector make it: one ``AuxRequestOutput`` per scheduled request whose ``rows`` are
  a view of the step's routed-experts array, or the whole prompt's rows for a prefill), then,
  timed, ``MessageQueue.enqueue((ResponseStatus.SUCCESS, output))`` as ``WorkerProc`` does, and
  lets the output go; tells the engine core;
- engine core: ``MessageQueue.dequeue()`` (the unpickling); ``update``: for each scheduled
  request, vLLM's ``Scheduler._update_request_with_output`` (append the token, ``check_stop``),
  R3 on: ``AuxOutputSchedulerConnector.take_output``, the ``EngineCoreOutput``, then
  ``EngineCoreOutputs``, the model runner output let go, the finished requests freed and the
  outputs put on the output queue; the output thread, vLLM's own
  ``EngineCoreProc.process_output_sockets``, encodes them (``MsgpackEncoder.encode_into``) and
  sends them (ZMQ PUSH, ipc);
- frontend: ``recv_multipart(copy=False)``, ``MsgpackDecoder(EngineCoreOutputs).decode``,
  ``OutputProcessor.process_outputs`` in chunks of ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` as
  ``AsyncLLM``'s output handler does (the outputs that finish a request in a second call,
  ``finish``: there the rows are concatenated); then, untimed, the rows of each finished
  request are checked, and the next step's requests are added; it acks the step to the engine
  core.

A hop's CPU is its thread's (``time.thread_time_ns``); a process's CPU per step is
``getrusage(RUSAGE_SELF)`` (every thread: the output thread, libzmq's I/O threads, the
collector) over the step's window, which spans its hops and excludes the harness's own work
(building inputs, checks, bookkeeping). Garbage collection runs as vLLM leaves it: each process
calls vLLM's ``freeze_gc_heap`` once set up, as vLLM's worker, engine core and API server do;
``gc.callbacks`` count the collections, the full ones (generation 2) by the hop that was running
in the thread that triggered them.

A transport arm is an :class:`Arm`: whether R3 runs, and what its processes install first (an
aostore transport would put its classes into vLLM's modules there; every hop looks its class up
in vLLM's module after that).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import queue
import resource
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

LAYERS = 46  # GLM-4.5-Air: MoE layers (as benches/worker.py)
TOP_K = 8
ROW_NBYTES = LAYERS * TOP_K  # one token's routed experts, uint8
POOL = 4096  # distinct rows; a row is a function of (block id, offset): benches/worker.py's
BLOCK = 16
TOKEN = 7  # every sampled token (no EOS, no stop tokens: requests finish on max_tokens)
WAIT_S = 600.0  # the longest a process waits for a peer before it gives up

WORKER_HOPS = ("enqueue",)
ENGINE_CORE_HOPS = ("dequeue", "update", "encode_send")
FRONTEND_HOPS = ("recv", "decode", "process_outputs", "finish")
PROCESS_HOPS = {"worker": WORKER_HOPS, "engine_core": ENGINE_CORE_HOPS, "frontend": FRONTEND_HOPS}


# -- Arms ---------------------------------------------------------------------------------------


def _plugins(enabled: bool, process: str) -> None:
    """What a vLLM process does at start: load the general plugins (``load_general_plugins``),
    aostore's among them, which puts its classes into vLLM's modules only when ``enabled``
    (``AOSTORE_VLLM_PLUGIN``, as a user turns it on or off)."""
    from aostore.vllm.settings import ENV_DISABLE

    os.environ[ENV_DISABLE] = "1" if enabled else "0"
    if enabled and process == "engine_core":
        # This engine core's frontend reads packed frames: as if it had started this process
        # (it set the variable to its version and pid), which the harness's parent stands in for.
        from aostore.vllm.transport import wire

        os.environ[wire.FRONTEND_VARIABLE] = f"{wire.VERSION}:{os.getppid()}"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if enabled:
        _check_installed(process)


def _vllm(process: str) -> None:
    _plugins(False, process)


def _aostore(process: str) -> None:
    _plugins(True, process)


def _check_installed(process: str) -> None:
    """The plugin put in what this process's hops use; else the run would time vLLM's."""
    from aostore.vllm.transport import wire
    from vllm.distributed.aux_output_connector import connector as aux
    from vllm.v1.engine import output_processor

    wanted = {
        "worker": [],
        "engine_core": [aux.AuxOutputSchedulerConnector],
        "frontend": [output_processor.RequestState],
    }[process]
    missing = [c.__qualname__ for c in wanted if not c.__module__.startswith("aostore")]
    if process == "engine_core" and not wire.packs_for_frontend():
        missing.append("the packed hop (AOSTORE_TRANSPORT_FRONTEND)")
    if missing:
        raise SystemExit(
            f"aostore arm: the plugin did not put in {', '.join(missing)} in the {process} "
            "(set AOSTORE_VLLM_PLUGIN, _DATA_PLANE and _TRANSPORT as the README says)"
        )


@dataclass(frozen=True)
class Arm:
    """One transport: ``r3`` says whether routed experts are captured and moved; ``install``
    runs first in each of the arm's processes (``worker``, ``engine_core``, ``frontend``)."""

    name: str
    label: str
    r3: bool
    install: Callable[[str], None]
    packed: bool = False
    """The worker's output is what aostore's data plane hands over with its transport on: one
    ``StepRows`` a step (else vLLM's dict)."""


ARMS: dict[str, Arm] = {
    "off": Arm("off", "R3 off", r3=False, install=_vllm),
    "vllm": Arm("vllm", "R3 on, vLLM's transport", r3=True, install=_vllm),
    "aostore": Arm("aostore", "R3 on, aostore's transport", r3=True, install=_aostore, packed=True),
}


def step_rows(ids: list[str], starts: list[int], counts: list[int], rows: np.ndarray) -> Any:
    """What aostore's worker plane hands over for a step (``StepRows.packed``): the rows in a
    fresh buffer, with the index of (token start, row end) per request."""
    from aostore.vllm.transport import StepRows

    index = np.empty((len(ids), 2), "<i8")
    index[:, 0] = starts
    index[:, 1] = np.cumsum(counts)
    return StepRows.packed(tuple(ids), index.tobytes(), bytearray(rows), rows.dtype, rows.shape[1:])


# -- The plan: what every process knows of the schedule -----------------------------------------


@dataclass
class Plan:
    """The requests (benches/worker.py's ``Request``) by admission step, and the window."""

    requests: list[Any]
    steps: int
    seed: int
    by_start: dict[int, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        by_start: dict[int, list[Any]] = defaultdict(list)
        for r in self.requests:
            if r.start < self.steps:
                by_start[r.start].append(r)
        self.by_start = dict(by_start)

    def pool(self) -> np.ndarray:
        return np.random.default_rng(self.seed).integers(0, 128, (POOL, LAYERS, TOP_K), np.uint8)


def expected_rows(pool: np.ndarray, request: Any, start: int, end: int) -> np.ndarray:
    """The routed experts of tokens ``start:end`` of ``request`` (benches/worker.py's rule)."""
    positions = np.arange(start, end)
    rows: np.ndarray = pool[(request.bases[positions // BLOCK] + positions % BLOCK) % POOL]
    return rows


def last_step(request: Any) -> int:
    """The step that samples a request's last token (it finishes there)."""
    return int(request.start + request.out_len - 1)


# -- Instrumentation ----------------------------------------------------------------------------


def _cpu_ns() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return int((usage.ru_utime + usage.ru_stime) * 1e9)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Meter:
    """One process's figures: per hop and step, the thread CPU; per step, the process's CPU
    over its window; collections, full ones by the hop running in the triggering thread."""

    def __init__(self, hops: Sequence[str], steps: int) -> None:
        self.hops = tuple(hops)
        self.hop_ns = {hop: np.zeros(steps, np.int64) for hop in hops}
        self.cpu_ns = np.zeros(steps, np.int64)
        self.bytes = np.zeros(steps, np.int64)
        self.frames = np.zeros(steps, np.int64)
        self.full_gcs: dict[str, int] = defaultdict(int)
        self.full_gc_ns: dict[str, int] = defaultdict(int)
        self.young_gcs = 0
        self._hop_of: dict[int, str] = {}  # thread id -> the hop it runs
        self._gc_started: dict[int, int] = {}
        self._window = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            self.young_gcs += phase == "start"
            return
        thread = threading.get_ident()
        if phase == "start":
            self._gc_started[thread] = time.perf_counter_ns()
            return
        label = self._hop_of.get(thread, "outside")
        self.full_gcs[label] += 1
        self.full_gc_ns[label] += time.perf_counter_ns() - self._gc_started.pop(thread, 0)

    def enter(self, hop: str) -> int:
        self._hop_of[threading.get_ident()] = hop
        return time.thread_time_ns()

    def leave(self, hop: str, step: int, started: int) -> None:
        self.hop_ns[hop][step] += time.thread_time_ns() - started
        self._hop_of[threading.get_ident()] = "outside"

    def begin(self) -> None:
        self._window = _cpu_ns()

    def end(self, step: int) -> None:
        self.cpu_ns[step] = _cpu_ns() - self._window

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def result(self) -> dict[str, Any]:
        return {
            "hop_ns": {hop: values.tolist() for hop, values in self.hop_ns.items()},
            "cpu_ns": self.cpu_ns.tolist(),
            "bytes": self.bytes.tolist(),
            "frames": self.frames.tolist(),
            "full_gcs": dict(self.full_gcs),
            "full_gc_ms": {k: v / 1e6 for k, v in self.full_gc_ns.items()},
            "young_gcs": self.young_gcs,
        }


def _recv(conn: Connection, what: str) -> Any:
    if not conn.poll(WAIT_S):
        raise TimeoutError(f"no {what} in {WAIT_S:.0f} s")
    return conn.recv()


def run_process(
    process: str, body: Callable[..., dict[str, Any]], result_path: str, *args: Any
) -> None:
    """A forked child's entry: ``body``'s figures, or the error, as JSON at ``result_path``."""
    try:
        result = body(*args)
    except BaseException:
        result = {"process": process, "error": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(result))
    os._exit(0)  # no atexit work inherited from the parent


# -- Worker -------------------------------------------------------------------------------------


def worker(arm: Arm, plan: Plan, conn: Connection) -> dict[str, Any]:
    """The worker process: ``WorkerProc``'s response queue (``MessageQueue(1, 1)``), one
    ``enqueue`` a step."""
    arm.install("worker")
    from vllm.distributed.aux_output_connector import connector as aux
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1 import outputs as v1_outputs
    from vllm.v1.executor.multiproc_executor import WorkerProc

    mq = shm_broadcast.MessageQueue(1, 1)
    conn.send(mq.export_handle())
    mq.wait_until_ready()
    pool = plan.pool()
    success = WorkerProc.ResponseStatus.SUCCESS
    has_index = "req_id_to_index" in {
        f.name for f in dataclasses.fields(v1_outputs.ModelRunnerOutput)
    }
    running: list[Any] = []
    freeze_gc_heap()  # as vLLM's worker does once warm-up is over
    meter = Meter(WORKER_HOPS, plan.steps)  # after the freeze: its collection is set-up's
    rss0 = _rss()
    for step in range(plan.steps):
        _recv(conn, f"step {step} from the engine core")
        # The model runner's output, untimed; with R3 the worker connector's outputs: views of
        # the step's routed experts (a prefill's from token 0, its whole prompt).
        running = [r for r in running if last_step(r) >= step]
        running.extend(plan.by_start.get(step, ()))
        req_ids = [r.request_id for r in running]
        aux_outputs = None
        if arm.r3 and running:
            index: list[Any] = []
            starts: list[int] = []
            for r in running:
                if r.start == step:
                    starts.append(0)
                    positions = np.arange(r.prompt_len)
                    index.append((r.bases[positions // BLOCK] + positions % BLOCK) % POOL)
                else:
                    position = r.prompt_len + step - r.start - 1
                    starts.append(position)
                    index.append([(int(r.bases[position // BLOCK]) + position % BLOCK) % POOL])
            rows = pool[np.concatenate(index)]
            if arm.packed:
                aux_outputs = step_rows(req_ids, starts, [len(part) for part in index], rows)
            else:
                aux_outputs = {}
                offset = 0
                for rid, token_start, part in zip(req_ids, starts, index, strict=True):
                    aux_outputs[rid] = aux.AuxRequestOutput(
                        token_start, rows[offset : offset + len(part)]
                    )
                    offset += len(part)
            del rows, index
        fields: dict[str, Any] = {}
        if has_index:  # vLLM 0.33.0 and earlier; 0.34.0 removed it
            fields["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        output = v1_outputs.ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[TOKEN] for _ in req_ids],
            aux_output_connector_output=aux_outputs,
            **fields,
        )
        response = (success, output)
        del output, aux_outputs, req_ids

        meter.begin()
        started = meter.enter("enqueue")
        mq.enqueue(response)
        del response  # the output is let go once it is sent
        meter.leave("enqueue", step, started)
        meter.end(step)
        conn.send(step)
    meter.close()
    result = meter.result() | {"process": "worker", "rss_growth": _rss() - rss0}
    _recv(conn, "the engine core's end")
    del mq  # its ring's __del__ unlinks the shared memory (the process ends with os._exit)
    gc.collect()
    return result


# -- Engine core --------------------------------------------------------------------------------


class _OutputQueue(queue.Queue[Any]):
    """The output thread's queue, timing the thread's hop: from one ``get`` returning to the
    next ``get`` (vLLM's loop: encode, send, buffer bookkeeping)."""

    def __init__(self, meter: Meter) -> None:
        super().__init__()
        self.meter = meter
        self.step = 0
        self.sent = threading.Semaphore(0)
        self._started: int | None = None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._started is not None:
            self.meter.leave("encode_send", self.step, self._started)
            self._started = None
            self.sent.release()
        item = super().get(block, timeout)
        self._started = self.meter.enter("encode_send")
        return item


def _shm_message_size(mq: Any) -> tuple[int, int]:
    """Bytes and buffers of the message last read from ``mq``'s ring (its chunk header: byte 0
    overflow, bytes 1-2 the buffer count, each buffer after its 4-byte length)."""
    index = (mq.current_idx - 1) % mq.buffer.max_chunks
    with mq.buffer.get_data(index) as buf:
        if buf[0] == 1:
            return -1, -1  # overflowed to the ZMQ socket: not read here
        count = int.from_bytes(buf[1:3], "big")
        offset = 3
        for _ in range(count):
            offset += 4 + int.from_bytes(buf[offset : offset + 4], "big")
        return offset, count


def engine_core(
    arm: Arm, plan: Plan, worker_conn: Connection, frontend_conn: Connection, output_path: str
) -> dict[str, Any]:
    """The engine-core process: the response queue's reader, the scheduler's output loop and
    vLLM's output thread."""
    arm.install("engine_core")
    import vllm.envs as envs
    from vllm.distributed.aux_output_connector import connector as aux
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.sampling_params import SamplingParams
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.v1 import engine as v1_engine
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.core.sched.utils import remove_all
    from vllm.v1.engine import core as core_module
    from vllm.v1.request import Request

    handle = _recv(worker_conn, "the worker's queue handle")
    mq = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    connector = None
    if arm.r3:
        # What the connector's __init__ reads of the KV cache manager (take_output reads none).
        manager = SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=BLOCK)]),
            block_pool=SimpleNamespace(hash_block_size=BLOCK),
            kv_cache_config=SimpleNamespace(num_blocks=1024),
        )
        connector = aux.AuxOutputSchedulerConnector(manager)
    max_model_len = max(r.prompt_len + r.out_len for r in plan.requests) + BLOCK
    # Scheduler._update_request_with_output reads max_model_len of the scheduler alone.
    scheduler = SimpleNamespace(max_model_len=max_model_len)
    update_request = scheduler_module.Scheduler._update_request_with_output
    take_output = connector.take_output if connector is not None else None
    engine_core_output = v1_engine.EngineCoreOutput
    engine_core_outputs = v1_engine.EngineCoreOutputs

    def update(running: list[Any], output: Any) -> tuple[list[Any], Any]:
        """The part of ``Scheduler.update_from_output`` a decode or prefill step runs here."""
        sampled = output.sampled_token_ids
        index = getattr(output, "req_id_to_index", None)
        if index is None:  # vLLM 0.34.0: the batch's order is req_ids'
            index = {rid: i for i, rid in enumerate(output.req_ids)}
        aux_outputs = output.aux_output_connector_output
        outputs = []
        stopped_reqs = set()
        for request in running:
            req_id = request.request_id
            new_token_ids, stopped = update_request(scheduler, request, sampled[index[req_id]])
            routed_experts = None
            if take_output is not None:
                routed_experts = take_output(request, aux_outputs)
            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                stopped_reqs.add(request)
            outputs.append(
                engine_core_output(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    routed_experts=routed_experts,
                    num_nans_in_logits=request.num_nans_in_logits,
                )
            )
        if stopped_reqs:
            running = remove_all(running, stopped_reqs)
        return running, engine_core_outputs(outputs=outputs)

    freeze_gc_heap()  # as EngineCore.__init__ does
    envs.enable_envs_cache()
    meter = Meter(ENGINE_CORE_HOPS, plan.steps)  # after the freeze
    outputs_queue = _OutputQueue(meter)
    proc = core_module.EngineCoreProc
    # vLLM's output thread, its own code: the few attributes it reads of the EngineCoreProc.
    stand_in = SimpleNamespace(
        output_queue=outputs_queue, _send_msg_tracking_payload=proc._send_msg_tracking_payload
    )
    thread = threading.Thread(
        target=proc.process_output_sockets,
        args=(stand_in, [output_path], None, 0),
        name="EngineCoreOutputIOThread",
        daemon=True,
    )
    thread.start()
    running: list[Any] = []
    rss0 = _rss()
    for step in range(plan.steps):
        # The scheduler admits the step's requests (untimed).
        for r in plan.by_start.get(step, ()):
            running.append(
                Request(
                    r.request_id, [0] * r.prompt_len, SamplingParams(max_tokens=r.out_len), None
                )
            )
        meter.begin()
        worker_conn.send(step)
        _recv(worker_conn, f"the worker's step {step}")
        started = meter.enter("dequeue")
        _, output = mq.dequeue()
        meter.leave("dequeue", step, started)
        started = meter.enter("update")
        running, outputs = update(running, output)
        del output  # EngineCore.step lets the model runner output go
        outputs_queue.step = step
        outputs_queue.put_nowait((0, outputs))
        del outputs
        meter.leave("update", step, started)
        if not outputs_queue.sent.acquire(timeout=WAIT_S):
            raise TimeoutError(f"the output thread did not send step {step}")
        _recv(frontend_conn, f"the frontend's ack of step {step}")
        meter.end(step)
        meter.bytes[step], meter.frames[step] = _shm_message_size(mq)
    outputs_queue.put_nowait(proc.ENGINE_CORE_DEAD)
    thread.join(WAIT_S)
    meter.close()
    worker_conn.send("end")
    return meter.result() | {"process": "engine_core", "rss_growth": _rss() - rss0}


# -- Frontend -----------------------------------------------------------------------------------


def engine_request(request_id: str, prompt_len: int, out_len: int) -> Any:
    """The ``EngineCoreRequest`` the frontend registers for a non-streaming completion of
    ``out_len`` tokens, without detokenization."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1 import engine as v1_engine

    params = SamplingParams(
        max_tokens=out_len,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,  # a non-streaming completion
    )
    return v1_engine.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[0] * prompt_len,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=request_id,
    )


def frontend(
    arm: Arm, plan: Plan, conn: Connection, output_path: str, verify: bool
) -> dict[str, Any]:
    """The frontend process: the output socket's reader, vLLM's decoder and output processor."""
    arm.install("frontend")
    import vllm.envs as envs
    import zmq
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1 import engine as v1_engine
    from vllm.v1.engine import output_processor as op_module
    from vllm.v1.serial_utils import MsgpackDecoder

    ctx = zmq.Context()
    socket = make_zmq_socket(ctx, output_path, zmq.PULL)  # binds, as the client does
    socket.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    decoder = MsgpackDecoder(v1_engine.EngineCoreOutputs)
    processor = op_module.OutputProcessor(None, log_stats=False)
    chunk_size = envs.VLLM_V1_OUTPUT_PROC_CHUNK_SIZE
    pool = plan.pool()
    by_id = {r.request_id: r for r in plan.requests}

    def add(step: int) -> None:
        for r in plan.by_start.get(step, ()):
            processor.add_request(engine_request(r.request_id, r.prompt_len, r.out_len), None)

    rows_held: dict[str, int] = defaultdict(int)  # rows of running requests
    held = np.zeros(plan.steps, np.int64)
    rss = np.zeros(plan.steps, np.int64)
    finishes: list[tuple[int, int, int]] = []  # (step, rows, ns of its share of ``finish``)
    checked = 0
    freeze_gc_heap()  # as vLLM's API server does once it is up
    meter = Meter(FRONTEND_HOPS, plan.steps)  # after the freeze
    add(0)
    rss0 = _rss()
    meter.begin()
    for step in range(plan.steps):
        started = meter.enter("recv")
        frames = socket.recv_multipart(copy=False)
        meter.leave("recv", step, started)
        started = meter.enter("decode")
        outputs = decoder.decode(frames)
        meter.leave("decode", step, started)
        engine_outputs = outputs.outputs
        going = [o for o in engine_outputs if o.finish_reason is None]
        ending = [o for o in engine_outputs if o.finish_reason is not None]
        started = meter.enter("process_outputs")
        for start in range(0, len(going), chunk_size):
            processor.process_outputs(going[start : start + chunk_size], outputs.timestamp, None)
        meter.leave("process_outputs", step, started)
        started = meter.enter("finish")
        finished = processor.process_outputs(ending, outputs.timestamp, None).request_outputs
        meter.leave("finish", step, started)
        meter.end(step)

        # Untimed: sizes, rows held, the finished requests' rows checked.
        meter.frames[step] = len(frames)
        meter.bytes[step] = sum(len(frame) for frame in frames)
        for o in engine_outputs:
            if o.routed_experts is not None:
                rows_held[o.request_id] += len(o.routed_experts)
            elif arm.r3 and o.finish_reason is None:  # packed: the rows are in their pages
                chunks = processor.request_states[o.request_id].routed_experts_chunks
                rows_held[o.request_id] = chunks.nbytes // ROW_NBYTES
        finish_ns = int(meter.hop_ns["finish"][step])
        total_rows = sum(
            r.prompt_len + r.out_len - 1 for r in (by_id[o.request_id] for o in ending)
        )
        for request_output in finished:
            r = by_id[request_output.request_id]
            completion = request_output.outputs[0]
            if len(completion.token_ids) != r.out_len:
                raise AssertionError(f"{r.request_id}: {len(completion.token_ids)} tokens")
            rows = completion.routed_experts
            n = r.prompt_len + r.out_len - 1
            if not arm.r3:
                if rows is not None:
                    raise AssertionError(f"{r.request_id}: routed experts with R3 off")
            elif rows is None or (
                verify and not np.array_equal(rows, expected_rows(pool, r, 0, n))
            ):
                raise AssertionError(f"{arm.name}: wrong routed experts for {r.request_id}")
            checked += 1
            finishes.append((step, n, finish_ns * n // max(total_rows, 1)))
            rows_held.pop(r.request_id, None)
        if len(finished) != len(ending):
            raise AssertionError(f"step {step}: {len(ending)} finishes, {len(finished)} outputs")
        del frames, outputs, engine_outputs, going, ending, finished
        held[step] = sum(rows_held.values()) * ROW_NBYTES
        rss[step] = _rss() - rss0
        if step + 1 < plan.steps:
            add(step + 1)
        meter.begin()
        conn.send(step)

    # The rows of the requests still running at the end of the window, checked too.
    partial = 0
    if arm.r3 and verify:
        for rid, state in processor.request_states.items():
            r = by_id[rid]
            chunks = state.routed_experts_chunks
            # aostore's RowChunks joins its rows itself (np.concatenate would index each chunk).
            got = np.concatenate(chunks.joined() if hasattr(chunks, "joined") else chunks)
            if not np.array_equal(got, expected_rows(pool, r, 0, len(got))):
                raise AssertionError(f"{arm.name}: wrong routed experts for running {rid}")
            if len(got) != rows_held[rid]:
                raise AssertionError(f"{rid}: {len(got)} rows, {rows_held[rid]} received")
            partial += 1
    dead = socket.recv()  # the engine core's last message, its output thread's end
    meter.close()
    socket.close(linger=0)
    ctx.term()
    return meter.result() | {
        "process": "frontend",
        "rss_growth": int(rss[-1]),
        "dead": dead.decode(errors="replace"),
        "held": held.tolist(),
        "rss": rss.tolist(),
        "finishes": finishes,
        "checked_finished": checked,
        "checked_running": partial,
        "running_at_end": len(processor.request_states),
    }


# -- One long sample's finish (the frontend and the API server) ---------------------------------


def import_answer_classes() -> None:
    """Import what :func:`completion_body` uses, before anything is timed."""
    import fastapi.responses  # noqa: F401
    import vllm.entrypoints.openai.completion.protocol
    import vllm.entrypoints.serve.engine.protocol  # noqa: F401


def completion_body(completion: Any, encoded: str | None, prompt_len: int, out_len: int) -> bytes:
    """The API server's body for a non-streaming ``/v1/completions`` of one choice: vLLM's
    ``CompletionResponse``, rendered as its router does (``JSONResponse(content=...
    model_dump())``), with ``encoded`` as the routed experts."""
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    response = CompletionResponse(
        model="glm-4.5-air",
        choices=[
            CompletionResponseChoice(
                index=0,
                text="",
                finish_reason=completion.finish_reason,
                routed_experts=encoded,
            )
        ],
        usage=UsageInfo(
            prompt_tokens=prompt_len, completion_tokens=out_len, total_tokens=prompt_len + out_len
        ),
    )
    return bytes(JSONResponse(content=response.model_dump()).body)


def finish_sample(arm: Arm, prompt_len: int, out_len: int, reps: int, seed: int) -> dict[str, Any]:
    """One request of ``prompt_len`` prompt tokens and ``out_len`` output tokens through vLLM's
    ``OutputProcessor`` as the frontend gets it (the prefill's output with the prompt's rows,
    then one row a decode), ``reps`` times, each with a fresh processor (the first on a cold
    heap); then the API server's answer to a non-streaming ``/v1/completions``: vLLM's
    ``numpy2base64`` of the rows, its ``CompletionResponse``, and the router's
    ``JSONResponse(content=response.model_dump())``. CPU per part by thread time; the rows
    checked; the peak of traced allocations over the finish and the answer in one more,
    untimed, repetition. The outputs go through vLLM's encoder and decoder first (not through
    ZMQ: a row is a view on a ``bytes`` frame rather than on a ``zmq.Frame``). Starlette is
    imported before the arm installs, as in vLLM's API server, which imports it before it
    loads plugins."""
    import starlette.responses  # noqa: F401

    arm.install("frontend")
    import tracemalloc

    from vllm.utils.serial_utils import numpy2base64
    from vllm.v1 import engine as v1_engine
    from vllm.v1.engine import output_processor as op_module
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import_answer_classes()

    rows_total = prompt_len + out_len - 1  # the last sampled token is not forwarded
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 128, (rows_total, LAYERS, TOP_K), np.uint8)
    clock = time.thread_time_ns

    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(v1_engine.EngineCoreOutputs)

    def outputs() -> list[Any]:
        """The outputs as the frontend decodes them: each through vLLM's encoder and decoder,
        so a row is a view on its own frame, as on the wire."""
        made = []
        for i in range(out_len):
            if not arm.r3:
                part = None
            elif i == 0:
                part = rows[:prompt_len].copy()
            else:
                part = rows[prompt_len + i - 1 : prompt_len + i].copy()
            if part is not None and arm.packed:  # a view of its step's buffer, as taken
                part = step_rows(["sample"], [0], [len(part)], part)["sample"].rows
            made.append(
                v1_engine.EngineCoreOutput(
                    request_id="sample",
                    new_token_ids=[TOKEN],
                    finish_reason=(v1_engine.FinishReason.LENGTH if i == out_len - 1 else None),
                    routed_experts=part,
                )
            )
        return [
            decoder.decode(encoder.encode(v1_engine.EngineCoreOutputs(outputs=[o]))).outputs[0]
            for o in made
        ]

    def one(timed: bool) -> dict[str, Any]:
        processor = op_module.OutputProcessor(None, log_stats=False)
        processor.add_request(engine_request("sample", prompt_len, out_len), None)
        made = outputs()
        t0 = clock()
        for output in made[:-1]:
            processor.process_outputs([output], None, None)
        t1 = clock()
        if not timed:
            tracemalloc.start()
        finished = processor.process_outputs(made[-1:], None, None).request_outputs
        t2 = clock()
        completion = finished[0].outputs[0]
        encoded = None
        if completion.routed_experts is not None:
            encoded = numpy2base64(completion.routed_experts)
        t3 = clock()
        body = completion_body(completion, encoded, prompt_len, out_len)
        t4 = clock()
        peak = 0
        if not timed:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        got = completion.routed_experts
        if arm.r3 and (got is None or not np.array_equal(got, rows)):
            raise AssertionError(f"{arm.name}: wrong routed experts for the sample")
        if not arm.r3 and got is not None:
            raise AssertionError("routed experts with R3 off")
        return {
            "accumulate_ns": t1 - t0,
            "finish_ns": t2 - t1,
            "base64_ns": t3 - t2,
            "render_ns": t4 - t3,
            "body_bytes": len(bytes(body)),
            "peak_bytes": peak,
        }

    timed = [one(True) for _ in range(reps)]
    traced = one(False)
    return {"arm": arm.name, "rows": rows_total, "reps": timed, "peak_bytes": traced["peak_bytes"]}
