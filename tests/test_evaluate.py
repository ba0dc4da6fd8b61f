import dataclasses
import html
import io
import json
import logging
import math
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.core import EvalResult, Gate, evaluate_checkpoint
from tests.browser import CHROMIUM, CHROMIUM_FLAGS, needs_chromium
from tests.helpers import snapshot_dir
from trainer.layout import RunPaths


def test_trained_model_beats_untrained(trained_copy: Path) -> None:
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert result.step == 60 and result.val_tokens > 0
    assert result.val_loss < result.untrained_val_loss - 1.0, result
    run = RunPaths.of(trained_copy, "run-1")
    assert json.loads(run.eval_result.read_text())["val_loss"] == result.val_loss
    assert "val perplexity" in run.eval_report.read_text()


def latest_dir(root: Path) -> Path:
    return RunPaths.of(root, "run-1").latest_checkpoint.resolve()


def rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a committed checkpoint, and its size in commit.json, as a bad writer would."""
    (checkpoint / name).write_bytes(data)
    commit = json.loads((checkpoint / "commit.json").read_text())
    commit["files"][name] = len(data)
    (checkpoint / "commit.json").write_text(json.dumps(commit))


def test_corrupt_checkpoint_is_one_clear_error(trained_copy: Path) -> None:
    share = latest_dir(trained_copy) / "__0_0.distcp"
    share.write_bytes(share.read_bytes()[:1000])  # truncated, as after a crash without atomic saves
    with pytest.raises(InputError, match=r"is truncated or altered: __0_0.distcp is 1000 bytes") as failure:
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert "\n" not in str(failure.value)


def test_checkpoint_that_is_not_plain_tensors_is_refused(trained_copy: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"step": 1, "payload": Path("/etc/passwd")}, buffer)  # an arbitrary object
    rewrite(latest_dir(trained_copy), "trainer_state.pt", buffer.getvalue())
    with pytest.raises(InputError, match="not a plain-tensor checkpoint"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_checkpoint_of_another_model_is_refused(trained_copy: Path) -> None:
    config_file = RunPaths.of(trained_copy, "run-1").config
    config = json.loads(config_file.read_text())
    config["model"]["n_embd"] *= 2
    config_file.write_text(json.dumps(config))
    with pytest.raises(InputError, match="does not fit the model"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_missing_checkpoint(trained_copy: Path) -> None:
    for committed in RunPaths.of(trained_copy, "run-1").checkpoints.glob("step_*"):
        shutil.rmtree(committed)
    with pytest.raises(InputError, match="holds no committed checkpoint \\(any\\): run 'run-1' is incomplete"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_evaluation_reads_the_weights_and_not_the_optimizer_state(trained_copy: Path) -> None:
    """Every optimizer record of the checkpoint is damaged (sizes kept): evaluation, which reads only the weights'
    records, is unaffected; a full read of the same checkpoint fails their CRC32."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint import CheckpointError, read_checkpoint

    checkpoint = latest_dir(trained_copy)
    before = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    damaged = 0
    for index, item in FileSystemReader(checkpoint).read_metadata().storage_data.items():
        if index.fqn.startswith("optim.state."):
            with open(checkpoint / item.relative_path, "r+b") as f:
                f.seek(item.offset)
                record = f.read(item.length)  # the item: a torch.save archive; flip the first byte of its data
                data = next(i for i in zipfile.ZipFile(io.BytesIO(record)).infolist() if i.filename.endswith("/0"))
                name_len, extra_len = struct.unpack_from("<HH", record, data.header_offset + 26)  # its local header
                start = data.header_offset + 30 + name_len + extra_len
                f.seek(item.offset + start)
                f.write(bytes([record[start] ^ 0xFF]))
            damaged += 1
    assert damaged > 10
    after = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    assert after.val_loss == before.val_loss
    with pytest.raises(CheckpointError, match="fails its CRC32"):
        read_checkpoint(checkpoint)


def test_bits_per_byte_counts_the_bytes_the_tokens_stand_for(trained_copy: Path) -> None:
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.core import token_byte_lengths
    from trainer.data import load_meta, load_split
    from trainer.layout import TOKENIZER

    snapshot = snapshot_dir(trained_copy, "synthetic")
    lengths = token_byte_lengths(Tokenizer.from_file(str(snapshot / TOKENIZER)), load_meta(snapshot)["vocab_size"])
    val = load_split(snapshot, "val")[:500].tolist()
    text = Tokenizer.from_file(str(snapshot / TOKENIZER)).decode(val, skip_special_tokens=True)
    assert int(lengths[val].sum()) == len(text.encode("utf-8"))
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    assert 0 < result.val_bits_per_byte < result.untrained_val_loss / math.log(2)


def test_a_named_step_and_the_samples(trained_copy: Path) -> None:
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", export=False)
    assert result.step == 40 and result.checkpoint.endswith("step_00000040")
    assert [s["prompt"] for s in result.samples] == ["The", "def ", "import ", "In the"]
    assert all(len(s["text"]) > len(s["prompt"]) and s["text"].startswith(s["prompt"]) for s in result.samples)
    assert "## Samples" in result.markdown() and f"- **'def '**: {result.samples[1]['text']!r}" in result.markdown()
    with pytest.raises(InputError, match="holds no committed checkpoint \\(step 41's\\)"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="41")


# Small evaluations, for tests of what is kept and compared rather than of the numbers: few val tokens, no export.
QUICK: dict[str, Any] = {"export": False, "max_tokens": 128}


@pytest.fixture
def short_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """2-token greedy samples: the samples (128 forward passes of the whole window) are most of a small
    evaluation's time on a CPU, and the gate and history tests do not read them."""
    monkeypatch.setattr("components.evaluate_checkpoint.core.SAMPLE_TOKENS", 2)


