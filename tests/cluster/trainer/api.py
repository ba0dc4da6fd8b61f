"""Kubeflow Trainer v2.3.0's names (``pkg/constants/constants.go``, ``pkg/apis/trainer/v1alpha1/trainjob_types.go``,
``pkg/util/trainjob``), and how its controller writes what it owns: a server-side apply as field manager
``trainer``."""

from __future__ import annotations

import json
import time
from typing import Any

import kubernetes

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
CLUSTER_RUNTIMES, RUNTIMES = "clustertrainingruntimes", "trainingruntimes"
CLUSTER_RUNTIME_KIND, RUNTIME_KIND = "ClusterTrainingRuntime", "TrainingRuntime"
CLUSTER_RUNTIME_KEY = f"{CLUSTER_RUNTIME_KIND}.{GROUP}"  # schema.GroupKind.String()
RUNTIME_KEY = f"{RUNTIME_KIND}.{GROUP}"
CONTROLLER_NAME = "trainer.kubeflow.org/trainjob-controller"  # pkg/util/trainjob
FIELD_MANAGER = "trainer"
# pkg/constants/constants.go
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
SUPPORT_LABEL, SUPPORT_DEPRECATED = "trainer.kubeflow.org/support", "deprecated"
DEPRECATION_POLICY_URL = (
    "https://trainer.kubeflow.org/en/latest/operator-guides/runtime.html#runtime-deprecation-policy"
)
ANCESTOR_TRAINER, NODE = "trainer", "node"
DATASET_INITIALIZER, MODEL_INITIALIZER = "dataset-initializer", "model-initializer"
INITIALIZER_VOLUME = "initializer"
TRAINER_PORT = 29500
COMPLETION_INDEX_FIELD_PATH = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
TORCH_RESERVED_ENVS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
SUSPENDED_MESSAGE, RESUMED_MESSAGE = "TrainJob is suspended", "TrainJob is resumed"
DEADLINE_MESSAGE = "TrainJob exceeded its active deadline"
# pkg/apis/trainer/v1alpha1/trainjob_types.go
SUSPENDED, COMPLETE, FAILED = "Suspended", "Complete", "Failed"
SUSPENDED_REASON, RESUMED_REASON = "Suspended", "Resumed"
NOT_SUPPORTED_REASON, DEADLINE_REASON = "TrainingRuntimeNotSupported", "DeadlineExceeded"
SNAPSHOT_SUFFIX, SNAPSHOT_KEY = "-runtime-snapshot", "runtime"
MUTATING_CONFIGURATION, VALIDATING_CONFIGURATION = "defaulter.trainer.kubeflow.org", "validator.trainer.kubeflow.org"
DEFAULTER_WEBHOOK = "defaulter.trainjob.trainer.kubeflow.org"
VALIDATOR_WEBHOOK = "validator.trainjob.trainer.kubeflow.org"
DEFAULTER_PATH = "/mutate-trainer-kubeflow-org-v1alpha1-trainjob"
VALIDATOR_PATH = "/validate-trainer-kubeflow-org-v1alpha1-trainjob"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def server_side_apply(api: kubernetes.client.ApiClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``client.Apply(..., client.FieldOwner("trainer"), client.ForceOwnership)``: a server-side apply."""
    headers = {"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"}
    response = api.call_api(
        path,
        "PATCH",
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        header_params=headers,
        query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
    )
    return json.loads(response[0].data)
