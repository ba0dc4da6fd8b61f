"""`render-rbac`: the Roles and bindings of components/preflight/access.py for one service account, as YAML a
platform engineer reads rule by rule (each rule under the calls that need it) and applies with kubectl.

deploy/ holds the output for standalone KFP's kubeflow/pipeline-runner (`render-rbac --split deploy`; a test holds the
files to it). For a Kubeflow profile (`--kubeflow-profile`: the profile's default-editor, bound to kubeflow-edit by
the profile controller), what kubeflow-edit already grants in the profile's namespace, and what Kubeflow grants every
account, is left out and named at the top instead of being granted twice.
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from common.errors import InputError
from components.preflight.access import (
    CLUSTER,
    HYPERPOD_OPERATOR_NAMESPACE,
    JOBS,
    KUBEFLOW_GRANTS,
    OPERATOR_NAMESPACE,
    RBAC_JOB_APIS,
    RoleSpec,
    beyond_kubeflow,
    kubeflow_source,
    roles,
)

DEFAULT_NAMESPACE, DEFAULT_ACCOUNT = "kubeflow", "pipeline-runner"  # standalone KFP's runner
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
API_VERSION = "rbac.authorization.k8s.io/v1"


@dataclass(frozen=True)
class Subject:
    """The service account the pipeline's steps run as; its namespace is also where the jobs go."""

    namespace: str = DEFAULT_NAMESPACE
    service_account: str = DEFAULT_ACCOUNT
    jobs_namespace: str = ""  # where the jobs go, when not in the account's namespace

    def __post_init__(self) -> None:
        for flag, namespace in (("--namespace", self.namespace), ("--jobs-namespace", self.jobs_namespace)):
            if namespace and (len(namespace) > 63 or not _DNS_1123.match(namespace)):
                raise InputError(f"{flag} {namespace!r} is not a namespace name (a DNS-1123 label)")
        if len(self.service_account) > 253 or not _DNS_SUBDOMAIN.match(self.service_account):
            raise InputError(f"--service-account {self.service_account!r} is not a service account name")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.service_account}"

    @property
    def jobs(self) -> str:
        return self.jobs_namespace or self.namespace


def _flow(values: tuple[str, ...]) -> str:
    return json.dumps(list(values))


def _comment(text: str, indent: str = "") -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.splitlines()]


def _wrapped(text: str) -> str:
    """Paragraphs refilled to the comment's width; an indented line (a command) kept as it is."""
    lines: list[str] = []
    paragraph: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line and not line.startswith("  "):
            paragraph.append(line)
            continue
        if paragraph:
            lines += textwrap.wrap(" ".join(paragraph), width=117, break_on_hyphens=False)
            paragraph = []
        if line:
            lines.append(line)
    return "\n".join(lines)


def _metadata(name: str, namespace: str) -> list[str]:
    lines = ["metadata:", f"  name: {name}"]
    if namespace:
        lines.append(f"  namespace: {namespace}")
    return [*lines, "  labels:", "    app.kubernetes.io/part-of: hyperpod-pretrain"]


def _namespace_of(spec: RoleSpec, subject: Subject) -> str:
    return {JOBS: subject.jobs, CLUSTER: ""}.get(spec.where, spec.namespace)


def role_documents(spec: RoleSpec, subject: Subject) -> list[str]:
    """The role and its binding to ``subject``. A binding outside the subject's namespace (an operator's namespace,
    or cluster-wide) is named after the subject, so that each profile's account has its own."""
    namespace = _namespace_of(spec, subject)
    kind = "ClusterRole" if spec.where == CLUSTER else "Role"
    role = [f"apiVersion: {API_VERSION}", f"kind: {kind}", *_metadata(spec.name, namespace), "rules:"]
    for rule in spec.rules:
        role += _comment(rule.why, "  ")
        role += [f"  - apiGroups: [{json.dumps(rule.group)}]", f"    resources: {_flow(rule.resources)}"]
        if rule.names:
            role.append(f"    resourceNames: {_flow(rule.names)}")
        role.append(f"    verbs: {_flow(rule.verbs)}")
    own = spec.where == JOBS and subject.jobs == subject.namespace
    binding = [
        f"apiVersion: {API_VERSION}",
        f"kind: {kind}Binding",
        *_metadata(spec.name if own else f"{spec.name}:{subject.namespace}:{subject.service_account}", namespace),
        "roleRef:",
        "  apiGroup: rbac.authorization.k8s.io",
        f"  kind: {kind}",
        f"  name: {spec.name}",
        "subjects:",
        "  - kind: ServiceAccount",
        f"    name: {subject.service_account}",
        f"    namespace: {subject.namespace}",
    ]
    return ["\n".join(role), "\n".join(binding)]


