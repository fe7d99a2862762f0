"""R3 rows in the trainer's layout (``aostore.r3.padded`` / ``packed``), against a model that
places each token by hand.

The model is the contract written the slow way: one token at a time, from the sample's
stitched rows, so a wrong offset, a byte written twice with another value, a pad where a route
belongs or a route wrapped into the dtype shows as a difference.
"""

from __future__ import annotations

import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest
from aostore import r3
from aostore.r3 import format as fmt
from aostore.r3.arena import Arena
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reference import rows, wire

LAYERS, TOP_K = 6, 4


def small(n: int, seed: int, dtype: str = "uint8", high: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (n, LAYERS, TOP_K)).astype(dtype)


def stitched(sample: Any) -> np.ndarray:
    """A sample's rows, its segments joined (the model reads rows, never references)."""
    if isinstance(sample, list):
        return np.concatenate([rows_[start:stop] for rows_, start, stop in sample])
    return sample


def model_token(
    sample_rows: np.ndarray,
    token: int,
    valid: int,
    layers: list[int],
    dtype: np.dtype[Any],
    missing_route: np.ndarray,
    pad: np.ndarray,
) -> np.ndarray:
    """What token ``token`` (counted from the sample's first) holds: its route, the missing
    route, or the pad."""
    if 0 <= token < valid:
        if token < len(sample_rows):
            return sample_rows[token][layers].astype(dtype)
        return np.broadcast_to(missing_route, (len(layers), TOP_K)).astype(dtype)
    return np.broadcast_to(pad, (len(layers), TOP_K)).astype(dtype)


def model_padded(samples, length, offsets, valid, layers, dtype, missing_route, pad, major):
    dtype = np.dtype(dtype)
    pad_row = np.arange(TOP_K) if pad == "arange" else np.asarray(pad)
    out = np.zeros((len(samples), length, len(layers), TOP_K), dtype)
    for i, sample in enumerate(samples):
        mine = stitched(sample)
        for t in range(length):
            out[i, t] = model_token(
                mine, t - offsets[i], valid[i], layers, dtype, np.asarray(missing_route), pad_row
            )
    return out.transpose(0, 2, 1, 3).copy() if major else out


def model_packed(samples, lengths, layers, dtype, fill, major):
    dtype = np.dtype(dtype)
    fill_row = np.arange(TOP_K) if fill == "arange" else np.asarray(fill)
    pieces = []
    for i, sample in enumerate(samples):
        mine = stitched(sample)
        for t in range(lengths[i]):
            pieces.append(model_token(mine, t, lengths[i], layers, dtype, fill_row, fill_row))
    out = np.stack(pieces) if pieces else np.zeros((0, len(layers), TOP_K), dtype)
    return out.transpose(1, 0, 2).copy() if major else out


@pytest.fixture
def arena():
    with Arena(8 << 20, ttl=60.0) as made:
        yield made


@pytest.fixture
def reader():
    made = r3.Reader()
    yield made
    made.close()


def as_sent(arena: Arena, sample: Any, form: str) -> Any:
    """A sample as a trainer gets it: rows, vLLM's string of rows, or a reference (array or
    the HTTP string); segments keep their ranges."""
    if isinstance(sample, list):
        return [(as_sent(arena, rows_, form), start, stop) for rows_, start, stop in sample]
    if form == "rows":
        return sample
    if form == "wire-rows":
        return wire(sample)
    reference = arena.deliver(sample)
    assert reference is not None
    return reference if form == "reference" else wire(reference)


FORMS = ["rows", "wire-rows", "reference", "wire-reference"]
DTYPE_NAMES = list(r3.layouts.DTYPES)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[Any], list[str]]:
    n = draw(st.integers(1, 5))
    samples: list[Any] = []
    for i in range(n):
        if draw(st.booleans()):
            samples.append(small(draw(st.integers(0, 12)), seed=i))
        else:
            parts = []
            for j in range(draw(st.integers(1, 3))):
                whole = small(draw(st.integers(0, 10)), seed=100 * i + j)
                start = draw(st.integers(0, len(whole)))
                stop = draw(st.integers(start, len(whole)))
                parts.append((whole, start, stop))
            samples.append(parts)
    forms = [draw(st.sampled_from(FORMS)) for _ in range(n)]
    return samples, forms


