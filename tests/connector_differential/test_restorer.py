"""vLLM 0.34.0's row restorer is upstream of the data plane: the same rows with it on and off.

0.34.0 lets a model module supply ``restore_routed_experts_rows``; ``bind_routed_experts_capturer``
binds it as the capturer's ``restore_rows``, which runs inside ``capture()`` on the device and
changes only what the capturer writes to its buffer. The connector reads that buffer through
``snapshot_routing_data`` as before. Here vLLM's real capturer (on the CPU platform, as vLLM's
own ``test_custom_restorer_writes_returned_rows`` builds it) is bound to modules with such a
restorer, and each step's forward pass runs through it; the connector with the data plane on
and with vLLM's code (aostore's store either way) emits the restored rows, byte for byte.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm.distributed.aux_output_connector.worker")
    pytest.importorskip("aostore.vllm_plugin")
    capturer_module = pytest.importorskip(
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
    )
    import torch

from . import contenders, harness, schedule, standins

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(
        not hasattr(capturer_module, "RoutedExpertsRowRestorer"),
        reason="this vLLM has no row restorer (0.34.0 added it)",
    ),
]

LAYERS, TOP_K, MAX_TOKENS = 4, 2, 8
PARAMS = contenders.Params(
    block_size=2,
    shape_per_token=(LAYERS, TOP_K),
    dtype_name="uint8",
    max_num_seqs=2,
    max_num_batched_tokens=MAX_TOKENS,
    max_concurrent_batches=1,
    store_slots=64,
    kv_blocks=64,
)


class Restoring(torch.nn.Module):
    """One MoE layer's capture source whose restorer keeps the context's rows of its input
    (as a backend that pads or gathers would restore its own)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn: Any = None
        self.restored = 0

    def forward(self, ids: torch.Tensor) -> None:
        self.capture_fn(ids)

    def restore_routed_experts_rows(self, ids: torch.Tensor, ctx: Any) -> torch.Tensor:
        self.restored += 1
        start = ctx.additional_kwargs["start"]
        return ids[start : start + ctx.batch_descriptor.num_tokens]


def _real_capturer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from transformers import MixtralConfig
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    MixtralConfig(
        architectures=["MixtralForCausalLM"],
        num_hidden_layers=LAYERS,
        num_local_experts=16,
        num_experts_per_tok=TOP_K,
    ).save_pretrained(tmp_path)
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(tmp_path),
            dtype="float32",
            max_model_len=32,
            enforce_eager=True,
            skip_tokenizer_init=True,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    monkeypatch.setattr(capturer_module, "current_platform", CpuPlatform())
    return capturer_module.RoutedExpertsCapturer(MAX_TOKENS, config)


def _ids(step: int, layer: int, padded: int) -> torch.Tensor:
    """A layer's top-k ids for a padded batch: row i of step s, layer l is distinct."""
    base = torch.arange(padded, dtype=torch.int32)[:, None] * 2 + torch.arange(TOP_K)[None, :]
    return (base + 40 * layer + 3 * step) % 16


def _run(which: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """One request: a 5-token prefill, then three decodes, through a connector built as
    ``which`` (``dataplane`` or ``aostore``) whose capturer is vLLM's, bound to restorers."""
    from vllm.forward_context import BatchDescriptor, ForwardContext, override_forward_context

    setup = contenders.installation()
    setup.use(which)
    connector, _ = contenders.build_connector(PARAMS)
    assert (connector.__dict__.get("_aostore_plane") is not None) == (which == "dataplane")
    capturer = _real_capturer(tmp_path / which, monkeypatch)
    model = torch.nn.ModuleList(Restoring(layer) for layer in range(LAYERS))
    capturer_module.bind_routed_experts_capturer(model, capturer)
    connector._capturer = capturer
    outputs = []
    position = 0
    try:
        for step, tokens in enumerate((5, 1, 1, 1)):
            blocks = range(position // 2, (position + tokens) // 2)
            hashes = {"r": [bytes([1, b]) for b in blocks]} if blocks else {}
            op = schedule.Begin(0, {"r": 0} if step == 0 else {"r": position}, hashes, ())
            connector.begin_step(harness._metadata(op))
            context = ForwardContext(
                no_compile_layers={},
                attn_metadata={},
                slot_mapping={},
                batch_descriptor=BatchDescriptor(num_tokens=tokens),
                additional_kwargs={"start": 1},
            )
            with override_forward_context(context):
                for layer, module in enumerate(model):
                    module(_ids(step, layer, tokens + 2))
            batch = standins.StandInInputBatch(
                req_ids=["r"],
                query_start_loc_np=np.array([0, tokens], dtype=np.int32),
                num_computed_tokens_np=np.array([position], dtype=np.int32),
            )
            pending = connector.prepare_output(batch)
            pending.enqueue_cpu_copy(np.array([1], np.int32), np.array([0], np.int32))
            outputs.append(connector.process_output(pending)["r"])
            position += tokens
        # vLLM binds the first provider's restorer for every layer.
        assert [module.restored for module in model] == [4 * LAYERS, 0, 0, 0]
    finally:
        connector.close()
    return outputs


def test_the_restored_rows_are_emitted_with_the_plane_on_and_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on = _run("dataplane", tmp_path, monkeypatch)
    off = _run("aostore", tmp_path, monkeypatch)
    for step, (native, vllm) in enumerate(zip(on, off, strict=True)):
        assert native.token_start == vllm.token_start
        assert native.rows.dtype == vllm.rows.dtype == np.uint8
        assert native.rows.tobytes() == vllm.rows.tobytes(), step
        # What the restorer kept (rows 1.. of the padded input), not the input's first rows.
        tokens = len(vllm.rows)
        restored = np.stack([_ids(step, layer, tokens + 2)[1 : 1 + tokens] for layer in range(4)])
        assert np.array_equal(vllm.rows, restored.transpose(1, 0, 2).astype(np.uint8))
