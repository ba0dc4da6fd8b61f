"""The Kubernetes API access the pipeline's steps use, rule by rule, with the calls that make each request, and which
of it a Kubeflow profile's ``default-editor`` already holds through Kubeflow's ``kubeflow-edit``.

One model for three readers: ``render-rbac`` writes the Roles from it (deploy/ holds its output for standalone KFP's
kubeflow/pipeline-runner), the preflight asks the API server about the launcher's part of it, and tests/test_rbac.py
holds every rule to a request the steps made on a real API server.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.errors import InputError
from components.launch_training.apis import job_api
from components.launch_training.job_api import JobApi

JOBS, OPERATOR, CLUSTER = "jobs", "operator", "cluster"  # where a role applies: the jobs' namespace, an operator's
# namespace (RoleSpec.namespace), cluster-wide
PROFILE_ACCOUNT = "default-editor"  # what a Kubeflow profile's pipeline pods run as (KFP multi-user)
OPERATOR_NAMESPACE = "kubeflow"  # the Training Operator's, as its release manifests and HyperPod's chart install it
# The HyperPod training operator's, where its EKS add-on installs it (operator_versions.py HYPERPOD_NAMESPACE)
HYPERPOD_OPERATOR_NAMESPACE = "aws-hyperpod"


@dataclass(frozen=True)
class Rule:
    """Verbs on resources of one API group (and only the named objects, if any); ``why``: the calls that make these
    requests, written above the rule in the rendered YAML."""

    group: str
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    why: str
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoleSpec:
    """A Role (``where`` JOBS or OPERATOR) or ClusterRole (CLUSTER) and the deploy file it is rendered into; an
    OPERATOR Role is in its operator's ``namespace``."""

    name: str
    where: str
    file: str
    rules: tuple[Rule, ...]
    namespace: str = OPERATOR_NAMESPACE


LAUNCHER_ROLE = "hyperpod-pretrain-launcher"

LAUNCHER = RoleSpec(
    LAUNCHER_ROLE,
    JOBS,
    "rbac.yaml",
    (
        Rule(
            "",
            ("pods",),
            ("list", "watch"),
            """\
list: the job's pods by label (JobApi.pod_selector: training.kubeflow.org/job-name for a PyTorchJob,
  jobset.sigs.k8s.io/jobset-name for a TrainJob, HPJob for a HyperPodPyTorchJob): pods.job_pods (pod_summary,
  describe_failure, Diagnoser.tick, the restarts at the end), PodWatcher.run; verify_nccl.fetch_pod_logs; one
  node's pods by label (JobApi.node_selector): LogStreamer.restarted_since_last_read.
watch: PodWatcher._watch_from, the job's pods by the same label: a pod made anew after a failure counts against the
  restart budget (restarts.py). Pods are never read one by one (get).""",
        ),
        Rule(
            "",
            ("pods/log",),
            ("get",),
            """\
get: LogStreamer._follow (following node 0's or every node's log), describe_failure, current_lines and last_lines
  (a failed or restarted container's last lines), verify_nccl.fetch_pod_logs.""",
        ),
        Rule(
            "",
            ("events",),
            ("list",),
            """\
list: Diagnoser.tick and describe_failure (why a pod is Pending, crash-looping or cannot pull its image). Without
  it the launcher runs, without the events (the preflight warns).""",
        ),
        Rule(
            "",
            ("persistentvolumeclaims",),
            ("get",),
            """\
get: preflight.check_pvc (the FSx PVC the job mounts: Bound, ReadWriteMany). Not limited by resourceNames: the
  claim's name is the compile flag --fsx-pvc (add resourceNames: [<it>] to narrow the rule), and a PVC object
  holds no secret.""",
        ),
    ),
)

PREFLIGHT_READ = RoleSpec(
    "hyperpod-pretrain-preflight-read",
    CLUSTER,
    "rbac.yaml",
    (
        Rule(
            "apiextensions.k8s.io",
            ("customresourcedefinitions",),
            ("get",),
            """\
get: preflight.check_crd (the compiled job API's CRD installed, serving its version, Established) and
  preflight.other_api_line (when it is missing: which other job API is there, for the one-line fix); the three job
  APIs' CRDs only.""",
            names=(
                "pytorchjobs.kubeflow.org",
                "trainjobs.trainer.kubeflow.org",
                "hyperpodpytorchjobs.sagemaker.amazonaws.com",
            ),
        ),
    ),
)