@pytest.mark.usefixtures("short_samples")
def test_the_gate_against_a_ceiling(trained_copy: Path) -> None:
    passed = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=100.0), export=False)
    assert passed.gate_passed and "<= ceiling 100.0000" in passed.gate_reasons[0]
    with pytest.raises(
        StepFailed, match=r"quality gate failed for run run-1 at step 60: val loss \d+\.\d+ > ceiling 0.1000"
    ):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=0.1), export=False)
    warned = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=0.1, warn_only=True), export=False
    )
    assert not warned.gate_passed
    assert json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())["gate_passed"] is False


@pytest.mark.usefixtures("short_samples")
def test_the_gate_against_a_baseline_run(trained_copy: Path) -> None:
    runs = trained_copy / "runs"
    shutil.copytree(runs / "run-1", runs / "run-0")
    baseline = evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint="20", export=False)
    better = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="previous"), export=False
    )
    assert better.gate_passed and better.baseline_run_id == "run-0" and better.baseline_step == 20
    assert better.baseline_val_loss == baseline.val_loss > better.val_loss
    # the verdict names the baseline's run and step, and says it is the baseline's newest evaluation, not its newest
    # checkpoint (step 60, never evaluated)
    assert better.gate_reasons[0].startswith(
        "baseline run run-0 at step 20 (its newest evaluation; its checkpoint of step 60 is not evaluated): val "
        "bits/byte "
    ), better.gate_reasons
    # run-0 at step 20 against run-1 at 60 as its baseline: worse, even with a small margin
    with pytest.raises(
        StepFailed,
        match=r"at step 20: baseline run run-1 at step 60 \(its newest evaluation\): val "
        r"bits/byte \d+\.\d+ > \d+\.\d+ \+ margin 0.0100",
    ):
        evaluate_checkpoint(
            str(trained_copy),
            "synthetic",
            "run-0",
            checkpoint="20",
            export=False,
            gate=Gate(baseline_run_id="run-1", baseline_margin=0.01),
        )
    with pytest.raises(InputError, match="baseline run 'run-9': no evaluation"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="run-9"))


@pytest.mark.usefixtures("short_samples")
def test_the_gate_names_the_baseline_step_it_compared_with(trained_copy: Path) -> None:
    """A baseline evaluated at two steps: the gate takes its newest by default, or the step asked for, and names
    it in the verdict, the step's error and the JSON."""
    runs = trained_copy / "runs"
    shutil.copytree(runs / "run-1", runs / "run-0")
    for step in ("20", "40"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint=step, **QUICK)
    newest = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="run-0"), **QUICK)
    assert (newest.baseline_run_id, newest.baseline_step) == ("run-0", 40)
    assert "baseline run run-0 at step 40 (its newest evaluation; its checkpoint of step 60 is not evaluated)" in (
        newest.gate_line()
    )
    asked = evaluate_checkpoint(
        str(trained_copy),
        "synthetic",
        "run-1",
        gate=Gate(baseline_run_id="run-0", baseline_step=20, baseline_margin=-10.0, warn_only=True),
        **QUICK,
    )
    assert not asked.gate_passed and asked.baseline_step == 20
    assert asked.gate_reasons[0].startswith("baseline run run-0 at step 20 (as asked): val bits/byte ")
    saved = json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())
    assert (saved["baseline_run_id"], saved["baseline_step"]) == ("run-0", 20)
    missing = Gate(baseline_run_id="run-0", baseline_step=30)
    with pytest.raises(
        InputError,
        match=r"baseline run 'run-0': no evaluation of step 30 .* \(evaluated steps: 20, "
        r"40\)",
    ):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=missing)


@pytest.mark.usefixtures("short_samples")
def test_two_evaluations_of_a_run_keep_both(trained_copy: Path) -> None:
    """Evaluations of steps 40, 60 and then 20: each keeps its own directory and a history line; the run's
    eval/eval.json and reports are the newest step's (60), whatever order they ran in."""
    run = RunPaths.of(trained_copy, "run-1")
    results = {
        s: evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint=str(s), **QUICK)
        for s in (40, 60, 20)
    }
    assert run.eval_steps() == [20, 40, 60]
    for step, result in results.items():
        kept = json.loads((run.eval_step(step) / "eval.json").read_text())
        assert kept["step"] == step and kept["val_loss"] == result.val_loss and kept["report_dir"] == result.report_dir
        assert f"at step {step} " in (run.eval_step(step) / "report.md").read_text()
        assert f"at step {step} " in (run.eval_step(step) / "report.html").read_text()
    history = [json.loads(line) for line in run.eval_history.read_text().splitlines()]
    assert [(h["step"], h["val_loss"], h["report_dir"]) for h in history] == [
        (s, results[s].val_loss, f"step_{s:08d}") for s in (40, 60, 20)
    ]
    assert all(h["evaluated_at"] and h["gate_passed"] is True and "val_bits_per_byte" in h for h in history)
    latest = json.loads(run.eval_result.read_text())
    assert latest == json.loads((run.eval_step(60) / "eval.json").read_text())
    assert run.eval_html.read_text() == (run.eval_step(60) / "report.html").read_text()
    assert run.eval_report.read_text() == (run.eval_step(60) / "report.md").read_text()


