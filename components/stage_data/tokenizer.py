"""The snapshot's tokenizer: one trained on the corpus (byte-level BPE, the default), or a Hugging Face tokenizer the
team brings (a tokenizer.json, or a directory as save_pretrained writes it, on the volume or in S3).

Every document is encoded as [BOS] text EOS: EOS is the tokenizer's end-of-document token; BOS is its
beginning-of-document token where it defines one apart from EOS (Llama 3's <|begin_of_text|>, <s>), none otherwise
(GPT-2's <|endoftext|> is both: the previous document's EOS stands between two documents). Both come from the
tokenizer's own configuration (tokenizer_config.json, special_tokens_map.json), else from its post-processor and
well-known token names. The snapshot keeps the tokenizer so that encoding with special tokens, as Hugging Face users
do, gives what training saw ([BOS] text): its post-processor is set to that, and truncation and padding are off.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.errors import InputError

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"  # the trained tokenizer's end-of-document token
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # read in this order; the first to name one wins
TOKENIZER_FILE = "tokenizer.json"
VOCAB_MULTIPLE = 64  # the model's vocabulary is padded to this: tensor-core friendly shapes, as nanoGPT's 50,304


@dataclass(frozen=True)
class Specials:
    eos: str
    eos_id: int
    bos: str | None = None
    bos_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"bos": self.bos, "bos_id": self.bos_id, "eos": self.eos, "eos_id": self.eos_id}


def model_vocab_size(tokenizer_vocab: int) -> int:
    """The embedding rows a model gets for a tokenizer: its size rounded up to VOCAB_MULTIPLE (ids past the
    tokenizer's are never seen in data)."""
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the staged corpus itself: nothing is downloaded."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@dataclass(frozen=True)
class GivenTokenizer:
    """A tokenizer the run brings: its tokenizer.json and what its configuration files say."""

    tokenizer_json: str
    config: dict[str, Any]  # tokenizer_config.json's keys, special_tokens_map.json's where the first lacks them
    where: str  # as the user gave it, for messages

    def load(self) -> Tokenizer:
        try:
            return Tokenizer.from_str(self.tokenizer_json)
        except Exception as exc:  # the library raises a bare Exception for a file it cannot parse
            raise InputError(f"tokenizer {self.where}: tokenizer.json does not load ({exc})") from None


def read_given(path: str, endpoint_url: str = "") -> GivenTokenizer:
    """The tokenizer at `path`: a tokenizer.json, or a directory (or S3 prefix) that holds one and perhaps its
    configuration files."""
    files = _s3_files(path, endpoint_url) if path.startswith("s3://") else _local_files(path)
    if TOKENIZER_FILE not in files:
        hint = (
            " (a SentencePiece tokenizer.model alone is not read: save the fast tokenizer with save_pretrained)"
            if "tokenizer.model" in files
            else ""
        )
        raise InputError(f"tokenizer {path}: has no {TOKENIZER_FILE}{hint}")
    config: dict[str, Any] = {}
    for name in CONFIG_FILES:
        if name in files:
            try:
                loaded = json.loads(files[name])
            except ValueError as exc:
                raise InputError(f"tokenizer {path}: {name} is not JSON ({exc})") from None
            config = {**loaded, **config}
    return GivenTokenizer(files[TOKENIZER_FILE].decode("utf-8", errors="replace"), config, path)


def snapshot_tokenizer(tokenizer_file: Path) -> GivenTokenizer:
    """A snapshot's tokenizer (a warm start stages with its origin's), with the BOS and EOS that snapshot wrote, so
    the documents are marked as the origin's training saw them (a snapshot from before BOS: EOS only)."""
    meta = json.loads((tokenizer_file.parent / "meta.json").read_text())
    config = {"bos_token": meta.get("bos"), "eos_token": meta.get("eos", EOS)}
    return GivenTokenizer(tokenizer_file.read_text(), config, str(tokenizer_file))


def _local_files(path: str) -> dict[str, bytes]:
    location = Path(path.removeprefix("file://"))
    if location.is_file():
        return {TOKENIZER_FILE: location.read_bytes()}
    if not location.is_dir():
        raise InputError(f"tokenizer {path}: no such file or directory")
    wanted = (TOKENIZER_FILE, *CONFIG_FILES, "tokenizer.model")
    return {name: (location / name).read_bytes() for name in wanted if (location / name).is_file()}


def _s3_files(uri: str, endpoint_url: str) -> dict[str, bytes]:
    """tokenizer.json (the object named, or the one under the prefix) and its configuration files beside it."""
    from common.s3 import S3Settings, S3Source

    source = S3Source(uri, S3Settings(endpoint_url=endpoint_url, workers=2))
    try:
        listed = source.list()
        single = len(listed) == 1 and listed[0].location == source.prefix
        files = {}
        for obj in listed:
            name = TOKENIZER_FILE if single else obj.key
            if name in (TOKENIZER_FILE, *CONFIG_FILES, "tokenizer.model") and obj.size < 2**30:
                out = io.BytesIO()
                source.fetch(obj, out, lambda _: None)
                files[name] = out.getvalue()
        return files
    finally:
        source.close()


def check_encodes(tokenizer: Tokenizer, where: str) -> None:
    """An InputError, in one line, for a tokenizer that cannot encode ordinary text (a word-level vocabulary without
    an unknown token raises on the first word it lacks), before any document reaches it."""
    probe = "The 3 quick brown foxes, naïve café: 東京.\n\tdef f(x): return x\n"
    try:
        tokenizer.encode(probe, add_special_tokens=True)
    except Exception as exc:  # the library raises a bare Exception
        raise InputError(f"tokenizer {where}: cannot encode text ({str(exc).splitlines()[0]})") from None


def _config_token(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template_bos(tokenizer: Tokenizer) -> str | None:
    """The special token the tokenizer's own post-processor puts first, if any (Llama 3's, Llama 2's)."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    if len(full) == len(plain) + 1 and full[1:] == plain or len(full) == len(plain) + 2 and full[1:-1] == plain:
        return tokenizer.id_to_token(full[0])
    return None


def special_tokens(tokenizer: Tokenizer, config: dict[str, Any], where: str) -> Specials:
    """The tokenizer's end- and beginning-of-document tokens (see the module docstring); an InputError when it
    defines no end-of-document token, saying how to name one."""
    vocab = tokenizer.get_vocab()
    eos = _config_token(config, "eos_token") or next((t for t in KNOWN_EOS if t in vocab), None)
    if eos is None:
        raise InputError(
            f"tokenizer {where}: it defines no end-of-document token (no eos_token in a "
            f"tokenizer_config.json beside it, and none of {', '.join(KNOWN_EOS)} among its tokens): "
            "put tokenizer.json in a directory with a tokenizer_config.json that says "
            '{"eos_token": "<the token>"} and give the directory'
        )
    if eos not in vocab:
        raise InputError(f"tokenizer {where}: its eos_token {eos!r} is not among its tokens")
    if config.get("add_bos_token") is False:
        bos = None
    elif "bos_token" in config:  # null there (Qwen's): none
        bos = _config_token(config, "bos_token")
    elif config:
        bos = _template_bos(tokenizer)
    else:  # a bare tokenizer.json: what its post-processor puts first, else a well-known name among its tokens
        bos = _template_bos(tokenizer) or next((t for t in KNOWN_BOS if t in vocab), None)
    if bos == eos:
        bos = None
    if bos is not None and bos not in vocab:
        raise InputError(f"tokenizer {where}: its bos_token {bos!r} is not among its tokens")
    return Specials(eos, vocab[eos], bos, vocab[bos] if bos is not None else None)


def as_trained(tokenizer: Tokenizer, specials: Specials) -> Tokenizer:
    """The tokenizer as the snapshot keeps it: encoding with special tokens gives [BOS] text, as training saw it;
    no truncation or padding (a published tokenizer may carry a max_length that would cut documents). Unchanged
    when it does that already, so that a tokenizer staged again keeps its hash (a warm start compares it)."""
    data = json.loads(tokenizer.to_str())
    changed = data.get("truncation") is not None or data.get("padding") is not None
    data["truncation"] = data["padding"] = None
    probe = "a b"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    wanted = ([specials.bos_id] if specials.bos_id is not None else []) + plain
    if tokenizer.encode(probe, add_special_tokens=True).ids != wanted:
        kept = [p for p in _processors(data.get("post_processor")) if p.get("type") == "ByteLevel"]
        bos = [specials.bos] if specials.bos is not None else []
        ours = processors.TemplateProcessing(  # a pair as two documents: [BOS] $A [BOS] $B
            single=[*bos, "$A"],
            pair=[*bos, "$A", *(f"{b}:1" for b in bos), "$B:1"],
            special_tokens=[(specials.bos, specials.bos_id)] if specials.bos is not None else [],
        )
        data["post_processor"] = (
            {"type": "Sequence", "processors": [*kept, json.loads(ours.__getstate__())]}
            if kept
            else json.loads(ours.__getstate__())
        )
        changed = True
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False)) if changed else tokenizer


def _processors(post_processor: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not post_processor:
        return []
    if post_processor.get("type") == "Sequence":
        return list(post_processor.get("processors", []))
    return [post_processor]


def block_safe(tokenizer: Tokenizer) -> bool:
    """Whether text encoded in pieces decodes to the text whole: true of byte-level tokenizers; not of those that
    mark the start of every encoded string (SentencePiece's prefix space), which plain text is then encoded by
    whole documents (up to a bound) instead of blocks."""
    pieces = ["first line\n", "second line\n", "  third\n"]
    ids = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False).ids]
    return tokenizer.decode(ids, skip_special_tokens=False) == "".join(pieces)
