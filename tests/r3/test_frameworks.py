"""aostore's layouts byte for byte against each framework's own way of making them.

Each ``*_way`` function (``tests/support/frameworks.py``) is a reimplementation, in the
project's words, of what a framework does with vLLM's rows (the repository, commit and function
are named in its docstring); aostore's one call must give the same bytes from the same rows, as
vLLM's arrays and as references in an arena, and refuse what the framework refuses. The rows
here are synthetic and vLLM-shaped (uint8, 46 layers x top-8 as GLM-4.5-Air's, and a small
model's); ``tests/vllm_engine/test_engine_asyncllm.py`` makes the same comparison on a real
engine's outputs (``AsyncLLM`` in process, references read on another node).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from aostore import r3
from aostore.r3.arena import Arena

torch = pytest.importorskip("torch", reason="the frameworks' own code is torch's")
from frameworks import (  # noqa: E402
    MISSING_ROUTE,
    nemo_rl_dtype,
    nemo_rl_way,
    skyrl_packed_way,
    skyrl_padded_way,
    verl_stitch,
    verl_way,
)

LAYERS, TOP_K = 46, 8


def vllm_rows(tokens: int, seed: int, experts: int = 128, layers: int = LAYERS) -> np.ndarray:
    """Routed experts as vLLM returns them: ``[tokens, layers, top_k]`` uint8."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, experts, (tokens, layers, TOP_K), dtype=np.uint8)


@pytest.fixture
def arena():
    with Arena(32 << 20, ttl=60.0) as made:
        yield made


@pytest.fixture
def reader():
    made = r3.Reader()
    yield made
    assert made.stats.leases == 0
    made.close()


def sender(arena: Arena, form: str) -> Any:
    """How a sample's rows reach the trainer: as vLLM's array, or by reference."""
    return (lambda rows: rows) if form == "rows" else (lambda rows: by_reference(arena, rows))


def by_reference(arena: Arena, rows: np.ndarray) -> Any:
    reference = arena.deliver(rows)
    assert reference is not None
    return reference


# verl ----------------------------------------------------------------------------------------


def test_verl_padded_int16_with_a_stitched_partial_rollout(arena, reader) -> None:
    prompt_width, response_width = 40, 64
    prompts = [12, 40, 7, 25]
    samples = [
        vllm_rows(p + r, seed=i)
        for i, (p, r) in enumerate(zip(prompts, [50, 64, 1, 0], strict=True))
    ]
    # Sample 2 was aborted after its first 20 rows and resumed: the resumed request's rows
    # repeat the prefix (here with other values, so a wrong stitch shows) and go on.
    first = vllm_rows(20, seed=10)
    resumed = vllm_rows(prompts[2] + 60, seed=11)
    stitched = verl_stitch(first, resumed)
    want = verl_way(
        [samples[0], samples[1], stitched, samples[3]], prompts, prompt_width, response_width
    )
    offsets = [prompt_width - p for p in prompts]
    for form in ("rows", "references"):
        sent = sender(arena, form)

        batch = [
            sent(samples[0]),
            sent(samples[1]),
            [(sent(first), 0, None), (sent(resumed), len(first), None)],
            sent(samples[3]),
        ]
        got = r3.padded(
            batch,
            prompt_width + response_width,
            offsets=offsets,
            dtype=np.int16,
            into="torch",
            reader=reader,
        )
        assert got.routes.dtype == torch.int16
        assert got.routes.numpy().tobytes() == want.numpy().tobytes()


def test_verl_refuses_what_does_not_fit_and_so_does_aostore(arena, reader) -> None:
    prompt_width, response_width = 10, 20
    rows = vllm_rows(15, seed=1)
    # A prompt longer than its width: verl's start is negative.
    with pytest.raises(ValueError, match="do not fit"):
        verl_way([rows], [12], prompt_width, response_width)
    with pytest.raises(r3.BadLayout, match="sample 0: 15 tokens at offset -2"):
        r3.padded([by_reference(arena, rows)], 30, offsets=[-2], reader=reader)
    # Rows past the response width: verl's end is past the tensor.
    long = vllm_rows(31, seed=2)
    with pytest.raises(ValueError, match="do not fit"):
        verl_way([long], [10], prompt_width, response_width)
    with pytest.raises(r3.BadLayout, match="sample 0: 31 tokens at offset 0 do not fit"):
        r3.padded([long], 30, offsets=[0], reader=reader)


# NeMo-RL -------------------------------------------------------------------------------------


def aostore_nemo_rl(
    samples: list[Any],
    valid: list[int],
    padded_length: int,
    num_experts: int,
    strict: bool,
    reader: r3.Reader,
) -> r3.Routes:
    dtype = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32}[
        nemo_rl_dtype(num_experts)
    ]
    return r3.padded(
        samples,
        padded_length,
        valid_lengths=[min(max(v - 1, 0), padded_length) for v in valid],
        drop_surplus=1 if strict else None,
        dtype=dtype,
        missing_route=MISSING_ROUTE,
        pad="arange",
        into="torch",
        reader=reader,
    )


