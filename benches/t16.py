"""T16 (docs/performance.md): R3 into the trainer's layout, aostore's one call against the
framework's path.

A batch of W3 samples (GLM-4.5-Air rows, 46 x 8 uint8; 16 prompts of 200-1,200 tokens x 8
samples with outputs of 1k-16k tokens, seeded) into verl's padded int16 layout
(``[batch, prompt_width + response_width, 46, 8]``, each sample at its left-padded prompt) and
into the packed layout (``[tokens, 46, 8]`` int16 with ``cu_seqlens``), in one paired run:

- **framework**: what verl does per sample (vLLM's base64 ``.npy`` string decoded where the rows
  came over HTTP, ``torch.from_numpy``, widened with ``.to(torch.int16)``, a zeroed
  ``[1, length, 46, 8]`` tensor filled at its offset), then ``torch.cat`` of the batch; packed:
  each sample widened, then ``torch.cat``;
- **aostore**: ``r3.padded`` / ``r3.packed`` from vLLM's rows (the arrays ``AsyncLLM`` hands out)
  and from references (an arena on this node, one ``fetch``), into a torch tensor;
- **memcpy floor**: one ``np.copyto`` of the output's bytes into a fresh buffer (mapped as
  aostore maps a large layout: its pages faulted in as the layouts' are) and into a warm one
  (compare aostore with a warm ``out=`` to it).

Arms alternate, ``--reps`` rounds (the median is reported). CPU is the process's
(``time.process_time``); memory is measured in a pass of its own: the traced peak
(``tracemalloc``: numpy's allocations, not torch's) and the peak of the process's resident
pages above where the call started (``VmHWM`` after a reset: torch's allocations included; the
inputs resident before the call not, but the arena's pages a reader maps are: from references,
the inputs count). 512 samples are scaled by
arithmetic (x 4: every figure here is linear in the samples).

    PYTHONPATH=python python benches/t16.py --reps 5 --out target/t16.json
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import mmap
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from aostore import r3
from aostore.r3.arena import Arena

LAYERS, TOP_K = 46, 8
PROMPT_WIDTH, RESPONSE_WIDTH = 1_200, 16_384


def workload(samples: int, seed: int) -> tuple[list[np.ndarray], list[int]]:
    """W3's shape: each prompt shared by 8 samples; a sample's rows are its prompt and output
    less the last token (vLLM routes every token it computed)."""
    rng = np.random.default_rng(seed)
    rows, prompts = [], []
    for _ in range(samples // 8):
        prompt = int(rng.integers(200, 1_201))
        for _ in range(8):
            output = int(rng.integers(1_000, 16_001))
            count = prompt + output - 1
            rows.append(rng.integers(0, 128, (count, LAYERS, TOP_K), dtype=np.uint8))
            prompts.append(prompt)
    return rows, prompts


def wire(array: np.ndarray) -> str:
    """vLLM's HTTP field (its numpy2base64)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def framework_padded(samples: list[Any], prompts: list[int], decode: bool) -> torch.Tensor:
    """verl's routed-experts padding, per sample, then the driver's cat."""
    length = PROMPT_WIDTH + RESPONSE_WIDTH
    per_sample = []
    for sample, prompt in zip(samples, prompts, strict=True):
        rows = np.load(io.BytesIO(base64.b64decode(sample))) if decode else sample
        widened = torch.from_numpy(rows).to(torch.int16)
        padded = torch.zeros(1, length, LAYERS, TOP_K, dtype=torch.int16)
        start = PROMPT_WIDTH - prompt
        padded[:, start : start + len(rows)] = widened.unsqueeze(0)
        per_sample.append(padded)
    return torch.cat(per_sample, dim=0)


def framework_packed(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in samples])
    cu_seqlens = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return torch.cat([torch.from_numpy(s).to(torch.int16) for s in samples]), cu_seqlens


