"""Staging: mirror a corpus onto the volume, tokenize it, publish a snapshot. The defaults below live here, not in
tokenization.py, so that the CLI shows them in --help without loading numpy and tokenizers."""

SHARD_TOKENS = 64 * 2**20  # tokens per shard file by default (about 250 MB of text)
SAMPLE_MB = 1024  # text the tokenizer is trained on by default: enough for a vocabulary, bounded in time
