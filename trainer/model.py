"""Model presets: causal LMs built from a transformers config, never downloaded.

Dropout is off in every preset: modern pretraining does without it, and it keeps resumed runs exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import GPT2Config, LlamaConfig, PretrainedConfig


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> Callable[[int, int], PretrainedConfig]:
    def make(vocab_size: int, max_seq_len: int) -> PretrainedConfig:
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_seq_len,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )

    return make


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> Callable[[int, int], PretrainedConfig]:
    def make(vocab_size: int, max_seq_len: int) -> PretrainedConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            max_position_embeddings=max_seq_len,
            num_hidden_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=ffn,
            attention_dropout=0.0,
            tie_word_embeddings=True,
        )

    return make


PRESETS: dict[str, Callable[[int, int], PretrainedConfig]] = {
    "tiny": _gpt2(n_layer=2, n_embd=64, n_head=4),  # tests
    "small": _gpt2(n_layer=4, n_embd=128, n_head=4),  # the laptop demo
    "gpt2-124m": _gpt2(n_layer=12, n_embd=768, n_head=12),
    "gpt2-350m": _gpt2(n_layer=24, n_embd=1024, n_head=16),
    "llama-1b": _llama(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192),
}


def check_preset(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown: choose one of {', '.join(PRESETS)}")
    return name


def model_config(preset: str, vocab_size: int, max_seq_len: int, eos_token_id: int) -> PretrainedConfig:
    config = PRESETS[check_preset(preset)](vocab_size, max_seq_len)
    config.bos_token_id = config.eos_token_id = eos_token_id  # our tokenizer's, not the preset family's
    return config


def build_model(config: PretrainedConfig) -> torch.nn.Module:
    # Imported here: AutoModel pulls in much of transformers, which only the model builders need.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def config_from_dict(data: dict[str, Any]) -> PretrainedConfig:
    """Rebuild the exact config a run trained with (as saved in its config.json)."""
    from transformers import AutoConfig

    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type"), **data)
