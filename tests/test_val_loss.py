"""The val loss that the trainer's --eval-every and the evaluation step both measure (trainer/evaluation.py): no batch's
whole logits, a mixture's totals weighted by its shares, the trainer's own figures beside the evaluation's, and the
bytes of text a SentencePiece-style tokenizer's tokens stand for."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from components.evaluate_checkpoint.results import WEIGHTING, EvalResult
from tests.allocations import LiveBytes
from trainer.data import TokenSplit
from trainer.evaluation import TokenBytes, bits_per_byte, mean_loss, mixture_total, token_byte_lengths, token_bytes
from trainer.layout import RunPaths
from trainer.loss import OutputHead, with_output_head

CPU = torch.device("cpu")


def small_model(family: str, vocab: int, seq_len: int) -> torch.nn.Module:
    """One block of GPT-2 (its output layer tied to the embedding) or of Llama (its own), fp32, drawn from seed 0."""
    from transformers import AutoConfig

    from trainer.model import build_model

    sizes: dict[str, Any] = {
        "gpt2": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": seq_len},
        "llama": {
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "max_position_embeddings": seq_len,
            "tie_word_embeddings": False,
        },
    }[family]
    torch.manual_seed(0)
    return build_model(AutoConfig.for_model(family, vocab_size=vocab, bos_token_id=0, eos_token_id=0, **sizes))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_val_loss_holds_a_chunk_of_logits_not_the_batchs(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 8 x 32 tokens of a 16k vocabulary: its fp32 logits are 16 MB, and the val pass holds a quarter of
    that at most (chunks of 16 tokens' logits), through the trainer's model (an OutputHead) and a plain transformers
    model alike; the loss is the plain logits' cross-entropy, the same to the bit either way."""
    vocab, seq_len, batch = 16384, 32, 8
    monkeypatch.setattr(OutputHead, "chunk_elements", 16 * vocab)
    plain = small_model(family, vocab, seq_len)
    headed = with_output_head(small_model(family, vocab, seq_len))
    headed.load_state_dict(plain.state_dict())
    tokens = np.random.default_rng(0).integers(0, vocab, 2 * batch * seq_len + 1, dtype=np.int64)
    split, no_bytes = TokenSplit([tokens], "val"), TokenBytes(np.zeros(vocab, dtype=np.int64), None, ())
    logits_bytes = batch * seq_len * vocab * 4
    measured = {}
    for name, model in (("headed", headed), ("plain", plain)):
        with LiveBytes() as held:
            measured[name] = mean_loss(model, split, seq_len, 10**6, batch, CPU, no_bytes)
        assert held.peak < logits_bytes / 4, f"{name}: {held.peak / logits_bytes:.2f}x the batch's fp32 logits"
    assert measured["headed"] == measured["plain"]

    windows = torch.from_numpy(split.windows(np.arange(2 * batch), seq_len))
    with torch.no_grad():
        logits = plain(input_ids=windows[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, vocab).double(), windows[:, 1:].reshape(-1)).item()
    loss, count, _ = measured["plain"]
    assert count == 2 * batch * seq_len and loss == pytest.approx(expected, rel=1e-6)


def test_a_mixtures_total_weighs_each_dataset_by_its_share() -> None:
    """The review's 0.99/0.01 mixture, each dataset measured over the same capped val tokens: the total is 0.104,
    not the 4.959 of weighting by tokens; bits per byte are the blend's nats over its bytes; the evaluation step's
    totals (the starting model's too) are the trainer's."""
    from components.evaluate_checkpoint.measure import total

    measured = {"web": (0.0045, 16384, 70000), "code": (9.914, 16384, 50000)}
    loss, tokens, n_bytes = mixture_total(measured, {"web": 0.99, "code": 0.01})
    assert round(loss, 3) == 0.104 and loss == pytest.approx(0.99 * 0.0045 + 0.01 * 9.914)
    assert tokens == 32768
    blend_bytes_per_token = 0.99 * 70000 / 16384 + 0.01 * 50000 / 16384
    assert bits_per_byte(loss, tokens, n_bytes) == pytest.approx(loss / blend_bytes_per_token / math.log(2))
    assert mixture_total(measured, {"web": 99, "code": 1}) == pytest.approx((loss, tokens, n_bytes))
    assert mixture_total({"web": (1.5, 100, 300)}, {}) == (1.5, 100, 300), "one dataset: its own figures"
    with_start = {"web": (0.0045, 16384, 70000, 10.0), "code": (9.914, 16384, 50000, 11.0)}
    assert total(with_start, {"web": 0.99, "code": 0.01}) == pytest.approx((loss, tokens, n_bytes, 10.01))


