"""What a launch is given and what it returns: `LaunchConfig` (the run's inputs, checked in one place, and what
they make: the trainer's command line and environment, the kubernetes backend's `JobSpec`) and `LaunchResult`.
"""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.launch_training.manifest import (
    GPU_TOLERATION,
    PIPELINE_RUN_LABEL,
    RUN_LABEL,
    JobSpec,
    job_name,
    label_value,
    render_job,
)
from components.launch_training.platform import TRAINER_OPTIONS, Platform, run_options
from components.run_summary.core import resolve_run_id
from components.stage_data.settings import check_source
from components.stage_data.snapshots import resolve_init_run
from trainer.config import SETTING, TRAIN_DEFAULTS, as_flags, check_setting, flag_of, run_settings
from trainer.durable import MirrorError, parse_mirror_uri
from trainer.layout import META, DatasetPaths, ModelPaths, RunPaths
from trainer.mixture import entry_weights
from trainer.tracking import check_tracking_uri

log = logging.getLogger(__name__)

BACKENDS = ("local", "kubernetes")
# The trainer's settings a run chooses, which the launcher passes on as they are (trainer/config.py declares them).
TRAIN_SETTINGS = run_settings(SETTING)
# Bounds of what a run may ask for: a typo of an extra digit fails here, not in the scheduler an hour later (the
# trainer's settings carry theirs in trainer/config.py).
LIMITS = {
    "nnodes": 1024,
    "max_nodes": 1024,
    "nproc_per_node": 64,
    "timeout_s": 90 * 24 * 3600,
    "pending_timeout_s": 30 * 24 * 3600,
    "recovery_timeout_s": 30 * 24 * 3600,
    "queue_timeout_s": 90 * 24 * 3600,
}
MAX_IMAGE_REFERENCE = 512
# The job's deadline on the operator's side (runPolicy.activeDeadlineSeconds) is the launcher's plus this margin:
# the launcher, which says more, deletes first; the operator stops the job if the launcher is gone.
OPERATOR_DEADLINE_MARGIN_S = 300


