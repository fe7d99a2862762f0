"""The pure-Python variable-size baseline keeps the contract it is measured under: random
calls against the reference model, the same outcomes and contents after every step."""

from __future__ import annotations

from typing import Any

import aostore
import model_variable as mv
from aostore.bench.baseline_variable import PythonVariableBlockObjectStore
from hypothesis import given, settings
from hypothesis import strategies as st

KEYS = ("a", "b", "c", "d", "e")
key_st = st.sampled_from(KEYS)
put_st = st.tuples(
    st.just("put"),
    st.lists(st.tuples(key_st, st.integers(0, 20)), max_size=4),
    st.lists(key_st, max_size=3),
    st.lists(key_st, max_size=3),
)
read_st = st.tuples(st.sampled_from(["get", "many", "contains"]), st.lists(key_st, max_size=4))
READS = {"get": "get_concatenated", "many": "get_many", "contains": "contains"}


def apply(store: Any, make: Any, op: tuple[Any, ...]) -> Any:
    """One call, as its outcome: a value, or the kind of error."""
    try:
        if op[0] == "put":
            _, batch, retains, releases = op
            objects = [make(k, bytes([len(k) + n]) * n) for k, n in batch]
            return ("ok", store.put(objects, retain_keys=retains, release_keys=releases))
        return ("ok", getattr(store, READS[op[0]])(op[1]))
    except KeyError as error:
        return ("KeyError", error.args)
    except (aostore.BlockObjectStoreError, mv.BlockObjectStoreError) as error:
        return ("cannot retain" in str(error), "does not exist" in str(error))


@settings(max_examples=400, deadline=None)
@given(
    max_bytes=st.integers(1, 40),
    chunk=st.sampled_from([1, 2, 5]),
    ops=st.lists(st.one_of(put_st, read_st), max_size=25),
)
def test_baseline_matches_the_model(max_bytes, chunk, ops):
    chunk = min(chunk, max_bytes)
    baseline = PythonVariableBlockObjectStore(max_bytes=max_bytes, chunk_nbytes=chunk)
    model = mv.VariableModelStore(max_bytes=max_bytes, chunk_nbytes=chunk)
    for op in ops:
        assert apply(baseline, aostore.BlockObject, op) == apply(model, mv.BlockObject, op), op
        assert baseline.snapshot() == model.snapshot(), op
    baseline.close()