def test_the_trainers_mixture_total_weighs_each_dataset_by_its_share(mixture_run: RunPaths) -> None:
    """The --eval-every rows of the 0.6/0.3/0.1 mixture, whose val splits hold different numbers of tokens."""
    from components.evaluate_checkpoint.measure import read_metrics

    shares = {"synthetic": 0.6, "code": 0.3, "math": 0.1}
    evaluated = [r for r in read_metrics(mixture_run) if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [10, 20]
    for row in evaluated:
        each = row["datasets"]
        weighted = sum(shares[name] * each[name]["val_loss"] for name in shares)
        assert row["val_loss"] == pytest.approx(weighted, rel=1e-12), row["step"]
        # each dataset's bytes per token, from its own figures: loss / (bits per byte x ln 2)
        nats_per_byte = weighted / sum(
            shares[name] * each[name]["val_loss"] / (each[name]["val_bpb"] * math.log(2)) for name in shares
        )
        assert row["val_bpb"] == pytest.approx(nats_per_byte / math.log(2), rel=1e-9), row["step"]


def test_a_mixtures_val_set_is_its_datasets_val_sets_at_their_shares(tmp_path: Path) -> None:
    """The totals weigh each dataset's loss by its share: a baseline compares only with a blend of the same shares
    (and an evaluation from before the totals did, token-weighted, has another digest)."""
    from components.evaluate_checkpoint.measure import mixture_val_set, mixture_weights

    def mixture(shares: dict[str, float]) -> list[tuple[dict[str, Any], Path]]:
        found = []
        for name, share in shares.items():
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / "meta.json").write_text(json.dumps({"val_set_sha256": f"{name}-val"}))
            found.append(({"dataset": name, "weight": share * 10, "share": share}, tmp_path / name))
        return found

    digest = mixture_val_set(mixture({"web": 0.8, "code": 0.2}))
    assert digest == mixture_val_set(mixture({"code": 0.2, "web": 0.8})), "the order does not count"
    assert digest != mixture_val_set(mixture({"web": 0.5, "code": 0.5}))
    assert mixture_weights(mixture({"web": 0.8, "code": 0.2})) == {"web": 8.0, "code": 2.0}


def an_evaluation(**fields: Any) -> EvalResult:
    """An evaluation of step 20 of run 'mixed', with `fields` as given."""
    figures = {
        "run_id": "mixed",
        "checkpoint": "/fsx/runs/mixed/checkpoints/step_00000020",
        "step": 20,
        "train_tokens_seen": 20480,
        "val_tokens": 1984,
        "val_loss": 2.6,
        "val_perplexity": 13.46,
        "val_bits_per_byte": 0.83,
        "untrained_val_loss": 5.9,
        "untrained_bits_per_byte": 1.9,
        "loss_reduction": 3.3,
        "train_tokens_per_s": None,
        "train_mfu": None,
    }
    return EvalResult(**{**figures, **fields})


def test_the_reports_say_how_a_mixtures_totals_are_weighted() -> None:
    dataset = {
        "dataset": "web",
        "share": 0.8,
        "tokens_trained": None,
        "trained_fraction": None,
        "epochs": None,
        "val_loss": 2.5,
        "val_bits_per_byte": 0.8,
        "untrained_val_loss": 5.9,
    }
    assert WEIGHTING in an_evaluation(datasets=[dataset, {**dataset, "dataset": "code", "share": 0.2}]).markdown()
    assert "weighted" not in an_evaluation().markdown(), "one dataset: no totals"


def test_the_trainers_own_val_figures_at_the_step_are_beside_the_evaluations(mixture_run: RunPaths) -> None:
    """The row at step 20 (--eval-every 10, --eval-tokens 16384 of each val split, batches of 8); none at step 15.
    The report says whether they read the same tokens, and why their figures differ when they do not."""
    from components.evaluate_checkpoint.measure import read_metrics, training_eval

    row = {r["step"]: r for r in read_metrics(mixture_run)}[20]
    theirs = training_eval(mixture_run, 20)
    assert theirs == {
        "val_loss": row["val_loss"],
        "val_bits_per_byte": row["val_bpb"],
        "val_tokens": row["val_tokens"],
        "eval_tokens": 16384,
        "batch_size": json.loads(mixture_run.config.read_text())["trainer"]["batch_size"],
        "datasets": {name: d["val_loss"] for name, d in row["datasets"].items()},
    }
    assert training_eval(mixture_run, 15) is None
    same = an_evaluation(training_eval=theirs, val_tokens=row["val_tokens"]).markdown()
    each = ", ".join(f"{name} {loss:.4f}" for name, loss in theirs["datasets"].items())
    assert (
        f"Training measured step 20 too (--eval-every): val loss {row['val_loss']:.4f} ({each}) over "
        f"{row['val_tokens']:,} tokens, --eval-tokens 16,384 of each, batches of {theirs['batch_size']}; the same val "
        "tokens as here" in same
    )
    other = an_evaluation(training_eval=theirs, val_tokens=4 * row["val_tokens"]).markdown()
    assert f"not the {4 * row['val_tokens']:,} read here: each reads the first windows of the val split" in other
    assert "Training measured" not in an_evaluation().markdown()