LAYER_CHOICES = [None, slice(1, 5), slice(0, 6, 2), [5, 0, 3], [2]]


def layer_list(layers: Any) -> list[int]:
    return (
        list(range(LAYERS))
        if layers is None
        else list(range(LAYERS)[layers])
        if isinstance(layers, slice)
        else list(layers)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=batches(),
    data=st.data(),
    dtype=st.sampled_from(DTYPE_NAMES),
    layers=st.sampled_from(LAYER_CHOICES),
    major=st.booleans(),
    pad=st.sampled_from([0, 7, "arange"]),
)
def test_padded_is_the_model_for_any_batch(batch, data, dtype, layers, major, pad) -> None:
    samples, forms = batch
    counts = [len(stitched(s)) for s in samples]
    valid = [data.draw(st.integers(max(0, c - 2), c + 3)) for c in counts]
    offsets = [data.draw(st.integers(0, 4)) for _ in samples]
    length = max(o + v for o, v in zip(offsets, valid, strict=True)) + data.draw(st.integers(0, 3))
    missing_route = 0 if dtype.startswith("u") else -1
    with Arena(8 << 20, ttl=60.0) as arena:
        sent = [as_sent(arena, s, f) for s, f in zip(samples, forms, strict=True)]
        reader = r3.Reader()
        got = r3.padded(
            sent,
            length,
            offsets=offsets,
            valid_lengths=valid,
            drop_surplus=None,
            dtype=dtype,
            layers=layers,
            layer_major=major,
            missing_route=missing_route,
            pad=pad,
            reader=reader,
        ).routes
        assert reader.stats.leases == 0
        reader.close()
    want = model_padded(
        samples, length, offsets, valid, layer_list(layers), dtype, missing_route, pad, major
    )
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=batches(),
    data=st.data(),
    dtype=st.sampled_from(DTYPE_NAMES),
    layers=st.sampled_from(LAYER_CHOICES),
    major=st.booleans(),
    fill=st.sampled_from([0, 9, "arange"]),
)
def test_packed_is_the_model_for_any_batch(batch, data, dtype, layers, major, fill) -> None:
    samples, forms = batch
    lengths = [data.draw(st.integers(max(0, len(stitched(s)) - 2), 15)) for s in samples]
    with Arena(8 << 20, ttl=60.0) as arena:
        sent = [as_sent(arena, s, f) for s, f in zip(samples, forms, strict=True)]
        got = r3.packed(
            sent,
            lengths=lengths,
            drop_surplus=None,
            dtype=dtype,
            layers=layers,
            layer_major=major,
            fill=fill,
        )
    want = model_packed(samples, lengths, layer_list(layers), dtype, fill, major)
    assert got.routes.tobytes() == want.tobytes() and got.routes.shape == want.shape
    assert got.cu_seqlens.dtype == np.int32
    assert got.cu_seqlens.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert r3.reader().stats.leases == 0


def test_defaults_take_each_samples_rows_as_its_length(arena, reader) -> None:
    a, b = small(5, 1), small(3, 2)
    got = r3.padded([a, arena.deliver(b)], 6, reader=reader).routes
    assert got.dtype == np.int16 and got.shape == (2, 6, LAYERS, TOP_K)
    assert np.array_equal(got[0, :5], a) and not got[0, 5:].any()
    assert np.array_equal(got[1, :3], b) and not got[1, 3:].any()
    pack = r3.packed([a, arena.deliver(b)], reader=reader)
    assert np.array_equal(pack.routes, np.concatenate([a, b]).astype(np.int16))
    assert pack.cu_seqlens.tolist() == [0, 5, 8] and reader.stats.fetches == 2


def test_references_of_several_arenas_are_read_in_one_fetch_per_arena(arena, reader) -> None:
    with Arena(1 << 20, ttl=60.0) as other:
        a, b, c = small(4, 1), small(2, 2), small(3, 3)
        sent = [arena.deliver(a), other.deliver(b), arena.deliver(c), wire(a)]
        got = r3.packed(sent, reader=reader).routes
        assert np.array_equal(got, np.concatenate([a, b, c, a]).astype(np.int16))
        assert reader.stats.fetches == 2 and reader.stats.references == 3
        assert reader.stats.leases == 0