_JOB_WHY = """\
create: attach._create (create_or_attach: the run's job, and the next attempt after a failed one).
get: create_or_attach (the job found on a 409), wait_until_gone, JobWatcher._get (after 410 Gone, and polling
  when watching is refused); cancel.delete_unfinished_job (the exit step's clean-up, run_summary.job_cleanup).
watch: JobWatcher._watch_once, a watch on the one job (fieldSelector metadata.name=<job>&watch=true). It starts
  from the resourceVersion of the created or read job, so "list" is never asked for.
delete: cancel.delete_job (a failed attempt replaced, a deadline passed, SIGTERM seen by the loop, the exit step's
  delete_unfinished_job, a Failed TrainJob once its failure is read) and cancel.ImmediateDelete (the SIGTERM
  handler's own delete)."""
JOB_VERBS = ("create", "get", "watch", "delete")

_MAKERS_WHY = """\
list: cancel.wait_until_inert, by the pod label (JobApi.pod_selector): deleting a {kind} (a failed attempt
  replaced, a deadline passed, SIGTERM seen by the loop, a Failed one once its failure is read, the exit step's
  clean-up) returns only once its {plural} are gone or being deleted: the Job controller makes pods for any other.
  Never read one by one, never written."""


def job_role(api: JobApi) -> RoleSpec:
    """The launcher's verbs on the compiled job API's jobs, in the jobs' namespace, a get of what the job's controller
    makes under its name (a TrainJob's JobSet) and a list of what makes its pods (the JobSet's Jobs)."""
    children = tuple(
        Rule(
            group,
            (plural,),
            ("get",),
            f"""\
get: attach.wait_until_gone: before a new attempt, until the {api.kind}'s child of its name in {plural} is
  gone (the garbage collector deletes it after the {api.kind}; one still there would be taken for the new one's);
  cancel.wait_until_inert: after a delete, until it is gone or being deleted.""",
        )
        for group, _version, plural in api.children
    )
    makers = tuple(
        Rule(group, (plural,), ("list",), _MAKERS_WHY.format(kind=api.kind, plural=plural))
        for group, _version, plural in api.pod_makers
    )
    return RoleSpec(
        f"hyperpod-pretrain-{api.name}",
        JOBS,
        f"rbac-{api.name}.yaml",
        (Rule(api.group, (api.plural,), JOB_VERBS, _JOB_WHY), *children, *makers),
    )


OPERATOR_READ = RoleSpec(
    "hyperpod-pretrain-operator-read",
    OPERATOR,
    "rbac-pytorchjob.yaml",
    (
        Rule(
            "apps",
            ("deployments",),
            ("list",),
            """\
list: preflight.operator_version (the Training Operator's version, for HyperPod auto-resume), by the label
  control-plane=kubeflow-training-operator: the release manifests name the Deployment training-operator, HyperPod's
  chart after its Helm release. RBAC cannot narrow a list to a label, so this reads every Deployment in kubeflow;
  the preflight keeps nothing but the operator's labels and image.""",
        ),
    ),
)


HYPERPOD_OPERATOR_READ = RoleSpec(
    "hyperpod-pretrain-hyperpod-operator-read",
    OPERATOR,
    "rbac-hyperpodpytorchjob.yaml",
    (
        Rule(
            "apps",
            ("deployments",),
            ("list",),
            """\
list: preflight.hyperpod_operator_version (the SageMaker HyperPod training operator's version, its image tag,
  for the crd check's report): the EKS add-on's Deployment, taken to be the one whose name contains
  training-operator (AWS publishes no name for it; its ServiceMonitor is hyperpod-training-operator). RBAC cannot
  narrow a list to part of a name, so this reads every Deployment in aws-hyperpod; the preflight keeps nothing but
  their names and the operator's image.""",
        ),
    ),
    namespace=HYPERPOD_OPERATOR_NAMESPACE,
)


