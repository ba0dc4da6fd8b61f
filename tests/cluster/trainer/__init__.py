"""Kubeflow Trainer v2.3.0's TrainJob controller and webhooks (``trainer.kubeflow.org/v1alpha1``), played on the real
API server; the JobSet it builds is run by :mod:`tests.cluster.jobset`, the Jobs by the real Job controller.

Sources, kubeflow/trainer at tag v2.3.0 (each function names its own), and the module that plays each:
- ``pkg/controller/trainjob_controller.go``: ``Reconcile`` (``removeFailedCondition``, ``reconcileObjects``,
  ``setSuspendedCondition``, ``setTrainJobStatus``, ``reconcileDeadline``, one status merge patch): controller.py,
  with its Events in events.py.
- ``pkg/runtime/core/{trainingruntime,clustertrainingruntime,snapshot}.go``: the runtime read once and kept in the
  ``<trainjob>-runtime-snapshot`` ConfigMap the TrainJob owns, ``newRuntimeInfo`` (propagated labels and annotations,
  ``mergeRuntimePatches``' strategic merge, ``resourcesPerNode``, the pod counts), ``ValidateObjects``: runtime.py
  and build.py.
- ``pkg/runtime/framework/plugins/torch/torch.go`` ``EnforceMLPolicy`` / ``Validate``; ``plainml/plainml.go``;
  ``jobset/jobset.go`` ``SyncParallelCount``, ``Build`` (server-side apply as field manager ``trainer``, forced; not
  changed while neither the TrainJob nor the JobSet is suspended), ``Status``, ``Validate``; ``jobset/builder.go``:
  build.py (the JobSet), controller.py (``Build``'s apply, ``Status``), webhooks.py (``Validate``).
- ``pkg/webhooks/trainjob_webhook.go``: ``TrainJobDefaulter.Default`` (runtime patch times) and
  ``TrainJobValidator``, registered as in ``manifests/base/webhook`` (configurations ``defaulter.trainer.kubeflow.org``
  and ``validator.trainer.kubeflow.org``); a denial is controller-runtime's ``Denied``: 403 with the error's text
  (``field.ErrorList.ToAggregate``: one error as itself, several as ``[a, b]``): webhooks.py.
- ``pkg/constants/constants.go`` and ``pkg/apis/trainer/v1alpha1/trainjob_types.go``: names, reasons and messages:
  api.py.
pods.py finds a TrainJob's pods for the tests.

The controller polls the namespace's TrainJobs and JobSets every POLL_S and reconciles a TrainJob when it or its
JobSet changed (``Owns`` through the JobSet plugin's watch), or its deadline timer is due. Not played: initializer
jobs' env, MPI / JAX / XGBoost / Flux policies, coscheduling and Volcano, torchtune, the TrainJobStatus feature (off by
default at v2.3.0), events other than TrainJobResourcesCreationFailed, the runtimes' own webhooks and finalizers.
"""

from tests.cluster.trainer.api import (
    CLUSTER_RUNTIMES,
    COMPLETE,
    FAILED,
    GROUP,
    KIND,
    PLURAL,
    RUNTIMES,
    SUSPENDED,
    VERSION,
)
from tests.cluster.trainer.build import build_jobset
from tests.cluster.trainer.controller import TrainJobController
from tests.cluster.trainer.pods import node_pods, wait_node_pod
from tests.cluster.trainer.runtime import read_runtime, strategic_merge
from tests.cluster.trainer.webhooks import TrainerWebhooks, validate_trainjob

__all__ = [
    "CLUSTER_RUNTIMES",
    "COMPLETE",
    "FAILED",
    "GROUP",
    "KIND",
    "PLURAL",
    "RUNTIMES",
    "SUSPENDED",
    "VERSION",
    "TrainJobController",
    "TrainerWebhooks",
    "build_jobset",
    "node_pods",
    "read_runtime",
    "strategic_merge",
    "validate_trainjob",
    "wait_node_pod",
]