@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int16", "int32", "int64"])
def test_a_route_the_dtype_cannot_hold_is_named_and_nothing_is_written(
    arena, reader, dtype
) -> None:
    limit = np.iinfo(dtype).max
    wide = "uint64" if dtype == "int64" else "int64"  # rows that can hold a route past limit
    good, bad = small(4, 1, wide), small(6, 2, wide)
    bad[3, 2, 1] = limit + 1  # token 3 of the sample, past what the dtype holds
    sent = [good, [(arena.deliver(bad[:2]), 0, None), (bad, 2, None)]]
    out = np.full((2, 8, LAYERS, TOP_K), 5, dtype)
    before = out.copy()
    with pytest.raises(r3.RouteOutOfRange, match=rf"sample 1: token 3: route {limit + 1}") as err:
        r3.padded(sent, 8, dtype=dtype, out=out, missing_route=0, reader=reader)
    assert (err.value.sample, err.value.token, err.value.route) == (1, 3, limit + 1)
    assert np.array_equal(out, before) and reader.stats.leases == 0
    # Below zero, for the unsigned: the same error, never a wrap.
    if dtype.startswith("u"):
        negative = small(3, 4, "int16")
        negative[2, 0, 0] = -1
        with pytest.raises(r3.RouteOutOfRange, match="token 2: route -1 does not fit"):
            r3.packed([negative], dtype=dtype, fill=0, reader=reader)


def test_a_route_at_least_num_experts_is_named(arena, reader) -> None:
    rows_ = small(10, 1, high=64)
    rows_[7, 5, 3] = 64
    with pytest.raises(r3.RouteOutOfRange, match="sample 0: token 7: route 64 is not an expert"):
        r3.packed([arena.deliver(rows_)], num_experts=64, reader=reader)
    assert reader.stats.leases == 0
    assert r3.packed([rows_], num_experts=65).routes.max() == 64
    # A layer left out is not checked: a pipeline stage reads only its layers.
    assert r3.packed([rows_], num_experts=64, layers=[0, 1, 2, 4]).routes.max() < 64
    with pytest.raises(r3.RouteOutOfRange, match="token 7"):
        r3.packed([rows_], num_experts=64, layers=[0, 5])


