"""Writes a tiny random-weight MoE checkpoint that vLLM loads like any Hugging Face model.

Nothing is downloaded: the config is a ``transformers`` ``Qwen3MoeConfig`` (an architecture
vLLM's CPU path runs, with its fused-MoE layers and routed-experts capture), the weights come
from ``torch.manual_seed(seed)``, and there is no tokenizer (the engine is started with
``skip_tokenizer_init=True`` and fed token ids). ``head_dim=32``: vLLM's CPU attention has no
kernel for 16. ``initializer_range=0.2`` instead of 0.02 spreads the router logits, so tokens
pick varied experts.

Run as ``python tiny_moe.py OUT_DIR [--seed N]``; prints the config as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LAYERS = 2
EXPERTS = 8
TOP_K = 2
VOCAB = 512


def build(out: Path, seed: int = 0) -> dict[str, object]:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    result: dict[str, object] = json.loads((out / "config.json").read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(build(args.out, args.seed), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
