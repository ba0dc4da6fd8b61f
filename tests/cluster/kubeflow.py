"""A full Kubeflow install's RBAC and its profile controller, played on the real API server.

- Kubeflow's aggregated ClusterRoles, as the platform's manifests install them: kubeflow-admin, -edit and -view and
  the Kubernetes rules aggregated into them (kubeflow/manifests v1.11.0 common/kubeflow-roles/base/cluster-roles.yaml);
  the Training Operator's kubeflow-training-edit and -view (kubeflow/training-operator v1.8.1
  manifests/overlays/kubeflow/kubeflow-training-roles.yaml); Kubeflow Trainer's kubeflow-trainer-admin, -edit and
  -view and kubeflow-trainer-view-cluster-runtimes, bound to every authenticated user (kubeflow/trainer v2.3.0
  manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml). The aggregation itself is the real controller
  manager's (clusterrole-aggregation-controller): kubeflow-edit holds what the labels select, as on a cluster.
- KFP's multi-user roles, aggregated into kubeflow-edit and -view the same way (kubeflow/pipelines 2.17.0
  manifests/kustomize/base/installs/multi-user/view-edit-cluster-roles.yaml).
- A profile's namespace as the profile controller leaves it (kubeflow/dashboard v2.0.0
  components/profile-controller/controllers/profile_controller.go, Reconcile and updateServiceAccount): the namespace
  with the owner annotation, istio-injection and the kubeflow overlay's labels (manifests/kustomize/overlays/kubeflow/
  namespace-labels-kubeflow.yaml), the service accounts default-editor and default-viewer bound to kubeflow-edit and
  kubeflow-view by RoleBindings of their own names, and namespaceAdmin binding the owner to kubeflow-admin. The
  controller also owns these objects through the Profile (its CRD is not installed here: no owner references) and
  writes an Istio AuthorizationPolicy (no Istio here: nothing reads it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import ControlPlane

AGGREGATE = "rbac.authorization.kubeflow.org/aggregate-to-"
GET_LIST_WATCH = ("get", "list", "watch")
WRITE = ("create", "delete", "deletecollection", "patch", "update")


def _rule(groups: tuple[str, ...], resources: tuple[str, ...], verbs: tuple[str, ...]) -> dict[str, Any]:
    return {"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}


def _role(name: str, rules: list[dict[str, Any]], into: tuple[str, ...] = (), aggregates: str = "") -> dict[str, Any]:
    """A ClusterRole aggregated into the roles ``into`` (by their labels); ``aggregates``: what it gathers."""
    role: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {f"{AGGREGATE}{r}": "true" for r in into}},
        "rules": rules,
    }
    if aggregates:
        role["aggregationRule"] = {"clusterRoleSelectors": [{"matchLabels": {f"{AGGREGATE}{aggregates}": "true"}}]}
    return role


KUBEFLOW_ROLES: tuple[dict[str, Any], ...] = (
    # common/kubeflow-roles
    _role("kubeflow-admin", [], aggregates="kubeflow-admin"),
    _role("kubeflow-edit", [], into=("kubeflow-admin",), aggregates="kubeflow-edit"),
    _role("kubeflow-view", [], into=("kubeflow-edit",), aggregates="kubeflow-view"),
    _role(
        "kubeflow-kubernetes-admin",
        [
            _rule(("authorization.k8s.io",), ("localsubjectaccessreviews",), ("create",)),
            _rule(("rbac.authorization.k8s.io",), ("rolebindings", "roles"), (*WRITE, *GET_LIST_WATCH)),
        ],
        into=("kubeflow-admin",),
    ),
    _role(
        "kubeflow-kubernetes-edit",
        [
            _rule(
                ("",),
                ("pods/attach", "pods/exec", "pods/portforward", "pods/proxy", "secrets", "services/proxy"),
                GET_LIST_WATCH,
            ),
            _rule(("",), ("serviceaccounts",), ("impersonate",)),
            _rule(("",), ("pods", "pods/attach", "pods/exec", "pods/portforward", "pods/proxy"), WRITE),
            _rule(
                ("",),
                (
                    "configmaps",
                    "endpoints",
                    "persistentvolumeclaims",
                    "replicationcontrollers",
                    "replicationcontrollers/scale",
                    "secrets",
                    "serviceaccounts",
                    "services",
                    "services/proxy",
                ),
                WRITE,
            ),
            _rule(
                ("apps",),
                (
                    "daemonsets",
                    "deployments",
                    "deployments/rollback",
                    "deployments/scale",
                    "replicasets",
                    "replicasets/scale",
                    "statefulsets",
                    "statefulsets/scale",
                ),
                WRITE,
            ),
            _rule(("autoscaling",), ("horizontalpodautoscalers",), WRITE),
            _rule(("batch",), ("cronjobs", "jobs"), WRITE),
            _rule(
                ("extensions",),
                (
                    "daemonsets",
                    "deployments",
                    "deployments/rollback",
                    "deployments/scale",
                    "ingresses",
                    "networkpolicies",
                    "replicasets",
                    "replicasets/scale",
                    "replicationcontrollers/scale",
                ),
                WRITE,
            ),
            _rule(("policy",), ("poddisruptionbudgets",), WRITE),
            _rule(("networking.k8s.io",), ("ingresses", "networkpolicies"), WRITE),
        ],
        into=("kubeflow-edit",),
    ),
    _role(
        "kubeflow-kubernetes-view",
        [
            _rule(
                ("",),
                (
                    "configmaps",
                    "endpoints",
                    "persistentvolumeclaims",
                    "persistentvolumeclaims/status",
                    "pods",
                    "replicationcontrollers",
                    "replicationcontrollers/scale",
                    "serviceaccounts",
                    "services",
                    "services/status",
                ),
                GET_LIST_WATCH,
            ),
            _rule(
                ("",),
                (
                    "bindings",
                    "events",
                    "limitranges",
                    "namespaces/status",
                    "pods/log",
                    "pods/status",
                    "replicationcontrollers/status",
                    "resourcequotas",
                    "resourcequotas/status",
                ),
                GET_LIST_WATCH,
            ),
            _rule(("",), ("namespaces",), GET_LIST_WATCH),
            _rule(
                ("apps",),
                (
                    "controllerrevisions",
                    "daemonsets",
                    "daemonsets/status",
                    "deployments",
                    "deployments/scale",
                    "deployments/status",
                    "replicasets",
                    "replicasets/scale",
                    "replicasets/status",
                    "statefulsets",
                    "statefulsets/scale",
                    "statefulsets/status",
                ),
                GET_LIST_WATCH,
            ),
            _rule(("autoscaling",), ("horizontalpodautoscalers", "horizontalpodautoscalers/status"), GET_LIST_WATCH),
            _rule(("batch",), ("cronjobs", "cronjobs/status", "jobs", "jobs/status"), GET_LIST_WATCH),
            _rule(
                ("extensions",),
                (
                    "daemonsets",
                    "daemonsets/status",
                    "deployments",
                    "deployments/scale",
                    "deployments/status",
                    "ingresses",
                    "ingresses/status",
                    "networkpolicies",
                    "replicasets",
                    "replicasets/scale",
                    "replicasets/status",
                    "replicationcontrollers/scale",
                ),
                GET_LIST_WATCH,
            ),
            _rule(("policy",), ("poddisruptionbudgets", "poddisruptionbudgets/status"), GET_LIST_WATCH),
            _rule(("networking.k8s.io",), ("ingresses", "ingresses/status", "networkpolicies"), GET_LIST_WATCH),
        ],
        into=("kubeflow-view",),
    ),
    # the Training Operator's kubeflow overlay
    _role("kubeflow-training-admin", [], into=("kubeflow-admin",), aggregates="kubeflow-training-admin"),
    _role(
        "kubeflow-training-edit",
        [
            _rule(
                ("kubeflow.org",),
                ("mpijobs", "tfjobs", "pytorchjobs", "mxjobs", "xgboostjobs", "paddlejobs"),
                ("create", "delete", "get", "list", "patch", "update", "watch"),
            ),
            _rule(
                ("kubeflow.org",),
                (
                    "mpijobs/status",
                    "tfjobs/status",
                    "pytorchjobs/status",
                    "mxjobs/status",
                    "xgboostjobs/status",
                    "paddlejobs/status",
                ),
                ("get",),
            ),
            _rule(("",), ("persistentvolumeclaims",), ("create", "delete", "get", "list", "watch")),
            _rule(("",), ("events",), GET_LIST_WATCH),
        ],
        into=("kubeflow-edit", "kubeflow-training-admin"),
    ),
    _role(
        "kubeflow-training-view",
        [
            _rule(
                ("kubeflow.org",),
                ("mpijobs", "tfjobs", "pytorchjobs", "mxjobs", "xgboostjobs", "paddlejobs"),
                GET_LIST_WATCH,
            ),
            _rule(
                ("kubeflow.org",),
                (
                    "mpijobs/status",
                    "tfjobs/status",
                    "pytorchjobs/status",
                    "mxjobs/status",
                    "xgboostjobs/status",
                    "paddlejobs/status",
                ),
                ("get",),
            ),
        ],
        into=("kubeflow-view",),
    ),
    # Kubeflow Trainer's kubeflow-platform overlay
    _role("kubeflow-trainer-admin", [], into=("kubeflow-admin",), aggregates="kubeflow-trainer-admin"),
    _role(
        "kubeflow-trainer-edit",
        [
            _rule(("trainer.kubeflow.org",), ("trainingruntimes",), GET_LIST_WATCH),
            _rule(("trainer.kubeflow.org",), ("trainjobs",), ("create", "patch", "get", "list", "watch", "delete")),
            _rule(("",), ("pods", "pods/log", "events"), GET_LIST_WATCH),
        ],
        into=("kubeflow-edit", "kubeflow-trainer-admin"),
    ),
    _role(
        "kubeflow-trainer-view",
        [
            _rule(("trainer.kubeflow.org",), ("trainingruntimes", "trainjobs"), GET_LIST_WATCH),
        ],
        into=("kubeflow-view", "kubeflow-trainer-view"),
    ),
    _role(
        "kubeflow-trainer-view-cluster-runtimes",
        [
            _rule(("trainer.kubeflow.org",), ("clustertrainingruntimes",), GET_LIST_WATCH),
        ],
    ),
    # KFP's (kubeflow/pipelines 2.17.0 manifests/kustomize/base/installs/multi-user/view-edit-cluster-roles.yaml):
    # what its API server's SubjectAccessReviews ask for (tests/kfp_server/ KubernetesAuthorizer)
    _role("kubeflow-pipelines-edit", [], into=("kubeflow-edit",), aggregates="kubeflow-pipelines-edit"),
    _role(
        "kubeflow-pipelines-view",
        [],
        into=("kubeflow-pipelines-edit", "kubeflow-view"),
        aggregates="kubeflow-pipelines-view",
    ),
    _role(
        "aggregate-to-kubeflow-pipelines-edit",
        [
            _rule(("pipelines.kubeflow.org",), ("pipelines", "pipelineversions"), ("create", "delete", "update")),
            _rule(("pipelines.kubeflow.org",), ("experiments",), ("archive", "create", "delete", "unarchive")),
            _rule(
                ("pipelines.kubeflow.org",),
                ("runs",),
                ("archive", "create", "delete", "retry", "terminate", "unarchive", "reportMetrics", "readArtifact"),
            ),
            _rule(("pipelines.kubeflow.org",), ("jobs",), ("create", "delete", "disable", "enable")),
            _rule(("kubeflow.org",), ("scheduledworkflows",), ("*",)),
            _rule(
                ("argoproj.io",),
                (
                    "cronworkflows",
                    "cronworkflows/finalizers",
                    "workflows",
                    "workflows/finalizers",
                    "workfloweventbindings",
                    "workflowtemplates",
                    "workflowtaskresults",
                ),
                ("*",),
            ),
        ],
        into=("kubeflow-pipelines-edit",),
    ),
    _role(
        "aggregate-to-kubeflow-pipelines-view",
        [
            _rule(
                ("pipelines.kubeflow.org",), ("pipelines", "pipelineversions", "experiments", "jobs"), ("get", "list")
            ),
            _rule(("pipelines.kubeflow.org",), ("runs",), ("get", "list", "readArtifact")),
            _rule(("kubeflow.org",), ("viewers",), ("create", "get", "delete")),
            _rule(("pipelines.kubeflow.org",), ("visualizations",), ("create",)),
        ],
        into=("kubeflow-pipelines-view",),
    ),
)
# Bound to system:authenticated: every account of the session holds it while it exists, so it is made by
# kubeflow_install() and removed after the tests that need it (the others measure deploy/ without it).
EVERYONE_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "ClusterRoleBinding",
    "metadata": {"name": "kubeflow-trainer-view-cluster-runtimes"},
    "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "kubeflow-trainer-view-cluster-runtimes",
    },
    "subjects": [{"kind": "Group", "name": "system:authenticated", "apiGroup": "rbac.authorization.k8s.io"}],
}
PROFILE_LABELS = {
    "istio-injection": "enabled",
    "app.kubernetes.io/part-of": "kubeflow-profile",
    "katib.kubeflow.org/metrics-collector-injection": "enabled",
    "pipelines.kubeflow.org/enabled": "true",
    "serving.kubeflow.org/inferenceservice": "enabled",
}
EDITOR, VIEWER = "default-editor", "default-viewer"


def _create(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except ApiException as exc:
        if exc.status != 409:
            raise


@contextlib.contextmanager
def kubeflow_install(plane: ControlPlane) -> Any:
    """Kubeflow's ClusterRoles (kept: bound to nobody but through a profile) and the everyone binding (removed at the
    end), once kubeflow-edit has aggregated what it should."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
    for role in KUBEFLOW_ROLES:
        _create(rbac.create_cluster_role, role)
    _create(rbac.create_cluster_role_binding, EVERYONE_BINDING)
    deadline = time.monotonic() + 30
    while not {"trainjobs", "jobs"} <= {
        res for r in rbac.read_cluster_role("kubeflow-edit").rules or [] for res in r.resources or []
    }:
        if time.monotonic() > deadline:
            raise RuntimeError("kubeflow-edit not aggregated within 30s: is clusterrole-aggregation-controller on?")
        time.sleep(0.1)
    try:
        yield
    finally:
        with contextlib.suppress(ApiException):
            rbac.delete_cluster_role_binding(EVERYONE_BINDING["metadata"]["name"])


@dataclass(frozen=True)
class Profile:
    namespace: str
    owner: str
    editor_token: str  # default-editor's, from the TokenRequest API

    @property
    def editor(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{EDITOR}"


def make_profile(plane: ControlPlane, name: str, owner: str = "user@example.com") -> Profile:
    """The namespace ``name`` as the profile controller makes it for a Profile owned by the user ``owner``."""
    core = kubernetes.client.CoreV1Api(plane.admin)
    core.create_namespace({"metadata": {"name": name, "annotations": {"owner": owner}, "labels": PROFILE_LABELS}})
    rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
    for account, role in ((EDITOR, "kubeflow-edit"), (VIEWER, "kubeflow-view")):
        core.create_namespaced_service_account(name, {"metadata": {"name": account}})
        rbac.create_namespaced_role_binding(
            name,
            {
                "metadata": {"name": account, "namespace": name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": name}],
            },
        )
    rbac.create_namespaced_role_binding(
        name,
        {
            "metadata": {"name": "namespaceAdmin", "namespace": name, "annotations": {"user": owner, "role": "admin"}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kubeflow-admin"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": owner}],
        },
    )
    return Profile(name, owner, plane.token_of(name, EDITOR))