def test_bad_input_is_named_changes_nothing_and_keeps_no_lease(arena, reader) -> None:
    a, b = small(4, 1), small(3, 2)
    ref_b = arena.deliver(b)
    out = np.full((2, 6, LAYERS, TOP_K), 3, np.int16)
    before = out.copy()
    cases: list[tuple[dict[str, Any], type[BaseException], str]] = [
        (
            dict(samples=[a, ref_b], length=6, out=np.empty((2, 5, 6, 4), np.int16)),
            r3.BadLayout,
            r"out is int16 \(2, 5, 6, 4\); the layout is int16 \(2, 6, 6, 4\)",
        ),
        (
            dict(samples=[a, ref_b], length=6, out=np.empty((2, 6, 6, 4), np.int32)),
            r3.BadLayout,
            "out is int32",
        ),
        (
            dict(samples=[a, ref_b], length=6, out=np.empty((2, 6, 6, 8), np.int16)[..., ::2]),
            r3.BadLayout,
            "C-contiguous",
        ),
        (
            dict(samples=[a, ref_b], length=6, offsets=[0, 4]),
            r3.BadLayout,
            "sample 1: 3 tokens at offset 4 do not fit a padded length of 6",
        ),
        (dict(samples=[a, ref_b], length=6, offsets=[-1, 0]), r3.BadLayout, "sample 0"),
        (
            dict(samples=[a, ref_b], length=6, valid_lengths=[4]),
            r3.BadLayout,
            "1 valid_lengths for 2 samples",
        ),
        (
            dict(samples=[a, ref_b], length=6, valid_lengths=[4, 1]),
            r3.BadLayout,
            r"sample 1: 3 rows for 1 tokens: 2 surplus, at most 0 dropped",
        ),
        (
            dict(samples=[a, small(2, 3)[:, :5]], length=6),
            r3.BadLayout,
            r"sample 1: rows of \[layers, top_k\] \(5, 4\), where the batch's are \(6, 4\)",
        ),
        (
            dict(samples=[a, a.astype(np.float32)], length=6),
            r3.BadLayout,
            "sample 1: routes are integers, not float32",
        ),
        (dict(samples=[a, a[:, 0]], length=6), r3.BadLayout, r"sample 1: rows are \[tokens"),
        (
            dict(samples=[a, [(ref_b, 1, 4)]], length=6),
            r3.BadLayout,
            r"sample 1: a segment \[1:4\] of rows 0 to 3",
        ),
        (dict(samples=[a, [(ref_b, 0)]], length=6), r3.BadLayout, "sample 1: a sample's segm"),
        (dict(samples=[a, ref_b], length=6, dtype=np.float32), r3.BadLayout, "a dtype of"),
        (
            dict(samples=[a, ref_b], length=6, dtype=np.uint8),
            r3.BadLayout,
            "missing_route -1 does not fit uint8",
        ),
        (
            dict(samples=[a, ref_b], length=6, dtype=np.uint8, missing_route=0, pad=-3),
            r3.BadLayout,
            "pad -3 does not fit uint8",
        ),
        (dict(samples=[a, ref_b], length=6, layers=[0, 6]), r3.BadLayout, "layer 6 of rows"),
        (dict(samples=[a, ref_b], length=6, num_experts=0), r3.BadLayout, "num_experts 0"),
        (dict(samples=[a, ref_b], length=6, pad="zeros"), r3.BadLayout, "pad is a number"),
        (dict(samples=[a, ref_b], length=6, missing="skip"), r3.BadLayout, "missing is"),
        (dict(samples=[a, 3], length=6), r3.BadLayout, "sample 1: a reference is a str"),
        (dict(samples=[a, ["junk!", 0, 1]], length=6), r3.BadLayout, "sample 1"),
        (dict(samples=wire(a), length=6), TypeError, "a sequence of samples"),
        (dict(samples=[], length=6), r3.BadLayout, "no sample has rows"),
    ]
    for kwargs, error, message in cases:
        kwargs.setdefault("out", out)
        with pytest.raises(error, match=message):
            r3.padded(reader=reader, **kwargs)
        assert np.array_equal(out, before), kwargs
        assert reader.stats.leases == 0
    assert reader.stats.fetches == 0  # every case was refused before a reference was read
    with pytest.raises(r3.BadLayout, match="sample 0: a length of -1"):
        r3.packed([a], lengths=[-1], reader=reader)
    with pytest.raises(r3.ForeignReference, match="neither rows nor"):
        r3.packed(["not base64!"], reader=reader)


def test_a_missing_sample_is_named_with_why_or_raised(arena, reader) -> None:
    a, b, c = small(4, 1), small(3, 2), small(5, 3)
    with Arena(fmt.PAGE, ttl=60.0) as tiny:
        gone = tiny.deliver(small(2, 9))
        r3.fetch([gone]).release()  # read: its slot may now hold newer rows
        assert tiny.deliver(small(2, 8)) is not None and tiny.stats()["evictions"] == 1
        elsewhere = arena.deliver(c).copy()
        elsewhere["boot"] = np.arange(16, dtype=np.uint8)
        newer = arena.deliver(c).copy()
        newer["version"] = fmt.REFERENCE_VERSION + 1
        sent = [a, gone, arena.deliver(b), elsewhere, [(b, 0, 1), (newer, 0, None)]]
        got = r3.padded(sent, 6, valid_lengths=[4, 2, 3, 5, 3], missing="report", reader=reader)
        assert sorted(got.missing) == [1, 3, 4]
        assert isinstance(got.missing[1], r3.ReferenceGone)
        assert isinstance(got.missing[3], r3.OtherNode)
        assert isinstance(got.missing[4], r3.ForeignReference)
        routes = got.routes
        assert np.array_equal(routes[0, :4], a) and np.array_equal(routes[2, :3], b)
        assert (routes[1, :2] == -1).all() and (routes[1, 2:] == 0).all()
        assert (routes[3, :5] == -1).all() and (routes[4, :3] == -1).all()
        assert reader.stats.leases == 0
        with pytest.raises(r3.ReferenceGone, match="sample 1: reference 0 of the batch"):
            r3.padded(sent[:3], 6, reader=reader)
        with pytest.raises(r3.OtherNode, match="sample 3: a reference from another node"):
            r3.padded(sent, 6, reader=reader)
        assert reader.stats.leases == 0
        pack = r3.packed(sent, lengths=[4, 2, 3, 5, 3], fill=-1, missing="report", reader=reader)
        assert sorted(pack.missing) == [1, 3, 4] and (pack.routes[4:6] == -1).all()


