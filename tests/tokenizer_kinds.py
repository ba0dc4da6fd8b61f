"""Tokenizers of the three families teams bring, made here with the tokenizers library and written with
transformers' save_pretrained (nothing downloaded): Llama 3's shape (byte-level BPE, <|begin_of_text|> put first by
its post-processor, <|end_of_text|>), Llama 2's and Mistral's (SentencePiece-style BPE with a prefix space marker and
byte fallback, <s> and </s>), and GPT-2's (byte-level BPE, <|endoftext|> as both). A team's own tokenizer, trained
with the tokenizers library has no post-processor: the `-bare` kinds are the first two so (tokenizer.json as the
library saves it, their BOS named only in tokenizer_config.json), and `eos-only` names an end token and no BOS
(save_pretrained's tokenizer.json, whose post-processor transformers 5 writes as a template of the text alone)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

KINDS = ("llama3", "sentencepiece", "gpt2", "llama3-bare", "sentencepiece-bare", "eos-only")


def make_tokenizer(kind: str, texts: Iterable[str], vocab_size: int = 400) -> Tokenizer:
    if kind.endswith("-bare"):  # the family's tokenizer as the tokenizers library trains it: no post-processor
        tokenizer = make_tokenizer(kind.removesuffix("-bare"), texts, vocab_size)
        data = json.loads(tokenizer.to_str())
        data["post_processor"] = None
        return Tokenizer.from_str(json.dumps(data))
    if kind == "sentencepiece":
        tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        specials = ["<unk>", "<s>", "</s>"]
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size + 256, special_tokens=specials + alphabet, show_progress=False
        )
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        specials = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>"], "eos-only": ["</s>"]}.get(
            kind, ["<|endoftext|>"]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if kind == "sentencepiece":  # the byte tokens are the model's own vocabulary, not added special tokens
        data = json.loads(tokenizer.to_str())
        data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
        tokenizer = Tokenizer.from_str(json.dumps(data))
    if kind == "llama3":
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A",
                    pair="<|begin_of_text|> $A $B",
                    special_tokens=[("<|begin_of_text|>", bos)],
                ),
            ]
        )
    elif kind == "sentencepiece":
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
    return tokenizer


def save_pretrained(kind: str, tokenizer: Tokenizer, directory: Path) -> Path:
    """The directory transformers writes (tokenizer.json, tokenizer_config.json), with each family's special
    tokens named in its configuration as its published tokenizers do."""
    from transformers import PreTrainedTokenizerFast

    names = {
        "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        "sentencepiece": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
        "eos-only": {"eos_token": "</s>"},
    }[kind.removesuffix("-bare")]
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names).save_pretrained(directory)
    if kind.endswith("-bare"):  # transformers 5 writes an empty template as the post-processor; the library, none
        tokenizer.save(str(directory / "tokenizer.json"))
    return directory
