"""``RowChunks`` against the ``list[np.ndarray]`` it stands in for in vLLM's ``RequestState``.

Every operation vLLM's ``OutputProcessor`` uses (``append``; ``chunks[-1] = rows``, which
``_trim_surplus_tokens`` uses to cut the last chunk, possibly to nothing, even when more tokens
are dropped than that output has rows; truth; the concatenation of a finished request) and the
other list reads give what the list gives, for any sequence of them; chunks that do not fit one
buffer (another dtype or shape) turn it into the list, chunk for chunk. And the rows are held at
their size: the buffer, not a view per row.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from aostore._npy import LaidOut
from aostore.vllm.transport import RowChunks
from hypothesis import given, settings
from hypothesis import strategies as st

SHAPE = (3, 2)  # a row: layers x top-k, small


def rows(n: int, seed: int, dtype: str = "uint8", shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, (n, *shape)).astype(dtype)


def same(a: object, b: object) -> None:
    """The same array: type, dtype, shape and values."""
    assert type(a) is type(b) is np.ndarray
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b)


def concatenated(chunks: object) -> object:
    """What vLLM's ``_new_completion_output`` makes, or the exception it raises."""
    try:
        return np.concatenate(chunks, axis=0)  # type: ignore[call-overload]
    except Exception as error:
        return (type(error), str(error))


def finished(chunks: RowChunks) -> object:
    """What the finish hands ``CompletionOutput``, or the exception it raises."""
    try:
        return chunks.finished()
    except Exception as error:
        return (type(error), str(error))


def check(ours: RowChunks, theirs: list[np.ndarray]) -> None:
    assert len(ours) == len(theirs)
    assert bool(ours) == bool(theirs)
    for got, want in zip(ours, theirs, strict=True):
        same(got, want)
    if theirs:
        same(ours[-1], theirs[-1])
        same(ours[0], theirs[0])
    joined, want = concatenated(ours.joined()), concatenated(theirs)
    if isinstance(want, np.ndarray):
        same(joined, want)
    else:
        assert joined == want
    # vLLM's finish: `if finished and chunks: np.concatenate(chunks, axis=0)`, else None.
    got, want = finished(ours), concatenated(theirs) if theirs else None
    if isinstance(want, np.ndarray):
        same(got, want)
        assert isinstance(got, np.ndarray) and got.flags.c_contiguous and got.flags.writeable
    else:
        assert got == want


# One step's operations on a request's chunks: an output with `n` rows arrives; or it arrives
# and the frontend trims `dropped` surplus tokens (vLLM: chunks[-1] = rows[:-dropped]).
operations = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 6), st.booleans()), min_size=0, max_size=30
)


@settings(max_examples=300, deadline=None)
@given(operations, st.integers(0, 2**32 - 1))
def test_the_outputs_vllm_sends_give_the_lists_results(
    steps: list[tuple[int, int, bool]], seed: int
) -> None:
    ours, theirs = RowChunks(), []
    for i, (n, dropped, trim) in enumerate(steps):
        output = rows(n, seed + i)
        ours.append(output)
        theirs.append(output)
        if trim and dropped:
            cut = output[:-dropped]  # possibly empty, as vLLM's slice is
            ours[-1] = cut
            theirs[-1] = cut
        check(ours, theirs)
    assert ours.nbytes == sum(chunk.nbytes for chunk in theirs)


@pytest.mark.parametrize(
    "odd",
    [
        rows(2, 1, dtype="int32"),  # another dtype: np.concatenate promotes
        rows(2, 2, shape=(3, 3)),  # another row shape: np.concatenate raises
        np.uint8(7),  # no rows dimension
        rows(2, 3).reshape(2, 6),  # another number of dimensions
        [[[1, 2], [3, 4], [5, 6]]],  # not an array
    ],
    ids=["dtype", "shape", "scalar", "ndim", "list"],
)
@pytest.mark.parametrize("how", ["append", "set last"])
def test_a_chunk_that_does_not_fit_turns_it_into_vllms_list(odd: object, how: str) -> None:
    ours, theirs = RowChunks(), []
    for i in range(3):
        ours.append(rows(i + 1, i))
        theirs.append(rows(i + 1, i))
    if how == "append":
        ours.append(odd)
        theirs.append(odd)  # type: ignore[arg-type]
    else:
        ours[-1] = odd
        theirs[-1] = odd  # type: ignore[call-overload]
    assert len(ours) == len(theirs)
    assert ours[-1] is odd
    joined, want = concatenated(ours.joined()), concatenated(theirs)
    if isinstance(want, np.ndarray):
        same(joined, want)
    else:
        assert joined == want
    ours.append(rows(1, 9))  # it stays the list from here
    theirs.append(rows(1, 9))
    assert len(ours) == len(theirs)