@dataclass
class LaunchConfig:
    storage_root: str
    dataset: str
    run_id: str
    snapshot: str = ""  # the dataset snapshot to train on (staging's output); "": the dataset's current one
    # several datasets, each {"dataset": name, "weight": w, "snapshot": id ("": its current one)}, trained on in
    # proportion to their weights (trainer/mixture.py); `dataset` is then the first's
    mixture: list[dict[str, Any]] = field(default_factory=list)
    init_from_run_id: str = ""  # a new run from this run's weights (a warm start); "previous": the newest finished
    resume: bool = False  # the run directory must hold a checkpoint to continue from (resume_run_id)
    # a new run from a published model's weights and architecture (preset unused): a directory on the volume, or an
    # s3:// prefix, which staging copies to its place on the volume (model_dir)
    init_from_model: str = ""
    backend: str = "local"
    nnodes: int = 1
    nproc_per_node: int = 2
    # The trainer's settings (TRAIN_SETTINGS) by name; those not given are the trainer's defaults.
    train: dict[str, Any] = field(default_factory=dict)
    timeout_s: int = 0  # 0: no deadline
    pending_timeout_s: int = 0  # kubernetes: a job that never started, pods Pending this long: failed (0: none)
    recovery_timeout_s: int = 0  # kubernetes: after it ran, below its minimum of pods this long: failed (0: none)
    queue_timeout_s: int = 0  # kubernetes: queued (suspended by Kueue) this long: failed (0: none)
    stall_timeout_s: int = 0  # no training step for this long: the job is deleted (0: derived, progress.py)
    extra_env: dict[str, str] = field(default_factory=dict)
    # s3://bucket/prefix: the trainer copies each committed checkpoint under <prefix>/<run_id>/ and fetches the
    # newest back when the volume lost it (trainer/durable.py); "": no copies
    checkpoint_s3_uri: str = ""
    s3_endpoint_url: str = ""  # an S3-compatible endpoint for those copies (the trainer's AWS_ENDPOINT_URL)
    # The cluster (backend "kubernetes"): the job is named after the KFP run, so a retried step re-attaches.
    pipeline_run_id: str = ""
    image: str = ""
    namespace: str = "kubeflow"
    instance_type: str = "p5.48xlarge"
    max_nodes: int = 0  # 0: nnodes (a fixed size); above nnodes: elastic between the two
    job_options: dict[str, Any] = field(default_factory=dict)  # any other JobSpec field, by name
    stream_logs: str = "worker-0"  # or "all", "none"
    owner_reference: bool = True  # the job is garbage-collected with the launcher's pod (KFP_POD_NAME/UID)
    platform: Platform = field(default_factory=Platform)

    def __post_init__(self) -> None:
        self.train = {name: TRAIN_DEFAULTS[name] for name in TRAIN_SETTINGS} | dict(self.train)

    @classmethod
    def of(cls, **settings: Any) -> LaunchConfig:
        """A config of flat settings: the trainer's (TRAIN_SETTINGS) go into `train`, the others are the config's."""
        train = {name: settings.pop(name) for name in TRAIN_SETTINGS if name in settings}
        return cls(**settings, train=train)

    @classmethod
    def of_step(
        cls, run_id: str, resume_run_id: str, pipeline_run_id: str, platform: dict[str, Any], **settings: Any
    ) -> LaunchConfig:
        """The config a pipeline step (the launcher's, the preflight's) makes of its inputs, whose other names are
        the config's own or the trainer's: the run directory resolved (a resume's, the one named, or the KFP run's),
        a resume marked, the compiled platform read. The CLI makes a submission's configs with it too, to check them
        beforehand."""
        return cls.of(
            run_id=resolve_run_id(run_id, resume_run_id, pipeline_run_id),
            resume=bool(resume_run_id),
            pipeline_run_id=pipeline_run_id,
            platform=Platform.from_dict(platform),
            **settings,
        )

    @property
    def dataset_paths(self) -> DatasetPaths:
        return DatasetPaths.of(self.storage_root, self.dataset)

    @property
    def data_dir(self) -> Path:
        """What the trainer is given: the snapshot named (staging's output), else the dataset's directory, whose
        current snapshot the trainer reads when it starts. (A resumed run trains on on the snapshot its checkpoint
        names, whatever this is: the trainer decides.)"""
        return self.dataset_paths.resolve_snapshot(self.snapshot) if self.snapshot else self.dataset_paths.root

    def mixture_arg(self) -> str:
        """The trainer's --mixture: each dataset's snapshot directory (or the dataset's, for its current one)."""
        parts = []
        for entry in self.mixture:
            paths = DatasetPaths.of(self.storage_root, entry["dataset"])
            directory = paths.resolve_snapshot(entry["snapshot"]) if entry.get("snapshot") else paths.root
            parts.append(f"{directory}={entry['weight']!r}")
        return ",".join(parts)

    def check_mixture(self, check_storage: bool) -> None:
        """Each entry a dataset name and a weight (numbers, none negative, not all 0, no dataset twice), staged."""
        try:
            weighed = entry_weights(self.mixture, {"snapshot"})
        except ValueError as exc:
            raise InputError(str(exc)) from None
        for entry, (dataset, _) in zip(self.mixture, weighed, strict=True):
            try:
                paths = DatasetPaths.of(self.storage_root, dataset)
                snapshot = paths.resolve_snapshot(str(entry.get("snapshot") or "")) if check_storage else None
            except ValueError as exc:
                raise InputError(f"mixture: {exc}") from None
            if check_storage and (snapshot is None or not (snapshot / META).is_file()):
                raise InputError(
                    f"mixture: dataset {dataset!r} is not staged under {self.storage_root} "
                    f"({snapshot / META if snapshot else paths.current} is missing)"
                )

    @property
    def init_run(self) -> RunPaths:
        """The warm start's origin ("previous" resolved: the newest finished run of the dataset but this one)."""
        origin = resolve_init_run(self.storage_root, self.dataset, self.init_from_run_id, self.run_id)
        return RunPaths.of(self.storage_root, origin)

    @property
    def model_dir(self) -> str:
        """The published model's directory the trainer reads: the one given, or an s3:// prefix's copy on the volume
        (where staging puts it: trainer/layout.py ModelPaths)."""
        if self.init_from_model.startswith("s3://"):
            return str(ModelPaths.of(self.storage_root, self.init_from_model).raw)
        return self.init_from_model.removeprefix("file://")

    @property
    def run_paths(self) -> RunPaths:
        return RunPaths.of(self.storage_root, self.run_id)

    @property
    def job_name(self) -> str:
        """The job's name: the same for every retry of the pipeline run's step, so a retry re-attaches."""
        return job_name(self.pipeline_run_id or self.run_id, self.run_id)

    @property
    def run_checkpoint_s3_uri(self) -> str:
        """This run's prefix under checkpoint_s3_uri ("" when there are no copies)."""
        return f"{self.checkpoint_s3_uri.rstrip('/')}/{self.run_id}" if self.checkpoint_s3_uri else ""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self, check_storage: bool = True) -> None:
        """Fail before anything starts, with one line naming the input."""
        if self.backend not in BACKENDS:
            raise InputError(f"backend {self.backend!r} is unknown: choose one of {', '.join(BACKENDS)}")
        for name in ("nnodes", "nproc_per_node"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        for name, value in self.train.items():
            if name not in TRAIN_SETTINGS:
                raise InputError(f"{name!r} is not a training setting a run chooses: {', '.join(TRAIN_SETTINGS)}")
            try:
                check_setting(name, value)
            except ValueError as exc:
                raise InputError(f"{flag_of(name)[2:]} {exc}") from None
        for name in (
            "timeout_s",
            "pending_timeout_s",
            "recovery_timeout_s",
            "queue_timeout_s",
            "stall_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise InputError(f"{name.replace('_', '-')} must be 0 (none) or positive, got {getattr(self, name)}")
        try:
            self.dataset_paths.snapshot(self.snapshot) if self.snapshot else self.dataset_paths  # checks the names
            RunPaths.of(self.storage_root, self.run_id)
            if self.init_from_run_id and self.init_from_run_id != "previous":
                RunPaths.of(self.storage_root, self.init_from_run_id)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if self.init_from_model and self.init_from_run_id:
            raise InputError(
                "init_from_run_id (a run's weights) and init_from_model (a published model's) are two "
                "starting points: give one"
            )
        if self.init_from_model:
            check_source(self.init_from_model, "init_from_model")
        if self.init_from_run_id and self.resume:
            origin = self.init_from_run_id
            raise InputError(
                f"resume_run_id continues run {self.run_id!r}; init_from_run_id {origin!r} starts a new "
                "run from another's weights: give one"
            )
        if self.checkpoint_s3_uri:
            try:
                parse_mirror_uri(self.checkpoint_s3_uri)
            except MirrorError as exc:
                raise InputError(str(exc).replace("checkpoint mirror", "checkpoint_s3_uri", 1)) from None
        try:
            check_tracking_uri(self.train["mlflow_tracking_uri"])
        except ValueError as exc:
            raise InputError(f"mlflow_tracking_uri: {exc}") from None
        if self.train["mlflow_tracking_uri"] and not self.train["mlflow_experiment"].strip():
            raise InputError("mlflow_experiment is empty: name the MLflow experiment the run goes in")
        if self.s3_endpoint_url and not self.s3_endpoint_url.startswith(("http://", "https://")):
            raise InputError(f"s3_endpoint_url {self.s3_endpoint_url!r} is not an http:// or https:// URL")
        if self.stream_logs not in ("worker-0", "all", "none"):
            raise InputError(f"stream-logs {self.stream_logs!r}: choose worker-0, all or none")
        if self.backend == "local" and self.nnodes != 1:
            raise InputError(f"nnodes {self.nnodes}: the local backend runs on one node")
        for name, limit in LIMITS.items():
            if getattr(self, name) > limit:
                raise InputError(f"{name.replace('_', '-')} {getattr(self, name)} is above the limit of {limit}")
        if self.backend == "kubernetes":
            self.check_under_mount()
            self.check_cluster_inputs()
        if self.mixture:
            self.check_mixture(check_storage)
        if check_storage and not self.mixture:
            try:
                snapshot = self.dataset_paths.resolve_snapshot(self.snapshot)
            except ValueError as exc:
                raise InputError(str(exc)) from None
            if snapshot is None or not (snapshot / META).is_file():
                missing = snapshot / META if snapshot is not None else self.dataset_paths.current
                raise InputError(
                    f"dataset {self.dataset!r} is not staged under {self.storage_root}: {missing} is missing"
                )
        if check_storage and self.resume and not self.run_paths.has_checkpoint() and not self.checkpoint_s3_uri:
            raise InputError(
                f"resume_run_id {self.run_id!r}: {self.run_paths.checkpoints} holds no checkpoint to "
                "continue from (and no checkpoint_s3_uri names a durable copy)"
            )

    def checked_job(self) -> tuple[JobSpec, dict[str, Any]]:
        """The kubernetes backend's job, its spec and manifest, checked as the launcher checks them before any API
        call, short of the storage (the dataset may not be staged yet): what preflight checks and render-job shows."""
        self.validate(check_storage=False)
        spec = self.job_spec()
        return spec, render_job(spec)

    def check_cluster_inputs(self) -> dict[str, Any]:
        """What a run gives for the cluster, against what the compiled pipeline allows, before any API call; the
        run's job options, checked."""
        if len(self.image) > MAX_IMAGE_REFERENCE or any(c.isspace() or not c.isprintable() for c in self.image):
            raise InputError(f"trainer_image {self.image[:80]!r} is not an image reference")
        if self.image:
            self.platform.check_image(self.image)
        self.platform.check_namespace(self.namespace)
        return run_options(self.job_options, self.platform.job_api)

    @property
    def mount_path(self) -> str:
        """Where the FSx PVC is mounted, in the steps and in the job's pods alike."""
        return self.platform.mount_path or self.storage_root

    def check_under_mount(self) -> None:
        """The job sees the volume at the mount path: a storage root elsewhere would not be the steps' directory,
        a model directory elsewhere not in the job's pods."""
        mount = posixpath.normpath(self.mount_path)

        def outside(path: str) -> bool:
            path = posixpath.normpath(path)
            return not posixpath.isabs(path) or (path != mount and not path.startswith(mount.rstrip("/") + "/"))

        if outside(self.storage_root):
            raise InputError(
                f"storage_root {self.storage_root!r} is outside the FSx mount path {mount!r}: every step "
                f"and the training job see PVC {self.platform.pvc_name!r} there, so the storage root must "
                f"be {mount} or a directory under it"
            )
        if self.init_from_model and outside(self.model_dir):
            raise InputError(
                f"init_from_model {self.init_from_model!r} is outside the FSx mount path {mount!r}, where "
                "the training job's pods see the volume: put the model there, or give its s3:// prefix "
                "(staging copies it there)"
            )

    def unsaid_settings(self) -> set[str]:
        unsaid = set()
        if self.init_from_model:
            unsaid.add("preset")
        if not self.train["mlflow_tracking_uri"]:
            unsaid.add("mlflow_experiment")
        return unsaid

    def trainer_args(self) -> list[str]:
        """The trainer's command line, the same for every backend."""
        return [
            *(["--mixture", self.mixture_arg()] if self.mixture else ["--data-dir", str(self.data_dir)]),
            *(["--init-from", str(self.init_run.root)] if self.init_from_run_id else []),
            *(["--init-from-model", self.model_dir] if self.init_from_model else []),
            "--run-dir",
            str(self.run_paths.root),
            *(["--checkpoint-s3-uri", self.run_checkpoint_s3_uri] if self.checkpoint_s3_uri else []),
            # the run's settings, but for those that would say nothing: a published model's config.json gives the
            # architecture, not a preset; an experiment matters only to a tracking server the run names (one the
            # platform's environment names keeps the environment's experiment too)
            *as_flags({k: v for k, v in self.train.items() if k not in self.unsaid_settings()}),
            *as_flags({key: value for key, value in self.job_options.items() if key in TRAINER_OPTIONS}),
        ]

    def trainer_env(self) -> dict[str, str]:
        """NCCL logs at INFO; the trainer writes the lines per process and attempt onto the volume, where
        verify_nccl finds them after the pods are gone. The S3 endpoint, if any, for the checkpoint copies (boto3
        reads AWS_ENDPOINT_URL; credentials come from the pods' IAM role)."""
        return {
            "NCCL_DEBUG": "INFO",  # the trainer points NCCL_DEBUG_FILE at <run>/nccl/attempt-NNNN/ itself
            **({"AWS_ENDPOINT_URL": self.s3_endpoint_url} if self.s3_endpoint_url else {}),
            **self.extra_env,
        }

    def job_spec(self) -> JobSpec:
        """The job's parameters: the trainer's command and environment, the run's options (RUN_OPTIONS only) and
        the platform team's settings."""
        if not self.image:
            raise InputError(
                "the trainer image is empty (--image; a pipeline's trainer_image): the kubernetes "
                "backend needs one (docker/build.sh builds and pushes it)"
            )
        options = self.check_cluster_inputs()  # also for a spec rendered without validate() (render-job)
        platform = self.platform
        run_labels = {RUN_LABEL: label_value(self.run_id), PIPELINE_RUN_LABEL: label_value(self.pipeline_run_id)}
        return JobSpec(
            name=self.job_name,
            image=self.image,
            trainer_args=self.trainer_args(),
            job_api=platform.job_api,
            runtime_name=platform.runtime_name,
            namespace=self.namespace,
            instance_type=self.instance_type,
            min_nodes=self.nnodes,
            max_nodes=self.max_nodes or self.nnodes,
            nproc_per_node=self.nproc_per_node,
            mount_path=self.mount_path,  # where the steps mount it: the trainer's paths mean the same files
            pvc_name=platform.pvc_name,
            queue_name=platform.queue_name,
            priority_class=platform.priority_class,
            service_account=platform.service_account,
            automount_service_account_token=platform.automount_service_account_token,
            tolerations=[GPU_TOLERATION, *platform.tolerations],
            health_affinity=platform.health_affinity,
            node_selector=dict(platform.node_selector),
            image_pull_secrets=list(platform.image_pull_secrets),
            env={**platform.env, **self.trainer_env()},
            topology_label=platform.topology_label,
            topology_required=platform.topology_required,
            log_rules=platform.hyperpod_log_rules or None,
            log_every=self.train["log_every"],
            labels={k: v for k, v in run_labels.items() if v},
            active_deadline_s=self.timeout_s + OPERATOR_DEADLINE_MARGIN_S if self.timeout_s else 0,
            owner=self.owner() if self.owner_reference else None,
            **{key: value for key, value in options.items() if key not in TRAINER_OPTIONS},  # those: trainer_args
        )

    def owner(self) -> tuple[str, str] | None:
        """The launcher's own pod, when it runs as a KFP step in the job's namespace (owners cannot cross them)."""
        name, uid = os.environ.get("KFP_POD_NAME"), os.environ.get("KFP_POD_UID")
        try:
            pod_namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
        except OSError:
            pod_namespace = ""
        if not (name and uid):
            return None
        if pod_namespace != self.namespace:
            log.warning(
                "no ownerReference: the launcher's pod runs in namespace %r, the job in %r",
                pod_namespace,
                self.namespace,
            )
            return None
        return name, uid


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass
class LaunchResult:
    run_id: str
    run_dir: str
    backend: str
    world_size: int
    seconds: float
    job_name: str = ""
    job_kind: str = ""  # PyTorchJob or TrainJob
    namespace: str = ""
    state: str = ""
    reattached: bool = False
    attempt: int = 1  # kubernetes: 1, then +1 each time a failed job of this run was replaced (a retried run)
    trainer_attempt: int = 0  # the trainer's last start (status.json): every restart or resize counts, 0: unknown
    queued_s: float | None = None
    running_s: float | None = None
    restarts: int = 0
    diagnosis: list[str] = field(default_factory=list)  # symptoms seen while the job ran, one line each
    # the training as KFP's run comparison shows it (the step's metrics), from metrics.jsonl: training_figures
    final_loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    tokens_seen: int | None = None
