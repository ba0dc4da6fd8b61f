"""Starting from a published model (trainer/published.py): real model directories written by transformers'
save_pretrained (Llama untied and in several safetensors shards, GPT-2 tied in one file), read back into the
trainer's model, and every bad directory refused in one line."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import PUBLISHED_VOCAB as VOCAB
from tests.helpers import save_gpt2, save_gpt2_as_the_hub_serves_it, save_llama, save_llama_without_its_prefix
from trainer.errors import CheckpointError
from trainer.parallel import parallelize
from trainer.published import PublishedModel
from trainer.published_weights import load_weights


def plain_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("save", [save_llama, save_gpt2, save_gpt2_as_the_hub_serves_it, save_llama_without_its_prefix])
@pytest.mark.usefixtures("one_process_group")
def test_the_trainers_model_loads_a_published_model_and_computes_its_loss(save, tmp_path: Path) -> None:  # noqa: ANN001
    """Under ddp (every weight whole) and fsdp (sharded DTensors, read piece by piece by DCP's Hugging Face reader):
    the loss of a batch is transformers' own on the same weights; with or without the base model's prefix in the
    files' names (the Hub's GPT-2: `h.0.*`, no head), as transformers loads them."""
    original = save(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    assert (len(published.files) > 1) == (save in (save_llama, save_llama_without_its_prefix))
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = plain_loss(original, tokens)
    for kind in ("ddp", "fsdp"):
        parallel = parallelize(
            published.model_config(), kind, torch.device("cpu"), seed=9, local_world=1, initial_weights=False
        )
        load_weights(parallel.model, published)
        with torch.no_grad():
            loss = parallel.forward_loss(tokens[:, :-1], tokens[:, 1:])
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=kind)
    record = published.record()
    assert record["bytes"] == sum((tmp_path / "model" / f).stat().st_size for f in published.files)
    assert set(record["sha256"]) == set(published.files)


def test_a_bad_model_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    save_llama(tmp_path / "model")

    def refused(path: Path) -> str:
        with pytest.raises(CheckpointError) as raised:
            PublishedModel.read(path)
        assert "\n" not in str(raised.value)
        return str(raised.value)

    assert refused(tmp_path).endswith("no config.json there: give a directory that save_pretrained wrote")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert "model_type 'mistral' cannot be trained here: choose a model of type llama or gpt2" in refused(
        tmp_path / "model"
    )
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    shard = sorted((tmp_path / "model").glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert f"model.safetensors.index.json names 1 file(s) that are not there: {shard.name}" in refused(
        tmp_path / "model"
    )
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    torch.save({}, pickled / "pytorch_model.bin")
    assert "a pickle checkpoint (pytorch_model.bin), which runs code when loaded: convert it to safetensors" in refused(
        pickled
    )


@pytest.mark.usefixtures("one_process_group")
def test_a_weight_of_another_shape_is_named(tmp_path: Path) -> None:
    save_llama(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    config = published.model_config()
    config.intermediate_size = 128  # the model the config describes no longer matches the files
    parallel = parallelize(config, "fsdp", torch.device("cpu"), seed=9, local_world=1)
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.0.mlp.gate_proj.weight is \[160, 64\] in the files and "
        r"\[128, 64\] in the model",
    ):
        load_weights(parallel.model, published)


def test_the_trainers_model_loads_a_published_model_on_two_processes(parallel_probe: Path) -> None:
    """tests/parallel_probe.py: on each of 2 processes, its own batch; under ddp and fsdp (each rank reading only
    its shards of the sharded Llama's files; the Hub's GPT-2 layout and a Llama without `model.` in its names, as
    transformers loads them) the loss the training loop calls is transformers' own."""
    for rank in (0, 1):
        losses = json.loads((parallel_probe / f"published_rank_{rank}.json").read_text())
        assert set(losses) == {"llama", "gpt2", "llama-unprefixed"}
        for model, by in losses.items():
            for kind in ("ddp", "fsdp"):
                assert by[kind] == pytest.approx(by["transformers"], rel=1e-5), (rank, model, kind, by)


