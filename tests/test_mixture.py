"""The mixture's sampler (trainer/mixture.py): shares, the same order on any world size, exact resume, bad weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import InputError
from components.launch_training.core import launch
from components.stage_data.core import stage_data
from tests.helpers import MIXED_RUN, MIXTURE, tiny_launch, write_corpus
from tests.test_trainer import assert_same_rows, preempt_at_random_step, read_metrics, start_torchrun
from trainer.checkpoint import read_checkpoint
from trainer.data import DataPosition, TokenSplit
from trainer.errors import DataError
from trainer.layout import RunPaths
from trainer.mixture import DatasetChoice, MixtureBatches, MixturePosition, mixture_plan, parse_weights
from trainer.preemption import ExitCode


def split_of(first_token: int, tokens: int) -> TokenSplit:
    """One shard whose tokens number their place, starting at `first_token`: a window shows where it was read."""
    return TokenSplit([np.arange(first_token, first_token + tokens, dtype=np.uint32)])


NAMES = ["web", "code", "math"]
# Sizes far from the weights: math, a tenth of the mixture, is the smallest and repeats; web never finishes an epoch.
SPLITS = [split_of(0, 40_000), split_of(1_000_000, 3_000), split_of(2_000_000, 170)]
SEQ_LEN = 16


def batches(weights: list[float], rank: int = 0, world: int = 1, batch_size: int = 8, seed: int = 5) -> MixtureBatches:
    return MixtureBatches(NAMES, SPLITS, weights, SEQ_LEN, batch_size, rank, world, seed)


def dataset_of_token(token: int) -> int:
    return int(token // 1_000_000)


def test_shares_of_2000_sequences_are_within_2_points_of_the_weights() -> None:
    for seed in range(20):  # not one lucky seed: every one
        mix = batches([0.6, 0.3, 0.1], batch_size=16, seed=seed)
        counts = np.zeros(3)
        for _ in range(2000 // 16):
            x, _ = mix.next_batch()
            counts += np.bincount([dataset_of_token(t) for t in x[:, 0].tolist()], minlength=3)
        assert counts.sum() == 2000
        assert np.abs(counts / 2000 - [0.6, 0.3, 0.1]).max() <= 0.02, (seed, counts)
        assert mix.position.consumed == dict(zip(NAMES, counts.astype(int).tolist(), strict=True))
    # The choice alone, far into a long run: as close (a Weyl sequence's discrepancy grows as log n).
    picks = DatasetChoice([0.6, 0.3, 0.1], seed=1)(np.arange(10**9, 10**9 + 100_000))
    assert np.abs(np.bincount(picks, minlength=3) / 100_000 - [0.6, 0.3, 0.1]).max() < 0.001
    assert set(DatasetChoice([0.0, 1.0, 0.0], seed=1)(np.arange(1000)).tolist()) == {1}  # a 0 weight: never drawn


def test_the_same_seed_gives_the_same_order_on_1_and_2_ranks_and_another_seed_another() -> None:
    one = batches([0.6, 0.3, 0.1], batch_size=8)
    two = [batches([0.6, 0.3, 0.1], rank=r, world=2, batch_size=4) for r in (0, 1)]
    for _ in range(60):  # math (10 windows) goes through several epochs
        x1, y1 = one.next_batch()
        halves = [b.next_batch() for b in two]
        assert torch.equal(x1, torch.cat([h[0] for h in halves])) and torch.equal(y1, torch.cat([h[1] for h in halves]))
        assert torch.equal(x1[:, 1:], y1[:, :-1])
        assert one.position == two[0].position == two[1].position
    assert one.accounting()["math"]["epochs"] > 3  # the small dataset repeated, counted
    other = batches([0.6, 0.3, 0.1], batch_size=8, seed=6)
    assert not torch.equal(other.next_batch()[0], batches([0.6, 0.3, 0.1], batch_size=8).next_batch()[0])


def test_each_epoch_of_a_repeating_dataset_is_a_new_permutation_of_all_its_windows() -> None:
    mix = batches([0.0, 0.0, 1.0], batch_size=5)  # math alone: 10 windows an epoch
    seen = [mix.next_batch()[0][:, 0].tolist() for _ in range(6)]  # three epochs
    epochs = [sum(seen[2 * e : 2 * e + 2], []) for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) and len(set(e)) == 10 for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert mix.accounting() == {
        "web": {"tokens": 0, "epochs": 0.0},
        "code": {"tokens": 0, "epochs": 0.0},
        "math": {"tokens": 30 * SEQ_LEN, "epochs": 3.0},
    }


def test_a_restored_position_goes_on_exactly_and_other_weights_are_refused() -> None:
    straight = batches([0.6, 0.3, 0.1])
    expected = [straight.next_batch()[0] for _ in range(30)]
    first = batches([0.6, 0.3, 0.1])
    for _ in range(13):
        first.next_batch()
    resumed = batches([0.6, 0.3, 0.1], rank=1, world=2, batch_size=4)  # another world size: the same sequences
    resumed_too = batches([0.6, 0.3, 0.1], rank=0, world=2, batch_size=4)
    for b in (resumed, resumed_too):
        b.position.load_state_dict(first.position.state_dict())
    for step in range(13, 30):
        x = torch.cat([resumed_too.next_batch()[0], resumed.next_batch()[0]])
        assert torch.equal(x, expected[step])
    refused = r"--mixture web=0.5,code=0.4,math=0.1 differs from the mixture this run trained on \(web=0.6,"
    with pytest.raises(DataError, match=refused):
        batches([0.5, 0.4, 0.1]).position.load_state_dict(first.position.state_dict())
    reordered = MixtureBatches(
        [NAMES[1], NAMES[0], NAMES[2]], [SPLITS[1], SPLITS[0], SPLITS[2]], [0.3, 0.6, 0.1], SEQ_LEN, 8, 0, 1, 5
    )
    with pytest.raises(DataError, match=r"--mixture code=0.3,web=0.6,math=0.1 differs from the mixture this run"):
        reordered.position.load_state_dict(first.position.state_dict())  # the same weights, another order of cuts
    with pytest.raises(DataError, match="trained on one dataset, not a mixture"):
        batches([0.6, 0.3, 0.1]).position.load_state_dict(DataPosition(1, 8).state_dict())
    with pytest.raises(DataError, match="trained on a data mixture"):
        DataPosition().load_state_dict(first.position.state_dict())
    assert MixturePosition({"a": 1.0}).state_dict()["order"] == "mixture-1"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("web=0.8,code=-0.2", "the weight of 'code' is -0.2: weights are numbers of 0 or more"),
        ("web=0,code=0", "every weight is 0"),
        ("web=lots", "the weight of 'web', 'lots', is not a number"),
        ("web=nan", "the weight of 'web' is nan"),
        ("web=0.5,web=0.5", "dataset 'web' is named twice"),
        ("web", "'web' is not DATASET=WEIGHT"),
        ("=0.3", "'=0.3' is not DATASET=WEIGHT"),
    ],
)
def test_bad_weights_are_refused_in_one_line(text: str, error: str) -> None:
    with pytest.raises(ValueError, match="^--mixture: " + error.replace("(", r"\(")):
        parse_weights(text)


def test_weights_are_kept_as_given_and_a_dataset_too_short_for_a_window_is_refused() -> None:
    assert parse_weights(" web = 4, code=1 ") == [("web", 4.0), ("code", 1.0)]
    with pytest.raises(DataError, match="dataset 'math'.*not one window of 201 tokens"):
        MixtureBatches(NAMES, SPLITS, [1, 1, 1], 200, 4, 0, 1, 0)
    MixtureBatches(NAMES, SPLITS, [1, 1, 0], 200, 4, 0, 1, 0)  # unused (weight 0): no windows needed


def test_a_mixture_stopped_by_sigterm_resumes_bit_identical_with_each_datasets_tokens(
    mixed_root: Path, mixture_run: RunPaths, tmp_path: Path
) -> None:
    """Under torchrun with 2 ranks of FSDP, dropout (its masks draw from each rank's RNG) and asynchronous saves every
    5 steps (each rank staging and writing its own shards), a SIGTERM at a random step: the run stops after the step
    the ranks agree on and commits it (after the pending background save); resumed to the end, every row repeats the
    uninterrupted run's (mixture_run, which also measured each dataset's val loss: evaluating, in eval mode, changes
    nothing of the training), each dataset's tokens included. The rows' tokens add up; the plan says the shares."""
    root = tmp_path / "fsx"
    shutil.copytree(mixed_root, root)
    fsdp_async = {"TRAINER_PARALLELISM": "fsdp", "TRAINER_ASYNC_CHECKPOINT": "true"}
    stopped = tiny_launch(root, "mixed-resumed", **MIXED_RUN, extra_env=fsdp_async)
    status = preempt_at_random_step(stopped, 3, 16)
    assert status["step"] < 20
    launch(stopped)
    log_text = stopped.run_paths.rank_log(0).read_text()
    assert f"resumed at step {status['step']}" in log_text
    straight, resumed = read_metrics(mixture_run), read_metrics(stopped.run_paths)
    assert_same_rows(resumed, straight, f"after a SIGTERM at step {status['step']}")
    assert [{k: v["tokens"] for k, v in r["datasets"].items()} for r in resumed] == [
        {k: v["tokens"] for k, v in r["datasets"].items()} for r in straight
    ]
    last = straight[-1]
    assert sum(d["tokens"] for d in last["datasets"].values()) == last["tokens"] == 20 * 8 * 2 * 64
    shares = {name: d["tokens"] / last["tokens"] for name, d in last["datasets"].items()}
    assert shares == pytest.approx({"synthetic": 0.6, "code": 0.3, "math": 0.1}, abs=0.02)
    assert last["datasets"]["math"]["epochs"] > 1, "the smallest dataset repeated"
    assert "mixture: synthetic 60.0% of " in log_text and "; math 10.0% of " in log_text
    evaluated = [r for r in straight if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [10, 20]
    for row in evaluated:
        each = row["datasets"]
        assert {name for name in each if "val_loss" in each[name]} == {"synthetic", "code", "math"}
        low, high = min(d["val_loss"] for d in each.values()), max(d["val_loss"] for d in each.values())
        assert low <= row["val_loss"] <= high, "the total is the datasets' share-weighted mean"
    from pipelines.runs import read_run

    assert read_run(stopped.run_paths).dataset == "synthetic+code+math", "runs' DATA column names each dataset"
    config = json.loads(stopped.run_paths.config.read_text())
    model = config["model"]
    assert (model["resid_pdrop"], model["embd_pdrop"], model["attn_pdrop"]) == (0.1, 0.1, 0.1)
    assert [(m["dataset"], m["weight"], m["share"]) for m in config["dataset"]["mixture"]] == [
        ("synthetic", 0.6, 0.6),
        ("code", 0.3, 0.3),
        ("math", 0.1, 0.1),
    ]


def test_a_resume_with_other_weights_or_tokenizers_is_refused_in_one_line(
    mixture_run: RunPaths, tmp_path: Path
) -> None:
    """An exact resume keeps its mixture: under torchrun, other weights are bad input (exit 2) naming both, the run
    left as it was. In process, as the trainer resolves its --mixture at start: a resume without the mixture, and a
    dataset staged with another tokenizer, refused in one line each."""
    from trainer.checkpoint import Checkpoint
    from trainer.mixture import resolve_mixture

    root = tmp_path / "fsx"
    shutil.copytree(mixture_run.root.parent.parent, root, symlinks=True)
    run = RunPaths.of(root, "mixed")
    before = run.metrics.read_text()
    other = [dict(e, weight=w) for e, w in zip(MIXTURE, (0.5, 0.4, 0.1), strict=True)]
    assert refusal(tiny_launch(root, "mixed", **dict(MIXED_RUN, mixture=other), nproc_per_node=1)) == (
        "--mixture synthetic=0.5,code=0.4,math=0.1 differs from the mixture this run trained on "
        "(synthetic=0.6,code=0.3,math=0.1); an exact resume keeps its mixture: resume with it, or start a new run "
        "from this one's weights (--init-from) with the new weights"
    )
    assert run.metrics.read_text() == before and read_checkpoint(run.latest_checkpoint)["step"] == 20
    state = Checkpoint(run.latest_checkpoint.resolve(), 0).trainer_state()
    with pytest.raises(DataError, match="^this run trained on a data mixture: "):
        DataPosition().load_state_dict(state["data"])
    datasets = root / "datasets"
    kept = resolve_mixture(f"{datasets}/synthetic=0.6,{datasets}/code=0.3,{datasets}/math=0.1", state, "keep")
    assert [(e.name, e.directory.name) for e in kept] == [
        (n, s["snapshot"]) for n, s in state["data_snapshots"].items()
    ]
    stage_data(str(write_corpus(tmp_path / "other", files=2, seed=9)), str(root), "other", vocab_size=300)
    with pytest.raises(
        DataError, match="^--mixture: dataset 'other' was staged with another tokenizer than 'synthetic'"
    ):
        resolve_mixture(f"{datasets}/synthetic=1,{datasets}/other=1", None, "keep")


def refusal(cfg) -> str:
    """The one line a trainer that exits on bad input (2) leaves in status.json."""
    output, _ = start_torchrun(cfg).communicate(timeout=120)
    assert f"exitcode  : {int(ExitCode.BAD_INPUT)}" in output, output[-3000:]
    status = json.loads(cfg.run_paths.status.read_text())
    assert status["state"] == "bad-input" and "\n" not in status["error"]
    return status["error"]


def test_staging_a_mixture_gives_every_entry_the_first_ones_tokenizer_and_refuses_another(tmp_path: Path) -> None:
    """The pipeline's staging of a mixture in process (components/stage_data/mixture.py): the first entry trains the
    tokenizer, the second is staged with it, an entry without a source is its dataset as staged before; the groups'
    work items name their dataset and weight; finalizing makes each snapshot current. An entry staged before with
    another tokenizer is refused in one line when the snapshots are finalized."""
    from components.stage_data.mixture import finish_mixture, mixture_sources, plan_mixture
    from components.stage_data.settings import StageSettings
    from components.stage_data.tokenization.encode import encode_group
    from tests.helpers import snapshot_dir
    from trainer.data import load_meta
    from trainer.layout import DatasetPaths

    root = str(tmp_path / "fsx")
    web, code = write_corpus(tmp_path / "web", seed=1), write_corpus(tmp_path / "code", files=4, seed=2)
    stage_data(str(write_corpus(tmp_path / "old", files=3, seed=3)), root, "old", vocab_size=300)

    def stage(entries: list[dict]) -> list[dict]:
        sources = mixture_sources(entries)
        work = plan_mixture(
            sources,
            StageSettings.of_step(sources[0].source, root, sources[0].dataset, vocab_size=400, tokenize_groups=2),
        )
        for item in work:
            encode_group(DatasetPaths.of(root, item["dataset"]), item["snapshot"], item["group"])
        return work

    work = stage(
        [
            {"dataset": "web", "weight": 3, "source": str(web)},
            {"dataset": "code", "weight": 1, "source": f"file://{code}"},
        ]
    )
    planned = sorted((w["dataset"], w["group"], w["weight"]) for w in work)
    assert planned == [("code", 0, 1.0), ("code", 1, 1.0), ("web", 0, 3.0), ("web", 1, 3.0)]
    finished, report = finish_mixture(root, work)
    assert [(f["dataset"], f["weight"]) for f in finished] == [("web", 3.0), ("code", 1.0)]
    metas = [load_meta(snapshot_dir(Path(root), name)) for name in ("web", "code")]
    assert metas[0]["tokenizer_sha256"] == metas[1]["tokenizer_sha256"] and metas[0]["vocab_size"] <= 400
    assert [f["snapshot"] for f in finished] == [snapshot_dir(Path(root), n).name for n in ("web", "code")]
    assert "| web | 3 | 75.0% |" in report and "| code | 1 | 25.0% |" in report
    again = stage(
        [{"dataset": "web", "weight": 1, "source": str(web)}, {"dataset": "code", "weight": 1, "source": str(code)}]
    )
    assert {w["snapshot"] for w in again} == {f["snapshot"] for f in finished}, "staged again: nothing new"
    as_staged = stage([{"dataset": "code", "weight": 1}, {"dataset": "web", "weight": 1}])
    assert {w["snapshot"] for w in as_staged} == {f["snapshot"] for f in finished}
    with pytest.raises(InputError, match="^mixture: dataset 'old' was staged with another tokenizer than 'web'"):
        finish_mixture(root, stage([{"dataset": "web", "weight": 1}, {"dataset": "old", "weight": 1}]))


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"dataset": "web"}, "mixture: {'dataset': 'web'} is not {dataset, weight, source?, text_field?}"),
        ({"dataset": "web", "weight": 1, "url": "x"}, "is not {dataset, weight, source?, text_field?}"),
        ({"dataset": "web", "weight": "lots"}, "mixture: the weight of 'web', 'lots', is not a number"),
        ({"dataset": "web", "weight": True}, "mixture: the weight of 'web', True, is not a number"),
        ({"dataset": "web", "weight": -1}, "mixture: the weight of 'web' is -1.0: weights are numbers of 0 or more"),
        ({"dataset": "../web", "weight": 1}, "mixture: dataset '../web' is not a valid name"),
        ({"dataset": "web", "weight": 1, "source": "ftp://x"}, "mixture source of 'web'"),
    ],
)
def test_a_bad_mixture_entry_is_refused_in_one_line(entry: dict, error: str) -> None:
    from components.stage_data.mixture import mixture_sources

    with pytest.raises(InputError) as refused:
        mixture_sources([entry, {"dataset": "code", "weight": 1}])
    assert error in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(InputError, match="^mixture: every weight is 0"):
        mixture_sources([{"dataset": "a", "weight": 0}, {"dataset": "b", "weight": 0.0}])
    with pytest.raises(InputError, match="^mixture: dataset 'a' is named twice"):
        mixture_sources([{"dataset": "a", "weight": 1}, {"dataset": "a", "weight": 2}])


def test_the_cli_takes_a_mixture_to_the_pipeline_and_the_launcher_and_refuses_bad_ones(
    mixed_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run-local's --mixture, --mixture-source and --mixture-text-field become the pipeline's `mixture` entries;
    launch's --mixture names staged datasets, which the trainer gets as snapshot directories; bad ones are one line
    and exit 2."""
    from pipelines.cli import build_parser, main
    from pipelines.cli.run_settings import launch_config, run_local_arguments

    def parsed(*argv: str):
        return build_parser().parse_args(list(argv))

    arguments = run_local_arguments(
        parsed("run-local", "--mixture", "web=0.8,code=0.2", "--mixture-source", f"web={tmp_path}")
    )
    assert arguments["mixture"] == [
        {"dataset": "web", "weight": 0.8, "source": str(tmp_path)},
        {"dataset": "code", "weight": 0.2, "source": ""},
    ]
    assert arguments["dataset"] == "web" and arguments["source"] == ""
    code = ["--mixture-source", f"code={tmp_path}", "--mixture-text-field", "code=content", "--text-field", "body"]
    own = run_local_arguments(
        parsed("run-local", "--mixture", "web=0.8,code=0.2", "--mixture-source", f"web={tmp_path}", *code)
    )
    assert [e.get("text_field") for e in own["mixture"]] == [None, "content"]
    assert own["text_field"] == "body", "the run's, for the entries without their own"
    config = launch_config(
        parsed("launch", "--storage-root", str(mixed_root), "--run-id", "m", "--mixture", "code=1,synthetic=3")
    )
    config.validate()
    args = config.trainer_args()
    assert "--data-dir" not in args and config.dataset == "code"
    assert args[args.index("--mixture") + 1] == f"{mixed_root}/datasets/code=1.0,{mixed_root}/datasets/synthetic=3.0"
    root = tmp_path / "fsx"
    for argv, message in [
        (["run-local", "--mixture", "web=0.8,web=0.2"], "argument --mixture: dataset 'web' is named twice"),
        (["run-local", "--mixture", "web=x"], "argument --mixture: the weight of 'web', 'x', is not a number"),
        (
            ["run-local", "--mixture", "web=1", "--mixture-source", "code=/x"],
            "--mixture-source code: not a dataset of --mixture",
        ),
        (
            [
                "run-local",
                "--mixture",
                "web=1",
                "--mixture-source",
                f"web={tmp_path}",
                "--mixture-text-field",
                "code=content",
            ],
            "--mixture-text-field code: not a dataset of --mixture",
        ),
        (
            [
                "run-local",
                "--mixture",
                "web=1,code=1",
                "--mixture-source",
                f"web={tmp_path}",
                "--mixture-text-field",
                "code=content",
            ],
            "--mixture-text-field code: the dataset has no --mixture-source, so it is trained on as "
            "staged before, with the text field it was staged with",
        ),
        (
            ["run-local", "--mixture", "web=1", "--mixture-text-field", "web"],
            "argument --mixture-text-field: 'web' is not KEY=VALUE",
        ),
        (
            ["run-local", "--mixture", "web=1", "--source", str(tmp_path)],
            "--source stages one dataset, --mixture several: give each its --mixture-source instead",
        ),
        (
            ["run-local", "--mixture", "web=1,code=1", "--mixture-source", f"web={tmp_path}/none"],
            f"mixture source of 'web', {tmp_path}/none: no such file or directory",
        ),
        (
            ["run-local", "--mixture", "web=1,code=1"],
            "mixture: dataset 'web' has no source and was never staged under {root}: give its source (--mixture-source "
            "web=PATH)",
        ),
        (
            ["launch", "--run-id", "m", "--mixture", "synthetic=1,never=1"],
            f"mixture: dataset 'never' is not staged under {mixed_root}",
        ),
    ]:
        try:
            code = main([*argv, "--storage-root", str(mixed_root if argv[0] == "launch" else root)])
        except SystemExit as exc:  # argparse's own
            code = exc.code
        assert code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) <= 2 and message.format(root=root) in err[-1], err  # argparse's usage line, then ours


