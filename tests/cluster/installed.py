"""What a HyperPod cluster holds before a run, written on the real API server as the components that own it write it.

The preflight reads these; nothing here runs a job. Each kind, as its owner leaves it (kubernetes/kubernetes v1.36
unless named):
- Nodes: labels and ``status`` as the kubelet reports them (``pkg/kubelet/kubelet_node_status.go``), HyperPod's health
  labels (``sagemaker.amazonaws.com/node-health-status``, ``.../deep-health-check-status``: the HyperPod health agent),
  and the node lifecycle controller's taints (``pkg/controller/nodelifecycle``: ``not-ready``/``unreachable``,
  ``unschedulable`` for a cordoned node). Admission's ``TaintNodesByCondition`` puts ``not-ready:NoSchedule`` on every
  new Node; a Ready node has it lifted, as the lifecycle controller does (``../shared/k8s/README.md``).
- Pods of other teams: bound at create (``spec.nodeName``), their status as the kubelet writes it.
- DaemonSets and Deployments: ``status`` as their controllers write it (``pkg/controller/daemon``
  ``updateDaemonSetStatus``, ``pkg/controller/deployment`` ``syncDeploymentStatus``); the device plugins as HyperPod
  installs them in kube-system; the Training Operator as its manifests or HyperPod's chart install it; the HyperPod
  training operator's Deployment in aws-hyperpod under the name we take it to have (``add_hyperpod_operator``).
- FSx for Lustre volumes as dynamic provisioning leaves them: the PVC made, the CSI provisioner's PV ``pvc-<uid>``
  (kubernetes-csi/external-provisioner ``makeVolumeName``) with the FSx CSI driver's volume context (``dnsname``,
  ``mountname``: kubernetes-sigs/aws-fsx-csi-driver ``pkg/driver/controller.go``), and the PV controller's binding
  (``pkg/controller/volume/persistentvolume/pv_controller.go`` ``bind``: the PVC's ``volumeName``, the PV's
  ``claimRef`` with the PVC's uid, both Bound).

Names of cluster-scoped objects carry the test's tag, so that nothing one test leaves can be read by another; all a
test made is removed by :meth:`Installed.close` (pods with grace 0: no kubelet would ever finish their deletion).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import ControlPlane

GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH_LABEL = "sagemaker.amazonaws.com/deep-health-check-status"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
# Allocatable resources of HyperPod instance types (8 GPUs each; EFA devices as in DESIGN.md), and a system node's.
INSTANCE_RESOURCES: dict[str, dict[str, str]] = {
    "ml.p5.48xlarge": {"cpu": "192", "memory": "2063937952Ki", GPU: "8", EFA: "32"},
    "ml.p5en.48xlarge": {"cpu": "192", "memory": "2063937952Ki", GPU: "8", EFA: "16"},
}
CPU_NODE_RESOURCES = {"cpu": "8", "memory": "31669808Ki"}
# The device plugins (HyperPod installs both in kube-system) and the Training Operator (kubeflow/training-operator
# manifests/base/deployment.yaml; HyperPod's chart, aws/sagemaker-hyperpod-cli helm_chart/HyperPodHelmChart/charts/
# training-operators, names it after the release and keeps the label).
EFA_PLUGIN = "aws-efa-k8s-device-plugin-daemonset"
EFA_PLUGIN_IMAGE = "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.6"
NVIDIA_PLUGIN = "nvidia-device-plugin-daemonset"
NVIDIA_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.16.2"
OPERATOR_LABELS = {"control-plane": "kubeflow-training-operator"}
# The SageMaker HyperPod training operator (the EKS add-on amazon-sagemaker-hyperpod-training-operator) runs in
# aws-hyperpod (AWS, "Using the HyperPod training operator"). AWS publishes neither its Deployment's name nor its image:
# the name here is its ServiceMonitor's (hyperpod-training-operator: "Using the training operator to run jobs",
# Monitoring), which is what the preflight assumes the Deployment's contains; the image's registry and repository
# are stand-ins, only its tag is read.
HYPERPOD_OPERATOR_NAMESPACE, HYPERPOD_OPERATOR_DEPLOYMENT = "aws-hyperpod", "hyperpod-training-operator"
HYPERPOD_OPERATOR_IMAGE = "registry.example.com/hyperpod/hyperpod-training-operator"
# Kubeflow Trainer v2.3.0 as its manifests install it (kubeflow/trainer
# manifests/overlays/manager/kustomization.yaml: namespace kubeflow-system, image tag v2.3.0, the ConfigMap
# kubeflow-trainer-public; manifests/base/manager/manager.yaml: the Deployment, its labels and its container
# "manager"), with the JobSet v0.12.0 it pulls in
# (manifests/third-party/jobset: the JobSet release manifests, namespace removed so that the overlay's applies;
# kubernetes-sigs/jobset config/default/kustomization.yaml namePrefix "jobset-" and commonLabels over
# config/components/manager/manager.yaml).
TRAINER_NAMESPACE = "kubeflow-system"
TRAINER_DEPLOYMENT = "kubeflow-trainer-controller-manager"
TRAINER_IMAGE = "ghcr.io/kubeflow/trainer/trainer-controller-manager"
TRAINER_LABELS = {
    "app.kubernetes.io/name": "trainer",
    "app.kubernetes.io/component": "manager",
    "app.kubernetes.io/part-of": "kubeflow",
}
TRAINER_PUBLIC_CONFIGMAP, TRAINER_VERSION_KEY = "kubeflow-trainer-public", "kubeflow_trainer_version"
JOBSET_DEPLOYMENT, JOBSET_IMAGE = "jobset-controller-manager", "registry.k8s.io/jobset/jobset"
JOBSET_LABELS = {
    "control-plane": "controller-manager",
    "app.kubernetes.io/name": "jobset",
    "app.kubernetes.io/instance": "jobset",
    "app.kubernetes.io/component": "manager",
    "app.kubernetes.io/created-by": "jobset",
    "app.kubernetes.io/part-of": "jobset",
    "app.kubernetes.io/managed-by": "kustomize",
}
# Kubeflow Trainer's grant of its public ConfigMap to every authenticated user (manifests/base/rbac/
# public_configmap_role.yaml and public_configmap_role_binding.yaml, in the overlay's namespace): the Trainer SDK, and
# the preflight, read the release there.
TRAINER_PUBLIC_ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": TRAINER_PUBLIC_CONFIGMAP},
    "rules": [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [TRAINER_PUBLIC_CONFIGMAP],
            "verbs": ["get", "list", "watch"],
        }
    ],
}
TRAINER_PUBLIC_BINDING = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "RoleBinding",
    "metadata": {"name": TRAINER_PUBLIC_CONFIGMAP},
    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TRAINER_PUBLIC_CONFIGMAP},
    "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "system:authenticated"}],
}
# What the components installed here grant every authenticated user, by namespace (for tests/test_rbac.py, which counts
# them as the cluster's own grants: they are gone from the server by the time it reads the session's requests).
PUBLIC_ROLES: tuple[tuple[str, dict[str, Any]], ...] = ((TRAINER_NAMESPACE, TRAINER_PUBLIC_ROLE),)
# Kueue as its release manifests install it (kubernetes-sigs/kueue v0.19.2, the release's manifests.yaml:
# `make release-artifacts IMAGE_REGISTRY=registry.k8s.io/kueue` in .github/workflows/release-utils.yml builds
# config/default): config/default/kustomization.yaml puts everything in kueue-system with namePrefix kueue-, labels
# metadata and pod templates app.kubernetes.io/name=kueue and metadata, selectors and templates
# control-plane=controller-manager; config/components/manager/manager.yaml is the Deployment controller-manager
# (container manager) and its kustomization.yaml's configMapGenerator the ConfigMap manager-config (no hash suffix)
# from controller_manager_config.yaml, whose integrations.frameworks lists the job kinds Kueue manages.
KUEUE_NAMESPACE, KUEUE_DEPLOYMENT, KUEUE_CONFIG = "kueue-system", "kueue-controller-manager", "kueue-manager-config"
KUEUE_IMAGE = "registry.k8s.io/kueue/kueue"
KUEUE_LABELS = {"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"}
KUEUE_CONFIG_KEY = "controller_manager_config.yaml"
# v0.19.2's controller_manager_config.yaml: its integrations.frameworks in order, each enabled or commented out.
KUEUE_FRAMEWORKS: tuple[tuple[str, bool], ...] = (
    ("batch/job", True),
    ("kubeflow.org/mpijob", True),
    ("ray.io/rayjob", True),
    ("ray.io/raycluster", True),
    ("ray.io/rayservice", True),
    ("jobset.x-k8s.io/jobset", True),
    ("kubeflow.org/paddlejob", False),
    ("kubeflow.org/pytorchjob", False),
    ("kubeflow.org/tfjob", False),
    ("kubeflow.org/xgboostjob", False),
    ("kubeflow.org/jaxjob", False),
    ("workload.codeflare.dev/appwrapper", True),
    ("trainer.kubeflow.org/trainjob", True),
    ("sparkoperator.k8s.io/sparkapplication", False),
    ("pod", True),
    ("deployment", True),
    ("statefulset", True),
    ("leaderworkerset.x-k8s.io/leaderworkerset", True),
)
KUEUE_DEFAULT_FRAMEWORKS = tuple(name for name, enabled in KUEUE_FRAMEWORKS if enabled)
FSX_DRIVER = "fsx.csi.aws.com"
FILE_SYSTEM = "fs-0123456789abcdef0"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def taint(text: str) -> dict[str, str]:
    """``key=value:Effect`` or ``key:Effect``."""
    key_value, _, effect = text.rpartition(":")
    key, _, value = key_value.partition("=")
    return {"key": key, "effect": effect} | ({"value": value} if value else {})


class Installed:
    """Objects made as the admin on one control plane for one test, removed by :meth:`close`."""

    def __init__(self, plane: ControlPlane, tag: str):
        self.plane, self.tag = plane, tag
        self.core = kubernetes.client.CoreV1Api(plane.admin)
        self.apps = kubernetes.client.AppsV1Api(plane.admin)
        self.storage = kubernetes.client.StorageV1Api(plane.admin)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
        self._made: list[tuple[str, str, str]] = []  # (kind, namespace, name), in order
        self._namespaces: list[str] = []

    def name(self, base: str) -> str:
        """A cluster-scoped object's name: ``base`` with this test's tag."""
        return f"{base}-{self.tag}"

    def close(self) -> None:
        for kind, namespace, name in reversed(self._made):
            with contextlib.suppress(ApiException):
                self.delete(kind, namespace, name)
        for namespace in self._namespaces:
            self.plane.delete_namespace(namespace)

    def adopt_namespace(self, name: str) -> None:
        """Delete ``name`` with the rest (a namespace made elsewhere for this test)."""
        self._namespaces.append(name)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete one object made here (a PVC's or PV's protection finalizer lifted first)."""
        if kind in ("persistentvolumeclaims", "persistentvolumes"):  # protection finalizers: no controller lifts them
            body = {"metadata": {"finalizers": None}}
            if kind == "persistentvolumes":
                self.core.patch_persistent_volume(name, body)
                self.core.delete_persistent_volume(name)
            else:
                self.core.patch_namespaced_persistent_volume_claim(name, namespace, body)
                self.core.delete_namespaced_persistent_volume_claim(name, namespace)
            return
        {
            "nodes": lambda: self.core.delete_node(name),
            "pods": lambda: self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0),
            "storageclasses": lambda: self.storage.delete_storage_class(name),
            "daemonsets": lambda: self.apps.delete_namespaced_daemon_set(name, namespace),
            "deployments": lambda: self.apps.delete_namespaced_deployment(name, namespace),
            "configmaps": lambda: self.core.delete_namespaced_config_map(name, namespace),
            "roles": lambda: self.rbac.delete_namespaced_role(name, namespace),
            "rolebindings": lambda: self.rbac.delete_namespaced_role_binding(name, namespace),
        }[kind]()

    def _raw(self, response: Any) -> dict[str, Any]:
        return json.loads(response.data)

    def namespace(self, name: str) -> str:
        """A namespace of another team's, made (and deleted) by this test unless it exists."""
        try:
            self.core.read_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.plane.create_namespace(name)
            self._namespaces.append(name)
        return name

    # -- nodes ------------------------------------------------------------------------------------------------

    def add_node(
        self,
        base: str,
        *,
        instance_type: str = "ml.p5.48xlarge",
        health_status: str | None = "Schedulable",
        deep_health_check: str | None = None,
        labels: dict[str, str] | None = None,
        taints: Iterable[str] = (),
        unschedulable: bool = False,
        ready: bool = True,
    ) -> str:
        """A node named ``base`` + tag; its allocatable is the instance type's. ``health_status`` None: no health
        label. Not ``ready``: KubeletNotReady, with the lifecycle controller's not-ready taints."""
        name = self.name(base)
        node_labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            INSTANCE_TYPE_LABEL: instance_type,
            "topology.kubernetes.io/zone": "us-west-2a",
        }
        if instance_type.startswith("ml."):
            node_labels["sagemaker.amazonaws.com/compute-type"] = "hyperpod"
        if health_status is not None:
            node_labels[HEALTH_LABEL] = health_status
        if deep_health_check is not None:
            node_labels[DEEP_HEALTH_LABEL] = deep_health_check
        node_labels |= labels or {}
        self.core.create_node({"metadata": {"name": name, "labels": node_labels}})
        self._made.append(("nodes", "", name))
        resources = {**INSTANCE_RESOURCES.get(instance_type, CPU_NODE_RESOURCES), "pods": "110"}
        condition = (
            ("True", "KubeletReady", "kubelet is posting ready status")
            if ready
            else (
                "False",
                "KubeletNotReady",
                "container runtime network not ready: NetworkReady=false reason:"
                "NetworkPluginNotReady message:Network plugin returns error: cni plugin not initialized",
            )
        )
        status = {
            "capacity": resources,
            "allocatable": resources,
            "addresses": [{"type": "InternalIP", "address": "10.2.0.4"}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": condition[0],
                    "reason": condition[1],
                    "message": condition[2],
                    "lastHeartbeatTime": now(),
                    "lastTransitionTime": now(),
                }
            ],
        }
        self.core.patch_node_status(name, {"status": status})
        node_taints = [taint(t) for t in taints]
        if unschedulable:
            node_taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
        if not ready:
            node_taints += [{"key": "node.kubernetes.io/not-ready", "effect": e} for e in ("NoSchedule", "NoExecute")]
        spec: dict[str, Any] = {"taints": node_taints or None}  # admission's not-ready taint replaced
        if unschedulable:
            spec["unschedulable"] = True
        self.core.patch_node(name, {"spec": spec})
        return name

    def remove_node(self, name: str) -> None:
        self.core.delete_node(name)

    # -- pods -------------------------------------------------------------------------------------------------

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str | None = None,
        phase: str = "Running",
        requests: dict[str, str] | None = None,
        limits: dict[str, str] | None = None,
        containers: list[dict[str, Any]] | None = None,
    ) -> None:
        """Another team's pod, bound to ``node`` (None: not scheduled), its containers as ``phase`` has them."""
        if containers is None:
            resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
            containers = [
                {"name": "main", "image": "public.ecr.aws/docker/library/busybox:1.36", "resources": resources}
            ]
        spec: dict[str, Any] = {
            "containers": containers,
            "restartPolicy": "Always" if phase in ("Pending", "Running") else "Never",
        }
        if node:
            spec["nodeName"] = node
        self.core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": spec})
        self._made.append(("pods", namespace, name))
        if node is None:
            status: dict[str, Any] = {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "lastTransitionTime": now(),
                        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    }
                ],
            }
        else:
            running = phase == "Running"
            state = {
                "Pending": {"waiting": {"reason": "ContainerCreating"}},
                "Running": {"running": {"startedAt": now()}},
                "Succeeded": {
                    "terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now(), "finishedAt": now()}
                },
                "Failed": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": now(), "finishedAt": now()}},
            }[phase]
            status = {
                "phase": phase,
                "hostIP": "10.2.0.4",
                "podIP": "10.3.0.9",
                "startTime": now(),
                "conditions": [
                    {"type": t, "status": "True" if ok else "False", "lastTransitionTime": now()}
                    for t, ok in (
                        ("Initialized", True),
                        ("Ready", running),
                        ("ContainersReady", running),
                        ("PodScheduled", True),
                    )
                ],
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": running,
                        "restartCount": 0,
                        "started": running,
                        "state": state,
                    }
                    for c in containers
                ],
            }
        self.core.patch_namespaced_pod_status(name, namespace, {"status": status})

    # -- storage ----------------------------------------------------------------------------------------------

    def add_storage_class(self, base: str, parameters: dict[str, str], *, provisioner: str = FSX_DRIVER) -> str:
        """A StorageClass; ``parameters`` as the FSx CSI driver reads them (``deploymentType``,
        ``perUnitStorageThroughput``, ...: aws-fsx-csi-driver ``pkg/driver/controller.go`` ``CreateVolume``)."""
        name = self.name(base)
        self.storage.create_storage_class(
            {
                "metadata": {"name": name},
                "provisioner": provisioner,
                "parameters": parameters,
                "reclaimPolicy": "Delete",
                "volumeBindingMode": "Immediate",
            }
        )
        self._made.append(("storageclasses", "", name))
        return name

    def add_pvc(
        self,
        namespace: str,
        name: str,
        *,
        phase: str = "Bound",
        access_modes: Iterable[str] = ("ReadWriteMany",),
        storage_class: str | None = None,
        capacity: str = "1200Gi",
        static_pv: str = "",
        pv: bool = True,
    ) -> dict[str, Any]:
        """A PVC; Bound: to the PV ``pvc-<uid>`` dynamic provisioning makes (or to ``static_pv``, a PV made by hand),
        which is made too unless ``pv`` is False. ``storage_class`` "": none; None: this test's ``fsx-sc``."""
        modes = list(access_modes)
        spec: dict[str, Any] = {"accessModes": modes, "resources": {"requests": {"storage": capacity}}}
        storage_class = self.name("fsx-sc") if storage_class is None else storage_class
        spec["storageClassName"] = storage_class  # "" binds only to a PV without a class, as given
        pvc = self._raw(
            self.core.create_namespaced_persistent_volume_claim(
                namespace, {"metadata": {"name": name}, "spec": spec}, _preload_content=False
            )
        )
        self._made.append(("persistentvolumeclaims", namespace, name))
        if phase != "Bound":
            self.core.patch_namespaced_persistent_volume_claim_status(name, namespace, {"status": {"phase": phase}})
            return pvc
        volume = static_pv or f"pvc-{pvc['metadata']['uid']}"
        annotations = {"pv.kubernetes.io/bind-completed": "yes", "pv.kubernetes.io/bound-by-controller": "yes"}
        if not static_pv:
            annotations["volume.kubernetes.io/storage-provisioner"] = FSX_DRIVER
        pvc = self._raw(
            self.core.patch_namespaced_persistent_volume_claim(
                name,
                namespace,
                {"metadata": {"annotations": annotations}, "spec": {"volumeName": volume}},
                _preload_content=False,
            )
        )
        self.core.patch_namespaced_persistent_volume_claim_status(
            name, namespace, {"status": {"phase": "Bound", "accessModes": modes, "capacity": {"storage": capacity}}}
        )
        if pv:
            self.add_pv(
                volume,
                capacity=capacity,
                storage_class=storage_class,
                access_modes=modes,
                claim=pvc,
                dynamic=not static_pv,
            )
        return pvc

    def apply_volumes(self, documents: list[dict[str, Any]]) -> None:
        """PVs and PVCs as a platform engineer applies them (render-storage's: each PV pre-bound to its claim by
        claimRef, each claim naming its PV), then bound as the PV controller binds them (kubernetes
        pkg/controller/volume/persistentvolume/pv_controller.go: syncVolume's bind fills the PV's claimRef with the
        claim's uid, syncClaim's bind marks the claim bind-completed; both phases Bound, the claim's status with the
        PV's access modes and capacity)."""
        for doc in documents:
            meta = doc["metadata"]
            if doc["kind"] == "PersistentVolume":
                self.core.create_persistent_volume(doc)
                self._made.append(("persistentvolumes", "", meta["name"]))
            else:
                self.core.create_namespaced_persistent_volume_claim(meta["namespace"], doc)
                self._made.append(("persistentvolumeclaims", meta["namespace"], meta["name"]))
        for pv in (d for d in documents if d["kind"] == "PersistentVolume"):
            ref = pv["spec"]["claimRef"]
            claim = self._raw(
                self.core.read_namespaced_persistent_volume_claim(ref["name"], ref["namespace"], _preload_content=False)
            )
            if claim["spec"].get("volumeName") != pv["metadata"]["name"]:
                continue  # pre-bound to a claim that names another volume: the controller leaves both unbound
            self.core.patch_persistent_volume(
                pv["metadata"]["name"],
                {
                    "spec": {
                        "claimRef": {
                            **ref,
                            "uid": claim["metadata"]["uid"],
                            "resourceVersion": claim["metadata"]["resourceVersion"],
                        }
                    }
                },
            )
            self.core.patch_persistent_volume_status(pv["metadata"]["name"], {"status": {"phase": "Bound"}})
            self.core.patch_namespaced_persistent_volume_claim(
                ref["name"], ref["namespace"], {"metadata": {"annotations": {"pv.kubernetes.io/bind-completed": "yes"}}}
            )
            self.core.patch_namespaced_persistent_volume_claim_status(
                ref["name"],
                ref["namespace"],
                {
                    "status": {
                        "phase": "Bound",
                        "accessModes": pv["spec"]["accessModes"],
                        "capacity": pv["spec"]["capacity"],
                    }
                },
            )

    def remove_pvc(self, namespace: str, name: str) -> None:
        """A PVC and the PV bound to it, gone."""
        pvc = self.core.read_namespaced_persistent_volume_claim(name, namespace)
        self.delete("persistentvolumeclaims", namespace, name)
        if pvc.spec.volume_name:
            with contextlib.suppress(ApiException):
                self.delete("persistentvolumes", "", pvc.spec.volume_name)

    def add_pv(
        self,
        name: str,
        *,
        capacity: str = "1200Gi",
        storage_class: str = "",
        driver: str = FSX_DRIVER,
        volume_handle: str = FILE_SYSTEM,
        access_modes: Iterable[str] = ("ReadWriteMany",),
        claim: dict[str, Any] | None = None,
        dynamic: bool = True,
    ) -> None:
        """A CSI PersistentVolume bound to ``claim`` (a PVC as read back): its ``claimRef`` holds the PVC's uid."""
        context = {"dnsname": f"{volume_handle}.fsx.us-east-1.amazonaws.com", "mountname": "abcdefgh"}
        meta: dict[str, Any] = {"name": name}
        if dynamic:
            meta["annotations"] = {"pv.kubernetes.io/provisioned-by": driver}
        spec: dict[str, Any] = {
            "accessModes": list(access_modes),
            "capacity": {"storage": capacity},
            "csi": {"driver": driver, "volumeHandle": volume_handle, "volumeAttributes": context},
            "persistentVolumeReclaimPolicy": "Delete" if dynamic else "Retain",
            "storageClassName": storage_class,
        }
        if claim is not None:
            m = claim["metadata"]
            spec["claimRef"] = {
                "kind": "PersistentVolumeClaim",
                "apiVersion": "v1",
                "namespace": m["namespace"],
                "name": m["name"],
                "uid": m["uid"],
                "resourceVersion": m["resourceVersion"],
            }
        self.core.create_persistent_volume({"metadata": meta, "spec": spec})
        self._made.append(("persistentvolumes", "", name))
        self.core.patch_persistent_volume_status(name, {"status": {"phase": "Bound" if claim else "Available"}})

    # -- DaemonSets and Deployments ---------------------------------------------------------------------------

    def add_daemonset(
        self,
        namespace: str,
        name: str,
        *,
        image: str,
        labels: dict[str, str] | None = None,
        container: str = "",
        desired: int = 0,
        ready: int | None = None,
        env: list[dict[str, str]] | None = None,
    ) -> None:
        """A DaemonSet and the status its controller writes (``ready`` defaults to ``desired``)."""
        self.plane.ensure_namespace(namespace)
        labels = labels or {"name": name}
        ready = desired if ready is None else ready
        pod = {
            "containers": [{"name": container or name, "image": image, **({"env": env} if env else {})}],
            "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
        }
        body = {
            "metadata": {"name": name, "labels": labels},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": pod}},
        }
        self.apps.create_namespaced_daemon_set(namespace, body)
        self._made.append(("daemonsets", namespace, name))
        status = {
            "currentNumberScheduled": desired,
            "desiredNumberScheduled": desired,
            "numberMisscheduled": 0,
            "numberReady": ready,
            "numberAvailable": ready,
            "updatedNumberScheduled": desired,
            "numberUnavailable": desired - ready,
            "observedGeneration": 1,
        }
        self.apps.patch_namespaced_daemon_set_status(name, namespace, {"status": status})

    def add_device_plugins(
        self, *, desired: int = 2, ready: int | None = None, efa: bool = True, nvidia: bool = True
    ) -> None:
        """The EFA and NVIDIA device plugins in kube-system, as HyperPod installs them."""
        if efa:
            self.add_daemonset(
                "kube-system",
                EFA_PLUGIN,
                image=EFA_PLUGIN_IMAGE,
                labels={"name": "aws-efa-k8s-device-plugin"},
                container="aws-efa-k8s-device-plugin",
                desired=desired,
                ready=ready,
            )
        if nvidia:
            self.add_daemonset(
                "kube-system",
                NVIDIA_PLUGIN,
                image=NVIDIA_PLUGIN_IMAGE,
                labels={"name": "nvidia-device-plugin-ds"},
                container="nvidia-device-plugin-ctr",
                desired=desired,
                ready=ready,
            )

    def add_deployment(
        self,
        namespace: str,
        name: str,
        *,
        image: str,
        labels: dict[str, str] | None = None,
        container: str = "",
        env: list[dict[str, str]] | None = None,
        selector: dict[str, str] | None = None,
    ) -> None:
        """A Deployment of one ready replica, with the status its controller writes (``selector``: its matchLabels,
        the labels by default)."""
        self.plane.ensure_namespace(namespace)
        labels = labels or {"app": name}
        container_spec = {"name": container or name, "image": image, **({"env": env} if env else {})}
        body = {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": selector or labels},
                "template": {"metadata": {"labels": labels}, "spec": {"containers": [container_spec]}},
            },
        }
        self.apps.create_namespaced_deployment(namespace, body)
        self._made.append(("deployments", namespace, name))
        status = {
            "observedGeneration": 1,
            "replicas": 1,
            "updatedReplicas": 1,
            "readyReplicas": 1,
            "availableReplicas": 1,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True",
                    "reason": "MinimumReplicasAvailable",
                    "message": "Deployment has minimum availability.",
                    "lastUpdateTime": now(),
                    "lastTransitionTime": now(),
                }
            ],
        }
        self.apps.patch_namespaced_deployment_status(name, namespace, {"status": status})

    def add_operator(
        self,
        image: str,
        *,
        namespace: str = "kubeflow",
        name: str = "training-operator",
        labels: dict[str, str] | None = None,
    ) -> None:
        """The Training Operator's Deployment, labelled as its manifests label it."""
        self.add_deployment(
            namespace, name, image=image, labels={**OPERATOR_LABELS, **(labels or {})}, container="training-operator"
        )

    def add_hyperpod_operator(self, tag: str, *, name: str = HYPERPOD_OPERATOR_DEPLOYMENT) -> None:
        """The HyperPod training operator's Deployment in aws-hyperpod, its image tagged ``tag`` (a ``sha256:...``
        digest: the image pinned by digest alone)."""
        at = "@" if tag.startswith("sha256:") else ":"
        self.add_deployment(
            HYPERPOD_OPERATOR_NAMESPACE, name, image=f"{HYPERPOD_OPERATOR_IMAGE}{at}{tag}", container="manager"
        )

    def add_trainer(
        self, version: str = "v2.3.0", *, jobset_version: str | None = "v0.12.0", namespace: str = TRAINER_NAMESPACE
    ) -> None:
        """Kubeflow Trainer's controller manager as ``manifests/overlays/manager`` installs it, as a client sees it:
        the Deployment ``kubeflow-trainer-controller-manager`` (image ``ghcr.io/kubeflow/trainer/trainer-controller-
        manager:<version>``, container ``manager``) and the ConfigMap ``kubeflow-trainer-public`` whose
        ``kubeflow_trainer_version`` names the release, with the Role and RoleBinding that let every authenticated
        user read it; with ``jobset_version``, JobSet's ``jobset-controller-manager`` beside it
        (``manifests/third-party/jobset``). The CRDs are the control plane's."""
        self.add_deployment(
            namespace,
            TRAINER_DEPLOYMENT,
            image=f"{TRAINER_IMAGE}:{version}",
            labels=TRAINER_LABELS,
            container="manager",
        )
        self.core.create_namespaced_config_map(
            namespace, {"metadata": {"name": TRAINER_PUBLIC_CONFIGMAP}, "data": {TRAINER_VERSION_KEY: version}}
        )
        self._made.append(("configmaps", namespace, TRAINER_PUBLIC_CONFIGMAP))
        self.rbac.create_namespaced_role(namespace, TRAINER_PUBLIC_ROLE)
        self._made.append(("roles", namespace, TRAINER_PUBLIC_CONFIGMAP))
        self.rbac.create_namespaced_role_binding(namespace, TRAINER_PUBLIC_BINDING)
        self._made.append(("rolebindings", namespace, TRAINER_PUBLIC_CONFIGMAP))
        if jobset_version:
            selector = {
                k: v
                for k, v in JOBSET_LABELS.items()
                if k
                in (
                    "control-plane",
                    "app.kubernetes.io/name",
                    "app.kubernetes.io/instance",
                    "app.kubernetes.io/managed-by",
                )
            }
            self.add_deployment(
                namespace,
                JOBSET_DEPLOYMENT,
                image=f"{JOBSET_IMAGE}:{jobset_version}",
                labels=JOBSET_LABELS,
                container="manager",
                selector=selector,
            )

    def add_kueue(self, version: str = "v0.19.2", frameworks: Iterable[str] = KUEUE_DEFAULT_FRAMEWORKS) -> None:
        """What Kueue's release manifests install that the preflight reads: in kueue-system, the Deployment
        ``kueue-controller-manager`` (image ``registry.k8s.io/kueue/kueue:<version>``, container ``manager``) and the
        ConfigMap ``kueue-manager-config`` whose ``controller_manager_config.yaml`` is v0.19.2's with
        ``frameworks`` in its integrations.frameworks (v0.19.2's list, the others commented out as there, then any
        it does not name). The namespace stays, as kubeflow-system does (a namespace deleted takes seconds to go)."""
        self.add_deployment(
            KUEUE_NAMESPACE,
            KUEUE_DEPLOYMENT,
            image=f"{KUEUE_IMAGE}:{version}",
            labels=KUEUE_LABELS,
            container="manager",
            selector={"control-plane": "controller-manager"},
        )
        enabled = list(frameworks)
        known = [name for name, _ in KUEUE_FRAMEWORKS]
        lines = [f'  - "{name}"' if name in enabled else f'  # - "{name}"' for name in known]
        lines += [f'  - "{name}"' for name in enabled if name not in known]
        config = "\n".join(
            [
                "apiVersion: config.kueue.x-k8s.io/v1beta2",
                "kind: Configuration",
                "health:",
                "  healthProbeBindAddress: :8081",
                "metrics:",
                "  bindAddress: :8443",
                "webhook:",
                "  port: 9443",
                "leaderElection:",
                "  leaderElect: true",
                "  resourceName: c1f6bfd2.kueue.x-k8s.io",
                "integrations:",
                "  frameworks:",
                *lines,
                "",
            ]
        )
        self.core.create_namespaced_config_map(
            KUEUE_NAMESPACE, {"metadata": {"name": KUEUE_CONFIG}, "data": {KUEUE_CONFIG_KEY: config}}
        )
        self._made.append(("configmaps", KUEUE_NAMESPACE, KUEUE_CONFIG))


def unique_tag() -> str:
    return uuid.uuid4().hex[:6]