def test_rows_are_read_without_a_second_copy_and_nothing_per_sample(arena, reader) -> None:
    """The traced peak of a call is its output, give or take a page: no widened or gathered
    temporary, whatever the layers kept or the layout."""
    samples = [small(300 + 37 * i, i) for i in range(24)]
    sent = [arena.deliver(s) if i % 2 else s for i, s in enumerate(samples)]
    for kwargs in (
        dict(layers=None, layer_major=False),
        dict(layers=[5, 0, 3], layer_major=True),
        dict(layers=slice(1, 5), layer_major=True),
    ):
        tracemalloc.start()
        got = r3.padded(sent, 1250, offsets=50, dtype=np.int32, reader=reader, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= got.routes.nbytes * 1.02 + 256 * 1024, (kwargs, peak, got.routes.nbytes)
    assert reader.stats.leases == 0


def test_a_big_sample_reads_the_same(arena, reader) -> None:
    big = rows(17_083, 5)  # a 16k-token GLM-4.5-Air sample, 46 x 8
    # 37.7 MB of int16: past STREAM_FROM, so the native copy streams its stores.
    sent = [arena.deliver(big), big, big[1:]]
    got = r3.padded(sent, 17_100, offsets=[17, 0, 3], reader=reader).routes
    assert got.nbytes >= r3._reader.STREAM_FROM
    assert np.array_equal(got[0, 17:], big.astype(np.int16)) and not got[0, :17].any()
    assert np.array_equal(got[1, :17_083], big) and not got[1, 17_083:].any()
    assert np.array_equal(got[2, 3:17_085], big[1:]) and not got[2, :3].any()
    for dtype in ("int8", "uint16", "int32", "int64"):
        wide = r3.packed(sent, dtype=dtype, reader=reader).routes
        assert np.array_equal(wide, np.concatenate([big, big, big[1:]]).astype(dtype))
    # An output this large is a fresh mapping the kernel zeroed: a zero pad is left as it is,
    # any other is written.
    got = r3.padded(
        [big], 17_100, offsets=[7], valid_lengths=[17_090], pad="arange", missing_route=5
    ).routes
    assert (got[0, :7] == np.arange(8)).all() and (got[0, 17_097:] == np.arange(8)).all()
    assert (got[0, 17_090:17_097] == 5).all() and np.array_equal(got[0, 7:17_090], big)


torch = pytest.importorskip("torch", reason="torch is the optional extra aostore[torch]")


def test_torch_destinations_allocated_or_given(arena, reader) -> None:
    a, b = small(4, 1), small(3, 2)
    got = r3.padded([a, arena.deliver(b)], 5, into="torch", reader=reader)
    assert isinstance(got.routes, torch.Tensor) and got.routes.dtype == torch.int16
    assert got.wait() is got.routes
    assert np.array_equal(got.routes[0, :4].numpy(), a)
    out = torch.full((7, LAYERS, TOP_K), 9, dtype=torch.int64)
    pack = r3.packed([a, b], out=out, dtype=np.int64, reader=reader)
    assert pack.routes is out and isinstance(pack.cu_seqlens, torch.Tensor)
    assert torch.equal(out, torch.from_numpy(np.concatenate([a, b]).astype(np.int64)))
    for bad, message in [
        (torch.empty((7, LAYERS, TOP_K), dtype=torch.int32), "out is torch.int32"),
        (torch.empty((8, LAYERS, TOP_K), dtype=torch.int64), r"\(8, 6, 4\)"),
        (torch.empty((TOP_K, LAYERS, 7), dtype=torch.int64).transpose(0, 2), "contiguous"),
    ]:
        with pytest.raises(r3.BadLayout, match=message):
            r3.packed([a, b], out=bad, dtype=np.int64, reader=reader)
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        r3.packed([a, b], out=[0] * 7, reader=reader)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the refusal without CUDA (CUDA runs the test below)"
)
def test_pinned_or_cuda_without_cuda_is_a_clear_error(reader) -> None:
    for into in ("pinned", "cuda"):
        with pytest.raises(RuntimeError, match=f"into='{into}' on a machine where torch sees no"):
            r3.packed([small(2, 1)], into=into, reader=reader)  # type: ignore[arg-type]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA here: the pinned and CUDA destinations are proved where a GPU is at hand",
)
def test_cuda_is_copied_once_from_pinned_memory(arena, reader) -> None:
    a, b = small(4, 1), small(3, 2)
    pinned = r3.padded([a, arena.deliver(b)], 5, into="pinned", reader=reader)
    assert pinned.routes.is_pinned()
    got = r3.padded([a, arena.deliver(b)], 5, into="cuda", reader=reader)
    assert got.routes.device.type == "cuda"
    assert torch.equal(got.wait().cpu(), pinned.routes)