def runtime_read(runtime_name: str) -> RoleSpec:
    return RoleSpec(
        "hyperpod-pretrain-runtime-read",
        CLUSTER,
        "rbac-trainjob.yaml",
        (
            Rule(
                "trainer.kubeflow.org",
                ("clustertrainingruntimes",),
                ("get",),
                """\
get: preflight.check_runtime (the runtime exists and holds what the pipeline's TrainJobs rely on) and
  k8s_backend.runtime_grace (its pods' grace period, which a queued TrainJob must keep), this one only: the compile
  flag --runtime-name (default hyperpod-pretrain); change resourceNames with it.""",
                names=(runtime_name,),
            ),
        ),
    )


CLUSTER_READ = RoleSpec(
    "hyperpod-pretrain-cluster-read",
    CLUSTER,
    "rbac-cluster-read.yaml",
    (
        Rule(
            "",
            ("nodes", "pods"),
            ("list",),
            """\
list nodes: preflight.check_nodes (allocatable, taints, cordons, Ready, HyperPod health labels).
list pods, in all namespaces: preflight.check_nodes (fieldSelector status.phase!=Succeeded,status.phase!=Failed),
  for what each node already runs: spec.nodeName and the containers' resource requests.""",
        ),
        Rule(
            "",
            ("persistentvolumes",),
            ("get",),
            """\
get persistentvolumes: preflight.check_checkpoint_throughput (the FSx PVC's volume: its capacity, CSI driver, file
  system id, and whether the FSx CSI driver provisioned it). Not limited by resourceNames: a dynamically provisioned
  volume is named pvc-<the claim's uid>. A PV holds no secret (a CSI secret is only referenced by name).""",
        ),
        Rule(
            "storage.k8s.io",
            ("storageclasses",),
            ("get",),
            """\
get storageclasses: preflight.read_tier (the StorageClass that provisioned the FSx volume: its deploymentType,
  storageType and perUnitStorageThroughput, hence the file system's write throughput).""",
        ),
        Rule(
            "apps",
            ("daemonsets", "deployments"),
            ("list",),
            """\
list daemonsets, in all namespaces: preflight.check_device_plugins (the EFA and NVIDIA device plugins, ready).
list deployments, in all namespaces: preflight.operator_version's fallback, by label
  (control-plane=kubeflow-training-operator), when none is in kubeflow; preflight.trainer_version's fallback (the
  Kubeflow Trainer controller in kubeflow-system, by name) when its public ConfigMap is missing;
  preflight.check_queue (Kueue's controller in kueue-system, by label app.kubernetes.io/name=kueue: its version).""",
        ),
        Rule(
            "",
            ("configmaps",),
            ("get",),
            """\
get configmaps, kueue-manager-config only: preflight.check_queue (whether Kueue manages the compiled job API:
  its integrations.frameworks). A ClusterRole names no namespace: this is the ConfigMap of that name anywhere
  (Kueue's own in kueue-system).""",
            names=("kueue-manager-config",),
        ),
    ),
)


# The job APIs whose Roles are modelled here and measured from the audit log (tests/test_rbac.py): every one the
# launcher drives.
RBAC_JOB_APIS = ("pytorchjob", "trainjob", "hyperpodpytorchjob")


def roles(api_name: str, runtime_name: str = "hyperpod-pretrain", cluster_read: bool = False) -> list[RoleSpec]:
    """What the pipeline's service account needs for a pipeline compiled for ``api_name``, in deploy-file order."""
    api = job_api(api_name)
    if api_name not in RBAC_JOB_APIS:
        raise InputError(f"the Roles a --job-api {api_name} pipeline needs are not measured")
    extra = {
        "pytorchjob": [OPERATOR_READ],
        "trainjob": [runtime_read(runtime_name)],
        "hyperpodpytorchjob": [HYPERPOD_OPERATOR_READ],
    }[api_name]
    return [LAUNCHER, PREFLIGHT_READ, job_role(api), *extra, *([CLUSTER_READ] if cluster_read else [])]


# -- what Kubeflow already grants ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeflowGrant:
    """A ClusterRole of a Kubeflow platform install and the part of it our rules need: ``edit`` aggregated into
    kubeflow-edit (bound to each profile's default-editor in its namespace by the profile controller), or given to
    every authenticated user cluster-wide."""

    role: str
    source: str
    rules: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (group, resources, verbs)
    everyone: bool = False  # bound to system:authenticated, cluster-wide: any namespace's account holds it
    job_api: str = ""  # only installed with this job API's controller

    def grants(self, verb: str, group: str, resource: str) -> bool:
        return any(verb in verbs and group == g and resource in resources for g, resources, verbs in self.rules)


