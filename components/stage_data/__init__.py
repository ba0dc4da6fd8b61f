"""Staging: mirror a corpus onto the volume, tokenize it, publish a snapshot. The defaults below live here, not in
tokenization/, so that the CLI shows them in --help without loading numpy and tokenizers; every entry point (the
pipeline's parameters, stage-data, run-local) takes these."""

SHARD_TOKENS = 64 * 2**20  # tokens per shard file by default (about 250 MB of text)
SAMPLE_MB = 1024  # text the tokenizer is trained on by default: enough for a vocabulary, bounded in time
VOCAB_SIZE = 8192  # the trained BPE tokenizer's vocabulary
VAL_FRACTION = 0.01  # documents (plain text: files) held out for the val split
TEXT_FIELD = "text"  # JSON Lines and Parquet: the field that holds a record's text
