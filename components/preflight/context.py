"""What every check reads: the rendered job's facts (its pod, container, requests, annotations, the model it
trains) and the API groups to read the cluster with, and how a check tells a refused or missing read from an error."""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from components.evaluate_checkpoint.resources import EvaluationResources
from components.kube import Kube
from components.launch_training.apis import api_of
from components.launch_training.job_api import JobApi
from components.launch_training.rendering import AUTO_RESUME
from components.preflight.scheduling import pod_requests
from trainer.config import TRAIN_DEFAULTS
from trainer.layout import META
from trainer.model import config_from_dict, model_config
from trainer.snapshot import given_snapshot, model_vocab

GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
# The pipeline's default vocab_size (pipelines/pipeline.py; tests/test_preflight_checkpoint_throughput.py holds it).
ASSUMED_VOCAB = 8192


class Context:
    """The manifest's facts the checks need, the evaluate step's resources, and the API groups to read the cluster
    with."""

    def __init__(
        self,
        job: dict[str, Any],
        kube: Kube,
        api_client: Any,
        memory_gib: int,
        instance_type: str = "",
        pod: dict[str, Any] | None = None,
        runtime: dict[str, Any] | None = None,
        model: dict[str, Any] | str | None = None,
        evaluation: EvaluationResources | None = None,
    ):
        self.job, self.kube, self.memory_gib, self.instance_type = job, kube, memory_gib, instance_type
        self.model = model  # a published model's config.json (a string: why it was not read); None: a preset
        self.evaluation = evaluation or EvaluationResources()  # the evaluate step's pod (None: the default compile's)
        self.api: JobApi = api_of(job)
        self.runtime = runtime  # a TrainJob's: the ClusterTrainingRuntime the compiled pipeline expects
        self.namespace: str = job["metadata"]["namespace"]
        self.name: str = job["metadata"]["name"]
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.apiext = client.ApiextensionsV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)
        self.authn = client.AuthenticationV1Api(api_client)
        self.storage = client.StorageV1Api(api_client)
        self.min_nodes, self.max_nodes = self.api.nodes(job)
        if pod is None:  # a PyTorchJob carries its pod, as a HyperPodPyTorchJob does in its one replica group
            replicas = job["spec"].get("pytorchReplicaSpecs")
            pod = replicas["Worker"]["template"] if replicas else job["spec"]["replicaSpecs"][0]["template"]
        self.pod: dict[str, Any] = pod.get("spec") or {}
        containers = self.pod.get("containers") or []
        self.container: dict[str, Any] = next(
            (c for c in containers if c.get("name") == self.api.container), containers[0]
        )
        self.request: dict[str, Decimal] = pod_requests(self.pod)
        self.annotations: dict[str, str] = job["metadata"].get("annotations") or {}
        self.unreachable = ""  # set once the API server could not be reached: later cluster reads are skipped
        self.pvc: Any = None  # the job's claim as check_pvc read it (V1PersistentVolumeClaim), for its volume

    def model_config(self, seq_len: int) -> tuple[Any, str, int, bool]:
        """The transformers config of the model the job trains, its name in messages, its vocabulary and whether
        that is assumed: the published model's (its config.json), else the preset's at the snapshot's vocabulary
        (ASSUMED_VOCAB before the dataset is staged). ValueError: the published model's config.json was not read."""
        if isinstance(self.model, str):
            raise ValueError(self.model)
        if self.model is not None:
            config = config_from_dict(self.model)
            return config, f"the published {config.model_type} model", config.vocab_size, False
        preset = self.trainer_flag("--preset", TRAIN_DEFAULTS["preset"])
        vocab, assumed = dataset_vocab(self.trainer_flag("--data-dir", ""))
        return model_config(preset, vocab, seq_len, eos_token_id=0), preset, vocab, assumed

    def trainer_flag(self, name: str, default: Any) -> str:
        """A trainer flag's value on the container's command line (the launcher passes every one it sets)."""
        argv = [*(self.container.get("command") or []), *(self.container.get("args") or [])]
        return argv[argv.index(name) + 1] if name in argv[:-1] else str(default)

    @property
    def auto_resume(self) -> bool:
        return self.annotations.get(AUTO_RESUME) == "true"

    def volume(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((v for v in self.pod.get("volumes") or [] if predicate(v)), None)


def dataset_vocab(data_dir: str) -> tuple[int, bool]:
    """The vocabulary of the snapshot the job trains on, read where the trainer reads it (the preflight step mounts
    the same volume at the same path); (ASSUMED_VOCAB, True) before the dataset is staged."""
    # Here, not at the top: trainer.data imports torch (1.5 s), which importing the preflight should not cost.
    from trainer.errors import DataError

    if not data_dir:
        return ASSUMED_VOCAB, True
    try:
        return model_vocab(json.loads((given_snapshot(Path(data_dir)) / META).read_text())), False
    except (DataError, OSError, ValueError, KeyError, TypeError):
        return ASSUMED_VOCAB, True


def forbidden(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 403


def not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def raw_items(response: Any) -> list[dict[str, Any]]:
    """The items of a list read with _preload_content=False: plain dicts, as the API server wrote them (a cluster's
    pods deserialize into typed models many times slower)."""
    return json.loads(response.data).get("items") or []
