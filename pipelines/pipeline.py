"""The pretraining pipeline: preflight -> stage_data -> launch_pytorchjob -> verify_nccl -> evaluate_checkpoint.

Storage paths are parameters (kfp.local ignores kfp-kubernetes settings, so a local directory can stand in for the
FSx volume). The defaults describe a cluster run; `hyperpod-pretrain run-local` overrides them. What belongs to
the platform team (the FSx PVC and its mount path, the Kueue queue, scheduling, resources, caching, retries,
timeouts, the images) comes from `PlatformOptions` at compile time and is baked into the YAML: no run can change
it. An exit step writes the run summary whatever happened (runs/<run_id>/summary.json) and deletes a PyTorchJob
that a terminated run left running.

The evaluation runs where the model fits: by default a pod of the pipeline that asks for one GPU on the training
nodes (their node selector and tolerations, the GPU's among them), which are idle once the training ended, in the
evaluator image (the trainer's CUDA torch with this project); compiled with `--evaluation-gpus 0`, a CPU pod in the
components image. Not a one-GPU job of the job API: that would be another create-follow-cancel round trip through the
launcher's machinery for one pod, a wait for Kueue's admission behind the queue's other work, and a pod that is not
KFP's, so the step's reports, metrics and model artifact would have to be carried back to a KFP step; a pipeline pod
needs none of it, and KFP already retries, times out and cancels it.

The compiled YAML needs KFP backend 2.14.0 or newer (pipelines.MIN_KFP_BACKEND): its exit step takes
`dsl.PipelineTaskFinalStatus`, which the Argo compiler of older backends rejects ("task final status not supported
yet", backend/src/v2/compiler/argocompiler/dag.go), and before 2.14 retry policies on the tasks inside the exit
handler are silently dropped.
"""

import re
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kfp import compiler, dsl
from kfp import kubernetes as k8s
from kfp.dsl.pipeline_channel import PipelineParameterChannel
from kfp.dsl.python_component import PythonComponent

from common.errors import InputError
from components.evaluate_checkpoint.benchmarks import DEFAULT_BENCHMARKS
from components.evaluate_checkpoint.component import evaluate_checkpoint
from components.evaluate_checkpoint.resources import EvaluationResources
from components.kfp_support import COMPONENTS_IMAGE, EVALUATOR_IMAGE
from components.launch_training.apis import job_api as api_named
from components.launch_training.component import launch_pytorchjob
from components.launch_training.job_api import DEFAULT_JOB_API
from components.launch_training.manifest import GPU_TOLERATION
from components.launch_training.platform import Platform
from components.preflight.component import preflight
from components.run_summary.component import summarize_run
from components.stage_data import SAMPLE_MB, VAL_FRACTION, VOCAB_SIZE
from components.stage_data.component import finalize_snapshot, stage_data, tokenize_group
from components.verify_nccl.component import verify_nccl
from pipelines import CLUSTER_DEFAULTS
from trainer.tracking import check_tracking_uri

PIPELINE_NAME = "hyperpod-pretrain"
COMPONENTS_REPOSITORY = "hyperpod-pretrain-components"
EVALUATOR_REPOSITORY = "hyperpod-pretrain-evaluator"
EVALUATION = "evaluate-checkpoint"
DEFAULT_EVALUATION = EvaluationResources()  # its default pod: one GPU (compile --evaluation-gpus/-cpu/-memory)
GPU = "nvidia.com/gpu"
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._/-][a-z0-9]+)*)?$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