@pytest.mark.parametrize("num_experts", [128, 160, 40_000])
def test_nemo_rl_three_regions_with_missing_and_surplus_routes(arena, reader, num_experts) -> None:
    padded_length = 48
    high = min(num_experts, 255)
    # (prompt rows, completion rows, valid length): complete with the final route surplus;
    # routes missing (prefix caching lost some); exactly complete; none at all; a long
    # sequence cut at the padded length.
    cases = [
        (vllm_rows(10, 1, high), vllm_rows(20, 2, high), 30),
        (vllm_rows(10, 3, high), vllm_rows(5, 4, high), 30),
        (None, vllm_rows(29, 5, high), 30),
        (None, vllm_rows(0, 6, high), 12),
        (vllm_rows(30, 7, high), vllm_rows(18, 8, high), 60),
    ]
    want = torch.stack(
        [
            nemo_rl_way(p, c, v, padded_length, nemo_rl_dtype(num_experts), require_complete=False)
            for p, c, v in cases
        ]
    )
    for form in ("rows", "references"):
        sent = sender(arena, form)

        samples = [
            [(sent(rows), 0, None) for rows in (p, c) if rows is not None] for p, c, _ in cases
        ]
        got = aostore_nemo_rl(
            samples, [v for *_, v in cases], padded_length, num_experts, False, reader
        )
        assert got.routes.dtype == want.dtype
        assert got.routes.numpy().tobytes() == want.numpy().tobytes()


def test_nemo_rl_refuses_two_surplus_routes_and_an_id_past_its_dtype(arena, reader) -> None:
    rows = vllm_rows(12, seed=1)
    # valid 11: 10 routes expected, 12 rows: two past them.
    with pytest.raises(ValueError, match="surplus"):
        nemo_rl_way(None, rows, 11, 16, torch.int8, require_complete=True)
    with pytest.raises(r3.BadLayout, match="sample 0: 12 rows for 10 tokens: 2 surplus"):
        aostore_nemo_rl([by_reference(arena, rows)], [11], 16, 128, True, reader)
    # One past them is the final token's route, dropped by both.
    want = nemo_rl_way(None, rows, 12, 16, torch.int8, require_complete=True)
    got = aostore_nemo_rl([by_reference(arena, rows)], [12], 16, 128, True, reader)
    assert got.routes[0].numpy().tobytes() == want.numpy().tobytes()
    # An expert id int8 cannot hold (a model whose expert count was mis-detected).
    wide = vllm_rows(12, seed=2)
    wide[4, 7, 2] = 200
    with pytest.raises(ValueError, match=r"exceeds torch\.int8"):
        nemo_rl_way(None, wide, 13, 16, torch.int8, require_complete=True)
    with pytest.raises(r3.RouteOutOfRange, match="sample 0: token 4: route 200 does not fit int8"):
        aostore_nemo_rl([by_reference(arena, wide)], [13], 16, 128, True, reader)


# SkyRL ---------------------------------------------------------------------------------------


MOE_LAYERS = [1, 2, 3, 5, 8, 13, 21, 34]  # a model whose other layers are dense


def test_skyrl_left_padded_with_arange_rows_on_its_moe_layers(arena, reader) -> None:
    samples = [vllm_rows(n, seed=n) for n in (17, 40, 1, 33)]
    want = skyrl_padded_way(samples, MOE_LAYERS)
    width = want.shape[1]
    for form in ("rows", "references"):
        sent = [s if form == "rows" else by_reference(arena, s) for s in samples]
        got = r3.padded(
            sent,
            width,
            offsets=[width - len(s) for s in samples],
            dtype=np.int32,
            layers=MOE_LAYERS,
            pad="arange",
            into="torch",
            reader=reader,
        )
        assert got.routes.numpy().tobytes() == want.numpy().tobytes()
    # Megatron replays a layer at a time: layer-major is SkyRL's per-layer split, in one call.
    major = r3.padded(
        samples,
        width,
        offsets=[width - len(s) for s in samples],
        dtype=np.int32,
        layers=MOE_LAYERS,
        pad="arange",
        layer_major=True,
        into="torch",
        reader=reader,
    )
    assert torch.equal(major.routes, want.permute(0, 2, 1, 3))


def test_skyrl_packed_with_cu_seqlens_and_a_dummy_suffix(arena, reader) -> None:
    samples = [vllm_rows(n, seed=n) for n in (17, 40, 0, 33)]
    lengths = [20, 40, 3, 33]  # two with a suffix the engine did not route
    want, want_cu = skyrl_packed_way(samples, lengths, MOE_LAYERS)
    for form in ("rows", "references"):
        sent = [s if form == "rows" else by_reference(arena, s) for s in samples]
        got = r3.packed(
            sent,
            lengths=lengths,
            dtype=np.int32,
            layers=MOE_LAYERS,
            fill="arange",
            into="torch",
            reader=reader,
        )
        assert got.routes.numpy().tobytes() == want.numpy().tobytes()
        assert torch.equal(got.cu_seqlens, want_cu)
