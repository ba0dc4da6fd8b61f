"""Model presets: causal LMs built from a transformers config, never downloaded.

Presets are plain data, so that listing or checking them imports neither torch nor transformers (the CLI
and the launcher need the names only). Dropout is off unless the run sets it (--dropout): modern pretraining
does without it. It is no architecture setting: a resume may change it, and a resumed run with dropout is
still exact, since every rank's RNG state is in the checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# name -> (transformers model_type, its size settings). The llama presets have the layer shapes of Llama 3.2 1B and
# 3B and Llama 3.1 8B (whose output layer is its own, not the embedding's); the vocabulary is always the staged
# tokenizer's, so their parameter counts are the run's (the preflight says them).
PRESETS: dict[str, tuple[str, dict[str, int | bool]]] = {
    "tiny": ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4}),  # tests
    "small": ("gpt2", {"n_layer": 4, "n_embd": 128, "n_head": 4}),  # the laptop demo
    "gpt2-124m": ("gpt2", {"n_layer": 12, "n_embd": 768, "n_head": 12}),
    "gpt2-350m": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}),
    "llama-1b": (
        "llama",
        {
            "num_hidden_layers": 16,
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "llama-3b": (
        "llama",
        {
            "num_hidden_layers": 28,
            "hidden_size": 3072,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "llama-8b": (
        "llama",
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "tie_word_embeddings": False,
        },
    ),
}

# Presets for a laptop or the tests: not compiled by --compile auto (compiling takes longer than their runs).
SMALL_PRESETS = frozenset({"tiny", "small"})

# What each family calls its context length and its dropout probabilities, and its fixed settings.
_FAMILY_SETTINGS: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
    "gpt2": ("n_positions", ("resid_pdrop", "embd_pdrop", "attn_pdrop"), {}),
    "llama": ("max_position_embeddings", ("attention_dropout",), {}),
}


def check_preset(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown: choose one of {', '.join(PRESETS)}")
    return name


def model_config(
    preset: str,
    vocab_size: int,
    max_seq_len: int,
    eos_token_id: int,
    dropout: float = 0.0,
    bos_token_id: int | None = None,
) -> PretrainedConfig:
    from transformers import AutoConfig

    family, sizes = PRESETS[check_preset(preset)]
    context_key, dropout_keys, fixed = _FAMILY_SETTINGS[family]
    return AutoConfig.for_model(
        family,
        vocab_size=vocab_size,
        bos_token_id=eos_token_id if bos_token_id is None else bos_token_id,  # the tokenizer's, not the family's
        eos_token_id=eos_token_id,
        **{context_key: max_seq_len},
        **dict.fromkeys(dropout_keys, dropout),
        **fixed,
        **sizes,
    )


def set_dropout(config: PretrainedConfig, dropout: float) -> PretrainedConfig:
    """The run's dropout in every one of the family's dropout settings (a published GPT-2 config says 0.1)."""
    for key in _FAMILY_SETTINGS[config.model_type][1]:
        setattr(config, key, dropout)
    return config


# What shapes the weights (and the vocabulary they embed): a checkpoint resumes only under the same values. Library
# metadata is not part of it: transformers 4.57 writes `transformers_version`, ~25 generation defaults
# (src/transformers/configuration_utils.py, _get_global_generation_defaults) and rope_theta, which 5.x leaves out
# or calls rope_parameters; comparing whole configs refused every resume across a transformers upgrade.
ARCHITECTURE_KEYS = (
    "model_type",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "n_layer",
    "n_embd",
    "n_head",
    "n_inner",
    "n_positions",  # gpt2
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",  # llama
)


def architecture_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The architecture fields on which a saved model config and this run's differ, as 'name: saved -> now'."""
    return [
        f"{key}: {saved[key]!r} -> {current[key]!r}"
        for key in ARCHITECTURE_KEYS
        if key in saved and key in current and saved[key] != current[key]
    ]


def build_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model in fp32, the master weights' dtype, whatever the config says: a published model's config.json says
    the dtype it was saved in (bfloat16), which from_config would otherwise build in."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def config_from_dict(data: dict[str, Any]) -> PretrainedConfig:
    """Rebuild the exact config a run trained with (as saved in its config.json)."""
    from transformers import AutoConfig

    data = dict(data)
    return AutoConfig.for_model(data.pop("model_type"), **data)


# Causal attention without a mask, for training: every batch is whole windows, never padded or packed.
UNMASKED_CAUSAL_ATTENTION = "sdpa_unmasked_causal"


def without_attention_masks(model: torch.nn.Module) -> torch.nn.Module:
    """Train with SDPA's is_causal=True and no mask built per batch.

    Given no attention mask, transformers 5 checks every batch's positions for packed sequences on the host
    (masking_utils.find_packed_sequence_indices: `.all()` on a device tensor, a sync per forward). It builds no mask
    at all for an attention implementation that has no mask function registered (masking_utils,
    _preprocess_mask_arguments), and its SDPA function then runs causal: the kernel the "sdpa" implementation
    picks for an unpadded batch, so the numbers are the same (tests/test_private_api.py)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNMASKED_CAUSAL_ATTENTION, sdpa_attention_forward)
    model.set_attn_implementation(UNMASKED_CAUSAL_ATTENTION)
    return model