@pytest.mark.usefixtures("short_samples")
def test_an_evaluation_from_before_steps_were_kept_is_kept(trained_copy: Path) -> None:
    """A run evaluated before per-step directories has only eval/eval.json (step 60): evaluating step 40 moves
    that one into its step's directory and the history first, and leaves it as the newest."""
    run = RunPaths.of(trained_copy, "run-1")
    run.eval.mkdir()
    old = {"step": 60, "val_loss": 1.5, "val_bits_per_byte": 0.5, "gate_passed": True, "dataset": "synthetic"}
    run.eval_result.write_text(json.dumps(old))
    run.eval_report.write_text("# the step-60 report\n")
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", **QUICK)
    assert json.loads(run.eval_result.read_text()) == old
    assert json.loads((run.eval_step(60) / "eval.json").read_text()) == old
    assert (run.eval_step(60) / "report.md").read_text() == "# the step-60 report\n"
    assert [json.loads(line)["step"] for line in run.eval_history.read_text().splitlines()] == [60, 40]


def test_export_loads_with_from_pretrained_and_gives_the_same_loss(trained_copy: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.checkpoint import read_checkpoint
    from trainer.model import build_model, config_from_dict

    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    run = RunPaths.of(trained_copy, "run-1")
    exported = AutoModelForCausalLM.from_pretrained(result.export_dir, local_files_only=True).eval()
    original = build_model(config_from_dict(json.loads(run.config.read_text())["model"])).eval()
    original.load_state_dict(read_checkpoint(run.latest_checkpoint)["model"])
    tokenizer = AutoTokenizer.from_pretrained(result.export_dir, local_files_only=True)
    batch = torch.tensor([tokenizer("the healthy node saves the rank. the warm pod trains the model.")["input_ids"]])
    with torch.no_grad():
        theirs = exported(input_ids=batch, labels=batch).loss.item()
        ours = original(input_ids=batch, labels=batch).loss.item()
    assert abs(theirs - ours) < 1e-5
    assert (Path(result.export_dir) / "model.safetensors").is_file()


@pytest.mark.usefixtures("short_samples")
def test_the_export_says_which_checkpoint_it_holds_and_has_the_umasks_modes(
    trained_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 60 exported, then an older step, 40: eval/eval.json keeps step 60's evaluation, and export/ now holds step
    40's weights, which export/export.json, the result and the log line say. safetensors writes its file 0600: every
    exported file has the mode open() gives under the umask instead (0640 under 027, 0644 under 022)."""
    run = RunPaths.of(trained_copy, "run-1")
    export = run.root / "export"
    trained_on = json.loads(run.config.read_text())["dataset"]

    def modes() -> dict[str, str]:
        return {
            p.relative_to(export).as_posix(): oct(p.stat().st_mode & 0o777) for p in export.rglob("*") if p.is_file()
        }

    previous = os.umask(0o027)
    try:
        newest = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", max_tokens=128)
        assert "model.safetensors" in modes() and set(modes().values()) == {"0o640"}, modes()
        os.umask(0o022)
        with caplog.at_level(logging.INFO, logger="components.evaluate_checkpoint.core"):
            older = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", max_tokens=128)
    finally:
        os.umask(previous)
    assert {"model.safetensors", "config.json", "tokenizer.json", "export.json"} <= set(modes())
    assert set(modes().values()) == {"0o644"}, modes()

    assert (newest.export_step, older.export_step, older.export_dir) == (60, 40, str(export))
    record = json.loads((export / "export.json").read_text())
    exported_at = record.pop("exported_at")
    assert record == {
        "run_id": "run-1",
        "step": 40,
        "checkpoint": older.checkpoint,
        "dataset": "synthetic",
        "snapshot": trained_on["snapshot"],
    }
    assert older.checkpoint.endswith("step_00000040") and exported_at >= older.evaluated_at
    assert json.loads(run.eval_result.read_text())["step"] == 60, "the newest evaluation stays the run's"
    assert f"Exported step 40's weights to `{export}`" in (run.eval_step(40) / "report.md").read_text()
    assert any(
        r.getMessage().startswith("run run-1 step 40: val loss ")
        and r.getMessage().endswith(f"; exported step 40 to {export}")
        for r in caplog.records
    ), caplog.text


def test_an_empty_val_split_is_one_clear_error(trained_copy: Path) -> None:
    from trainer.layout import META

    meta_path = snapshot_dir(trained_copy, "synthetic") / META
    meta = json.loads(meta_path.read_text())
    meta["shards"]["val"] = []
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InputError, match="the val split has no shards"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


@pytest.mark.usefixtures("aws_env")
def test_the_export_is_uploaded_to_s3(trained_copy: Path, s3_endpoint: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="models")
    result = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", export_s3_uri="s3://models/nightly/run-1", s3_endpoint_url=s3_endpoint
    )
    listed = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="models", Prefix="nightly/run-1/")["Contents"]}
    local = {
        f"nightly/run-1/{p.relative_to(result.export_dir).as_posix()}": p.stat().st_size
        for p in Path(result.export_dir).rglob("*")
        if p.is_file()
    }
    assert listed == local and "nightly/run-1/model.safetensors" in listed
    with pytest.raises(InputError, match="give s3://bucket/prefix"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export_s3_uri="models/nightly")


def test_mean_loss_reads_the_windows_of_each_shard_without_joining_them() -> None:
    import numpy as np

    from trainer.data import DataError, TokenSplit
    from trainer.evaluation import mean_loss
    from trainer.model import build_model, model_config

    torch.manual_seed(0)
    model, cpu = build_model(model_config("tiny", 64, 16, 63)), torch.device("cpu")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 100, dtype=np.uint16), rng.integers(0, 64, 60, dtype=np.uint16)  # 6 + 3 windows
    ones = np.ones(64, dtype=np.int64)
    loss, count, n_bytes = mean_loss(model, TokenSplit([a, b], "val"), 16, 10**6, 4, cpu, ones)
    each = [mean_loss(model, TokenSplit([s], "val"), 16, 10**6, 4, cpu, ones) for s in (a, b)]
    assert count == n_bytes == each[0][1] + each[1][1] == 9 * 16
    assert loss == pytest.approx((each[0][0] * each[0][1] + each[1][0] * each[1][1]) / count, rel=1e-6)
    assert mean_loss(model, TokenSplit([a, b], "val"), 16, 7 * 16, 4, cpu, ones)[1] == 7 * 16  # max_tokens
    with pytest.raises(DataError, match="shard"):  # 2 x 10 tokens: no window of 17 inside one shard
        mean_loss(model, TokenSplit([a[:10], b[:10]], "val"), 16, 10**6, 4, cpu, ones)


# -- the HTML report ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report_run(trained_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EvalResult, EvalResult]:
    """Run-1 evaluated once for the module's report tests, gated against run-0 (a copy of it) evaluated at step 20:
    (storage root, run-1's result, run-0's). run-0's samples are 2 tokens (its report is not read)."""
    root = tmp_path_factory.mktemp("report")
    shutil.copytree(trained_root, root, symlinks=True, dirs_exist_ok=True)
    shutil.copytree(root / "runs" / "run-1", root / "runs" / "run-0", symlinks=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("components.evaluate_checkpoint.core.SAMPLE_TOKENS", 2)
        baseline = evaluate_checkpoint(str(root), "synthetic", "run-0", checkpoint="20", **QUICK)
    result = evaluate_checkpoint(
        str(root), "synthetic", "run-1", export=False, gate=Gate(baseline_run_id="run-0", warn_only=True)
    )
    return root, result, baseline


def table(page: str, table_id: str) -> list[list[str]]:
    """A table of the report as rows of cell texts (header row first)."""
    body = re.search(f'<table id="{table_id}">(.*?)</table>', page, re.S)
    assert body, f"no table {table_id}"
    return [
        [html.unescape(c) for c in re.findall(r"<t[dh]>(.*?)</t[dh]>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)
    ]


def test_the_report_has_the_plots_the_tables_and_the_samples(report_run: tuple[Path, EvalResult, EvalResult]) -> None:
    root, result, baseline = report_run
    run = RunPaths.of(root, "run-1")
    page = run.eval_html.read_text()
    assert page == (run.eval_step(60) / "report.html").read_text()
    for name in ("curve-loss", "curve-lr", "curve-grad-norm", "curve-tokens-per-s"):
        assert f'<img id="{name}" ' in page and 'src="data:image/png;base64,iVBORw0KGgo' in page
    evaluation = table(page, "eval")
    assert evaluation[0] == ["metric", "trained", "untrained", "baseline run-0 at step 20"]
    assert evaluation[3] == [
        "val bits per byte",
        f"{result.val_bits_per_byte:.4f}",
        f"{result.untrained_bits_per_byte:.4f}",
        f"{baseline.val_bits_per_byte:.4f}",
    ]
    # the untrained model's bits per byte come from the same tokens and bytes as the trained one's
    assert result.untrained_bits_per_byte / result.val_bits_per_byte == pytest.approx(
        result.untrained_val_loss / result.val_loss, rel=1e-4
    )
    assert "| metric | trained | untrained | baseline run-0 at step 20 |" in run.eval_report.read_text()
    settings = dict(table(page, "settings")[1:])
    config = json.loads(run.config.read_text())
    train_tokens = json.loads((snapshot_dir(root, "synthetic") / "meta.json").read_text())["tokens"]["train"]
    assert result.train_tokens_seen == 60 * 8 * 64 * 2 and result.train_split_tokens == train_tokens
    assert settings["epochs over the train split"] == (
        f"{result.train_tokens_seen / train_tokens:.2f} "
        f"({result.train_tokens_seen:,} tokens trained / "
        f"{train_tokens:,} train tokens)"
    )
    assert settings["world size"] == "2 (1 node(s) x 2 process(es) per node)"
    assert settings["tokens per step"] == "1,024" and settings["preset"] == "tiny"
    assert settings["parameters"] == f"{result.parameters:,}" and result.parameters > 10_000
    assert settings["hyperpod-pretrain"].startswith(f"{config['hyperpod_pretrain']} (training, config.json); ")
    assert settings["torch"].startswith(f"{torch.__version__} (training")
    assert all(row and all(cell.strip() for cell in row) for row in [*evaluation, *settings.items()])
    assert page.count('<pre class="sample">') == 4
    # one dataset: no per-dataset figures anywhere, its val set its snapshot's
    assert result.datasets == [] and json.loads(run.eval_result.read_text())["datasets"] == []
    assert '<table id="datasets">' not in page and "Per dataset" not in run.eval_report.read_text()
    assert (
        result.val_set_sha256
        == json.loads((snapshot_dir(root, "synthetic") / "meta.json").read_text())["val_set_sha256"]
    )


def test_the_curves_are_what_the_run_recorded(report_run: tuple[Path, EvalResult, EvalResult]) -> None:
    """The plots' data: the run's rows, its checkpoints (all three kept), its evaluation, the baseline's rows and
    evaluation; no resume (one start). Loss keeps its range; every other axis starts at zero."""
    from components.evaluate_checkpoint.core import Curves, curve_figures, read_metrics

    root, result, baseline = report_run
    run = RunPaths.of(root, "run-1")
    curves = Curves.of(run, result, json.loads(run.config.read_text()))
    assert [r["step"] for r in curves.rows] == [10, 20, 30, 40, 50, 60]
    assert curves.checkpoints == [20, 40, 60] and curves.resumes == [] and curves.grad_clip == 1.0
    assert curves.evaluations == [(60, result.val_loss)]
    assert curves.baseline_rows == read_metrics(RunPaths.of(root, "run-0"))
    assert curves.baseline_evaluations == [(20, baseline.val_loss)]
    figures = {name: figure.axes[0] for name, _, figure in curve_figures(curves)}
    assert list(figures) == ["curve-loss", "curve-lr", "curve-grad-norm", "curve-tokens-per-s"]
    labels = [t.get_text() for t in figures["curve-loss"].get_legend().get_texts()]
    assert labels == [
        "baseline run-0: train",
        "baseline run-0: val",
        "train (run-1)",
        "val (evaluations)",
        "checkpoint",
    ]
    assert figures["curve-loss"].get_ylim()[0] > 0.5
    assert all(figures[name].get_ylim()[0] == 0 for name in ("curve-lr", "curve-grad-norm", "curve-tokens-per-s"))


def test_resumes_are_found_from_the_attempts_and_the_rows(trained_root: Path, tmp_path: Path) -> None:
    """run-1's records, then as the trainer leaves them when a second start resumes from step 40's checkpoint (its
    rows past 40 dropped, then logged again, with val_loss rows from --eval-every) and a third starts from scratch
    (no checkpoint: its rows start again at 10). Derived from the rows, as for a run trained before the attempts'
    reports recorded their start step; where one is recorded, it is taken."""
    from components.evaluate_checkpoint.core import Curves, Resume, curve_figures, resumes
    from trainer.metrics import MetricsLog

    run = RunPaths(tmp_path / "runs" / "run-1")
    original = RunPaths.of(trained_root, "run-1")
    shutil.copytree(original.comms, run.comms)
    shutil.copyfile(original.metrics, run.metrics)
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert resumes(run, rows) == []
    MetricsLog(run.metrics, enabled=True).truncate_after(40)
    start = json.loads(original.comms_report(0, 1).read_text())
    assert start.pop("start_step") == 0
    restarted = rows[-1]["time"] + 10
    for attempt, when in ((2, restarted), (3, restarted + 100)):
        run.comms_report(0, attempt).parent.mkdir(parents=True)
        run.comms_report(0, attempt).write_text(json.dumps(start | {"attempt": attempt, "time": when}))
    log = MetricsLog(run.metrics, enabled=True)
    for step, when in ((50, restarted + 1), (60, restarted + 2), (10, restarted + 101)):
        log.write(rows[step // 10 - 1] | {"time": when, "val_loss": 1.5 + step / 100})
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50, 60, 10]
    assert resumes(run, rows) == [Resume(2, 40), Resume(3, 0)]
    # Recorded: the second start went on from step 30 (step 40's checkpoint found damaged), which the rows cannot tell.
    run.comms_report(0, 2).write_text(json.dumps(start | {"attempt": 2, "time": restarted, "start_step": 30}))
    assert resumes(run, rows) == [Resume(2, 30), Resume(3, 0)]
    curves = Curves(
        run_id="run-1", rows=rows, evaluations=[], checkpoints=[], resumes=resumes(run, rows), grad_clip=0.0
    )
    assert Curves.points(rows, "val_loss") == ([50, 60, 10], [2.0, 2.1, 1.6])
    loss = curve_figures(curves)[0][2].axes[0]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["train (run-1)", "val (training)", "resume"]


# Reports, from the loaded page, what the tests check: images decoded, nothing wider than the window outside a
# scrolling box, samples within their height cap, no empty cell in the eval and settings tables.
PROBE = """<script>window.addEventListener("load", () => {
  const width = window.innerWidth;
  const scrolled = (el) => {
    for (let up = el.parentElement; up; up = up.parentElement) {
      const style = getComputedStyle(up);
      if (/auto|scroll|hidden/.test(style.overflowX + " " + style.overflowY)) return true;
    }
    return false;
  };
  const probe = {
    innerWidth: width,
    scrollWidth: document.documentElement.scrollWidth,
    images: [...document.images].map((i) => ({id: i.id, decoded: i.complete && i.naturalWidth > 0})),
    wide: [...document.body.querySelectorAll("*")]
      .filter((el) => el.getBoundingClientRect().right > width + 1 && !scrolled(el))
      .map((el) => el.tagName + "#" + el.id + " " + el.getBoundingClientRect().right),
    samples: [...document.querySelectorAll("pre.sample")].map((p) => ({
      height: p.getBoundingClientRect().height, cap: parseFloat(getComputedStyle(p).maxHeight) || 0,
      content: p.scrollHeight, wrapped: p.scrollWidth <= p.clientWidth})),
    cells: [...document.querySelectorAll("#eval td, #eval th, #settings td, #settings th")]
      .map((c) => c.textContent.trim()),
  };
  const out = document.createElement("script");
  out.type = "application/json";
  out.id = "probe";
  out.textContent = JSON.stringify(probe);
  document.body.appendChild(out);
});</script>"""


@needs_chromium
@pytest.mark.parametrize("width,height", [(1280, 900), (1920, 1080)])
def test_the_html_report_renders_in_headless_chromium(
    report_run: tuple[Path, EvalResult, EvalResult], tmp_path: Path, width: int, height: int
) -> None:
    """The report of the module's evaluation, with one more sample of 30 newlines and a 2000-character line, at a
    window's size: a screenshot of that size, and a probe script's findings: every plot decoded, nothing wider than
    the window, the samples within their height cap, no empty table cell."""
    import subprocess

    from components.evaluate_checkpoint.core import html_report

    root, result, _ = report_run
    long = {"prompt": "The", "text": "The" + "\n" * 30 + "x" * 2000}
    page = html_report(dataclasses.replace(result, samples=[*result.samples, long]), RunPaths.of(root, "run-1"))
    report = tmp_path / "report.html"
    report.write_text(page)
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    flags = ["--headless", *CHROMIUM_FLAGS, f"--window-size={width},{height}", "--virtual-time-budget=5000"]

    def chromium(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [CHROMIUM, *flags, f"--user-data-dir={tmp_path / name}", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )

    shot = tmp_path / "shot.png"
    done = chromium("profile-shot", f"--screenshot={shot}", report.as_uri())
    assert shot.is_file(), done.stderr[-2000:]
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (width, height)
    dom = chromium("profile-probe", "--dump-dom", probed.as_uri()).stdout
    found = re.search(r'<script type="application/json" id="probe">(.*?)</script>', dom, re.S)
    assert found, dom[-2000:]
    probe = json.loads(found.group(1))
    assert probe["innerWidth"] == width
    assert probe["scrollWidth"] <= width and probe["wide"] == [], probe
    assert [i["id"] for i in probe["images"]] == ["curve-loss", "curve-lr", "curve-grad-norm", "curve-tokens-per-s"]
    assert all(i["decoded"] for i in probe["images"]), probe["images"]
    samples = probe["samples"]
    assert len(samples) == 5 and all(s["cap"] > 0 and s["height"] <= s["cap"] + 0.5 for s in samples), samples
    assert all(s["wrapped"] for s in samples), samples  # long lines wrap: no sideways scrolling in a sample
    assert samples[-1]["content"] > samples[-1]["cap"], "the long sample should need its scroll box"
    assert len(probe["cells"]) == 4 * 4 + 2 * len(table(page, "settings")) and all(probe["cells"]), probe["cells"]


# -- a mixture ----------------------------------------------------------------------------------------------------


class Messages(logging.Handler):
    """The log lines of a module-scoped fixture's evaluation (caplog is per test)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def mixture_eval(
    mixture_run: RunPaths, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunPaths, EvalResult, list[str]]:
    """The mixed run (conftest's mixture_run, copied: evaluation writes into the run) evaluated once at its newest
    checkpoint (step 20) over up to 16384 tokens of each val split in batches of 8, as its --eval-every rows were
    measured: (the copy's run, the result, the evaluation's log lines). Samples of 2 tokens (not read here)."""
    root = tmp_path_factory.mktemp("mixture-eval")
    shutil.copytree(mixture_run.root.parent.parent, root, symlinks=True, dirs_exist_ok=True)
    messages, logger = Messages(), logging.getLogger("components.evaluate_checkpoint.core")
    logger.addHandler(messages)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("components.evaluate_checkpoint.core.SAMPLE_TOKENS", 2)
            result = evaluate_checkpoint(str(root), "synthetic", "mixed", max_tokens=16384, batch_size=8, export=False)
    finally:
        logger.removeHandler(messages)
        logger.setLevel(level)
    return RunPaths.of(root, "mixed"), result, messages.lines


MIXED = ["synthetic", "code", "math"]


def test_a_mixture_is_evaluated_on_each_datasets_val_split(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """eval.json has each dataset's share, tokens trained and epochs (the checkpoint's and the rows' accounting), and
    its own val figures; the top-level ones are their totals: the token-weighted mean loss, bits per byte of the
    summed nats and bytes. Each dataset's loss is the one the trainer measured at step 20 over the same tokens."""
    from components.evaluate_checkpoint.core import find_checkpoint, read_metrics

    run, result, lines = mixture_eval
    saved = json.loads((run.eval_step(20) / "eval.json").read_text())
    assert saved == json.loads(run.eval_result.read_text()) and saved["step"] == result.step == 20
    datasets = saved["datasets"]
    assert [d["dataset"] for d in datasets] == MIXED
    assert [d["weight"] for d in datasets] == [0.6, 0.3, 0.1] and [d["share"] for d in datasets] == [0.6, 0.3, 0.1]
    mixture = {m["dataset"]: m for m in json.loads(run.config.read_text())["dataset"]["mixture"]}
    assert all(d["snapshot"] == mixture[d["dataset"]]["snapshot"] for d in datasets)
    assert all(d["train_split_tokens"] == mixture[d["dataset"]]["train_tokens"] for d in datasets)
    losses = [d["val_loss"] for d in datasets]
    assert all(math.isfinite(d["val_loss"]) and 0 < d["val_loss"] < d["untrained_val_loss"] - 1.0 for d in datasets)
    assert len(set(losses)) == 3, "three val splits of different text: three losses"
    tokens = sum(d["val_tokens"] for d in datasets)
    assert saved["val_tokens"] == tokens
    assert min(losses) <= saved["val_loss"] <= max(losses)
    assert saved["val_loss"] == pytest.approx(sum(d["val_loss"] * d["val_tokens"] for d in datasets) / tokens, abs=2e-6)
    assert saved["untrained_val_loss"] == pytest.approx(
        sum(d["untrained_val_loss"] * d["val_tokens"] for d in datasets) / tokens, abs=2e-6
    )
    assert (
        min(d["val_bits_per_byte"] for d in datasets)
        <= saved["val_bits_per_byte"]
        <= max(d["val_bits_per_byte"] for d in datasets)
    )

    # the tokens trained on from each dataset: the checkpoint's sequences of it, together all the tokens trained
    state = find_checkpoint(run, "20").trainer_state()
    seq_len = json.loads(run.config.read_text())["trainer"]["seq_len"]
    assert [d["tokens_trained"] for d in datasets] == [state["data"]["consumed"][n] * seq_len for n in MIXED]
    assert sum(d["tokens_trained"] for d in datasets) == saved["train_tokens_seen"] == 20 * 8 * 2 * seq_len
    assert sum(d["trained_fraction"] for d in datasets) == pytest.approx(1.0, abs=1e-5)

    # the trainer's row at step 20 (--eval-every 10: over eval_tokens = 16384 tokens, batches of 8): the same
    row = {r["step"]: r for r in read_metrics(run)}[20]
    for d in datasets:
        theirs = row["datasets"][d["dataset"]]
        assert d["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5), d["dataset"]
        assert d["val_bits_per_byte"] == pytest.approx(theirs["val_bpb"], rel=1e-5), d["dataset"]
        assert (d["tokens_trained"], d["epochs"]) == (theirs["tokens"], theirs["epochs"]), d["dataset"]
    assert (saved["val_loss"], saved["val_tokens"]) == (pytest.approx(row["val_loss"], rel=1e-5), row["val_tokens"])
    assert saved["val_bits_per_byte"] == pytest.approx(row["val_bpb"], rel=1e-5)

    assert {k: v for k, v in result.metrics().items() if k.startswith("val_loss_")} == {
        f"val_loss_{d['dataset']}": d["val_loss"] for d in datasets
    }
    (line,) = [line for line in lines if line.startswith("run mixed step 20: val loss ")]
    assert "; val loss per dataset: " + ", ".join(f"{d['dataset']} {d['val_loss']:.4f}" for d in datasets) in line


def test_each_dataset_of_a_mixture_measures_as_its_val_split_alone(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """mean_loss of the step-20 weights and of the untrained model (the run's seed) on each dataset's val split alone:
    each dataset's figures, and the totals computed from them."""
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.core import find_checkpoint
    from trainer.checkpoint import read_weights
    from trainer.data import load_split
    from trainer.evaluation import bits_per_byte, mean_loss, token_byte_lengths
    from trainer.layout import TOKENIZER, DatasetPaths
    from trainer.model import build_model, config_from_dict

    run, result, _ = mixture_eval
    config = json.loads(run.config.read_text())
    root, cpu = run.root.parent.parent, torch.device("cpu")
    snapshots = {
        m["dataset"]: DatasetPaths.of(root, m["dataset"]).snapshot(m["snapshot"]) for m in config["dataset"]["mixture"]
    }
    lengths = token_byte_lengths(
        Tokenizer.from_file(str(snapshots["code"] / TOKENIZER)), config["dataset"]["model_vocab_size"]
    )
    model = build_model(config_from_dict(config["model"]))
    model.load_state_dict(read_weights(find_checkpoint(run, "20")))
    torch.manual_seed(config["trainer"]["seed"])
    untrained = build_model(config_from_dict(config["model"]))
    measured = {}
    for name, directory in snapshots.items():
        val = load_split(directory, "val")
        measured[name] = mean_loss(model, val, 64, 16384, 8, cpu, lengths)
        assert measured[name][1] == min(16384, val.num_windows(64) * 64)
        mine = {d["dataset"]: d for d in result.datasets}[name]
        assert (mine["val_loss"], mine["val_tokens"]) == (pytest.approx(measured[name][0], abs=1e-6), measured[name][1])
        assert mine["val_bits_per_byte"] == pytest.approx(bits_per_byte(*measured[name]), abs=1e-6)
        assert mine["untrained_val_loss"] == pytest.approx(
            mean_loss(untrained, val, 64, 16384, 8, cpu, lengths)[0], abs=1e-6
        )
    tokens = sum(t for _, t, _ in measured.values())
    loss = sum(x * t for x, t, _ in measured.values()) / tokens
    assert result.val_loss == pytest.approx(loss, abs=1e-6)
    assert result.val_bits_per_byte == pytest.approx(
        bits_per_byte(loss, tokens, sum(b for *_, b in measured.values())), abs=1e-6
    )


def test_the_report_of_a_mixture_has_each_dataset(mixture_eval: tuple[RunPaths, EvalResult, list[str]]) -> None:
    """report.md and report.html: the per-dataset table with eval.json's figures; the HTML's per-dataset plots; the
    settings name the mixture. TensorBoard has each dataset's evaluation charts at the step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, result, _ = mixture_eval
    datasets = json.loads(run.eval_result.read_text())["datasets"]
    expected = [
        [
            d["dataset"],
            f"{d['share']:.1%}",
            f"{d['tokens_trained']:,} ({d['trained_fraction']:.1%})",
            f"{d['epochs']:.2f}",
            f"{d['val_loss']:.4f}",
            f"{d['val_bits_per_byte']:.4f}",
            f"{d['untrained_val_loss']:.4f}",
        ]
        for d in datasets
    ]
    assert expected[0][:3] == ["synthetic", "60.0%", f"{datasets[0]['tokens_trained']:,} (60.0%)"]
    header = ["dataset", "share", "tokens trained", "epochs", "val loss", "val bits per byte", "untrained loss"]
    page = (run.eval_step(20) / "report.html").read_text()
    assert table(page, "datasets") == [header, *expected]
    markdown = (run.eval_step(20) / "report.md").read_text()
    assert "| " + " | ".join(header) + " |" in markdown
    assert all("| " + " | ".join(row) + " |" in markdown for row in expected), markdown
    assert "1,984 held-out tokens of the 3 datasets' val splits" in markdown
    for name in ("curve-loss", "curve-dataset-val-loss", "curve-dataset-tokens"):
        assert re.search(f'<img id="{name}" alt="[^"]+" src="data:image/png;base64,iVBORw0KGgo', page), name
    settings = dict(table(page, "settings")[1:])
    assert settings["dataset"] == "mixture of " + ", ".join(
        f"{d['dataset']} (snapshot {d['snapshot']}, weight {d['weight']:g})" for d in datasets
    )
    split_tokens = sum(d["train_split_tokens"] for d in datasets)
    assert result.train_split_tokens == split_tokens
    assert settings["epochs over the train split"].startswith(f"{result.train_tokens_seen / split_tokens:.2f} (")
    events = EventAccumulator(str(run.tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    for d in datasets:
        for chart, key in (("val_loss", "val_loss"), ("bits_per_byte", "val_bits_per_byte")):
            found = [(e.step, e.value) for e in events.Scalars(f"evaluation/{d['dataset']}/{chart}")]
            assert found == [(20, pytest.approx(d[key], rel=1e-6))], (d["dataset"], chart)


def test_the_mixture_plots_are_what_the_rows_and_the_evaluations_recorded(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]], tmp_path: Path
) -> None:
    """Each dataset's val loss: the rows' (steps 10 and 20) and the kept evaluations' marks (step 20, and a step-10
    evaluation kept beside it in a copy); each dataset's tokens at every logged step."""
    from components.evaluate_checkpoint.core import Curves, curve_figures, read_metrics

    run, result, _ = mixture_eval
    copy = RunPaths(tmp_path / "runs" / "mixed")
    shutil.copytree(run.root, copy.root, symlinks=True)
    rows = {r["step"]: r for r in read_metrics(copy)}
    older = {
        "step": 10,
        "datasets": [{"dataset": n, "val_loss": rows[10]["datasets"][n]["val_loss"] + 0.5} for n in MIXED],
    }
    copy.eval_step(10).mkdir(parents=True)
    (copy.eval_step(10) / "eval.json").write_text(json.dumps(older))
    curves = Curves.of(copy, result, json.loads(copy.config.read_text()))
    assert curves.datasets == MIXED
    assert curves.dataset_evaluations == {
        d["dataset"]: [(10, rows[10]["datasets"][d["dataset"]]["val_loss"] + 0.5), (20, d["val_loss"])]
        for d in result.datasets
    }
    figures = {name: figure.axes[0] for name, _, figure in curve_figures(curves)}
    assert list(figures) == [
        "curve-loss",
        "curve-dataset-val-loss",
        "curve-dataset-tokens",
        "curve-lr",
        "curve-grad-norm",
        "curve-tokens-per-s",
    ]
    losses = figures["curve-dataset-val-loss"]
    assert [t.get_text() for t in losses.get_legend().get_texts()] == [
        f"{n} ({what})" for n in MIXED for what in ("training", "evaluations")
    ]
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in losses.get_lines()}
    for name in MIXED:
        assert drawn[f"{name} (training)"] == ([10, 20], [rows[s]["datasets"][name]["val_loss"] for s in (10, 20)])
        assert drawn[f"{name} (evaluations)"] == tuple(map(list, zip(*curves.dataset_evaluations[name], strict=True)))
    tokens = figures["curve-dataset-tokens"]
    assert tokens.get_ylim()[0] == 0
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in tokens.get_lines()}
    assert drawn == {n: (sorted(rows), [rows[s]["datasets"][n]["tokens"] for s in sorted(rows)]) for n in MIXED}
    assert drawn["math"][1][-1] == {d["dataset"]: d for d in result.datasets}["math"]["tokens_trained"]


def test_a_mixture_is_compared_only_with_evaluations_on_the_same_datasets_val_sets(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """A mixture's val set is none of its datasets' alone: an evaluation of its first dataset alone is no baseline for
    it, one of the same mixture is (find_baseline, as the gate calls it)."""
    from components.evaluate_checkpoint.core import find_baseline

    run, result, _ = mixture_eval
    root = run.root.parent.parent
    per_dataset = {d["dataset"]: d["val_set_sha256"] for d in result.datasets}
    assert all(per_dataset.values()) and result.val_set_sha256 not in per_dataset.values()
    single = RunPaths.of(root, "single")
    single.eval.mkdir(parents=True)
    alone = {
        "step": 20,
        "dataset": "synthetic",
        "val_loss": 2.5,
        "val_bits_per_byte": 0.8,
        "val_set_sha256": per_dataset["synthetic"],
    }
    single.eval_result.write_text(json.dumps(alone))
    with pytest.raises(
        InputError,
        match="baseline 'previous': no other run of dataset 'synthetic' evaluated on the "
        f"same val set \\({result.val_set_sha256}\\)",
    ):
        find_baseline(str(root), "synthetic", "mixed", "previous", result.val_set_sha256)
    with pytest.raises(InputError, match="baseline run 'single' was evaluated on another val set"):
        find_baseline(str(root), "synthetic", "mixed", "single", result.val_set_sha256)
    shutil.copytree(run.eval, root / "runs" / "mixed-0" / "eval")
    found = find_baseline(str(root), "synthetic", "mixed", "previous", result.val_set_sha256)
    assert (found.run_id, found.step, found.evaluation["val_loss"]) == ("mixed-0", 20, result.val_loss)


def test_a_mixture_whose_snapshot_is_gone_is_refused_naming_the_dataset(mixture_run: RunPaths, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(mixture_run.root.parent.parent, root, symlinks=True)
    code = next(m for m in json.loads(mixture_run.config.read_text())["dataset"]["mixture"] if m["dataset"] == "code")
    shutil.rmtree(root / "datasets" / "code" / "snapshots" / code["snapshot"])
    with pytest.raises(
        InputError, match=f"run 'mixed' trained on snapshot {code['snapshot']} of dataset 'code', which is gone"
    ) as refused:
        evaluate_checkpoint(str(root), "synthetic", "mixed", **QUICK)
    assert "\n" not in str(refused.value)
    assert not RunPaths.of(root, "mixed").eval.exists(), "refused before anything was written"
