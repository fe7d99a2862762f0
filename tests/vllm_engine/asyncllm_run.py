"""vLLM's ``AsyncLLM`` in this process, as verl, NeMo-RL, SkyRL and rLLM run it inside a Ray
actor: the requests below, one at a time, and every finished output's routed experts written
to a file as vLLM's HTTP field would carry them (``.npy`` bytes, base64).

    python asyncllm_run.py MODEL_DIR OUT_JSON

The plugin's settings come from the environment (``AOSTORE_VLLM_PLUGIN``,
``AOSTORE_VLLM_R3_DELIVERY``, ``AOSTORE_VLLM_R3_MOONCAKE``, ...): with delivery by reference
the field is a reference into this process's arena, so the process stays up after writing
``OUT_JSON`` (and publishing, with Mooncake) until a line arrives on stdin, while another
process reads the references. The engine core runs in its own process, as ``AsyncLLM`` starts
it; the worker under it.

The requests (seeded sampling, token prompts, no tokenizer): ``n`` = 2; a one-token answer; a
conversation whose second turn re-sends the first turn's prompt and answer (a prefix-cache
hit: its rows are read back from vLLM's store); a request aborted by its caller after four
tokens, and its resumption from those tokens (verl's partial rollout). Each entry: what, the
choice's index, its prompt's length, its token ids, whether it finished, the prompt's
tokens found in the prefix cache, its field (None where vLLM gave none).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROMPT = list(range(3, 11))
TURN = list(range(30, 70))  # over one 32-token block: the second turn hits the prefix cache
SEED = 1234


def field(routed: Any) -> str | None:
    """vLLM's field for ``routed`` (rows or aostore's reference): ``np.save``'s bytes, base64."""
    if routed is None:
        return None
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.asarray(routed), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def run(model: Path, out: Path) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            enforce_eager=True,
            enable_return_routed_experts=True,
            enable_prefix_caching=True,
            block_size=32,
            max_model_len=1024,
            max_num_seqs=8,
            kv_cache_memory_bytes=64 << 20,
            disable_log_stats=True,
        )
    )
    got: list[dict[str, Any]] = []

    async def generate(
        what: str, prompt: list[int], max_tokens: int, n: int = 1, stop_after: int = 0
    ) -> list[list[int]]:
        params = SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=SEED,
            detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE,
        )
        # Each choice's latest output: how vLLM's collector merges a step's outputs of n > 1
        # depends on when this task takes them.
        latest: dict[int, Any] = {}
        cached = 0
        stream = engine.generate(TokensPrompt(prompt_token_ids=prompt), params, what)
        async for output in stream:
            latest |= {choice.index: choice for choice in output.outputs}
            cached = max(cached, output.num_cached_tokens or 0)
            if stop_after and len(latest[0].token_ids) >= stop_after:
                await engine.abort(what)  # the caller gives the request up
                break
        assert sorted(latest) == list(range(n)), (what, sorted(latest))
        for index, choice in sorted(latest.items()):
            got.append(
                {
                    "what": what,
                    "index": index,
                    "prompt_tokens": len(prompt),
                    "token_ids": list(choice.token_ids),
                    "finished": choice.finished(),
                    "cached_tokens": cached,
                    "routed_experts": field(choice.routed_experts),
                }
            )
        return [list(choice.token_ids) for _, choice in sorted(latest.items())]

    try:
        await generate("n=2", PROMPT, 16, n=2)
        await generate("one token", PROMPT, 1)
        first = (await generate("turn 1", TURN, 12))[0]
        await generate("turn 2", TURN + first + [11, 12], 8)
        partial = (await generate("aborted", [*PROMPT, 20], 200, stop_after=4))[0]
        await generate("resumed", [*PROMPT, 20, *partial[:4]], 8)
        out.with_suffix(".tmp").write_text(json.dumps(got))
        out.with_suffix(".tmp").rename(out)
        print("written", flush=True)
        sys.stdin.readline()  # the references live with this frontend: until the reader is done
    finally:
        engine.shutdown()


def main(argv: list[str]) -> int:
    model, out = Path(argv[0]), Path(argv[1])
    from engine_run import setup_environment

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # AsyncLLM's own layout
    setup_environment()
    asyncio.run(run(model, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