def test_evaluation_compares_with_the_published_model_the_run_started_from(tmp_path: Path) -> None:
    """The report's baseline column is the starting model when the run began from a published one (its weights,
    read again from the directory its config.json names, into a model of the evaluation's dtype), and the untrained
    model when that directory is gone."""
    from components.evaluate_checkpoint.loading import starting_model

    original = save_llama(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    config = {"init_from": published.record(), "trainer": {"seed": 1}}
    cpu = torch.device("cpu")
    start, name = starting_model(published.model_config(), config, cpu, torch.float32)
    assert name == "start (model)"
    assert all(
        torch.equal(p, original.state_dict()[k]) for k, p in start.state_dict().items() if k in original.state_dict()
    )
    in_bf16, _ = starting_model(published.model_config(), config, cpu, torch.bfloat16)
    assert all(
        torch.equal(p, original.state_dict()[k].to(torch.bfloat16))
        for k, p in in_bf16.named_parameters()
        if k in original.state_dict()
    )
    config["init_from"]["model"] = str(tmp_path / "gone")
    untrained, name = starting_model(published.model_config(), config, cpu, torch.float32)
    assert name == "untrained" and not torch.equal(untrained.lm_head.weight, original.lm_head.weight)


def published_in_s3(given: Path, s3_endpoint: str) -> str:
    """The model directory ``given`` uploaded to a bucket of the S3 server: its URI."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="published")
    for path in given.iterdir():
        s3.upload_file(str(path), "published", f"models/tiny-llama/{path.name}")
    return "s3://published/models/tiny-llama/"


def run_local_from(uri: str, source: Path, root: Path, s3_endpoint: str) -> subprocess.CompletedProcess[str]:
    """`run-local --init-from-model <uri>`: run "continued" on dataset "domain" staged from ``source``, 8 steps with
    a checkpoint every 4."""
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    return subprocess.run(
        [
            cli,
            "run-local",
            "--storage-root",
            str(root),
            "--source",
            str(source),
            "--dataset",
            "domain",
            "--run-id",
            "continued",
            "--init-from-model",
            uri,
            "--endpoint-url",
            s3_endpoint,
            "--val-fraction",
            "0.2",
            "--max-steps",
            "8",
            "--checkpoint-every",
            "4",
            "--log-every",
            "1",
            "--warmup-steps",
            "4",
            "--lr",
            "1e-3",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_started_from_the_copy(
    run: Any, config: dict, copy: Any, given: Path, uri: str, staged: Any, rows: list[dict]
) -> None:
    """The trainer started from the copy staging made of the model (fresh optimizer and schedule), recorded where its
    weights came from, and trained on a snapshot staged with the model's own tokenizer."""
    from tokenizers import Tokenizer

    origin = config["init_from"]
    assert (origin["s3_uri"], origin["model"], origin["dtype"], origin["name"]) == (
        uri,
        str(copy.raw),
        "bfloat16",
        "tiny-llama",
    )
    files = sorted(p.name for p in given.glob("*.safetensors"))
    assert len(files) > 1 and sorted(origin["etags"]) == files and all(origin["etags"].values())
    assert origin["bytes"] == sum((given / name).stat().st_size for name in files)
    assert config["trainer"]["preset"] == "" and config["model"]["num_hidden_layers"] == 2
    assert staged.get_vocab() == Tokenizer.from_file(str(given / "tokenizer.json")).get_vocab()  # the model's own
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[0]["lr"] < rows[1]["lr"] < rows[2][
        "lr"
    ]  # a fresh warm-up
    details = next(s for s in json.loads(run.summary.read_text())["steps"] if s["step"] == "stage-data")["details"]
    assert details["init_from_model"] == uri and details["model_dir"] == str(copy.raw)


def assert_the_baseline_is_the_published_models_loss(
    run: Any, result: subprocess.CompletedProcess[str], given: Path, snapshot: Path, staged: Any, meta: dict
) -> None:
    """The evaluation's baseline is the published model's val loss: transformers' own model on the same val split."""
    from transformers import AutoModelForCausalLM

    from trainer.data import load_split
    from trainer.evaluation import mean_loss, token_bytes

    evaluation = json.loads(run.eval_result.read_text())
    assert evaluation["start"] == "start (tiny-llama)"
    assert all(s["text"].startswith(s["prompt"]) for s in evaluation["samples"]), "no literal <|begin_of_text|>"
    report = (run.eval_step(evaluation["step"]) / "report.html").read_text()
    assert "none: the architecture of tiny-llama" in report, "the settings' preset row of a published start"
    assert f"(start (tiny-llama) {evaluation['untrained_val_loss']:.3f})" in result.stderr + result.stdout
    reference = AutoModelForCausalLM.from_pretrained(given, dtype=torch.float32)
    byte_lengths = token_bytes(staged, meta)
    loss, _, _ = mean_loss(reference, load_split(snapshot, "val"), 32, 1048576, 8, torch.device("cpu"), byte_lengths)
    assert evaluation["untrained_val_loss"] == pytest.approx(loss, abs=1e-5)


def assert_the_export_keeps_the_inputs_config_and_generates(run: Any, snapshot: Path, meta: dict) -> None:
    """The export: the input's config, its dtype, its tokenizer, which encodes as training did; it generates."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.helpers import LLAMA3_ROPE
    from tests.test_formats import decoded_documents, split_stream

    export = run.root / "export"
    exported = AutoConfig.from_pretrained(export)
    assert (exported.dtype, exported.bos_token_id, exported.eos_token_id) == (torch.bfloat16, 0, 1)
    assert {k: v for k, v in exported.rope_parameters.items() if k in LLAMA3_ROPE} == LLAMA3_ROPE
    model, tokenizer = AutoModelForCausalLM.from_pretrained(export), AutoTokenizer.from_pretrained(export)
    first, stream = decoded_documents(snapshot, "train")[0], split_stream(snapshot, "train")
    assert tokenizer(first)["input_ids"] == stream[: stream.index(meta["eos_id"])]
    prompt = tokenizer("the quiet river", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 5


def assert_an_export_before_any_update_is_the_input(
    config: dict, copy: Any, snapshot: Path, original: torch.nn.Module, tmp_path: Path
) -> None:
    """An export of the weights before any update is the input, bit for bit."""
    from transformers import AutoModelForCausalLM

    from components.evaluate_checkpoint.export import export_model
    from trainer.model import build_model, config_from_dict

    untouched = build_model(config_from_dict(config["model"]))
    load_weights(untouched, PublishedModel.read(copy.raw))
    before = export_model(untouched, snapshot, tmp_path / "export-before", {"step": 0}, config["init_from"]["dtype"])
    expected = original.to(torch.bfloat16).state_dict()
    for name, tensor in AutoModelForCausalLM.from_pretrained(before).state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def resume(root: Path, config: dict, copy: Any) -> None:
    """Launch "continued-resumed" (a copy of the run rewound to a checkpoint) with the run's own settings."""
    from components.launch_training.config import LaunchConfig
    from components.launch_training.core import launch

    trainer = config["trainer"]
    launch(
        LaunchConfig.of(
            storage_root=str(root),
            dataset="domain",
            run_id="continued-resumed",
            init_from_model=str(copy.raw),
            nproc_per_node=config["world_size"],
            timeout_s=300,
            **{
                k: trainer[k]
                for k in (
                    "max_steps",
                    "seed",
                    "batch_size",
                    "seq_len",
                    "lr",
                    "warmup_steps",
                    "checkpoint_every",
                    "log_every",
                    "eval_every",
                )
            },
        )
    )


def test_a_run_from_a_published_model_in_s3_trains_resumes_exactly_and_exports_it(
    s3_endpoint: str, aws_env: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`run-local --init-from-model s3://...`: staging copies the model (its files naming the weights without the
    base model's prefix) onto the volume and stages with its own tokenizer; the trainer starts from its weights (fresh
    optimizer and schedule) and records where they came from; the evaluation's baseline is that model, its loss
    transformers' own; the export keeps its config (bfloat16, Llama 3's rope scaling, special
    token ids), loads and generates; the run resumes to the bit without the model's files; the next run copies
    nothing."""
    from tokenizers import Tokenizer

    from components.stage_data.models import published_model
    from tests.test_formats import corpus_of_every_format, expected_documents
    from tests.test_parallel import rewound_copy
    from tests.test_trainer import assert_same_rows, read_metrics
    from tests.tokenizer_kinds import make_tokenizer, save_pretrained
    from trainer.layout import ModelPaths, RunPaths

    source = corpus_of_every_format(tmp_path / "corpus")
    given = tmp_path / "tiny-llama"
    original = save_llama_without_its_prefix(given)  # its files name the weights without `model.`
    save_pretrained("llama3", make_tokenizer("llama3", [t for _, _, t in expected_documents(source)], 320), given)
    uri, root = published_in_s3(given, s3_endpoint), tmp_path / "fsx"
    result = run_local_from(uri, source, root, s3_endpoint)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run, copy = RunPaths.of(root, "continued"), ModelPaths.of(root, uri)
    config = json.loads(run.config.read_text())
    snapshot = Path(config["dataset"]["tokenized_dir"])
    staged = Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    rows = read_metrics(run)
    assert_started_from_the_copy(run, config, copy, given, uri, staged, rows)
    meta = json.loads((snapshot / "meta.json").read_text())
    assert_the_baseline_is_the_published_models_loss(run, result, given, snapshot, staged, meta)

    # The corpus of every format, as the reports show it.
    finalize_report = next((root / "kfp-local" / "continued").rglob("finalize-snapshot/report")).read_text()
    assert "First train document of the parquet files" in finalize_report and "| jsonl.zst |" in finalize_report
    finalized = next(s for s in json.loads(run.summary.read_text())["steps"] if s["step"] == "finalize-data")
    assert "parquet " in finalized["details"]["documents"] and "null" in finalized["details"]["skipped_records"]

    assert_the_export_keeps_the_inputs_config_and_generates(run, snapshot, meta)
    assert_an_export_before_any_update_is_the_input(config, copy, snapshot, original, tmp_path)

    # A resume from the step-4 checkpoint goes on to the same losses to the bit, with the model's files gone.
    resumed = rewound_copy(run, root, "continued-resumed", 4)
    shutil.move(copy.raw, tmp_path / "away")
    resume(root, config, copy)
    assert "resumed at step 4" in resumed.rank_log(0).read_text()
    assert_same_rows(read_metrics(resumed), rows, "after a resume at step 4")

    # The next run of the same model copies nothing: the copy is checked against the listing and kept.
    shutil.move(tmp_path / "away", copy.raw)
    mtimes = {p.name: p.stat().st_mtime_ns for p in copy.raw.iterdir()}
    with caplog.at_level(logging.INFO, logger="components.stage_data.models"):
        again = published_model(uri, str(root), s3_endpoint)
    assert again.path == copy.raw and {p.name: p.stat().st_mtime_ns for p in copy.raw.iterdir()} == mtimes
    assert f"the copy in {copy.raw} is up to date" in caplog.text and "nothing copied" in caplog.text


def test_staging_refuses_a_bad_starting_model_in_one_line_before_anything_is_staged(
    s3_endpoint: str, aws_env: None, tmp_path: Path
) -> None:
    """Each refused at staging, the step before any GPU is requested, naming init_from_model (or the tokenizer) as
    given; the dataset has no snapshot afterwards."""
    import boto3

    from common.errors import InputError
    from components.stage_data.core import stage_data
    from tests.helpers import write_corpus
    from tests.tokenizer_kinds import make_tokenizer, save_pretrained
    from trainer.layout import DatasetPaths

    corpus, root = write_corpus(tmp_path / "corpus", files=4, sentences=20), tmp_path / "fsx"
    texts = [p.read_text() for p in sorted(corpus.rglob("*.txt"))]
    model = tmp_path / "model"
    save_llama(model)

    def refused(match: str, **settings: object) -> None:
        with pytest.raises(InputError, match=match) as raised:
            stage_data(str(corpus), str(root), "d", **{"val_fraction": 0.25, "endpoint_url": s3_endpoint, **settings})
        assert "\n" not in str(raised.value)
        snapshots = DatasetPaths.of(root, "d").snapshots
        assert not snapshots.exists() or not any(snapshots.iterdir())

    refused(rf"^init_from_model {tmp_path}/nowhere: no such directory$", init_from_model=str(tmp_path / "nowhere"))
    refused(rf"^init_from_model {corpus}: no config.json there", init_from_model=str(corpus))
    refused(rf"^init_from_model {model} holds no tokenizer.json: give tokenizer_path", init_from_model=str(model))
    other = save_pretrained("gpt2", make_tokenizer("gpt2", texts, 320), tmp_path / "other-tokenizer")
    save_pretrained("llama3", make_tokenizer("llama3", texts, 320), model)
    refused(
        rf"^tokenizer_path {other} does not fit init_from_model {model}: the tokenizer is not the model's own: "
        r"\d+ of its \d+ tokens have another id",
        init_from_model=str(model),
        tokenizer_path=str(other),
    )
    larger = make_tokenizer("llama3", texts, 320)
    larger.add_tokens([f"<|reserved_{i}|>" for i in range(400)])  # as Llama 3's reserved special tokens
    large = save_pretrained("llama3", larger, tmp_path / "large-tokenizer")
    (model / "tokenizer.json").unlink()  # only the embedding rows to check against
    refused(
        r"the tokenizer has \d{3} tokens and the model embeds 384; leave",
        init_from_model=str(model),
        tokenizer_path=str(large),
    )
    refused(
        "init_from_run_id .* and init_from_model .* are two starting points: give one",
        init_from_model=str(model),
        init_from_run_id="previous",
    )
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="models")
    refused(
        r"^init_from_model s3://models/llama-9b: no objects under prefix 'llama-9b/'$",
        init_from_model="s3://models/llama-9b",
    )
    refused(
        r"^init_from_model s3://no-such-bucket/llama: bucket no-such-bucket does not exist$",
        init_from_model="s3://no-such-bucket/llama",
    )
    s3.put_object(Bucket="models", Key="pickled/config.json", Body=(model / "config.json").read_bytes())
    s3.put_object(Bucket="models", Key="pickled/pytorch_model.bin", Body=b"not read")
    refused(
        r"^init_from_model s3://models/pickled: its weights are a pickle checkpoint \(pytorch_model.bin\), which "
        "runs code when loaded: convert it to safetensors",
        init_from_model="s3://models/pickled",
    )


def test_the_trainer_refuses_a_snapshot_staged_with_another_tokenizer(tmp_path: Path) -> None:
    """A run that skips staging, on a snapshot of another tokenizer than the model's: the ids would mean other
    tokens than its weights learnt."""
    from tests.tokenizer_kinds import make_tokenizer, save_pretrained
    from trainer.errors import DataError
    from trainer.train_ddp import check_published_fits

    texts = ["the quiet river runs to the sea."] * 20
    save_llama(tmp_path / "model")
    save_pretrained("llama3", make_tokenizer("llama3", texts, 300), tmp_path / "model")
    snapshot = save_pretrained("gpt2", make_tokenizer("gpt2", texts, 300), tmp_path / "snapshot")
    published = PublishedModel.read(tmp_path / "model")
    with pytest.raises(
        DataError,
        match=r"--init-from-model .*model: snapshot snapshot was staged with another "
        r"tokenizer \(the tokenizer is not the model's own: ",
    ):
        check_published_fits(published, published.model_config(), snapshot, 32)
    check_published_fits(published, published.model_config(), tmp_path / "model", 32)  # its own: fits


def rope_as_transformers_4_reads_it(config: dict) -> torch.Tensor:
    """The rotary inverse frequencies transformers 4.57 builds from a Llama's config.json, by its own rules
    (huggingface/transformers v4.57.6, as its wheel ships them): src/transformers/models/llama/configuration_llama.py
    LlamaConfig.__init__ takes `rope_theta` (default 10000.0) and `rope_scaling` (default None; a "type" is copied to
    "rope_type"), and keeps any other key, such as 5.x's `rope_parameters`, as an attribute it never reads;
    src/transformers/models/llama/modeling_llama.py LlamaRotaryEmbedding takes the rope type from rope_scaling
    ("default" without one); src/transformers/modeling_rope_utils.py _validate_llama3_parameters requires factor,
    low_freq_factor, high_freq_factor and original_max_position_embeddings (a KeyError without them), and
    _compute_default_rope_parameters and _compute_llama3_parameters compute the frequencies as below."""
    import math

    theta = config.get("rope_theta", 10000.0)
    scaling = config.get("rope_scaling")
    if scaling is not None and "type" in scaling:
        scaling = scaling | {"rope_type": scaling["type"]}
    rope_type = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else "default"
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope_type == "default":
        return inv_freq
    assert rope_type == "llama3", f"rope type {rope_type} is not read here"
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@pytest.mark.parametrize("rope_scaling", [None, "llama3"])
def test_the_export_of_a_llama_reads_the_same_under_transformers_4_and_5(
    rope_scaling: str | None, tmp_path: Path
) -> None:
    """A Llama 3 (rope_theta 500000, Llama 3's rope scaling) and one without scaling, exported: transformers 5.24
    loads the export to the model's own rope settings, and transformers 4.x's reading of its config.json (serving
    stacks still on 4.x) gives the same rotary frequencies. 5.x writes only `rope_parameters`, which 4.57 read as
    rope_theta 10000.0 and no scaling: positions silently wrong. The 4.x rules are checked against 5.24's own
    arithmetic on the same settings first, so what differs is the config, never the re-implementation."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from components.evaluate_checkpoint.export import export_model
    from tests.helpers import LLAMA3_ROPE
    from trainer.model import build_model

    # save_llama hands LLAMA3_ROPE itself to LlamaConfig, which puts its rope_theta in: leave that out
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"} if rope_scaling else None
    sizes = {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    config = LlamaConfig(**sizes, rope_theta=500000.0, rope_scaling=scaling and dict(scaling))  # it fills it in
    model = build_model(config)
    expected = model.model.rotary_emb.inv_freq.clone()  # the export casts the model to bfloat16, buffers and all
    as_4x_wrote_it = {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 500000.0, "rope_scaling": scaling}
    torch.testing.assert_close(rope_as_transformers_4_reads_it(as_4x_wrote_it), expected)

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    vocab = {"<bos>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, 64)}
    Tokenizer(models.WordLevel(vocab, unk_token="w2")).save(str(snapshot / "tokenizer.json"))
    (snapshot / "meta.json").write_text(json.dumps({"bos": "<bos>", "eos": "<eos>"}))
    export = export_model(model, snapshot, tmp_path / "export", {"step": 0}, "bfloat16")

    assert AutoConfig.from_pretrained(export).rope_parameters == config.rope_parameters  # 5.24: the model's own
    inv_freq = AutoModelForCausalLM.from_pretrained(export).model.rotary_emb.inv_freq
    torch.testing.assert_close(inv_freq, expected, rtol=0, atol=0)
    written = json.loads((export / "config.json").read_text())
    torch.testing.assert_close(rope_as_transformers_4_reads_it(written), inv_freq)