# Text the tokenizers are trained on, and documents of it: none starts with a space (a Metaspace pre-tokenizer makes a
# document's leading space and its prepended mark one '▁', which the decoder drops: its bytes are the decoded text's).
TRAINING = [
    "The quick brown fox jumps over the lazy dog.",
    "Café crème: naïve résumé 🙂 costs 12 euros, € 5 each.",
    "def main():\n    return 42\n",
]
DOCUMENTS = ["The lazy fox.", "Café 🙂 costs € 5.", "def f():\n    return 1\n", "x", "12 dog"]


def metaspace_bpe() -> Tokenizer:
    """A SentencePiece-style BPE: Metaspace, prepended to the first word only (tokenizers' 'first')."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.train_from_iterator(
        TRAINING, trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"], show_progress=False)
    )
    return tokenizer


def metaspace_unigram() -> Tokenizer:
    """A SentencePiece-style Unigram: Metaspace prepended to every split ('always')."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="always")
    tokenizer.train_from_iterator(
        TRAINING * 3,
        trainers.UnigramTrainer(
            vocab_size=120, special_tokens=["<s>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
        ),
    )
    return tokenizer


def llama2_style() -> Tokenizer:
    """Llama 2's as transformers converts it: a Prepend('▁') normalizer, BPE with byte fallback (here '€', which
    its training text lacks, takes three byte tokens), and a decoder that strips the one leading space."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator(
        [t.replace("€", "") for t in TRAINING],
        trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>"], show_progress=False),
    )
    spec = json.loads(trained.to_str())["model"]
    vocab = dict(spec["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = trained.normalizer
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


def byte_level() -> Tokenizer:
    """The tokenizer staging trains (GPT-2's kind): EOS only, between documents."""
    from components.stage_data.tokenizer import train_tokenizer

    return train_tokenizer(iter(TRAINING), 300)


@pytest.mark.parametrize(
    ("make", "bos", "eos", "prepends"),
    [
        (metaspace_bpe, "<s>", "</s>", True),
        (metaspace_unigram, "<s>", "</s>", True),
        (llama2_style, "<s>", "</s>", True),
        (llama2_style, None, "</s>", True),
        (byte_level, None, "<|endoftext|>", False),
    ],
)
def test_bits_per_byte_counts_the_bytes_of_the_documents_text(
    make: Any, bos: str | None, eos: str, prepends: bool
) -> None:
    """Documents laid out as staging writes them ([BOS] text EOS, or text EOS; the stream's start stands for the
    previous document's end), read in windows as the val loss reads them: their bytes exactly, the word mark a
    SentencePiece-style tokenizer prepends to each document counted as none; per token alone, one byte too many per
    document."""
    tokenizer = make()
    bos_id, eos_id = (tokenizer.token_to_id(bos) if bos else None), tokenizer.token_to_id(eos)
    stream = [] if bos_id is not None else [eos_id]
    for text in DOCUMENTS:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(encoded.ids) == text and tokenizer.token_to_id("<unk>") not in encoded.ids
        stream += ([bos_id] if bos_id is not None else []) + encoded.ids + [eos_id]
    seq_len = 8
    stream += [eos_id] * (-(len(stream) - 1) % seq_len)  # whole windows, every token a target once
    vocab = tokenizer.get_vocab_size()
    meta = {"vocab_size": vocab, "model_vocab_size": -(-vocab // 64) * 64, "bos_id": bos_id, "eos_id": eos_id}
    counted = token_bytes(tokenizer, meta)
    assert (counted.prepended is not None) == prepends
    expected = sum(len(text.encode()) for text in DOCUMENTS)
    split = TokenSplit([np.asarray(stream, dtype=np.uint16)], "val")
    windows = split.windows(np.arange(split.num_windows(seq_len)), seq_len)
    assert sum(counted.of(windows[i : i + 1]) for i in range(len(windows))) == counted.of(windows) == expected
    per_token = int(token_byte_lengths(tokenizer, meta["model_vocab_size"])[np.asarray(stream[1:])].sum())
    assert per_token == expected + (len(DOCUMENTS) if prepends else 0)
    _, _, n_bytes = mean_loss(
        small_model("gpt2", meta["model_vocab_size"], seq_len), split, seq_len, 10**6, 3, CPU, counted
    )
    assert n_bytes == expected