# kubeflow-edit aggregates kubeflow-view, which aggregates kubeflow-kubernetes-view (kubeflow/manifests v1.11.0
# common/kubeflow-roles/base/cluster-roles.yaml, unchanged in 26.03 for these rules); the Training Operator's
# kubeflow overlay and Kubeflow Trainer's kubeflow-platform overlay add their edit roles to kubeflow-edit with the
# label rbac.authorization.kubeflow.org/aggregate-to-kubeflow-edit. A Training Operator installed without that
# overlay (HyperPod's Helm chart) adds nothing: render-rbac without --kubeflow-profile then.
KUBEFLOW_GRANTS = (
    KubeflowGrant(
        "kubeflow-kubernetes-view",
        "kubeflow/manifests v1.11.0 common/kubeflow-roles",
        (
            ("", ("pods", "persistentvolumeclaims"), ("get", "list", "watch")),
            ("", ("events", "pods/log"), ("get", "list", "watch")),
            ("batch", ("jobs",), ("get", "list", "watch")),
        ),
    ),
    KubeflowGrant(
        "kubeflow-training-edit",
        "kubeflow/training-operator v1.8.1 manifests/overlays/kubeflow/kubeflow-training-roles.yaml",
        (("kubeflow.org", ("pytorchjobs",), ("create", "delete", "get", "list", "patch", "update", "watch")),),
        job_api="pytorchjob",
    ),
    KubeflowGrant(
        "kubeflow-trainer-edit",
        "kubeflow/trainer v2.3.0 manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml",
        (("trainer.kubeflow.org", ("trainjobs",), ("create", "patch", "get", "list", "watch", "delete")),),
        job_api="trainjob",
    ),
    KubeflowGrant(
        "kubeflow-trainer-view-cluster-runtimes",
        "kubeflow/trainer v2.3.0 manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml",
        (("trainer.kubeflow.org", ("clustertrainingruntimes",), ("get", "list", "watch")),),
        everyone=True,
        job_api="trainjob",
    ),
)


def kubeflow_source(api_name: str, where: str, verb: str, group: str, resource: str) -> KubeflowGrant | None:
    """The Kubeflow role that gives a profile's default-editor this verb (in its own namespace for JOBS, anywhere for
    CLUSTER when it is everyone's), or None."""
    for grant in KUBEFLOW_GRANTS:
        if grant.job_api not in ("", api_name) or not grant.grants(verb, group, resource):
            continue
        if where == JOBS or grant.everyone:
            return grant
    return None


def beyond_kubeflow(spec: RoleSpec, api_name: str) -> RoleSpec | None:
    """``spec`` less what Kubeflow already grants a profile's default-editor (None: nothing is left)."""
    rules = []
    for rule in spec.rules:
        verbs = tuple(
            v
            for v in rule.verbs
            if not all(kubeflow_source(api_name, spec.where, v, rule.group, r) for r in rule.resources)
        )
        if verbs:
            rules.append(Rule(rule.group, rule.resources, verbs, rule.why, rule.names))
    return replace(spec, rules=tuple(rules)) if rules else None


def launcher_access(api: JobApi) -> tuple[tuple[str, str, str, str, bool], ...]:
    """(verb, group, resource, subresource, needed): what the launcher and the exit step's clean-up do in the job's
    namespace: the job Role's verbs and the launcher Role's but the PVC read (the preflight's own). Events are not
    needed: without them the launcher runs, but cannot show the pods' events."""
    access = [
        (verb, rule.group, plural, "", True)
        for rule in job_role(api).rules
        for plural in rule.resources
        for verb in rule.verbs
    ]
    for rule in LAUNCHER.rules:
        for resource in rule.resources:
            if resource != "persistentvolumeclaims":
                plural, _, sub = resource.partition("/")
                access += [(verb, rule.group, plural, sub, resource != "events") for verb in rule.verbs]
    return tuple(access)