def test_submit_checks_a_mixture_and_renders_the_job_it_will_train() -> None:
    """`submit` and `render-job --pipeline-file` see the mixture before the run: staging's check of each entry, and
    the launcher's trainer arguments with what the finalize step will hand it (each dataset, by weight)."""
    from pipelines import COMPILED_PIPELINE
    from pipelines.package import Package

    package = Package.load(COMPILED_PIPELINE)
    image = [("trainer_image", "123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-trainer:1")]
    mixture = [
        (
            "mixture",
            json.dumps(
                [
                    {"dataset": "web", "weight": 0.8, "source": "s3://b/web/"},
                    {"dataset": "code", "weight": 0.2, "text_field": "content"},
                ]
            ),
        )
    ]
    assert package.checked(mixture + image)["mixture"][1] == {"dataset": "code", "weight": 0.2, "text_field": "content"}
    config = package.launch_config(mixture + image, "launch-pytorchjob", "run-1")
    args = config.trainer_args()
    assert config.dataset == "web" and args[:2] == ["--mixture", "/fsx/datasets/web=0.8,/fsx/datasets/code=0.2"]
    for entries, refusal in [
        ([{"dataset": "web", "weight": -1, "source": "s3://b/web/"}], "the weight of 'web' is -1.0"),
        ([{"dataset": "web", "weight": 1, "source": "ftp://b/web/"}], "mixture source of 'web' ftp://b/web/"),
        ([{"dataset": "web", "weight": 1}, {"dataset": "web", "weight": 2}], "dataset 'web' is named twice"),
    ]:
        with pytest.raises(InputError, match="^--param mixture: ") as refused:
            package.checked([("mixture", json.dumps(entries)), *image])
        assert refusal in str(refused.value)


def test_the_plan_says_when_weights_that_do_not_sum_to_1_are_scaled() -> None:
    """web=0.8,code=0.3 trains at 72.7/27.3: the plan line says so instead of scaling without a word."""
    assert "(the weights sum to" not in mixture_plan(batches([0.6, 0.3, 0.1]), 1000)
    plan = mixture_plan(batches([0.8, 0.3, 0.0]), 1000)
    assert f"{NAMES[0]} 72.7% of " in plan and f"{NAMES[1]} 27.3% of " in plan
    assert plan.endswith("(the weights sum to 1.1, not 1: each share is its weight over the sum)"), plan