def test_writes_other_than_to_the_last_chunk_keep_the_lists_meaning() -> None:
    ours, theirs = RowChunks(), []
    for i in range(4):
        ours.append(rows(2, i))
        theirs.append(rows(2, i))
    ours[1] = rows(5, 10)
    theirs[1] = rows(5, 10)
    check(ours, theirs)
    ours[3] = rows(1, 11)  # the last chunk by its index: a list too
    theirs[3] = rows(1, 11)
    check(ours, theirs)
    with pytest.raises(IndexError):
        ours[7] = rows(1, 12)


def test_an_empty_one_is_false_and_joins_nothing() -> None:
    ours = RowChunks()
    assert not ours and len(ours) == 0 and list(ours) == [] and ours.joined() == []
    with pytest.raises(IndexError):
        ours[-1] = rows(1, 0)  # as on an empty list
    ours.append(rows(0, 0))  # an empty chunk still makes it true (vLLM's list would be)
    assert ours and len(ours) == 1
    same(np.concatenate(ours.joined()), np.concatenate([rows(0, 0)]))
    same(ours.finished(), np.concatenate([rows(0, 0)]))


def test_rows_of_no_bytes_are_the_lists() -> None:
    """A row shape with a zero in it: the pages' size cannot count such rows, the list can."""
    ours, theirs = RowChunks(), []
    for n in (3, 0, 2):
        chunk = np.zeros((n, 4, 0), np.uint8)
        ours.append(chunk)
        theirs.append(chunk)
    check(ours, theirs)
    assert ours.finished().shape == (5, 4, 0)  # type: ignore[union-attr]


def test_the_finished_rows_follow_their_npy_header_and_are_the_callers() -> None:
    """The finish's array sits right after its ``.npy`` header in one buffer (what the API
    server's ``numpy2base64`` encodes as it is), and is the caller's, as vLLM's concatenation
    is: writable, and no later write to the chunks reaches it."""
    import io

    ours, want = RowChunks(), rows(5000, 3, shape=(46, 8))
    ours.append(want[:700])
    for i in range(700, 5000):
        ours.append(want[i : i + 1])
    got = ours.finished()
    assert got is not None
    same(got, want)
    buffer = got.base  # up to the LaidOut buffer (its memory a bytearray of its own)
    while isinstance(buffer.base, np.ndarray):  # type: ignore[union-attr]
        buffer = buffer.base  # type: ignore[union-attr]
    saved = io.BytesIO()
    np.save(saved, want, allow_pickle=False)
    assert type(buffer) is LaidOut and buffer.tobytes() == saved.getvalue()
    ours[-1] = rows(1, 99, shape=(46, 8))
    got[0, 0, 0] = 255
    same(got[1:], want[1:])


@pytest.mark.parametrize("n", [0, 1, 11, 700, 5000])
def test_streamed_into_a_slot_the_rows_are_the_finished_ones(n: int) -> None:
    """What an R3 arena's slot gets (streaming stores, pages clipped at the rows' end, any
    alignment) is byte for byte the finish's rows; a target of the wrong size or a read-only
    one is refused before a byte is written."""
    from aostore._native import copy_pages

    ours, want = RowChunks(), rows(n + 3, 4, shape=(46, 8))
    ours.append(want[:3])
    for i in range(3, n + 3):
        ours.append(want[i : i + 1])
    ours[-1] = want[n + 2 : n + 2]  # a trim: the last page is part full
    finished = ours.finished()
    assert finished is not None
    for offset in (0, 1, 17):
        slab = np.zeros(ours.nbytes + offset + 1, np.uint8)
        ours.stream_into([slab[offset : offset + ours.nbytes]])
        assert slab[offset : offset + ours.nbytes].tobytes() == finished.tobytes()
        assert not slab[:offset].any() and slab[-1] == 0
    # A slot whose pages are in runs apart: the same bytes, run by run.
    runs = np.zeros(ours.nbytes + 4096, np.uint8)
    cut = min(4096, ours.nbytes)
    ours.stream_into([runs[4096 + cut :], runs[:cut]])
    assert runs[4096 + cut :].tobytes() + runs[:cut].tobytes() == finished.tobytes()
    plain = np.zeros(ours.nbytes, np.uint8)
    pages = [page for page, _ in ours._pages.pages()]
    copy_pages(pages, ours.nbytes, plain, stream=False)  # out= of a small batch
    assert plain.tobytes() == finished.tobytes()
    target = np.zeros(ours.nbytes + 1, np.uint8)
    with pytest.raises(ValueError, match="not the"):
        ours.stream_into([target])
    with pytest.raises(ValueError, match="not the"):
        ours.stream_into([target[:1], target[1:]])
    assert not target.any()
    with pytest.raises(ValueError, match="the pages hold"):
        copy_pages([bytearray(3)], 4, np.zeros(4, np.uint8))
    readonly = np.zeros(4, np.uint8)
    readonly.setflags(write=False)
    with pytest.raises(TypeError, match="writable"):
        copy_pages([bytearray(b"abcd")], 4, readonly)
    assert not readonly.any()
    with pytest.raises(TypeError, match="a page is a buffer"):
        copy_pages([object()], 4, np.zeros(4, np.uint8))  # type: ignore[list-item]
    assert not target.any()