@dataclass
class Images:
    """The components image the steps run in, the trainer image (the default of `trainer_image`), and the evaluator
    image the evaluation runs in on a GPU."""

    components: str = COMPONENTS_IMAGE
    trainer: str = ""  # empty: each run sets trainer_image (the local backend needs none)
    evaluator: str = EVALUATOR_IMAGE

    @classmethod
    def in_registry(cls, registry: str, tag: str = "", job_api: str = DEFAULT_JOB_API) -> "Images":
        """The three images as docker/build.sh --job-api pushes them: <registry>/<repository>:<tag>, the trainer's
        repository the one whose stack the job API's workers run."""
        registry, tag = registry.rstrip("/"), tag or version("hyperpod-pretrain")
        if not _REGISTRY.match(registry):
            raise InputError(
                f"image registry {registry!r} is not a registry host (and path), e.g. "
                "123456789012.dkr.ecr.us-east-1.amazonaws.com"
            )
        if not _TAG.match(tag):
            raise InputError(f"image tag {tag!r}: up to 128 of [A-Za-z0-9_.-], not starting with . or -")
        trainer = api_named(job_api).trainer_repository  # the job API's: HyperPod's carries the agent
        return cls(
            f"{registry}/{COMPONENTS_REPOSITORY}:{tag}",
            f"{registry}/{trainer}:{tag}",
            f"{registry}/{EVALUATOR_REPOSITORY}:{tag}",
        )


def in_image(component: PythonComponent, image: str) -> PythonComponent:
    """The component, running in `image` (KFP fixes a component's image when it is decorated)."""
    return dsl.component(component.python_func, base_image=image, install_kfp_package=False)


def inputs_for(component: PythonComponent, parameters: dict[str, Any], **wired: Any) -> dict[str, Any]:
    """A call's arguments: each input the component declares, from `wired` (other steps' outputs, compiled-in
    values, inputs of another name) or else the pipeline parameter of its name; so a setting that passes through
    is named in the component's signature and the pipeline's, not again in the call."""
    taken = {k: v for k, v in parameters.items() if isinstance(v, PipelineParameterChannel)}
    declared = component.component_spec.inputs or {}
    return {name: wired[name] if name in wired else taken[name] for name in declared if name in wired or name in taken}


TRAIN_TIMEOUT_S = int(CLUSTER_DEFAULTS["timeout_s"])  # pipelines/__init__.py says why it is finite
RETRY_BACKOFF_S = 10  # KFP waits this long before a step's first retry, doubling each time
# Every step reruns: a cache hit of stage-data (its inputs name the source, not its content) would skip a changed
# corpus, and the others' inputs (the run id, on a resume) do not say what they read either.
CACHING = False


