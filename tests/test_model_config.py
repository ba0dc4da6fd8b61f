"""Resume compares the model's architecture, not the library's metadata in its config."""

from __future__ import annotations

from trainer.model import architecture_differences, model_config

# What transformers 4.57 adds to every config dict that 5.x leaves out: its version and the global generation
# defaults (transformers v4.57.6 src/transformers/configuration_utils.py, PretrainedConfig.
# _get_global_generation_defaults), and, for llama, rope_theta/rope_scaling where 5.x has rope_parameters.
TRANSFORMERS_4_57_KEYS = {
    "transformers_version": "4.57.6",
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "early_stopping": False,
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "num_return_sequences": 1,
    "output_scores": False,
    "return_dict_in_generate": False,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "torch_dtype": "float32",
}


def as_written_by_4_57(config: dict) -> dict:
    """This version's config dict as transformers 4.57 writes it: its keys added, 5.x's own dropped."""
    written = {k: v for k, v in config.items() if k not in ("transformers_version", "dtype", "rope_parameters")}
    if config["model_type"] == "llama":
        written |= {"rope_theta": 10000.0, "rope_scaling": None}
    return written | TRANSFORMERS_4_57_KEYS


def test_a_checkpoint_of_either_transformers_version_resumes_under_the_other() -> None:
    for preset in ("tiny", "gpt2-124m", "llama-1b"):
        now = model_config(preset, 8192, 1024, 0).to_dict()
        old = as_written_by_4_57(now)
        assert old != now, "the dicts differ as a whole"
        assert architecture_differences(old, now) == [], preset  # 4.57 checkpoint, 5.x run
        assert architecture_differences(now, old) == [], preset  # 5.x checkpoint, 4.57 run


def test_an_architecture_change_is_refused_with_the_fields_that_differ() -> None:
    saved = as_written_by_4_57(model_config("gpt2-124m", 8192, 1024, 0).to_dict())
    wider = model_config("gpt2-124m", 16384, 2048, 0).to_dict()
    assert architecture_differences(saved, wider) == ["vocab_size: 8192 -> 16384", "n_positions: 1024 -> 2048"]
    llama = model_config("llama-1b", 8192, 1024, 0).to_dict()
    assert architecture_differences(llama, {**llama, "num_key_value_heads": 32}) == ["num_key_value_heads: 8 -> 32"]