def _header(file: str, subject: Subject) -> str:
    who = f"the service account {subject}"
    apply = "kubectl apply -f deploy/rbac.yaml -f deploy/rbac-{api}.yaml"
    texts = {
        "rbac.yaml": f"""\
What the pipeline's steps need whichever job API the pipeline was compiled for, and nothing more, for {who}
(jobs go to {subject.jobs}): there, to follow and diagnose the job's pods and to read the FSx PVC;
and the preflight's read of the three job APIs' CRDs. The job API's own rules are in rbac-pytorchjob.yaml
(compile --job-api pytorchjob, the default), rbac-trainjob.yaml (--job-api trainjob) or rbac-hyperpodpytorchjob.yaml
(--job-api hyperpodpytorchjob): apply this file and that one. Each rule
names the calls that make its requests (tests/test_rbac.py checks them against what the runner asked the real API
server for across the launcher's and the preflight's tests: every request granted, every rule used).
  {apply.format(api="pytorchjob")}      (or another job API's file)
Optional, for the preflight's cluster-wide reads (nodes, pods on them, DaemonSets, Deployments in other namespaces,
the FSx PVC's PersistentVolume and StorageClass, Kueue's configuration); without it those checks warn that they
could not look:
  kubectl apply -f deploy/rbac-cluster-read.yaml
Another namespace or service account: hyperpod-pretrain render-rbac --namespace NS --service-account SA (and
--kubeflow-profile for a Kubeflow profile's default-editor). The preflight's permissions check
(SelfSubjectAccessReviews) needs no rule: every authenticated user may review its own access (the bootstrap
ClusterRole system:basic-user).""",
        "rbac-pytorchjob.yaml": f"""\
A pipeline compiled with --job-api pytorchjob (the default): what {who} needs of the PyTorchJob API, besides
rbac.yaml: in the jobs' namespace, to launch, follow and clean up PyTorchJobs; in {OPERATOR_NAMESPACE}, to find the
Training Operator's Deployment by its label (its version, for HyperPod auto-resume). tests/test_rbac.py holds every
rule to a request the runner made.
  {apply.format(api="pytorchjob")}""",
        "rbac-trainjob.yaml": f"""\
A pipeline compiled with --job-api trainjob: what {who} needs of Kubeflow Trainer v2, besides rbac.yaml: in the
jobs' namespace, to launch, follow and clean up TrainJobs; and the preflight's read of the one ClusterTrainingRuntime
the pipeline's TrainJobs name (cluster-scoped, so a ClusterRole; installing it takes a cluster admin:
deploy/trainjob-runtime.yaml). Kubeflow Trainer's version is read from its public ConfigMap, which every
authenticated user may read (Trainer's own kubeflow-trainer-public Role). The JobSet, its Jobs and their pods are
Kubeflow Trainer's and JobSet's to make: nothing here creates them. tests/test_rbac.py holds every rule to a request
the runner made.
  {apply.format(api="trainjob")}""",
        "rbac-hyperpodpytorchjob.yaml": f"""\
A pipeline compiled with --job-api hyperpodpytorchjob: what {who} needs of the SageMaker HyperPod training operator's
HyperPodPyTorchJob API, besides rbac.yaml: in the jobs' namespace, to launch, follow and clean up HyperPodPyTorchJobs;
in {HYPERPOD_OPERATOR_NAMESPACE}, to find the operator's Deployment (its version, for the preflight's report). Their
pods are the operator's to make: nothing here creates them. tests/test_rbac.py holds every rule to a request the
runner made.
  {apply.format(api="hyperpodpytorchjob")}""",
        "rbac-cluster-read.yaml": f"""\
Optional: the preflight's cluster-wide reads, read-only, for {who}. With it the preflight sees whether the job
fits (nodes and what already runs on them), whether the device plugins are ready, whether the FSx file system writes
the job's checkpoint within its preemption budget (its PersistentVolume and StorageClass), finds a Training Operator
installed under another name or namespace, and reads Kueue's version and configuration when a queue is compiled in.
Without it the pipeline runs all the same; those checks warn that they could not look. Apply after rbac.yaml:
  kubectl apply -f deploy/rbac-cluster-read.yaml
Listing pods and Deployments returns their whole specs, environment values included: a value written in plain text
in a pod's env (rather than from a Secret) is readable with this grant. The preflight keeps only what it counts (the
pods' node names, labels and resource requests; the Deployment's labels and image) and never logs or reports a pod
(tests/test_rbac.py checks it). Leave this file out where that is too much.""",
    }
    return "\n".join(_comment(_wrapped(texts[file])))