@dataclass
class StepSettings:
    cpu: str
    memory: str
    timeout_s: int  # 0: none (the launcher has its own deadline, train_timeout_s)
    # KFP retries a failed step with exponential backoff from 10 s (kfp.local too). A step's own calls retry
    # transient errors already; these are for the pod itself (a node lost, an eviction).
    retries: int = 0
    # nvidia.com/gpu: a step with GPUs runs on the training nodes (the trainer pods' node selector and tolerations),
    # not where the other steps run.
    gpus: int = 0

    def retry_window_s(self) -> int:
        """Argo counts the backoff's maxDuration from the start of the first attempt, and gives up on a retry that
        would start past it (argoproj/argo-workflows#13044): to cover every attempt of a long step, the window holds
        them all, each up to its timeout, and the waits between them."""
        waits = sum(RETRY_BACKOFF_S * 2**i for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits + 60


@dataclass
class PlatformOptions:
    """What the platform team compiles in: the training job's settings (`job`: the job API and, for a TrainJob, its
    runtime, the FSx PVC and its mount path, which every step mounts too, the queue, the trainer pods' service account,
    tolerations, node selector, pull secrets and environment, the namespaces and registries a run may use), and what
    kfp-kubernetes and the task settings put on each step."""

    job: Platform = field(default_factory=lambda: Platform(mount_path="/fsx", namespaces=("kubeflow",)))
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)  # key, operator, value, effect
    image_pull_secrets: list[str] = field(default_factory=list)
    steps: dict[str, StepSettings] = field(
        default_factory=lambda: {
            "preflight": StepSettings("500m", "1Gi", 600),
            "stage-data": StepSettings("4", "16Gi", 6 * 3600, retries=2),  # staging resumes where it stopped
            "tokenize-data": StepSettings(
                "16", "32Gi", 6 * 3600, retries=2
            ),  # each group carries on after its last file
            "finalize-data": StepSettings("500m", "1Gi", 600, retries=2),
            "launch-pytorchjob": StepSettings("500m", "1Gi", 0),  # it re-attaches to (or replaces) its job itself
            "verify-nccl": StepSettings("1", "2Gi", 3600, retries=2),
            EVALUATION: StepSettings(
                DEFAULT_EVALUATION.cpu, DEFAULT_EVALUATION.memory, 4 * 3600, gpus=DEFAULT_EVALUATION.gpus
            ),
            "summarize-run": StepSettings("500m", "1Gi", 600),
        }
    )
    images: Images = field(default_factory=Images)
    # The mlflow_tracking_uri parameter's default: the team's MLflow tracking server (http(s):// or a SageMaker ARN).
    mlflow_tracking_uri: str = ""
    # The benchmark_data_s3_uri parameter's default: where the team mirrored the benchmarks' task data. With one, the
    # benchmarks parameter defaults to the small 0-shot suite; without, to none (nothing to score them on).
    benchmark_data_s3_uri: str = ""

    def __post_init__(self) -> None:
        try:
            check_tracking_uri(self.mlflow_tracking_uri)
        except ValueError as exc:
            raise InputError(f"--mlflow-tracking-uri: {exc}") from None
        if self.benchmark_data_s3_uri and not self.benchmark_data_s3_uri.startswith("s3://"):
            raise InputError(f"--benchmark-data-s3-uri {self.benchmark_data_s3_uri!r}: give s3://bucket/prefix")
        self.evaluation()  # a GPU count, CPU or memory the evaluation cannot run with fails the compile here

    def evaluation(self) -> EvaluationResources:
        """The evaluate step's pod, as the preflight checks the model against it."""
        settings = self.steps[EVALUATION]
        return EvaluationResources(settings.gpus, settings.cpu, settings.memory)

    def evaluate_with(self, resources: EvaluationResources) -> None:
        """Run the evaluate step with these GPUs, CPUs and memory (compile --evaluation-gpus/-cpu/-memory)."""
        self.steps[EVALUATION] = replace(
            self.steps[EVALUATION], gpus=resources.gpus, cpu=resources.cpu, memory=resources.memory
        )

    def image(self, step: str) -> str:
        """A step with GPUs runs in the evaluator image (CUDA torch); the others in the components image."""
        return self.images.evaluator if self.steps[step].gpus else self.images.components

    def described(self) -> list[str]:
        """What this compile bakes in, a line each, for the platform engineer to check before uploading."""
        job = self.job

        def listed(values: dict[str, str] | tuple[str, ...] | list[str]) -> str:
            return (
                ", ".join(f"{k}={v}" for k, v in values.items())
                if isinstance(values, dict)
                else (", ".join(str(v) for v in values))
            )

        def tolerations(values: tuple[dict[str, Any], ...] | list[dict[str, str]]) -> str:
            return ", ".join(
                f"{t.get('key', '')}{'=' + t['value'] if t.get('value') else ''}:{t.get('effect', '')}" for t in values
            )

        evaluation = self.evaluation()
        where = (
            f"{evaluation.gpus} GPU ({GPU}) on the training nodes (the trainer pods' node selector and tolerations)"
            if evaluation.on_gpu
            else "the CPU (--evaluation-gpus 0)"
        )
        return [
            f"images: components {self.images.components}; trainer {self.images.trainer or 'none (each run sets it)'};"
            f" evaluator {self.images.evaluator}; allowed registries {listed(job.registries) or 'any'}",
            f"job API: {job.job_api}"
            + (f" (ClusterTrainingRuntime {job.runtime_name})" if job.job_api == "trainjob" else "")
            + (
                f" (topology {'required' if job.topology_required else 'preferred'}: {job.topology_label or 'none'};"
                f" log monitoring rules {'compiled in' if job.hyperpod_log_rules else 'derived from the trainer'})"
                if job.job_api == "hyperpodpytorchjob"
                else ""
            ),
            f"jobs' namespaces: {listed(job.namespaces) or 'any'} (a run's namespace parameter picks one)",
            f"volume: PVC {job.pvc_name} mounted at {job.mount_path} in every step and in the job's pods",
            f"Kueue: {'queue ' + job.queue_name if job.queue_name else 'no queue'}"
            + (f", priority class {job.priority_class}" if job.priority_class else ""),
            f"trainer pods: service account {job.service_account or '(the namespace default)'}, token "
            f"{'mounted' if job.automount_service_account_token else 'not mounted'}; node selector "
            f"{listed(job.node_selector) or 'none'}; tolerations nvidia.com/gpu"
            f"{', ' + tolerations(job.tolerations) if job.tolerations else ''}; pull secrets "
            f"{listed(job.image_pull_secrets) or 'none'}; environment {listed(job.env) or 'none'}; HyperPod "
            f"health affinity {'on' if job.health_affinity else 'off'}",
            f"MLflow: {self.mlflow_tracking_uri or 'none'} by default (a run's mlflow_tracking_uri parameter)",
            f"benchmarks: {self.default_benchmarks() or 'none'} by default, their data from "
            f"{self.benchmark_data_s3_uri or 'the volume (none mirrored)'} (a run's benchmarks and "
            "benchmark_data_uri parameters)",
            f"steps: node selector {listed(self.node_selector) or 'none'}; tolerations "
            f"{tolerations(self.tolerations) or 'none'}; pull secrets {listed(self.image_pull_secrets) or 'none'}",
            f"evaluation: on {where}, {evaluation.cpu} CPUs, {evaluation.memory} memory, in {self.image(EVALUATION)}",
        ]

    def default_benchmarks(self) -> str:
        return DEFAULT_BENCHMARKS if self.benchmark_data_s3_uri else ""

    def apply(self, task: dsl.PipelineTask, step: str) -> None:
        settings = self.steps[step]
        k8s.mount_pvc(task, pvc_name=self.job.pvc_name, mount_path=self.job.mount_path)
        # A step with GPUs goes where the trainer pods go (the GPU nodes, tainted for GPU pods); the others where the
        # platform's steps run.
        node_selector = self.job.node_selector if settings.gpus else self.node_selector
        tolerations = [GPU_TOLERATION, *self.job.tolerations] if settings.gpus else self.tolerations
        for key, value in node_selector.items():
            k8s.add_node_selector(task, label_key=key, label_value=value)
        for toleration in tolerations:
            k8s.add_toleration(
                task,
                key=toleration.get("key"),
                operator=toleration.get("operator"),
                value=toleration.get("value"),
                effect=toleration.get("effect"),
                toleration_seconds=toleration.get("tolerationSeconds"),
            )
        if settings.gpus:
            task.set_accelerator_type(GPU).set_accelerator_limit(settings.gpus)
        if self.image_pull_secrets:
            k8s.set_image_pull_secrets(task, self.image_pull_secrets)
        task.set_cpu_request(settings.cpu).set_cpu_limit(settings.cpu)
        if settings.cpu.isdigit():  # the tokenizers library's thread pool, sized to the step's CPUs, not the node's
            task.set_env_variable(name="RAYON_NUM_THREADS", value=settings.cpu)
        task.set_memory_request(settings.memory).set_memory_limit(settings.memory)
        if settings.timeout_s:
            k8s.set_timeout(task, settings.timeout_s)
        if settings.retries:
            task.set_retry(
                num_retries=settings.retries,
                backoff_duration=f"{RETRY_BACKOFF_S}s",
                backoff_factor=2.0,
                backoff_max_duration=f"{settings.retry_window_s()}s",
            )
        task.set_caching_options(CACHING)


