"""The smallest stand-ins vLLM's scheduler connector reads, and real vLLM ``Request`` objects.

- :class:`StandInBlockPool`: ``hash_block_size`` and ``get_cached_block(hash, group_ids)``
  over a plain set of GPU-cached block hashes (the schedule adds and drops hashes).
- :func:`kv_cache_manager`: ``coordinator.single_type_managers[0]`` (``block_size``,
  ``block_pool``), ``block_pool`` and ``kv_cache_config.num_blocks`` (0.33.0's retention
  capacity), as ``benches/scheduler.py``'s stand-in does.
- :func:`make_request`: a ``vllm.v1.request.Request`` whose block hasher chains BLAKE2b over
  each full ``hash_block_size`` chunk of its tokens, so shared prefixes share hashes.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

HASH_BYTES = 32


class StandInBlockPool:
    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.cached: set[bytes] = set()

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> Any:
        return [block_hash] if block_hash in self.cached else None


def kv_cache_manager(block_size: int, hash_block_size: int, num_blocks: int) -> Any:
    pool = StandInBlockPool(hash_block_size)
    manager = SimpleNamespace(block_size=block_size, block_pool=pool)
    return SimpleNamespace(
        coordinator=SimpleNamespace(single_type_managers=[manager]),
        block_pool=pool,
        kv_cache_config=SimpleNamespace(num_blocks=num_blocks),
    )


def chain_hashes(
    tokens: list[int], hash_block_size: int, start: int = 0, prev: bytes = b""
) -> list[bytes]:
    """The chained hashes of the full chunks of ``tokens`` from chunk ``start`` on."""
    out = []
    for index in range(start, len(tokens) // hash_block_size):
        chunk = tokens[index * hash_block_size : (index + 1) * hash_block_size]
        digest = hashlib.blake2b(prev + repr(chunk).encode(), digest_size=HASH_BYTES).digest()
        out.append(digest)
        prev = digest
    return out


def hasher(hash_block_size: int) -> Any:
    """vLLM's block-hasher contract: the hashes of the full blocks after ``block_hashes``."""

    def block_hasher(request: Any) -> list[bytes]:
        done = len(request.block_hashes)
        prev = request.block_hashes[-1] if done else b""
        return chain_hashes(list(request.all_token_ids), hash_block_size, done, prev)

    return block_hasher


def make_request(rid: str, prompt: list[int], prompt_start: int, hash_block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    request = Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=1 << 20, routed_experts_prompt_start=prompt_start),
        None,
        block_hasher=hasher(hash_block_size),
    )
    request.status = RequestStatus.RUNNING
    return request