def status(field: str) -> int:
    """A ``/proc/self/status`` figure, in bytes."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()`` and the peak of the process's resident pages above where it started: the
    high-water mark is reset first (``clear_refs`` 5), so a peak inside a call that holds the
    GIL (torch's, numpy's) is seen, which a polling thread would miss."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = status("VmRSS")
    result = call()
    return result, status("VmHWM") - start


def output_bytes(result: Any) -> int:
    tensor = result[0] if isinstance(result, tuple) else result
    if isinstance(tensor, r3.Routes):
        tensor = tensor.routes
    return int(tensor.nbytes)


def fresh_mapping(nbytes: int) -> np.ndarray:
    """A fresh buffer mapped as aostore maps a large layout, so the fresh floor faults its
    pages in as the layouts do."""
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapped, np.uint8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the framework's copies on one core, as aostore's: CPU compared

    rows, prompts = workload(args.samples, args.seed)
    strings = [wire(r) for r in rows]
    input_bytes = sum(r.nbytes for r in rows)
    length = PROMPT_WIDTH + RESPONSE_WIDTH
    offsets = [PROMPT_WIDTH - p for p in prompts]
    arena = Arena(input_bytes + (64 << 20) + len(rows) * 4096, ttl=3600.0)
    references = [arena.deliver(r) for r in rows]
    assert all(ref is not None for ref in references)
    reader = r3.Reader()

    def padded(samples: list[Any]) -> Callable[[], Any]:
        return lambda: r3.padded(samples, length, offsets=offsets, into="torch", reader=reader)

    def packed(samples: list[Any]) -> Callable[[], Any]:
        return lambda: r3.packed(samples, into="torch", reader=reader)

    padded_bytes = len(rows) * length * LAYERS * TOP_K * 2
    source = np.ones(padded_bytes, np.uint8)
    warm = np.ones(padded_bytes, np.uint8)
    packed_bytes = input_bytes * 2

    def floor(nbytes: int, fresh: bool) -> Callable[[], Any]:
        def copy() -> np.ndarray:
            into = fresh_mapping(nbytes) if fresh else warm[:nbytes]
            np.copyto(into, source[:nbytes])
            return into

        return copy

    warm_padded = torch.ones((len(rows), length, LAYERS, TOP_K), dtype=torch.int16)
    warm_packed = torch.ones((sum(len(r) for r in rows), LAYERS, TOP_K), dtype=torch.int16)

    arms: dict[str, Callable[[], Any]] = {
        "padded: framework, vLLM's strings": lambda: framework_padded(strings, prompts, True),
        "padded: framework, vLLM's rows": lambda: framework_padded(rows, prompts, False),
        "padded: aostore, vLLM's rows": padded(rows),
        "padded: aostore, references": padded(references),
        "padded: aostore, references, num_experts=128": lambda: r3.padded(
            references, length, offsets=offsets, into="torch", num_experts=128, reader=reader
        ),
        "padded: aostore, references, warm out=": lambda: r3.padded(
            references, length, offsets=offsets, out=warm_padded, reader=reader
        ),
        "padded: memcpy floor, fresh buffer": floor(padded_bytes, True),
        "padded: memcpy floor, warm buffer": floor(padded_bytes, False),
        "packed: framework, vLLM's rows": lambda: framework_packed(rows),
        "packed: aostore, vLLM's rows": packed(rows),
        "packed: aostore, references": packed(references),
        "packed: aostore, references, warm out=": lambda: r3.packed(
            references, out=warm_packed, reader=reader
        ),
        "packed: memcpy floor, fresh buffer": floor(packed_bytes, True),
        "packed: memcpy floor, warm buffer": floor(packed_bytes, False),
    }
    # The layouts are the same bytes both ways (checked once, untimed).
    want = framework_padded(rows, prompts, False)
    assert torch.equal(r3.padded(references, length, offsets=offsets, into="torch").routes, want)
    del want
    got_packed = r3.packed(references, into="torch")
    want_packed = framework_packed(rows)
    assert torch.equal(got_packed.routes, want_packed[0])
    assert torch.equal(got_packed.cu_seqlens, want_packed[1])
    del got_packed, want_packed

    timings: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in arms}
    gc.collect()
    gc.freeze()
    for _ in range(args.reps):
        for name, arm in arms.items():
            wall, cpu = time.perf_counter(), time.process_time()
            result = arm()
            timings[name]["wall"].append(time.perf_counter() - wall)
            timings[name]["cpu"].append(time.process_time() - cpu)
            del result
    figures: dict[str, dict[str, float]] = {}
    for name, arm in arms.items():
        gc.collect()
        tracemalloc.start()
        result, rss = rss_peak(arm)
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        nbytes = output_bytes(result)
        del result
        figures[name] = {
            "wall_s": statistics.median(timings[name]["wall"]),
            "cpu_s": statistics.median(timings[name]["cpu"]),
            "traced_peak_bytes": traced,
            "rss_peak_bytes": rss,
            "output_bytes": nbytes,
        }
    assert reader.stats.leases == 0
    report = {
        "samples": len(rows),
        "rows": sum(len(r) for r in rows),
        "input_bytes": input_bytes,
        "reps": args.reps,
        "arms": figures,
    }
    print(json.dumps(report, indent=1))
    print(table(report))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    reader.close()
    arena.close()
    return 0


def table(report: dict[str, Any]) -> str:
    arms = report["arms"]
    lines = [
        f"{report['samples']} samples, {report['rows']:,} rows, "
        f"{report['input_bytes'] / 1e9:.2f} GB of uint8 rows in; median of {report['reps']}",
        "",
        "| arm | wall, s | CPU, s | x 4 (512): wall, s | traced peak / output | "
        "RSS peak / output | output, GB | wall / memcpy floor, fresh | "
        "wall / memcpy floor, warm | CPU / framework's (rows) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in arms.items():
        layout = name.split(":")[0]
        floor = arms[f"{layout}: memcpy floor, fresh buffer"]["wall_s"]
        warm = arms[f"{layout}: memcpy floor, warm buffer"]["wall_s"]
        framework = arms[f"{layout}: framework, vLLM's rows"]["cpu_s"]
        out = f["output_bytes"]
        lines.append(
            f"| {name} | {f['wall_s']:.3f} | {f['cpu_s']:.3f} | {4 * f['wall_s']:.2f} | "
            f"{f['traced_peak_bytes'] / out:.2f} | {f['rss_peak_bytes'] / out:.2f} | "
            f"{out / 1e9:.3f} | {f['wall_s'] / floor:.2f} | {f['wall_s'] / warm:.2f} | "
            f"{f['cpu_s'] / framework:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