def build_pipeline(platform: PlatformOptions):
    """The pipeline, with `platform`'s settings on its steps and its images."""
    image = platform.images.components
    stage, launch = in_image(stage_data, image), in_image(launch_pytorchjob, image)
    tokenize, finalize = in_image(tokenize_group, image), in_image(finalize_snapshot, image)
    verify, evaluate = in_image(verify_nccl, image), in_image(evaluate_checkpoint, platform.image(EVALUATION))
    check, summarize = in_image(preflight, image), in_image(summarize_run, image)

    @dsl.pipeline(
        name=PIPELINE_NAME,
        description="Pretrain a causal LM with PyTorch DDP on SageMaker HyperPod (EKS). Every step runs in the "
        "components image, the evaluation on a GPU in the evaluator image (the trainer's CUDA torch); both carry kfp "
        "and this project: no step installs packages when it starts.",
    )
    def pretrain_pipeline(
        source: str = "",
        storage_root: str = platform.job.mount_path,
        dataset: str = str(CLUSTER_DEFAULTS["dataset"]),
        mixture: list = [],  # noqa: B006 - {dataset, weight, source?, text_field?} each: several datasets by weight
        include: list = ["*"],  # noqa: B006 - KFP reads the default from the signature
        exclude: list = ["__pycache__/*", "*.pyc", ".*"],  # noqa: B006
        vocab_size: int = VOCAB_SIZE,
        val_fraction: float = VAL_FRACTION,
        tokenizer_path: str = "",
        text_field: str = "",
        max_bad_records: int = 0,
        s3_endpoint_url: str = "",
        staging_workers: int = 16,
        staging_chunk_size_mb: int = 8,
        keep_deleted: bool = False,
        tokenize_workers: int = 1,
        tokenizer_sample_mb: int = SAMPLE_MB,
        init_from_run_id: str = "",
        init_from_model: str = "",
        skip_staging: bool = False,
        run_id: str = "",
        resume_run_id: str = "",
        backend: str = "kubernetes",
        nnodes: int = int(CLUSTER_DEFAULTS["nnodes"]),
        max_nodes: int = int(CLUSTER_DEFAULTS["max_nodes"]),
        nproc_per_node: int = int(CLUSTER_DEFAULTS["nproc_per_node"]),
        preset: str = str(CLUSTER_DEFAULTS["preset"]),
        max_steps: int = int(CLUSTER_DEFAULTS["max_steps"]),
        seed: int = int(CLUSTER_DEFAULTS["seed"]),
        batch_size: int = int(CLUSTER_DEFAULTS["batch_size"]),
        seq_len: int = int(CLUSTER_DEFAULTS["seq_len"]),
        lr: float = float(CLUSTER_DEFAULTS["lr"]),
        warmup_steps: int = int(CLUSTER_DEFAULTS["warmup_steps"]),
        extend_schedule: str = "",
        weight_decay: float = float(CLUSTER_DEFAULTS["weight_decay"]),
        dropout: float = float(CLUSTER_DEFAULTS["dropout"]),
        checkpoint_every: int = int(CLUSTER_DEFAULTS["checkpoint_every"]),
        log_every: int = int(CLUSTER_DEFAULTS["log_every"]),
        eval_every: int = int(CLUSTER_DEFAULTS["eval_every"]),
        checkpoint_s3_uri: str = "",
        train_timeout_s: int = TRAIN_TIMEOUT_S,
        pending_timeout_s: int = int(CLUSTER_DEFAULTS["pending_timeout_s"]),
        recovery_timeout_s: int = int(CLUSTER_DEFAULTS["recovery_timeout_s"]),
        queue_timeout_s: int = int(CLUSTER_DEFAULTS["queue_timeout_s"]),
        stall_timeout_s: int = int(CLUSTER_DEFAULTS["stall_timeout_s"]),
        preflight_warn_only: bool = False,
        trainer_image: str = platform.images.trainer,
        namespace: str = (platform.job.namespaces or ("kubeflow",))[0],
        instance_type: str = str(CLUSTER_DEFAULTS["instance_type"]),
        job_options: dict = {},  # noqa: B006 - any other manifest setting (components/launch_training/manifest.py)
        stream_logs: str = "worker-0",
        owner_reference: bool = True,
        expect_transport: str = "",
        bandwidth_fails: bool = False,
        eval_max_tokens: int = 1048576,
        eval_checkpoints: str = "latest",
        max_val_loss: float = 0.0,
        baseline_run_id: str = "",
        baseline_margin: float = 0.0,
        gate_warn_only: bool = False,
        benchmarks: str = platform.default_benchmarks(),
        benchmark_data_uri: str = platform.benchmark_data_s3_uri,
        benchmark_limit: int = 0,
        benchmark_gate: str = "",
        export_s3_uri: str = "",
        mlflow_tracking_uri: str = platform.mlflow_tracking_uri,
        mlflow_experiment: str = str(CLUSTER_DEFAULTS["mlflow_experiment"]),
    ):
        parameters = dict(locals())  # the run's parameters, which the steps take by their names
        kfp_run = {"pipeline_run_id": dsl.PIPELINE_JOB_ID_PLACEHOLDER}  # each step records the KFP run it ran in
        summary = summarize(**inputs_for(summarize, parameters, **kfp_run, job_api=platform.job.job_api))
        platform.apply(summary, "summarize-run")
        with dsl.ExitHandler(summary):
            # First: a cluster the job cannot run on fails in a minute, not after hours of staging.
            checked = check(
                **inputs_for(
                    check,
                    parameters,
                    **kfp_run,
                    image=trainer_image,
                    platform=platform.job.to_dict(),
                    evaluation=platform.evaluation().to_dict(),
                    warn_only=preflight_warn_only,
                )
            )
            platform.apply(checked, "preflight")
            staged = stage(
                **inputs_for(
                    stage,
                    parameters,
                    **kfp_run,
                    endpoint_url=s3_endpoint_url,
                    workers=staging_workers,
                    chunk_size_mb=staging_chunk_size_mb,
                    tokenize_groups=tokenize_workers,
                    skip=skip_staging,
                )
            ).after(checked)
            platform.apply(staged, "stage-data")
            with dsl.ParallelFor(staged.outputs["Output"]) as work:  # one pod per group of files, all at once
                tokenized = tokenize(**inputs_for(tokenize, parameters, **kfp_run, work=work))
                platform.apply(tokenized, "tokenize-data")
            finalized = finalize(**inputs_for(finalize, parameters, **kfp_run, work=staged.outputs["Output"])).after(
                tokenized
            )
            platform.apply(finalized, "finalize-data")
            trained = launch(
                **inputs_for(
                    launch,
                    parameters,
                    **kfp_run,
                    dataset=finalized.outputs["dataset"],  # a mixture's first
                    snapshot=finalized.outputs["snapshot"],
                    mixture=finalized.outputs["mixture"],
                    init_from_run_id=finalized.outputs["init_from"],
                    # init_from_model as given: staging copied an s3:// one to the place the launcher reads
                    timeout_s=train_timeout_s,
                    image=trainer_image,
                    platform=platform.job.to_dict(),
                )
            )
            platform.apply(trained, "launch-pytorchjob")
            verified = verify(
                **inputs_for(
                    verify,
                    parameters,
                    run_id=trained.outputs["run_id"],
                    job_name=trained.outputs["job_name"],
                    namespace=trained.outputs["namespace"],
                    job_api=platform.job.job_api,
                )
            )
            platform.apply(verified, "verify-nccl")
            evaluated = evaluate(
                **inputs_for(
                    evaluate,
                    parameters,
                    dataset=finalized.outputs["dataset"],
                    run_id=trained.outputs["run_id"],
                    max_tokens=eval_max_tokens,
                    checkpoint=eval_checkpoints,
                )
            ).after(verified)
            platform.apply(evaluated, EVALUATION)

    return pretrain_pipeline


pretrain_pipeline = build_pipeline(PlatformOptions())


def compile_pipeline(output: Path, platform: PlatformOptions | None = None) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_pipeline(platform or PlatformOptions()), str(output))
