"""Each RL framework's own way of making its trainer's routed-experts tensor from vLLM's rows,
reimplemented in this project's words from the framework's published source (each function
names the repository, commit and function). aostore's layouts (``aostore.r3.padded`` and
``packed``) must give the same bytes: ``tests/r3/test_frameworks.py`` on synthetic rows,
``tests/vllm_engine/test_engine_asyncllm.py`` on a real engine's.
"""

from __future__ import annotations

import numpy as np
import torch

MISSING_ROUTE = -1
"""NeMo-RL's route for an expected token that has none."""


def verl_way(
    samples: list[np.ndarray], prompt_lengths: list[int], prompt_width: int, response_width: int
) -> torch.Tensor:
    """verl (volcengine/verl at 1dda039b9c, ``verl/experimental/agent_loop/agent_loop.py``: the
    routed-experts block of the agent loop's per-sample postprocessing, then the batch's
    ``torch.cat``): a sample's rows become int16, go into a zeroed ``[1, prompt_width +
    response_width, layers, top_k]`` tensor at the column where its left-padded prompt begins
    (the prompt width less the prompt's length), and a negative start or an end past the
    tensor is a ``ValueError``. The batch is the samples concatenated on the first axis."""
    total = prompt_width + response_width
    placed = []
    for rows, prompt_length in zip(samples, prompt_lengths, strict=True):
        widened = torch.from_numpy(rows).to(torch.int16)
        one = torch.zeros((1, total, *rows.shape[1:]), dtype=torch.int16)
        begin = prompt_width - prompt_length
        end = begin + rows.shape[0]
        if begin < 0 or end > total:
            raise ValueError(f"rows do not fit: {begin}..{end} of {total}")
        one[0, begin:end] = widened
        placed.append(one)
    return torch.cat(placed, dim=0)


def verl_stitch(first: np.ndarray, resumed: np.ndarray) -> np.ndarray:
    """verl's partial rollout (``llm_server.py`` lines 423-428 at the same commit): the first
    segment's rows, then the resumed request's rows past them (the resumed request routed the
    whole sequence again; only its new tokens' rows are kept)."""
    return np.concatenate([first, resumed[len(first) :]])


def nemo_rl_dtype(num_experts: int) -> torch.dtype:
    """NeMo-RL's carry dtype (``nemo_rl/models/generation/interfaces.py``): the narrowest signed
    integer that holds every expert id."""
    if num_experts <= 128:
        return torch.int8
    if num_experts <= 32_768:
        return torch.int16
    return torch.int32


def nemo_rl_way(
    prompt_rows: np.ndarray | None,
    rows: np.ndarray,
    valid_length: int,
    padded_length: int,
    dtype: torch.dtype,
    require_complete: bool,
) -> torch.Tensor:
    """NeMo-RL (NVIDIA-NeMo/RL at 04018778b9f81aa40dadeecd55dce80341783d98,
    ``nemo_rl/models/generation/vllm/utils.py``, ``pad_and_align_routed_expert_indices``): the
    prompt's routes then the completion's, checked to fit the carry dtype (a ``ValueError``,
    not a wrap) and narrowed; the sequence's tokens but the last are expected to have a route
    (``valid_length - 1``, at most the padded length). Strictly, at most one route past those
    is allowed (the final token's, dropped). The result is the padded length of
    ``arange(top_k)`` rows, the expected routes copied over its start, and ``-1`` for the
    expected tokens that have no route."""
    parts = [p for p in (prompt_rows, rows) if p is not None]
    routes = torch.cat([torch.from_numpy(p.astype(np.int64)) for p in parts])
    if routes.numel() and int(routes.max()) > torch.iinfo(dtype).max:
        raise ValueError(f"routed expert id {int(routes.max())} exceeds {dtype}")
    routes = routes.to(dtype)
    expected = min(max(valid_length - 1, 0), padded_length)
    if require_complete and routes.shape[0] > expected + 1:
        raise ValueError("more than one surplus final-token route")
    full = (
        torch.arange(routes.shape[2], dtype=dtype)
        .expand(padded_length, routes.shape[1], routes.shape[2])
        .clone()
    )
    copied = min(expected, routes.shape[0])
    full[:copied] = routes[:copied]
    full[copied:expected] = MISSING_ROUTE
    return full


def skyrl_padded_way(samples: list[np.ndarray], moe_layers: list[int]) -> torch.Tensor:
    """SkyRL's padded batch, as issue 50 describes SkyRL at a9564572eb
    (``skyrl_train/dataset/preprocess.py``, ``skyrl_train/utils/replay_utils.py``; the source
    was not at hand to re-read line by line when this was written): ``[N, max_total, layers,
    top_k]`` filled with ``arange(top_k)`` rows, each sample's rows (vLLM's layers mapped onto
    the model's MoE layers) left-padded, that is ending at the last column."""
    width = max(len(rows) for rows in samples)
    top_k = samples[0].shape[2]
    out = (
        torch.arange(top_k, dtype=torch.int32)
        .expand(len(samples), width, len(moe_layers), top_k)
        .clone()
    )
    for i, rows in enumerate(samples):
        if len(rows):
            out[i, width - len(rows) :] = torch.from_numpy(rows[:, moe_layers].astype(np.int32))
    return out


def skyrl_packed_way(
    samples: list[np.ndarray], sequence_lengths: list[int], moe_layers: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's packed batch (SkyRL#2235, as issue 50 describes it): the samples' tokens one
    after the other with their ``cu_seqlens``; a sequence's tokens past its captured rows (a
    suffix the engine did not route) get the dummy route ``arange(top_k)``."""
    pieces = []
    for rows, length in zip(samples, sequence_lengths, strict=True):
        captured = torch.from_numpy(rows[:length][:, moe_layers].astype(np.int32))
        top_k = rows.shape[2]
        dummy = torch.arange(top_k, dtype=torch.int32).expand(
            length - captured.shape[0], len(moe_layers), top_k
        )
        pieces.append(torch.cat([captured, dummy]))
    cu_seqlens = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(sequence_lengths), 0)
    return torch.cat(pieces), cu_seqlens
