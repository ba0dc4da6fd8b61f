"""The evaluation's report (components/evaluate_checkpoint/report.py): its tables, the curves it plots, the resumes it
marks, and the page as a browser renders it."""

import dataclasses
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.gate import Gate
from components.evaluate_checkpoint.results import EvalResult
from tests.browser import CHROMIUM, CHROMIUM_FLAGS, needs_chromium
from tests.evaluate_helpers import QUICK, table
from tests.helpers import snapshot_dir
from trainer.layout import RunPaths


@pytest.fixture(scope="module")
def report_run(trained_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, EvalResult, EvalResult]:
    """Run-1 evaluated once for the module's report tests, gated against run-0 (a copy of it) evaluated at step 20:
    (storage root, run-1's result, run-0's). run-0's samples are 2 tokens (its report is not read)."""
    root = tmp_path_factory.mktemp("report")
    shutil.copytree(trained_root, root, symlinks=True, dirs_exist_ok=True)
    shutil.copytree(root / "runs" / "run-1", root / "runs" / "run-0", symlinks=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("components.evaluate_checkpoint.measure.SAMPLE_TOKENS", 2)
        baseline = evaluate_checkpoint(str(root), "synthetic", "run-0", checkpoint="20", **QUICK)
    result = evaluate_checkpoint(
        str(root), "synthetic", "run-1", export=False, gate=Gate(baseline_run_id="run-0", warn_only=True)
    )
    return root, result, baseline


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
    from components.evaluate_checkpoint.measure import read_metrics
    from components.evaluate_checkpoint.report import Curves, curve_figures

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
    from components.evaluate_checkpoint.report import Curves, Resume, curve_figures, resumes
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

    from components.evaluate_checkpoint.report import html_report

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
