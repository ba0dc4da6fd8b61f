"""Tokenize the mirrored corpus into a snapshot: the train/val shards the trainer memory-maps, and its tokenizer.

A snapshot is named by a hash of its inputs (staged content, val set, tokenizer and document settings, shard size,
groups): built under snapshots/.building.<id>/, renamed into place whole and never changed after; current.json then
points at it. Staging the same inputs again finds the snapshot and skips all of it; staging changed ones writes a new
snapshot beside the old, which the runs that trained on it keep reading.

Documents: a plain-text file is one document; a JSON Lines line or a Parquet row is one (formats/). Each is written
as [BOS] tokens EOS (tokenizer.py says which tokens). The val split is whole plain-text files (chosen at the dataset's
first staging and kept in val_set.json, as before documents had records) and, in record files, single documents
chosen by a hash of (key, record number) at val_fraction: a corpus of a few large Parquet files is split properly,
and a document keeps its split across re-stagings and as other files come and go.

Three stages, so that a corpus larger than one pod fans out, one module each:
- plan.py (one process, under the staging lock): every file's format found and checked, the val split, the tokenizer
  (trained on a bounded, deterministic sample of the train documents, or given), and the files cut into `groups`
  contiguous, byte-balanced groups: plan.json;
- encode.py, a group (one process per group, in parallel pods): its documents read a part at a time, encoded a batch
  at a time (the tokenizers library spreads a batch over every core), appended to the group's own shard files; a
  journal records how far the group got (files, and Parquet row groups) with its counts, so a killed group carries on
  there;
- finalize.py: meta.json lists every group's shards in order with the documents' report, and the snapshot is renamed
  into place.
snapshot.py holds what they hand one another: the plan and its entries, a group's result, where a snapshot is built,
meta.json and current.json.
"""
