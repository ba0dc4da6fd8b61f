import io
import json
import math
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.core import Gate, evaluate_checkpoint
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
    assert all(len(s["text"]) > len(s["prompt"]) for s in result.samples)
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
    warned = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=0.1, warn_only=True),
                                 export=False)  # fmt: skip
    assert not warned.gate_passed
    assert json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())["gate_passed"] is False


@pytest.mark.usefixtures("short_samples")
def test_the_gate_against_a_baseline_run(trained_copy: Path) -> None:
    runs = trained_copy / "runs"
    shutil.copytree(runs / "run-1", runs / "run-0")
    baseline = evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint="20", export=False)
    better = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="previous"),
                                 export=False)  # fmt: skip
    assert better.gate_passed and better.baseline_run_id == "run-0" and better.baseline_step == 20
    assert better.baseline_val_loss == baseline.val_loss > better.val_loss
    # the verdict names the baseline's run and step, and says it is the baseline's newest evaluation, not its newest
    # checkpoint (step 60, never evaluated)
    assert better.gate_reasons[0].startswith(
        "baseline run run-0 at step 20 (its newest evaluation; its checkpoint of step 60 is not evaluated): val "
        "bits/byte "
    ), better.gate_reasons
    # run-0 at step 20 against run-1 at 60 as its baseline: worse, even with a small margin
    with pytest.raises(StepFailed, match=r"at step 20: baseline run run-1 at step 60 \(its newest evaluation\): val "
                       r"bits/byte \d+\.\d+ > \d+\.\d+ \+ margin 0.0100"):  # fmt: skip
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint="20", export=False,
                            gate=Gate(baseline_run_id="run-1", baseline_margin=0.01))  # fmt: skip
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
    asked = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="run-0",
                                baseline_step=20, baseline_margin=-10.0, warn_only=True), **QUICK)  # fmt: skip
    assert not asked.gate_passed and asked.baseline_step == 20
    assert asked.gate_reasons[0].startswith("baseline run run-0 at step 20 (as asked): val bits/byte ")
    saved = json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())
    assert (saved["baseline_run_id"], saved["baseline_step"]) == ("run-0", 20)
    missing = Gate(baseline_run_id="run-0", baseline_step=30)
    with pytest.raises(InputError, match=r"baseline run 'run-0': no evaluation of step 30 .* \(evaluated steps: 20, "
                       r"40\)"):  # fmt: skip
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=missing)


@pytest.mark.usefixtures("short_samples")
def test_two_evaluations_of_a_run_keep_both(trained_copy: Path) -> None:
    """Evaluations of steps 40, 60 and then 20: each keeps its own directory and a history line; the run's
    eval/eval.json and reports are the newest step's (60), whatever order they ran in."""
    run = RunPaths.of(trained_copy, "run-1")
    results = {s: evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint=str(s), **QUICK)
               for s in (40, 60, 20)}  # fmt: skip
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


def test_html_report_has_the_curves_the_table_and_the_samples(trained_copy: Path) -> None:
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    page = (RunPaths.of(trained_copy, "run-1").eval / "report.html").read_text()
    assert '<img id="curves" alt="training curves" src="data:image/png;base64,iVBORw0KGgo' in page
    assert '<table id="eval">' in page and "val bits per byte" in page and '<ul id="samples">' in page


def test_an_empty_val_split_is_one_clear_error(trained_copy: Path) -> None:
    from trainer.layout import META

    meta_path = snapshot_dir(trained_copy, "synthetic") / META
    meta = json.loads(meta_path.read_text())
    meta["shards"]["val"] = []
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InputError, match="the val split has no shards"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (make test installs Debian's where it runs as root)")
def test_the_html_report_renders_in_headless_chromium(trained_copy: Path, tmp_path: Path) -> None:
    """The browser decodes the embedded plot and lays out the table; a script added to a copy reports both."""
    import subprocess

    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    page = (RunPaths.of(trained_copy, "run-1").eval / "report.html").read_text()
    probe = """<script>window.addEventListener("load", () => {
      const img = document.getElementById("curves");
      document.body.dataset.curves = img.complete ? img.naturalWidth + "x" + img.naturalHeight : "broken";
      document.body.dataset.rows = document.getElementById("eval").rows.length;
    });</script>"""
    copy = tmp_path / "report.html"
    copy.write_text(page.replace("</body>", probe + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom"]  # fmt: skip
    dom = subprocess.run([CHROMIUM, *flags, copy.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert 'data-curves="1200x320"' in dom, dom[:500]
    assert 'data-rows="4"' in dom


@pytest.mark.usefixtures("aws_env")
def test_the_export_is_uploaded_to_s3(trained_copy: Path, s3_endpoint: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="models")
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export_s3_uri="s3://models/nightly/run-1",
                                 s3_endpoint_url=s3_endpoint)  # fmt: skip
    listed = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="models", Prefix="nightly/run-1/")["Contents"]}
    local = {f"nightly/run-1/{p.relative_to(result.export_dir).as_posix()}": p.stat().st_size
             for p in Path(result.export_dir).rglob("*") if p.is_file()}  # fmt: skip
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
