"""Dataset snapshots: a re-stage writes a new snapshot beside the old; runs, evaluations and the gate keep theirs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.gate import Gate
from components.launch_training.core import launch
from components.stage_data.core import stage_data
from components.stage_data.snapshots import prune_snapshots
from tests.helpers import EXACT, rewound_copy, snapshot_dir, tiny_launch
from trainer.layout import META, DatasetPaths, RunPaths

TOKENS_PER_STEP = 8 * 64 * 2  # tiny_launch: batch 8, seq_len 64, 2 ranks


def change_a_train_file(source: Path) -> None:
    """Add a document: a new file always goes to train (the val set is fixed at the first staging)."""
    (source / "part-a" / "new doc.txt").write_text("the idle pod saves the rank.\n" * 40)


def restage(source: Path, root: Path, **settings) -> str:
    return stage_data(str(source), str(root), "synthetic", vocab_size=512, val_fraction=0.1, **settings).snapshot


@pytest.fixture
def source(corpus: Path, tmp_path: Path) -> Path:
    """A private copy of the corpus that staged_copy was staged from, to change."""
    return Path(shutil.copytree(corpus, tmp_path / "source"))


def test_a_restage_writes_a_new_snapshot_beside_the_old(staged_copy: Path, source: Path) -> None:
    paths = DatasetPaths.of(staged_copy, "synthetic")
    first = snapshot_dir(staged_copy, "synthetic")
    meta_before = (first / META).read_text()
    assert restage(source, staged_copy) == first.name, "the same inputs name the same snapshot: nothing to do"
    change_a_train_file(source)
    second = restage(source, staged_copy)
    assert second != first.name and snapshot_dir(staged_copy, "synthetic").name == second
    assert (first / META).read_text() == meta_before, "the old snapshot is never changed"
    old, new = json.loads(meta_before), json.loads((paths.snapshot(second) / META).read_text())
    assert new["val_set_sha256"] == old["val_set_sha256"] and new["tokens"]["train"] > old["tokens"]["train"]
    with pytest.raises(InputError, match=r"val fraction 0.2: dataset 'synthetic' holds out a fixed val set chosen"):
        stage_data(str(source), str(staged_copy), "synthetic", vocab_size=512, val_fraction=0.2)


def test_a_resume_after_a_restage_keeps_its_snapshot_or_is_refused(
    staged_copy: Path, source: Path, uninterrupted: RunPaths
) -> None:
    """The uninterrupted run as it was at step 20 (trained on the snapshot staged_copy holds), resumed after a
    restage: refused when asked to, else it goes on on its own snapshot."""
    run = rewound_copy(uninterrupted, staged_copy, "run", 20)
    started_on = snapshot_dir(staged_copy, "synthetic").name
    assert json.loads(run.config.read_text())["dataset"]["snapshot"] == started_on
    change_a_train_file(source)
    restaged = restage(source, staged_copy)

    refuse = {"TRAINER_ON_NEW_SNAPSHOT": "refuse"}
    with pytest.raises(
        StepFailed,
        match=rf"was staged again: --data-dir is snapshot {restaged}, this run's checkpoint "
        rf"was trained on snapshot {started_on}",
    ):
        launch(tiny_launch(staged_copy, "run", **EXACT, nproc_per_node=1, extra_env=refuse))  # a refusal: one rank

    launch(tiny_launch(staged_copy, "run", **EXACT, nproc_per_node=1))  # handed the current snapshot; one rank
    assert f"keeps training on its snapshot {started_on}, not on {restaged}" in run.rank_log(0).read_text()
    config = json.loads(run.config.read_text())
    assert config["dataset"]["snapshot"] == started_on and json.loads(run.status.read_text())["step"] == 40
    result = evaluate_checkpoint(str(staged_copy), "synthetic", "run", export=False)
    assert result.snapshot == started_on, "the evaluation reads the run's own val split and tokenizer"

    shutil.rmtree(DatasetPaths.of(staged_copy, "synthetic").snapshot(started_on))
    with pytest.raises(InputError, match=f"trained on snapshot {started_on} of dataset 'synthetic', which is gone"):
        evaluate_checkpoint(str(staged_copy), "synthetic", "run", export=False)


def test_the_gate_compares_bits_per_byte_on_the_same_val_set_only(trained_copy: Path, source: Path) -> None:
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    first = snapshot_dir(trained_copy, "synthetic").name
    change_a_train_file(source)
    other_tokenizer = stage_data(str(source), str(trained_copy), "synthetic", vocab_size=400, val_fraction=0.1)
    launch(tiny_launch(trained_copy, "run-2", max_steps=20, nproc_per_node=1))  # runs to evaluate: one process
    result = evaluate_checkpoint(
        str(trained_copy),
        "synthetic",
        "run-2",
        export=False,
        gate=Gate(baseline_run_id="previous", baseline_margin=10.0),
    )
    assert result.baseline_run_id == "run-1" and result.baseline_bits_per_byte is not None
    assert (
        result.tokenizer_sha256
        != json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())["tokenizer_sha256"]
    )
    assert (
        f"bits per byte compare across tokenizers; snapshot {first} vs {other_tokenizer.snapshot}, same val set"
        in result.gate_reasons[0]
    )

    val_file = next(k for k in json.loads(DatasetPaths.of(trained_copy, "synthetic").val_set.read_text())["keys"])
    (source / val_file).write_text((source / val_file).read_text() + "the stale node loads the model.\n")
    stage_data(str(source), str(trained_copy), "synthetic", vocab_size=400, val_fraction=0.1)
    launch(tiny_launch(trained_copy, "run-3", max_steps=10, nproc_per_node=1))
    with pytest.raises(InputError, match=r"baseline run 'run-1' was evaluated on another val set"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-3", export=False, gate=Gate(baseline_run_id="run-1"))
    with pytest.raises(InputError, match=r"baseline 'previous': no other run of dataset 'synthetic' evaluated on"):
        evaluate_checkpoint(
            str(trained_copy), "synthetic", "run-3", export=False, gate=Gate(baseline_run_id="previous")
        )

    # Three snapshots, each used by a run: nothing to prune, until a run goes.
    paths = DatasetPaths.of(trained_copy, "synthetic")
    assert prune_snapshots(str(trained_copy), "synthetic").removed == []
    shutil.rmtree(RunPaths.of(trained_copy, "run-1").root)
    assert prune_snapshots(str(trained_copy), "synthetic", dry_run=True).removed == [first]
    assert paths.snapshot(first).is_dir()
    pruned = prune_snapshots(str(trained_copy), "synthetic")
    assert pruned.removed == [first] and pruned.bytes_freed > 0 and not paths.snapshot(first).exists()
    assert sorted(p.name for p in paths.snapshots.iterdir()) == sorted(pruned.in_use)


def test_a_warm_start_continues_a_finished_run_on_a_restaged_corpus(trained_copy: Path, source: Path) -> None:
    change_a_train_file(source)
    staged = stage_data(
        str(source),
        str(trained_copy),
        "synthetic",
        vocab_size=400,
        val_fraction=0.1,
        init_from_run_id="previous",
        run_id="run-2",
    )
    first = RunPaths.of(trained_copy, "run-1")
    assert staged.init_from_run_id == "run-1" and staged.snapshot != snapshot_dir_of(first)
    assert staged.vocab_size == json.loads(first.config.read_text())["dataset"]["vocab_size"], "run-1's tokenizer"

    launch(tiny_launch(trained_copy, "run-2", max_steps=10, log_every=1, nproc_per_node=1, init_from_run_id="previous"))
    second = RunPaths.of(trained_copy, "run-2")
    last_before = [json.loads(line) for line in first.metrics.read_text().splitlines()][-1]
    first_after = json.loads(second.metrics.read_text().splitlines()[0])
    untrained = math.log(staged.vocab_size)  # a fresh model's loss is about ln(vocabulary)
    assert first_after["step"] == 1 and abs(first_after["loss"] - last_before["loss"]) < 0.1 * last_before["loss"]
    assert first_after["loss"] < 0.5 * untrained
    config = json.loads(second.config.read_text())
    assert config["init_from"] == {
        "run": "run-1",
        "step": 60,
        "tokens_seen": 60 * TOKENS_PER_STEP,
        "snapshot": snapshot_dir_of(first),
    }
    assert config["dataset"]["snapshot"] == staged.snapshot
    assert "warm start from run run-1 at step 60" in second.rank_log(0).read_text()

    other_tokenizer = stage_data(str(source), str(trained_copy), "synthetic", vocab_size=300, val_fraction=0.1)
    with pytest.raises(StepFailed, match=r"its weights were trained with tokenizer \w+, and this run's snapshot has"):
        launch(
            tiny_launch(
                trained_copy,
                "run-3",
                max_steps=10,
                nproc_per_node=1,  # a refusal: one rank
                snapshot=other_tokenizer.snapshot,
                init_from_run_id="run-1",
            )
        )


def snapshot_dir_of(run: RunPaths) -> str:
    return json.loads(run.config.read_text())["dataset"]["snapshot"]
