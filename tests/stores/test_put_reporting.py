"""``put_reporting`` / ``put_blocks_reporting``: a put that says which keys it stored.

The Mooncake tier publishes exactly what the local tier wrote; these calls are how it knows.
Checked against each store's rule for random calls: a new key is written, a stored one only
where the store rewrites it (profile ``grow``: nothing referenced it as the call began; the
variable store: always), and a key evicted by its own put is not written.
"""

from __future__ import annotations

import random

import aostore
import numpy as np
import pytest

NBYTES = 4


def _key(i: int) -> str:
    return f"vllm-artifact/0/{i}"


def _stores() -> list[tuple[str, object]]:
    return [
        ("fail-closed", aostore.BlockObjectStore(max_bytes=8 * NBYTES, object_nbytes=NBYTES)),
        (
            "grow",
            aostore.BlockObjectStore(max_bytes=8 * NBYTES, object_nbytes=NBYTES, profile="grow"),
        ),
        ("variable", aostore.VariableBlockObjectStore(max_bytes=48, chunk_nbytes=4)),
    ]


def _expected(rule: str, keys: list[str], before: dict, unreferenced: set, after: dict) -> list:
    written = []
    for key in dict.fromkeys(keys):
        rewritten = {"fail-closed": False, "grow": key in unreferenced, "variable": True}[rule]
        if key in after and (key not in before or rewritten):
            written.append(key)
    return written


def written_nothing(store: object, before: dict) -> bool:
    """A refused put stored nothing: every object is as it was, and none is new."""
    return store.snapshot()["objects"] == before  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(20))
def test_put_reporting_names_what_each_store_wrote(seed: int) -> None:
    rng = random.Random(seed)
    for rule, store in _stores():
        held: dict[str, int] = {}
        for _ in range(60):
            keys = [_key(rng.randrange(20)) for _ in range(rng.randrange(0, 8))]
            payloads = [
                bytes([rng.randrange(256)]) * (NBYTES if rule != "variable" else rng.randrange(9))
                for _ in keys
            ]
            retains = [_key(rng.randrange(20)) for _ in range(rng.randrange(3))]
            releases = [k for k in held if held[k] > 0 and rng.random() < 0.3]
            before = store.snapshot()["objects"]
            counts = store.reference_counts(keys)
            unreferenced = {k for k, c in zip(keys, counts, strict=True) if c == 0}
            objects = [aostore.BlockObject(k, p) for k, p in zip(keys, payloads, strict=True)]
            try:
                written = store.put_reporting(objects, retain_keys=retains, release_keys=releases)
            except aostore.BlockObjectStoreError:
                assert written_nothing(store, before)
                if rule != "variable":  # vLLM's fixed store keeps a refused put's counts
                    for k in retains:
                        held[k] = held.get(k, 0) + 1
                    for k in releases:
                        held[k] -= 1
                continue
            for k in retains:
                held[k] = held.get(k, 0) + 1
            for k in releases:
                held[k] -= 1
            after = store.snapshot()["objects"]
            assert written == _expected(rule, keys, before, unreferenced, after), (rule, seed)
            last = {k: p for k, p in zip(keys, payloads, strict=True)}
            for k in written:
                assert after[k] == last[k]
        store.check()


def test_put_blocks_reporting_takes_arrays_and_refuses_bad_input_unchanged() -> None:
    store = aostore.BlockObjectStore(max_bytes=4 * NBYTES, object_nbytes=NBYTES)
    rows = np.arange(3 * NBYTES, dtype=np.uint8).reshape(3, NBYTES)
    keys = [_key(0), _key(1), _key(0)]
    assert store.put_blocks_reporting(keys, rows) == [_key(0), _key(1)]
    assert store.get_concatenated([_key(0)]) == rows[2].tobytes()
    assert store.put_blocks_reporting([_key(0)], rows[:1]) == []  # stored: kept, not rewritten
    before = store.snapshot()
    with pytest.raises(ValueError):
        store.put_blocks_reporting([_key(5)], np.zeros((1, NBYTES + 1), dtype=np.uint8))
    with pytest.raises(KeyError):
        store.put_reporting([], release_keys=[_key(9)])
    assert store.snapshot() == before
    store.close()
    with pytest.raises(RuntimeError):
        store.put_reporting([aostore.BlockObject(_key(7), b"abcd")])
