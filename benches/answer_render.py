"""The API server's JSON render with aostore's transport against Starlette's own (issue 46, item
1): an answer without routed experts must cost what Starlette's render does (at most 1.05x);
one with routed experts costs the splice.

Each answer is made and rendered in a context of its own, as a request's handler task makes
and renders its answer: ``numpy2base64`` (aostore's, over vLLM's) for the rows where the answer
has them, then ``JSONResponse.render``. Bodies:

- ``token ids``: a completion of 16,384 token ids, no routed experts (what a trainer asks for);
- ``chat``: a short chat answer, no routed experts;
- ``routed experts``: the token ids and a 16k-token sample's rows (17,083 x 46 x 8 uint8).

Medians of ``--reps`` renders, alternating aostore's and Starlette's.

    .venv-vllm/bin/python benches/answer_render.py [--reps 200]
"""

from __future__ import annotations

import argparse
import contextvars
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import starlette.responses
from aostore.vllm.transport.answer import numpy2base64_over, render_over
from vllm.utils import serial_utils

STARLETTE = vars(starlette.responses.JSONResponse)["render"]
RENDER = render_over(STARLETTE)
NUMPY2BASE64 = numpy2base64_over(serial_utils.numpy2base64)
ROWS = np.random.default_rng(0).integers(0, 128, (17_083, 46, 8), np.uint8)


def completion(token_ids: list[int], routed: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": "", "token_ids": token_ids, "finish_reason": "length"}
    if routed is not None:
        choice["routed_experts"] = routed
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}


def answer(body: str, render: Callable[[Any, Any], bytes]) -> int:
    """One answer made and rendered in a context of its own; its render's nanoseconds."""
    response = object.__new__(starlette.responses.JSONResponse)

    def handler() -> int:
        tokens = list(range(16_384))
        if body == "chat":
            content: Any = {
                "id": "chat-1",
                "choices": [{"message": {"role": "assistant", "content": "Hello! " * 20}}],
            }
        elif body == "token ids":
            content = completion(tokens, None)
        else:
            content = completion(tokens, NUMPY2BASE64(ROWS))
        start = time.perf_counter_ns()
        render(response, content)
        return time.perf_counter_ns() - start

    return contextvars.Context().run(handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    print(f"| {'answer':<16} | {'Starlette, us':>13} | {'aostore, us':>11} | ratio |")
    print(f"|{'-' * 18}|{'-' * 15}|{'-' * 13}|-------|")
    for body in ("token ids", "chat", "routed experts"):
        theirs, mine = [], []
        for _ in range(args.reps):
            theirs.append(answer(body, STARLETTE))
            mine.append(answer(body, RENDER))
        a, b = statistics.median(theirs) / 1000, statistics.median(mine) / 1000
        print(f"| {body:<16} | {a:>13.1f} | {b:>11.1f} | {b / a:>5.2f} |")


if __name__ == "__main__":
    main()