def render_file(file: str, subject: Subject = Subject(), runtime_name: str = "hyperpod-pretrain") -> str:
    """One deploy file's text (rbac.yaml, rbac-<job api>.yaml or rbac-cluster-read.yaml)."""
    specs = {s.name: s for api in RBAC_JOB_APIS for s in roles(api, runtime_name, cluster_read=True)}
    docs = [d for spec in specs.values() if spec.file == file for d in role_documents(spec, subject)]
    return _header(file, subject) + "\n" + "\n---\n".join(docs) + "\n"


def write_deploy(directory: Path, subject: Subject = Subject(), runtime_name: str = "hyperpod-pretrain") -> list[Path]:
    files = ["rbac.yaml", *(f"rbac-{api}.yaml" for api in RBAC_JOB_APIS), "rbac-cluster-read.yaml"]
    written = []
    for file in files:
        path = directory / file
        path.write_text(render_file(file, subject, runtime_name))
        written.append(path)
    return written


def render(
    subject: Subject,
    api_name: str,
    runtime_name: str = "hyperpod-pretrain",
    cluster_read: bool = False,
    kubeflow_profile: bool = False,
) -> str:
    """Everything ``subject`` needs for a pipeline compiled for ``api_name``, as one stream; for a Kubeflow profile,
    less what Kubeflow grants it (listed at the top, with the role and manifest that grant each)."""
    specs = roles(api_name, runtime_name, cluster_read)
    head = [
        f"What {subject} needs for a pipeline compiled with --job-api {api_name} (jobs in {subject.jobs}).",
        "Rendered by: hyperpod-pretrain render-rbac; apply with kubectl apply -f -.",
    ]
    if kubeflow_profile:
        if subject.jobs != subject.namespace:
            raise InputError(
                "--kubeflow-profile: a profile's default-editor holds kubeflow-edit in its own namespace "
                "only: leave out --jobs-namespace"
            )
        given: dict[str, list[str]] = {}
        for spec in specs:
            for rule in spec.rules:
                for verb in rule.verbs:
                    sources = [kubeflow_source(api_name, spec.where, verb, rule.group, r) for r in rule.resources]
                    for resource, source in zip(rule.resources, sources, strict=True):
                        if all(sources) and source is not None:
                            given.setdefault(source.role, []).append(f"{verb} {resource}")
        head.append(f"Left out, as Kubeflow grants them to {subject.service_account} already:")
        for grant in KUBEFLOW_GRANTS:
            if grant.role in given:
                where = (
                    "to every account, cluster-wide" if grant.everyone else f"through kubeflow-edit in {subject.jobs}"
                )
                line = f"- {grant.role} ({where}; {grant.source}): {', '.join(given[grant.role])}"
                parts = textwrap.wrap(line, 115, subsequent_indent="    ", break_on_hyphens=False)
                head += ["  " + part for part in parts]
        specs = [s for s in (beyond_kubeflow(spec, api_name) for spec in specs) if s is not None]
    docs = [d for spec in specs for d in role_documents(spec, subject)]
    return "\n".join(_comment("\n".join(head))) + "\n" + "\n---\n".join(docs) + "\n"