def test_a_strided_chunk_is_held_by_value() -> None:
    base = rows(10, 5)
    strided = base[::2]  # not contiguous
    ours = RowChunks()
    ours.append(strided)
    base[:] = 0  # the caller's memory changes: the rows held do not
    same(ours[0], np.ascontiguousarray(rows(10, 5)[::2]))


def test_a_join_that_is_still_alive_does_not_stop_the_next_write() -> None:
    ours = RowChunks()
    ours.append(rows(3, 1))
    views = ours.joined()
    ours.append(rows(2, 2))  # pages never move: no BufferError
    ours[-1] = rows(1, 3)
    same(np.concatenate(views), rows(3, 1))
    same(np.concatenate(ours.joined()), np.concatenate([rows(3, 1), rows(1, 3)]))


@pytest.mark.parametrize("shape", [(46, 8), (7,), (3, 1000)])
def test_chunks_across_pages_and_trims_across_pages(shape: tuple[int, ...]) -> None:
    """Rows that span pages (a prompt larger than a page, rows that fill one) and trims that
    drop whole pages read back as the list's."""
    ours, theirs = RowChunks(), []
    sizes = [300, 1, 1, 250, 1, 3, 400, 2]
    for i, n in enumerate(sizes):
        chunk = rows(n, i, shape=shape)
        ours.append(chunk)
        theirs.append(chunk)
        check(ours, theirs)
        if n > 2:
            ours[-1] = chunk[: n // 3]
            theirs[-1] = chunk[: n // 3]
            check(ours, theirs)
    ours[-1] = chunk[:0]
    theirs[-1] = chunk[:0]
    check(ours, theirs)


def test_rows_are_held_at_their_size() -> None:
    """A 16k-token request's rows as they arrive (the prompt, then one row a step): the pages
    and the chunk ends are at most 1.1x the rows' bytes (one part-full page of 64 KiB at most,
    8 bytes a chunk), where vLLM's list holds a view per row (an ndarray header, its shape and
    strides, the list slot) and pins the message it came in."""
    shape = (46, 8)
    ours, theirs = RowChunks(), []
    prompt = rows(700, 0, shape=shape)
    ours.append(prompt)
    theirs.append(prompt)
    decode = rows(16_384, 1, shape=shape)
    for i in range(len(decode)):
        ours.append(decode[i : i + 1])
        theirs.append(decode[i : i + 1])
    held = ours.allocated + ours._pages.books + sys.getsizeof(ours)
    assert ours.nbytes == (700 + 16_384) * 368
    assert held <= 1.1 * ours.nbytes, (held, ours.nbytes)
    per_row_view = sys.getsizeof(theirs) / len(theirs) + sys.getsizeof(decode[:1])
    assert per_row_view > 100  # what the list costs beyond the rows: the point of the buffer
    same(np.concatenate(ours.joined()), np.concatenate(theirs))


def test_the_page_being_written_cannot_be_resized_from_python() -> None:
    # Rows are written through the last page's address: that page stays exported, so Python
    # cannot move it (a resize would leave the next write pointing at freed memory).
    chunks = RowChunks()
    chunks.append(rows(5, 1))
    pages = chunks._pages
    assert pages is not None
    page, used = pages.pages()[-1]
    with pytest.raises(BufferError):
        page.extend(b"\0" * 4096)
    with pytest.raises(BufferError):
        del page[used:]
    chunks.append(rows(3, 2))
    chunks[-1] = rows(2, 3)  # a trim re-exports the page it ends on
    with pytest.raises(BufferError):
        pages.pages()[-1][0].extend(b"\0")
    same(np.concatenate(chunks, axis=0), np.concatenate([rows(5, 1), rows(2, 3)]))


def test_an_unwritten_bytearray_is_a_plain_bytearray_of_its_size() -> None:
    """The finish's and the pages' memory: a ``bytearray`` of exactly the size asked (its bytes
    whatever they were, written before read), that behaves as any other; a size that is no
    size is refused."""
    from aostore._native import unwritten_bytearray

    for size in (0, 1, 4095, 4096, 5 << 20):
        page = unwritten_bytearray(size)
        assert type(page) is bytearray and len(page) == size
        page[:] = b"\x07" * size
        assert page.count(7) == size
        page.extend(b"ab")  # resizable like any bytearray with no export
        assert len(page) == size + 2 and page[-2:] == b"ab"
    with pytest.raises(OverflowError):
        unwritten_bytearray(-1)
    with pytest.raises((OverflowError, ValueError, MemoryError)):
        unwritten_bytearray(1 << 62)