def test_segments_count_rows_as_vllm_sent_them(arena, reader) -> None:
    """A later turn's reference holds its rows from its ``token_start`` on; a segment's start
    and stop count as ``fetch``'s ``start`` does, so the turns stitch by token."""
    want = small(60, 7)
    first_turn = arena.deliver(want[:25])
    later_turn = arena.deliver(want[20:], token_start=20)  # the prefix cache hit 20 tokens
    sample = [(first_turn, None, None), (later_turn, 25, None)]
    got = r3.packed([sample], reader=reader).routes
    assert np.array_equal(got, want.astype(np.int16))
    got = r3.packed([[(later_turn, 30, 40)]], reader=reader).routes
    assert np.array_equal(got, want[30:40].astype(np.int16))
    with pytest.raises(r3.BadLayout, match=r"sample 0: a segment \[19:60\] of rows 20 to 60"):
        r3.packed([[(later_turn, 19, None)]], reader=reader)


def test_the_native_widening_copy_lets_other_threads_run() -> None:
    """``widen_routes`` copies with the GIL released (a trainer's other threads, its data
    loader, run meanwhile): a thread stamping the time stamps inside the copy, away from its
    ends (where the interpreter may hand the GIL over between bytecodes either way)."""
    import sys
    import threading
    import time

    from aostore._native import widen_routes

    routes = np.ones(96 << 20, np.uint8)
    out = np.empty(routes.size, np.int16)
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    thread = threading.Thread(target=stamp)
    thread.start()
    try:
        inside = 0
        for _ in range(5):
            begin = time.perf_counter()
            widen_routes(routes, out, True)
            end = time.perf_counter()
            margin = 0.005
            inside = sum(begin + margin < t < end - margin for t in stamps)
            if end - begin > 4 * margin and inside > 100:
                break
            stamps.clear()
        assert inside > 100, "no other thread ran during the copy: the GIL was held"
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert (out == 1).all()
    with pytest.raises(ValueError, match="not 10 routes widened"):
        widen_routes(routes[:10], out[:11], True)
    with pytest.raises(TypeError, match="uint8"):
        widen_routes(out[:10], routes[:20], True)


def _anonymous_resident() -> int:
    """This process's resident anonymous bytes (RssAnon of /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_fresh_dense_layout_is_committed_at_once_and_a_padded_one_is_not() -> None:
    """A packed layout writes every byte, so its fresh output is committed in one call (no
    fault a page); a padded one leaves its zero padding unwritten and uncommitted. Both are
    zeros as given."""
    from aostore.r3 import layouts

    size = 4 * layouts.MAP_FROM
    before = _anonymous_resident()
    sparse, sparse_zeroed = layouts._allocate((size // 2,), np.dtype(np.int16), False)
    assert _anonymous_resident() - before <= 0.1 * size
    before = _anonymous_resident()
    dense, dense_zeroed = layouts._allocate((size // 2,), np.dtype(np.int16), True)
    assert _anonymous_resident() - before >= 0.9 * size
    assert dense_zeroed and sparse_zeroed
    assert not dense.any() and not sparse.any()
