"""KFP wrapper of evaluate_checkpoint (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def evaluate_checkpoint(
    storage_root: str,
    dataset: str,
    run_id: str,
    max_tokens: int,
    checkpoint: str,
    max_val_loss: float,
    baseline_run_id: str,
    baseline_margin: float,
    gate_warn_only: bool,
    benchmarks: str,
    benchmark_data_uri: str,
    benchmark_limit: int,
    benchmark_gate: str,
    export_s3_uri: str,
    s3_endpoint_url: str,
    report: dsl.Output[dsl.Markdown],
    html_report: dsl.Output[dsl.HTML],
    metrics: dsl.Output[dsl.Metrics],
    model: dsl.Output[dsl.Model],
):
    """Val loss, perplexity and bits/byte of the checkpoints `checkpoint` names ('latest', 'unevaluated', or steps
    "100,200"), each against the model it started from; the benchmarks asked for (lm-evaluation-harness); the quality
    gate and the Hugging Face export of the newest evaluated, whose result the outputs hold (every one is kept under
    <run>/eval/)."""
    import shutil
    from pathlib import Path

    from components.evaluate_checkpoint.benchmarks import BenchmarkSettings
    from components.evaluate_checkpoint.checkpoints import evaluate_checkpoints
    from components.evaluate_checkpoint.gate import Gate
    from components.evaluate_checkpoint.loading import steady_host_memory
    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step
    from trainer.layout import RunPaths

    setup_logging()
    steady_host_memory()
    run_paths = RunPaths.of(storage_root, run_id)
    with recorded_step(
        storage_root,
        run_id,
        "evaluate-checkpoint",
        {"report": report.uri, "html": html_report.uri, "volume": str(run_paths.eval_html)},
    ) as record:
        gate = Gate(
            max_val_loss=max_val_loss,
            baseline_run_id=baseline_run_id,
            baseline_margin=baseline_margin,
            benchmarks=benchmark_gate,
            warn_only=gate_warn_only,
        )
        results = evaluate_checkpoints(
            storage_root=storage_root,
            dataset=dataset,
            run_id=run_id,
            max_tokens=max_tokens,
            checkpoints=checkpoint,
            gate=gate,
            export_s3_uri=export_s3_uri,
            s3_endpoint_url=s3_endpoint_url,
            benchmarks=BenchmarkSettings(benchmarks, benchmark_data_uri, benchmark_limit),
        )
        result = results[-1]  # the newest step evaluated: the gated and exported one
        with open(report.path, "w") as f:
            f.write(result.markdown())
        # this evaluation's own report: eval/report.html holds the newest evaluated step's, which may be another
        shutil.copyfile(Path(result.report_dir) / "report.html", html_report.path)
        record.reports["volume"] = str(Path(result.report_dir) / "report.html")
        log_numbers(metrics, result.metrics())
        model.metadata.update(
            {
                "path": result.export_dir,
                "format": "huggingface-safetensors",
                "step": result.step,
                "s3_uri": result.export_s3_uri,
            }
        )
        with open(model.path, "w") as f:  # the export stays on the volume; the artifact says where
            f.write(result.export_dir + "\n")
        record.details = {
            "step": result.step,
            "val_loss": round(result.val_loss, 4),
            "gate_passed": result.gate_passed,
            "evaluated_steps": [r.step for r in results],
        }
