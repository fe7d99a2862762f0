"""T13: what moving routed-experts rows (R3) after the worker connector costs across vLLM's
processes, with vLLM's own classes for every hop, with vLLM's transport and with aostore's;
R3 on minus R3 off.

The multiprocess executor's layout on one node, three processes forked per run, in lockstep (one
step at a time; loopback and IPC only; a process that waits blocks, it never spins):

- worker: ``MessageQueue.enqueue`` (``distributed/device_communicators/shm_broadcast.py``:
  pickle protocol 5, buffers under 1 MiB in-band, into the shared-memory ring) of
  ``(ResponseStatus.SUCCESS, ModelRunnerOutput)`` as ``WorkerProc`` sends it: with R3, one
  ``AuxRequestOutput`` and one ndarray (a view of the step's rows) per scheduled request, as
  vLLM's worker connector returns them;
- engine core: ``MessageQueue.dequeue`` (unpickling); ``update``: per scheduled request vLLM's
  ``Scheduler._update_request_with_output``, with R3 ``AuxOutputSchedulerConnector.take_output``,
  the ``EngineCoreOutput``, then ``EngineCoreOutputs``, the model runner output let go;
  ``encode_send``: vLLM's output thread as shipped (``EngineCoreProc.process_output_sockets``:
  ``MsgpackEncoder.encode_into`` of ``v1/serial_utils.py``, every array of at least
  ``VLLM_MSGPACK_ZERO_COPY_THRESHOLD`` bytes its own ZMQ frame, PUSH over ipc);
- frontend: ``recv_multipart(copy=False)``, ``MsgpackDecoder(EngineCoreOutputs).decode``,
  ``OutputProcessor.process_outputs`` (``v1/engine/output_processor.py``) in chunks of
  ``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` as ``AsyncLLM``'s output handler calls it, each row kept
  in ``routed_experts_chunks`` until the request finishes; ``finish``: the outputs that finish
  requests, processed in their own call, where the rows are concatenated (``np.concatenate``)
  into the ``CompletionOutput``.

Measured (``benches/transport_hops.py`` says how): per hop the CPU of its thread
(``time.thread_time_ns``) per step; per process ``getrusage(RUSAGE_SELF)`` (all threads: the
output thread, libzmq's I/O threads, the collector) over each step's window, which excludes the
harness's own work; full collections (``gc.callbacks``, generation 2) per process and per hop,
with the collector as vLLM leaves it (``freeze_gc_heap`` once per process after set-up, where
vLLM's worker, engine core and API server call it; no ``gc.disable`` or ``gc.freeze`` of the
harness's); bytes and frames per step on each hop (the ring's message header; the ZMQ frames);
the frontend's RSS growth against the bytes of rows held by its running requests. Every
finished request's rows are checked against what was produced (a row is a function of its
block and position, as in ``benches/worker.py``), and at the end of the window the rows held
for every running request; with R3 off, that no rows come.

The schedule is W3's (``benches/worker.py``'s ``schedule``: 64 prompts x 8 samples, prompts of
200-1,200 tokens shared by their samples, outputs of 1k-16k tokens, at most 16,384 tokens a
step) with the KV cache unbounded, so all 512 requests are admitted in the first steps and about
500 run; a request is prefilled in its admission step (emitting its whole prompt's rows: the
worker reads a prefix hit back from its store), decodes one token a step and finishes on
``max_tokens``. The hard shape (the default; ``--finishing 0`` leaves W3 as it is): 64 of
those requests become 16k samples (16,384 rows at their finish, prompts of their own, one
admitted a step from step 0) that all finish in the window's last step, when the frontend holds
about 400 MB of their rows beside the ~450 others' (``finishing_together``). Rows:
GLM-4.5-Air's, 46 layers x top-8, uint8 (368 B a token).

Then one long sample's finish (``--sample-tokens``, default 16,384 output tokens after a
700-token prompt: 17,083 rows, GLM-4.5-Air's 16k sample), per arm in a forked child:
vLLM's ``OutputProcessor`` taking the sample's outputs one a step (each through vLLM's
encoder and decoder first, so a row is a view on its frame), the finishing output's
concatenation, and the API server's answer to a non-streaming ``/v1/completions``
(``numpy2base64``, ``CompletionResponse``, ``JSONResponse(content=response.model_dump())``):
CPU per part, the body's bytes, the peak of traced allocations. On its own small heap; the
window's finishes above are the same work inside a frontend that holds ~500 requests' rows.

Arms, each run in its own three processes, ABBA order per ``--reps`` (``off vllm aostore
aostore vllm off``): ``off``: R3 off (no rows, no ``take_output``, ``routed_experts`` None);
``vllm``: R3 on with vLLM's transport; ``aostore``: R3 on with aostore's transport
(``aostore.vllm.transport``: its ``install`` puts the encoder's and decoder's hooks, the
frontend's ``RequestState``, ``numpy2base64`` and the JSON render into vLLM's modules in each
process, and aostore's scheduler connector in the engine core, before the hops look them up;
the worker hands over one ``StepRows`` a step, as aostore's data plane does under the
multiprocess executor). The R3 share of a figure is an arm minus ``off``; T13 is ``aostore``'s
share over ``vllm``'s, printed last.

Not modelled: the GPU and the worker connector (T12: ``benches/worker.py``); the scheduler's own
work (scheduling, KV blocks, ``build_connector_meta``: ``benches/scheduler.py``) and the
scheduler-to-worker broadcast; async scheduling and the pipelining of the processes (lockstep
instead: on 2 cores the figures do not contend); speculative decoding, chunked prefill,
preemption, stop strings, detokenization (``detokenize=False``), stats (``log_stats=False``),
``n`` > 1; the frontend's asyncio loop (``RequestOutputCollector`` queues: the outputs are
returned, ``LLMEngine``-style) and the API server (``numpy2base64``, the JSON body); the
reader's spin-wait (``SpinCondition``: the reader is called once the message is in the ring).

    python benches/transport.py                  # W3, the first 3,000 steps, one ABBA block
    python benches/transport.py --quick          # tiny sizes, a smoke run (under a minute)
    python benches/transport.py --reps 3 --out t13.json

Run it with vLLM 0.33.0 or 0.34.0 and aostore installed (``.venv-vllm/bin/python``,
``.venv-vllm34/bin/python``; 0.34.0's ``ModelRunnerOutput`` has no ``req_id_to_index``, so
the engine core indexes the batch by ``req_ids``, as 0.34.0's scheduler does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import transport_hops as hops  # noqa: E402  (benches/transport_hops.py: the three processes)
import worker  # noqa: E402  (benches/worker.py: W3's schedule; sets AOSTORE_VLLM_PLUGIN=0)
from aostore.bench import replay  # noqa: E402

PROCESSES = ("worker", "engine_core", "frontend")
ORDER = (*hops.ARMS, *reversed(hops.ARMS))
UNBOUNDED = 1 << 40  # KV blocks: every request is admitted


# -- One run ------------------------------------------------------------------------------------


def run_arm(arm: hops.Arm, plan: hops.Plan, number: int) -> dict[str, Any]:
    """The arm's three processes through ``plan``; each one's figures, by process."""
    context = multiprocessing.get_context("fork")
    worker_end, core_worker_end = context.Pipe()
    core_frontend_end, frontend_end = context.Pipe()
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    output_path = get_open_zmq_ipc_path()
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    paths = {p: scratch / f"aostore-transport-{os.getpid()}-{number}-{p}.json" for p in PROCESSES}
    bodies: dict[str, tuple[Any, ...]] = {
        "worker": (hops.worker, arm, plan, worker_end),
        "engine_core": (
            hops.engine_core,
            arm,
            plan,
            core_worker_end,
            core_frontend_end,
            output_path,
        ),
        "frontend": (hops.frontend, arm, plan, frontend_end, output_path, True),
    }
    children = {
        process: context.Process(
            target=hops.run_process,
            args=(process, body[0], str(paths[process]), *body[1:]),
            name=f"transport-{arm.name}-{process}",
        )
        for process, body in bodies.items()
    }
    for child in children.values():
        child.start()
    for end in (worker_end, core_worker_end, core_frontend_end, frontend_end):
        end.close()  # the children hold them: a child's exit closes its ends
    results: dict[str, Any] = {}
    errors = []
    for process, child in children.items():
        child.join()
        try:
            results[process] = json.loads(paths[process].read_text())
        except FileNotFoundError:
            results[process] = {"error": f"exited with {child.exitcode}, no result"}
        finally:
            paths[process].unlink(missing_ok=True)
        if "error" in results[process]:
            errors.append(f"{process}: {results[process]['error']}")
            for other in children.values():  # a peer that failed leaves the others waiting
                if other.is_alive():
                    other.kill()
    if errors:
        raise RuntimeError(f"{arm.name}: " + "\n".join(errors))
    return {"arm": arm.name, "steps": plan.steps, "processes": results}


def run_sample(arm: hops.Arm, args: argparse.Namespace, number: int) -> dict[str, Any]:
    """``hops.finish_sample`` for ``arm`` in a forked child (the frontend's and API server's
    work on one long sample's finish)."""
    context = multiprocessing.get_context("fork")
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    path = scratch / f"aostore-transport-{os.getpid()}-sample-{number}.json"
    child = context.Process(
        target=hops.run_process,
        args=(
            "frontend",
            hops.finish_sample,
            str(path),
            arm,
            args.sample_prompt,
            args.sample_tokens,
            args.sample_reps,
            args.seed,
        ),
        name=f"transport-{arm.name}-sample",
    )
    child.start()
    child.join()
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        result = {"error": f"exited with {child.exitcode}, no result"}
    finally:
        path.unlink(missing_ok=True)
    if "error" in result:
        raise RuntimeError(f"{arm.name} sample: {result['error']}")
    return result


SAMPLE_PARTS = ("accumulate", "finish", "base64", "render")


def sample_report(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm over its runs: each part's CPU (median of every repetition, and the cold one:
    each run's first, a fresh process), the body's bytes, the traced peak."""
    arms: dict[str, Any] = {}
    for name in dict.fromkeys(s["arm"] for s in samples):
        runs = [s for s in samples if s["arm"] == name]
        reps = [rep for s in runs for rep in s["reps"]]
        figures: dict[str, Any] = {"rows": runs[0]["rows"], "runs": len(runs)}
        for part in SAMPLE_PARTS:
            figures[f"{part}_ms"] = statistics.median(r[f"{part}_ns"] for r in reps) / 1e6
            figures[f"{part}_cold_ms"] = (
                statistics.median(s["reps"][0][f"{part}_ns"] for s in runs) / 1e6
            )
        figures["body_bytes"] = reps[0]["body_bytes"]
        figures["peak_mib"] = max(s["peak_bytes"] for s in runs) / 2**20
        arms[name] = figures
    return arms


def sample_table(arms: dict[str, Any]) -> str:
    lines = [
        "| arm | rows | accumulate ms | finish ms (cold) | base64 ms (cold) | render ms (cold) |"
        " finish + answer ms | body bytes | traced peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in arms.items():
        answer = f["finish_ms"] + f["base64_ms"] + f["render_ms"]
        lines.append(
            f"| {hops.ARMS[name].label} | {f['rows']:,} | {f['accumulate_ms']:.1f} | "
            f"{f['finish_ms']:.1f} ({f['finish_cold_ms']:.1f}) | {f['base64_ms']:.1f} "
            f"({f['base64_cold_ms']:.1f}) | {f['render_ms']:.1f} ({f['render_cold_ms']:.1f}) | "
            f"{answer:.1f} | {f['body_bytes']:,} | {f['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


# -- Figures ------------------------------------------------------------------------------------


def _stats(ns: Any) -> dict[str, float]:
    values = np.asarray(ns, dtype=np.float64)
    return {
        "p50_us": float(np.percentile(values, 50) / 1e3),
        "p99_us": float(np.percentile(values, 99) / 1e3),
        "total_s": float(values.sum() / 1e9),
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: per process and per hop, CPU per step; collections; sizes."""
    processes = run["processes"]
    out: dict[str, Any] = {"hops": {}, "processes": {}}
    for process in PROCESSES:
        result = processes[process]
        out["processes"][process] = _stats(result["cpu_ns"]) | {
            "full_gcs": sum(result["full_gcs"].values()),
            "full_gc_ms": sum(result["full_gc_ms"].values()),
            "young_gcs": result["young_gcs"],
            "rss_growth_mib": result["rss_growth"] / 2**20,
        }
        for hop in hops.PROCESS_HOPS[process]:
            out["hops"][f"{process}.{hop}"] = _stats(result["hop_ns"][hop]) | {
                "full_gcs": result["full_gcs"].get(hop, 0),
                "full_gc_ms": result["full_gc_ms"].get(hop, 0.0),
            }
    out["all"] = _stats(np.sum([processes[p]["cpu_ns"] for p in PROCESSES], axis=0))
    core, front = processes["engine_core"], processes["frontend"]
    sizes = {"worker": core, "frontend": front}  # the receiving end counts a hop's message
    for process, result in sizes.items():
        measured = [b for b in result["bytes"] if b >= 0]
        out["processes"][process]["bytes_p50"] = float(np.median(measured)) if measured else -1.0
        out["processes"][process]["bytes_mean"] = float(np.mean(measured)) if measured else -1.0
        out["processes"][process]["frames_p50"] = float(np.median(result["frames"]))
        out["processes"][process]["overflowed"] = len(result["bytes"]) - len(measured)
    # The frontend's memory where the rows it holds peak (held is the same in every run of an
    # arm; the R3 share compares RSS at that step with R3 off's at the same step).
    held = np.asarray(front["held"])
    peak = int(held.argmax())
    finishes = front["finishes"]
    out["frontend_memory"] = {
        "peak_step": peak,
        "held_mib": float(held[peak]) / 2**20,
        "rss_growth_mib": front["rss"][peak] / 2**20,
        "end_held_mib": float(held[-1]) / 2**20,
        "end_rss_growth_mib": front["rss"][-1] / 2**20,
    }
    out["frontend_rss"] = front["rss"]
    out["finishes"] = {
        "count": len(finishes),
        "rows": sum(f[1] for f in finishes),
        "ms": sum(f[2] for f in finishes) / 1e6,
        "largest_rows": max((f[1] for f in finishes), default=0),
        "largest_ms": max(finishes, key=lambda f: f[1])[2] / 1e6 if finishes else 0.0,
    }
    out["checked"] = {
        "finished": front["checked_finished"],
        "running": front["checked_running"],
        "running_at_end": front["running_at_end"],
    }
    return out


def _mean(figures: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for f in figures:
        value: Any = f
        for key in keys:
            value = value[key]
        values.append(float(value))
    return statistics.fmean(values)


def report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm, each figure's mean over its runs; the R3 share of each arm with R3 (minus
    ``off``)."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(summarize(run))
    arms: dict[str, Any] = {}
    for arm, figures in by_arm.items():
        first = figures[0]
        arms[arm] = {
            "runs": len(figures),
            "hops": {
                hop: {key: _mean(figures, "hops", hop, key) for key in first["hops"][hop]}
                for hop in first["hops"]
            },
            "processes": {
                p: {key: _mean(figures, "processes", p, key) for key in first["processes"][p]}
                for p in PROCESSES
            },
            "all": {key: _mean(figures, "all", key) for key in first["all"]},
            "frontend_memory": {
                key: _mean(figures, "frontend_memory", key) for key in first["frontend_memory"]
            },
            "frontend_rss_end_mib": [f["frontend_memory"]["end_rss_growth_mib"] for f in figures],
            "finishes": {key: _mean(figures, "finishes", key) for key in first["finishes"]},
            "checked": {key: sum(f["checked"][key] for f in figures) for key in first["checked"]},
            "all_total_s_range": [
                min(f["all"]["total_s"] for f in figures),
                max(f["all"]["total_s"] for f in figures),
            ],
        }
    shares: dict[str, Any] = {}
    if "off" in arms:
        off = arms["off"]
        for arm, figures in arms.items():
            if arm == "off":
                continue
            share: dict[str, Any] = {"hops": {}, "processes": {}}
            for hop, values in figures["hops"].items():
                share["hops"][hop] = {k: values[k] - off["hops"][hop][k] for k in values}
            for p, values in figures["processes"].items():
                share["processes"][p] = {k: values[k] - off["processes"][p][k] for k in values}
            share["all"] = {k: figures["all"][k] - off["all"][k] for k in figures["all"]}
            held = figures["frontend_memory"]["held_mib"]
            peak = by_arm[arm][0]["frontend_memory"]["peak_step"]
            off_rss = statistics.fmean(f["frontend_rss"][peak] for f in by_arm["off"]) / 2**20
            growth = figures["frontend_memory"]["rss_growth_mib"] - off_rss
            share["frontend_memory"] = {
                "peak_step": peak,
                "rss_growth_mib": growth,
                "held_mib": held,
                "ratio": growth / held if held > 0 else float("nan"),
            }
            shares[arm] = share
    return {"arms": arms, "r3_share": shares}


LABELS = {
    "worker.enqueue": "`MessageQueue.enqueue` of `ModelRunnerOutput` (pickle 5, shm ring)",
    "engine_core.dequeue": "`MessageQueue.dequeue` (unpickle)",
    "engine_core.update": "`take_output`, `EngineCoreOutput`(s), output let go",
    "engine_core.encode_send": "output thread: `MsgpackEncoder.encode_into` + ZMQ send",
    "frontend.recv": "ZMQ `recv_multipart(copy=False)`",
    "frontend.decode": "`MsgpackDecoder.decode`",
    "frontend.process_outputs": "`OutputProcessor.process_outputs` (rows kept as chunks)",
    "frontend.finish": "`process_outputs` of finishing outputs (`np.concatenate`)",
}


def table(summary: dict[str, Any], arm_names: list[str]) -> str:
    arms = summary["arms"]
    shares = summary["r3_share"]
    with_r3 = [a for a in arm_names if a in shares]
    lines: list[str] = []
    head = "| process | hop | " + " | ".join(f"{a} p50 µs" for a in arm_names if a in arms)
    for a in with_r3:
        head += f" | R3 share ({a}) p50 / p99 µs | total s | full GCs off / {a} (ms)"
    lines.append(head + " |")
    lines.append("|" + "---|" * (head.count("|")))

    def gcs(off: dict[str, Any], on: dict[str, Any]) -> str:
        return (
            f"{off['full_gcs']:.1f} ({off['full_gc_ms']:.0f}) / "
            f"{on['full_gcs']:.1f} ({on['full_gc_ms']:.0f})"
        )

    for hop in arms[arm_names[0]]["hops"]:
        process, name = hop.split(".")
        row = f"| {process} | {LABELS.get(hop, name)} | "
        row += " | ".join(f"{arms[a]['hops'][hop]['p50_us']:.1f}" for a in arm_names if a in arms)
        for a in with_r3:
            s = shares[a]["hops"][hop]
            row += (
                f" | {s['p50_us']:.1f} / {s['p99_us']:.1f} | {s['total_s']:.2f}"
                f" | {gcs(arms['off']['hops'][hop], arms[a]['hops'][hop])}"
            )
        lines.append(row + " |")
    for process in PROCESSES:
        row = f"| **{process}** | whole process (getrusage, all threads) | "
        row += " | ".join(
            f"{arms[a]['processes'][process]['p50_us']:.1f}" for a in arm_names if a in arms
        )
        for a in with_r3:
            s = shares[a]["processes"][process]
            row += (
                f" | **{s['p50_us']:.1f} / {s['p99_us']:.1f}** | **{s['total_s']:.2f}**"
                f" | {gcs(arms['off']['processes'][process], arms[a]['processes'][process])}"
            )
        lines.append(row + " |")
    row = "| **all** | the three processes, summed per step | "
    row += " | ".join(f"{arms[a]['all']['p50_us']:.1f}" for a in arm_names if a in arms)
    for a in with_r3:
        s = shares[a]["all"]
        row += f" | **{s['p50_us']:.1f} / {s['p99_us']:.1f}** | **{s['total_s']:.2f}** | |"
    lines.append(row + " |")
    lines.append("")
    lines.append(
        "| arm | runs | full GCs worker / engine core / frontend (ms) | worker -> engine core "
        "bytes, frames a step (p50) | engine core -> frontend bytes, frames a step (p50) | "
        "frontend RSS growth MiB | rows held MiB (at their peak) | finishes (rows): `finish` ms |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for a in arm_names:
        if a not in arms:
            continue
        f = arms[a]
        p = f["processes"]
        full = " / ".join(f"{p[x]['full_gcs']:.1f} ({p[x]['full_gc_ms']:.0f})" for x in PROCESSES)
        fin = f["finishes"]
        lines.append(
            f"| {hops.ARMS[a].label} | {f['runs']} | {full} | {p['worker']['bytes_p50']:,.0f}, "
            f"{p['worker']['frames_p50']:.0f} | {p['frontend']['bytes_p50']:,.0f}, "
            f"{p['frontend']['frames_p50']:.0f} | {f['frontend_memory']['rss_growth_mib']:.1f} | "
            f"{f['frontend_memory']['held_mib']:.1f} | {fin['count']:.0f} ({fin['rows']:,.0f}):"
            f" {fin['ms']:.1f} |"
        )
    for a in with_r3:
        s = shares[a]
        m = s["frontend_memory"]
        fin = arms[a]["finishes"]
        off_fin = arms["off"]["finishes"]
        per_k = (fin["ms"] - off_fin["ms"]) / fin["rows"] * 1e3 if fin["rows"] else float("nan")
        c = arms[a]["checked"]
        gcs_caused = {
            p: arms[a]["processes"][p]["full_gcs"] - arms["off"]["processes"][p]["full_gcs"]
            for p in PROCESSES
        }
        lines.append("")
        lines.append(
            f"{a}: frontend RSS growth over R3 off, {m['rss_growth_mib']:.1f} MiB, for "
            f"{m['held_mib']:.1f} MiB of rows held by running requests (step {m['peak_step']}, "
            f"where they peak): {m['ratio']:.2f}x their bytes. The finishing requests' "
            f"`process_outputs` (`finish`): {fin['ms']:.1f} ms for {fin['count']:.0f} finishes "
            f"of {fin['rows']:,.0f} rows (R3 off: {off_fin['ms']:.1f} ms), an R3 share of "
            f"{per_k:.2f} ms per 1,000 rows; the largest finish, {fin['largest_rows']:,.0f} "
            f"rows, {fin['largest_ms']:.1f} ms. Checked: "
            f"{c['finished']} finished requests' rows, {c['running']} running requests' rows "
            "at the end of the window."
        )
        caused = ", ".join(f"{p} {n:+.1f}" for p, n in gcs_caused.items())
        verdict = (
            f"R3's share, {a} ({hops.ARMS[a].label}): R3 costs {s['all']['p50_us'] / 1e3:.2f}"
            f" ms of CPU a step outside the worker connector (p50 of the three processes' sum, "
            f"R3 on minus off; p99 {s['all']['p99_us'] / 1e3:.2f} ms), {s['all']['total_s']:.2f}"
            f" s over the window; full GCs caused by R3 (per run): {caused}; rows held at "
            f"{m['ratio']:.2f}x their bytes."
        )
        lines.append(verdict)
    return "\n".join(lines)


PICKLING = ("worker.enqueue", "engine_core.dequeue")


def t13(summary: dict[str, Any]) -> dict[str, Any] | None:
    """T13's figures, aostore's transport against vLLM's in the same run (None without both):
    the R3 share summed over the three processes (total over the window, and p50 a step),
    pickling plus unpickling, full GCs caused by R3, rows held by the frontend over their bytes,
    and a 16k sample's finish plus answer (R3 on minus off)."""
    shares = summary["r3_share"]
    if "vllm" not in shares or "aostore" not in shares:
        return None
    theirs, ours = shares["vllm"], shares["aostore"]
    arms = summary["arms"]

    def pickling(share: dict[str, Any]) -> float:
        return float(sum(share["hops"][hop]["total_s"] for hop in PICKLING))

    figures: dict[str, Any] = {
        "ratio_total": ours["all"]["total_s"] / theirs["all"]["total_s"],
        "ratio_p50": ours["all"]["p50_us"] / theirs["all"]["p50_us"],
        "pickling_s": {"vllm": pickling(theirs), "aostore": pickling(ours)},
        "pickling_ratio": pickling(ours) / pickling(theirs),
        "full_gcs_caused": {
            arm: {
                p: arms[arm]["processes"][p]["full_gcs"] - arms["off"]["processes"][p]["full_gcs"]
                for p in PROCESSES
            }
            for arm in ("vllm", "aostore")
        },
        "rows_held_ratio": {
            arm: shares[arm]["frontend_memory"]["ratio"] for arm in ("vllm", "aostore")
        },
        "hops_total_s": {
            hop: {arm: shares[arm]["hops"][hop]["total_s"] for arm in ("vllm", "aostore")}
            for hop in theirs["hops"]
        },
    }
    sample = summary.get("sample")
    if sample and {"off", "vllm", "aostore"} <= set(sample):

        def finish(arm: str) -> float:
            f = sample[arm]
            return float(f["finish_ms"] + f["base64_ms"] + f["render_ms"])

        figures["sample_ms"] = {arm: finish(arm) for arm in ("off", "vllm", "aostore")}
        figures["sample_ratio"] = (finish("aostore") - finish("off")) / (
            finish("vllm") - finish("off")
        )
    return figures


def t13_lines(figures: dict[str, Any]) -> list[str]:
    caused = figures["full_gcs_caused"]["aostore"]
    held = figures["rows_held_ratio"]
    lines = [
        f"T13: aostore / vLLM, R3's CPU outside the worker connector over the three processes: "
        f"{figures['ratio_total']:.3f} over the window ({figures['ratio_p50']:.3f} of the p50 a "
        "step; target <= 1/5)",
        f"  pickling + unpickling (worker enqueue + engine-core dequeue): "
        f"{figures['pickling_s']['aostore']:.2f} s against {figures['pickling_s']['vllm']:.2f} s"
        f" = {figures['pickling_ratio']:.3f} (target <= 1/10)",
        "  full GCs caused by R3 per run, aostore: "
        + ", ".join(f"{p} {n:+.1f}" for p, n in caused.items())
        + " (target: none)",
        f"  rows held by the frontend: {held['aostore']:.2f}x their bytes (vLLM "
        f"{held['vllm']:.2f}x; target <= 1.25x)",
    ]
    if "sample_ratio" in figures:
        ms = figures["sample_ms"]
        lines.append(
            f"  a 16k sample's finish + answer: {ms['aostore']:.1f} ms against {ms['vllm']:.1f} "
            f"ms (R3 off {ms['off']:.1f} ms): {figures['sample_ratio']:.3f} of vLLM's R3 share "
            "(target <= 1/3)"
        )
    lines.append(
        "  what is left, per hop (R3 share over the window, s: vLLM -> aostore): "
        + "; ".join(
            f"{hop} {v['vllm']:.2f} -> {v['aostore']:.2f}"
            for hop, v in figures["hops_total_s"].items()
        )
    )
    return lines


# -- Main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--prompts", type=int, default=None, help="W3: 64")
    parser.add_argument("--samples", type=int, default=None, help="W3: 8")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="run the first N steps (default 3,000; --quick: all; 0: all)",
    )
    parser.add_argument("--reps", type=int, default=1, help="ABBA blocks (each: every arm x2)")
    parser.add_argument("--arms", nargs="+", default=list(hops.ARMS), choices=list(hops.ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument(
        "--sample-tokens",
        type=int,
        default=None,
        help="output tokens of the one long sample whose finish is measured (default 16,384, "
        "with a 700-token prompt: 17,083 rows; --quick: 1,000; 0: none)",
    )
    parser.add_argument(
        "--finishing",
        type=int,
        default=None,
        help="the hard shape: this many of W3's requests replaced by long samples that finish "
        "together in the window's last step (default 64; --quick: 4; 0: W3 as it is)",
    )
    parser.add_argument(
        "--finishing-rows",
        type=int,
        default=16_384,
        help="rows of each such sample at its finish (default 16,384: a 16k sample)",
    )
    parser.add_argument("--sample-prompt", type=int, default=700)
    parser.add_argument("--sample-reps", type=int, default=3, help="repetitions a run")
    args = parser.parse_args(argv)
    if args.sample_tokens is None:
        args.sample_tokens = 1000 if args.quick else 16_384
    if args.finishing is None:
        args.finishing = 4 if args.quick else 64
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if "off" not in args.arms:
        parser.error("--arms needs off: the R3 share is an arm minus off")
    if args.quick:
        shaped = ["--quick", "--seed", str(args.seed)]
        if args.prompts is not None:
            shaped += ["--prompts", str(args.prompts)]
        if args.samples is not None:
            shaped += ["--samples", str(args.samples)]
        shape = worker.parse_args(shaped).shape
    else:
        shape = replay.RolloutShape(
            prompts=args.prompts or 64, samples=args.samples or 8, seed=args.seed
        )
    args.shape = dataclasses.replace(shape, kv_blocks=UNBOUNDED)
    if args.steps is None:
        args.steps = 0 if args.quick else 3000
    return args


def finishing_together(requests: list[Any], steps: int, count: int, rows: int) -> list[Any]:
    """The hard shape: the first ``count`` of W3's requests become long samples, admitted one
    a step from step 0 (a prefill of at most ``rows`` tokens a step, as vLLM's token budget
    would allow), each ``rows`` rows long at its finish and all finishing in the window's last
    step; their prompts are their own (no prefix hit). The frontend then holds ``count`` x
    ``rows`` rows (64 x 16k: about 400 MB) when they finish together."""
    if count > len(requests) or count >= steps:
        raise SystemExit(f"--finishing {count}: more than the window's requests or steps")
    long = []
    for i, request in enumerate(requests[:count]):
        out_len = steps - i  # its last token sampled in step steps - 1
        prompt_len = rows - out_len + 1
        if prompt_len < 1:
            raise SystemExit(f"--finishing-rows {rows}: fewer than the window's {steps} steps")
        blocks = -(-(prompt_len + out_len) // hops.BLOCK)
        bases = [worker._mix(-(10_000_019 + i) * 1_000_003 - k) for k in range(blocks)]
        long.append(
            dataclasses.replace(
                request,
                prompt=-(i + 1),
                prompt_len=prompt_len,
                out_len=out_len,
                keys=[],
                prompt_blocks=prompt_len // hops.BLOCK,
                start=i,
                cached=0,
                bases=np.array(bases, dtype=np.int64),
            )
        )
    return long + requests[count:]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = args.shape
    requests = worker.schedule(shape)
    schedule_steps = max(hops.last_step(r) for r in requests) + 1
    steps = min(args.steps, schedule_steps) if args.steps else schedule_steps
    if args.finishing:
        requests = finishing_together(requests, steps, args.finishing, args.finishing_rows)
    plan = hops.Plan(requests, steps, args.seed)
    admitted = sum(r.start < steps for r in requests)
    finished = sum(hops.last_step(r) < steps for r in requests)
    print(
        f"transport.py: W3 {shape.prompts} prompts x {shape.samples} samples, {len(requests)} "
        f"requests, {schedule_steps} steps; the first {steps} run: {admitted} admitted, "
        f"{finished} finish, {sum(r.cached > 0 for r in requests)} prefix-cache hits; rows "
        f"{hops.LAYERS} x {hops.TOP_K} uint8; {args.finishing} samples of "
        f"{args.finishing_rows:,} rows finish together in the last step",
        flush=True,
    )
    started = time.perf_counter()
    import vllm.distributed.aux_output_connector.connector
    import vllm.distributed.device_communicators.shm_broadcast
    import vllm.v1.core.sched.scheduler
    import vllm.v1.engine.core
    import vllm.v1.engine.output_processor
    import vllm.v1.executor.multiproc_executor  # noqa: F401

    print(f"transport.py: vLLM imported in {time.perf_counter() - started:.1f} s", flush=True)
    order = [arm for _ in range(args.reps) for arm in ORDER if arm in args.arms]
    runs: list[dict[str, Any]] = []
    for number, name in enumerate(order):
        t0 = time.perf_counter()
        try:
            run = run_arm(hops.ARMS[name], plan, number)
        except RuntimeError as error:
            print(f"transport.py: {error}", file=sys.stderr)
            return 1
        figures = summarize(run)
        per = ", ".join(
            f"{p} {figures['processes'][p]['p50_us']:.0f}/{figures['processes'][p]['total_s']:.2f}"
            for p in PROCESSES
        )
        print(
            f"  run {number + 1}/{len(order)} {name:6s}: CPU p50 µs/step / total s: {per}; full "
            "GCs "
            + "/".join(f"{figures['processes'][p]['full_gcs']}" for p in PROCESSES)
            + f"; {figures['checked']['finished']} finished checked; "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        runs.append(run)
    samples: list[dict[str, Any]] = []
    if args.sample_tokens:
        for number, name in enumerate(order):
            try:
                samples.append(run_sample(hops.ARMS[name], args, number))
            except RuntimeError as error:
                print(f"transport.py: {error}", file=sys.stderr)
                return 1
    summary = report(runs)
    print()
    print(table(summary, [a for a in hops.ARMS if a in args.arms]))
    if samples:
        summary["sample"] = sample_report(samples)
        print()
        print(
            f"One sample's finish ({args.sample_prompt:,}-token prompt, {args.sample_tokens:,} "
            "output tokens), the frontend's `OutputProcessor` and the API server's answer to a "
            "non-streaming /v1/completions (`numpy2base64`, `CompletionResponse`, "
            f"`JSONResponse`); CPU, median of {args.sample_reps} repetitions a run (cold: each "
            "run's first):"
        )
        print(sample_table(summary["sample"]))
    figures = t13(summary)
    if figures is not None:
        summary["t13"] = figures
        print()
        print("\n".join(t13_lines(figures)))
    if args.quick:
        print("(--quick: tiny sizes, a smoke run; its figures are noise, not T13)")
    if args.out is not None:
        payload = {
            "shape": dataclasses.asdict(shape),
            "requests": len(requests),
            "steps": steps,
            "order": order,
            "summary": summary,
            "runs": [
                {k: v for k, v in summarize(run).items() if k != "frontend_rss"} for run in runs
            ],
        }
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
