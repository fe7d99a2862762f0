"""Fixtures the ``vllm serve`` tests share: the model, and vLLM's own arm (plugin off), run
once for every module that compares its answers with vLLM's (``serve.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import serve

    model = tmp_path_factory.mktemp("served") / "model"
    serve.build_model(model)
    return model


@pytest.fixture(scope="session")
def vllm_answers(served_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's arm: ``exchange`` with the plugin off, and its log up to the exchange's end."""
    import serve

    log = tmp_path_factory.mktemp("vllm-arm") / "vllm.log"
    server = serve.Server(served_model, log, "0")
    try:
        return {"bodies": serve.exchange(server), "log": log.read_text(errors="replace")}
    finally:
        server.stop()
