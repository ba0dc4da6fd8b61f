"""deploy/rbac*.yaml grant exactly what the code asks for, measured on the real server.

The control plane's audit log records every request the pipeline runner made across the session's launcher and
preflight tests (ResponseComplete events: verb, resource, subresource, name, namespace, code; tests that run with less
granted use an account of their own, so the runner always holds both files whole). These tests run last (conftest.py)
and read that record: the runner met no 403; each request is granted by the files (or by what the cluster grants every
account itself, read from the server, or an installed component every authenticated user); and each rule of the files
grants some request. A rule removed from a file fails them naming the request; a rule no request needs fails them
naming the rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from components.launch_training.apis import job_api
from components.launch_training.manifest import DEFAULT_RUNTIME
from components.preflight.access import PROFILE_ACCOUNT, RBAC_JOB_APIS, launcher_access
from pipelines.deploy.rbac import Subject, render, render_file
from tests.cluster.control_plane import (
    JOB_ROLES,
    LAUNCHER_ROLE,
    RBAC_FILES,
    REPO,
    RUNNER_ACCOUNT,
    RUNNER_NAMESPACE,
    RUNNER_USER,
    ControlPlane,
    deploy_grants,
)
from tests.cluster.installed import PUBLIC_ROLES
from tests.cluster.kubeflow import EVERYONE_BINDING

RBAC, CLUSTER_READ, *JOB_API_FILES = RBAC_FILES  # the common file, the optional one, one per job API
REQUIRED = (RBAC, *JOB_API_FILES)
JOBS = "<the jobs' namespace>"  # every test namespace holds the launcher's Role, as the jobs' namespace does
# The files whose tests make the requests the rules are measured from: the launcher's and the preflight's on the
# control plane (as the runner, or as a profile's default-editor). Each must run in the session, or a rule only its
# tests use would be taken for unused; one of test_k8s_launcher*.py or test_preflight*.py that reaches the control plane
# and is not listed here fails test_every_launcher_and_preflight_file_on_the_control_plane_is_measured.
MEASURED_FROM = (
    "test_k8s_launcher.py",
    "test_k8s_launcher_attach.py",
    "test_k8s_launcher_cancel.py",
    "test_k8s_launcher_deadlines.py",
    "test_k8s_launcher_diagnosis.py",
    "test_k8s_launcher_restarts.py",
    "test_k8s_launcher_streams.py",
    "test_preflight_checkpoint_throughput.py",
    "test_preflight_component.py",
    "test_preflight_core.py",
    "test_preflight_crd.py",
    "test_preflight_device_plugins.py",
    "test_preflight_fsx_pvc.py",
    "test_preflight_hyperpodpytorchjob.py",
    "test_preflight_image.py",
    "test_preflight_kueue.py",
    "test_preflight_memory.py",
    "test_preflight_mlflow.py",
    "test_preflight_nodes.py",
    "test_preflight_permissions.py",
    "test_preflight_trainjob.py",
)
MEASURED_PATTERNS = ("test_k8s_launcher*.py", "test_preflight*.py")

pytestmark = pytest.mark.after_cluster_tests


# -- the authorizer: kubernetes/kubernetes plugin/pkg/auth/authorizer/rbac/rbac.go RuleAllows, with the matchers of
# pkg/apis/rbac/v1/evaluation_helpers.go (VerbMatches, APIGroupMatches, ResourceMatches, ResourceNameMatches,
# NonResourceURLMatches) -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request as the authorizer saw it (the audit event's verb and objectRef); ``scope`` is its namespace, with
    a test namespace read as :data:`JOBS`, or "" for a cluster-scoped or all-namespaces request."""

    verb: str
    group: str
    resource: str
    subresource: str
    name: str
    scope: str
    path: str = ""  # a non-resource request's URL path

    @classmethod
    def of(cls, event: dict[str, Any]) -> Request:
        ref = event.get("objectRef")
        if ref is None:
            return cls(event["verb"], "", "", "", "", "", event["requestURI"].split("?", 1)[0])
        namespace = ref.get("namespace", "")
        scope = JOBS if namespace.startswith("hyperpod-t") else namespace
        name = ref.get("name", "")
        if ref["resource"] == "clustertrainingruntimes" and name.startswith("hpp-hyperpod-t"):
            # A launch test's own runtime (tests/cluster/cluster.py names it after its namespace and binds render-rbac's
            # runtime read for that name): the deploy files' for the default name.
            name = DEFAULT_RUNTIME
        return cls(event["verb"], ref.get("apiGroup", ""), ref["resource"], ref.get("subresource", ""), name, scope)

    def __str__(self) -> str:
        if self.path:
            return f"{self.verb} {self.path}"
        what = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        group = f".{self.group}" if self.group else ""
        named = f" {self.name!r}" if self.name else ""
        where = f"in {self.scope}" if self.scope else "cluster-wide"
        return f"{self.verb} {what}{group}{named} {where}"


def rule_allows(rule: dict[str, Any], request: Request) -> bool:
    """RuleAllows: for a resource request, verb, API group, resource (``resource/subresource`` or ``*/subresource``)
    and resourceName (any, when the rule names none) all match; for a non-resource request, verb and URL."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and request.verb not in verbs:
        return False
    if request.path:
        return any(
            u == request.path or (u.endswith("*") and request.path.startswith(u[:-1]))
            for u in rule.get("nonResourceURLs") or []
        )
    groups = rule.get("apiGroups") or []
    if "*" not in groups and request.group not in groups:
        return False
    combined = f"{request.resource}/{request.subresource}" if request.subresource else request.resource
    resources = rule.get("resources") or []
    if not any(r in ("*", combined) or (request.subresource and r == f"*/{request.subresource}") for r in resources):
        return False
    names = rule.get("resourceNames") or []
    return not names or request.name in names


@dataclass(frozen=True)
class Permission:
    """One verb on one resource (and resourceName, "" for any) that one binding of a deploy file gives, where:
    ``scope`` is a Role's namespace (:data:`JOBS` for the launcher's), "" for a ClusterRole's (everywhere)."""

    file: str
    role: str
    scope: str
    group: str
    resource: str
    verb: str
    name: str = ""

    def allows(self, request: Request) -> bool:
        rule: dict[str, Any] = {"apiGroups": [self.group], "resources": [self.resource], "verbs": [self.verb]}
        if self.name:
            rule["resourceNames"] = [self.name]
        return self.scope in ("", request.scope) and rule_allows(rule, request)

    def __str__(self) -> str:
        where = f"in {self.scope}" if self.scope else "cluster-wide"
        named = f" {self.name!r}" if self.name else ""
        return f"{self.file}: {self.verb} {self.resource}{named} ({self.group or 'core'}) {where} ({self.role})"


def permissions(path: Path) -> list[Permission]:
    """Every verb x resource x resourceName of the file's Roles and ClusterRoles that a binding there gives the
    runner."""
    return granted_to(path.name, deploy_grants((path,)), RUNNER_NAMESPACE, RUNNER_ACCOUNT)


def granted_to(file: str, docs: list[dict[str, Any]], namespace: str, account: str) -> list[Permission]:
    """What the documents' bindings give the account: its Roles in the jobs' namespace read as :data:`JOBS`."""
    bound = {
        (d["roleRef"]["kind"], d["roleRef"]["name"], d["metadata"].get("namespace", ""))
        for d in docs
        if d["kind"].endswith("Binding")
        and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in d["subjects"]
    }
    out = []
    for doc in docs:
        meta = doc["metadata"]
        if "rules" not in doc or (doc["kind"], meta["name"], meta.get("namespace", "")) not in bound:
            continue
        scope = JOBS if meta["name"] in (LAUNCHER_ROLE, *JOB_ROLES) else meta.get("namespace", "")
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [""]:
                            out.append(Permission(file, meta["name"], scope, group, resource, verb, name))
    return out


def granted(request: Request, grants: Iterable[Permission]) -> bool:
    return any(p.allows(request) for p in grants)


def cluster_grants(plane: ControlPlane) -> list[dict[str, Any]]:
    """The rules the cluster itself gives every account (bootstrap policy, as the server holds it): ClusterRoles bound
    to system:authenticated or system:serviceaccounts, such as system:basic-user's SelfSubjectAccessReviews."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
    groups = {"system:authenticated", "system:serviceaccounts", f"system:serviceaccounts:{RUNNER_NAMESPACE}"}
    roles = {
        b.role_ref.name
        for b in rbac.list_cluster_role_binding().items
        if any(s.kind == "Group" and s.name in groups for s in b.subjects or [])
    }
    return [
        plane.admin.sanitize_for_serialization(rule)
        for role in sorted(roles)
        for rule in rbac.read_cluster_role(role).rules or []
    ]


# -- what the session measured ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    request: Request
    refused_by_rbac: bool  # a 403 with RBAC's decision; an admission webhook's denial is a 403 RBAC allowed


def not_collected(request: pytest.FixtureRequest) -> list[str]:
    """The files of MEASURED_FROM this session did not collect."""
    ran = {Path(item.fspath).name for item in request.session.items}
    return [name for name in MEASURED_FROM if name not in ran]


def test_every_launcher_and_preflight_file_on_the_control_plane_is_measured(request: pytest.FixtureRequest) -> None:
    """A test file of the launcher's or the preflight's that reaches the control plane is one MEASURED_FROM requires
    (checked of the files this session collected)."""
    on_plane = {
        Path(item.fspath).name
        for item in request.session.items
        if "control_plane" in item.fixturenames and any(fnmatch(Path(item.fspath).name, p) for p in MEASURED_PATTERNS)
    }
    assert on_plane <= set(MEASURED_FROM), f"add to MEASURED_FROM: {', '.join(sorted(on_plane - set(MEASURED_FROM)))}"


@pytest.fixture(scope="module")
def measured(request: pytest.FixtureRequest, control_plane: ControlPlane) -> list[Measured]:
    """Every request the runner made this session, in order."""
    if missing := not_collected(request):
        pytest.skip(
            f"the rules are measured from the requests of the launcher's and the preflight's tests on the control "
            f"plane ({', '.join(MEASURED_PATTERNS)}): run them in the same session "
            f"(not collected: {', '.join(missing)})"
        )
    events = control_plane.audit_events(user=RUNNER_USER)
    assert events, "the runner made no request: the launcher's and preflight's tests did not reach the API server"
    return [
        Measured(
            Request.of(e),
            e["responseStatus"]["code"] == 403
            and e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow",
        )
        for e in events
    ]


def table(requests: Iterable[Request]) -> str:
    return "\n".join(sorted({str(r) for r in requests}))


def test_the_runner_met_no_403(measured: list[Measured]) -> None:
    refused = [m.request for m in measured if m.refused_by_rbac]
    assert not refused, f"RBAC refused the runner (a rule missing from deploy/rbac*.yaml):\n{table(refused)}"


def installed_grant(request: Request) -> bool:
    """Granted to every authenticated user, in its namespace, by a component the tests install (Kubeflow Trainer's
    public ConfigMap, its version: tests/cluster/installed.py PUBLIC_ROLES)."""
    return any(
        request.scope == namespace and rule_allows(rule, request)
        for namespace, role in PUBLIC_ROLES
        for rule in role["rules"]
    )


def test_every_request_is_granted_by_the_deploy_files(measured: list[Measured], control_plane: ControlPlane) -> None:
    grants = [p for path in RBAC_FILES for p in permissions(path)]
    own = cluster_grants(control_plane)
    needed = [
        m.request
        for m in measured
        if not granted(m.request, grants)
        and not any(rule_allows(rule, m.request) for rule in own)
        and not installed_grant(m.request)
    ]
    assert not needed, f"requests no rule of deploy/rbac*.yaml grants:\n{table(needed)}"


def test_every_rule_is_used_by_a_request(measured: list[Measured]) -> None:
    """Each verb x resource x resourceName of deploy/rbac.yaml and of each job API's file is used by a request; each of
    deploy/rbac-cluster-read.yaml by a request that those alone would refuse (nothing granted twice)."""
    requests = {m.request for m in measured}
    base = [p for path in REQUIRED for p in permissions(path)]
    unused = [p for p in base if not any(p.allows(r) for r in requests)]
    unused += [p for p in permissions(CLUSTER_READ) if not any(p.allows(r) and not granted(r, base) for r in requests)]
    assert not unused, "rules no request uses:\n" + "\n".join(map(str, unused))


# -- a Kubeflow profile's default-editor (tests/cluster/kubeflow.py) --------------------------------------------------

PROFILE_EDITOR = re.compile(r"^system:serviceaccount:hyperpod-t[^:]*:default-editor$")


@pytest.fixture(scope="module")
def profile_measured(request: pytest.FixtureRequest, control_plane: ControlPlane) -> list[Measured]:
    """Every request a profile's default-editor made this session (the launcher's and the preflight's tests in
    profiles: make_cluster(profile=True), make_site(profile=...))."""
    if missing := not_collected(request):
        pytest.skip(
            f"measured from the requests of the launcher's and the preflight's tests on the control plane "
            f"({', '.join(MEASURED_PATTERNS)}; not collected: {', '.join(missing)})"
        )
    events = [e for e in control_plane.audit_events() if PROFILE_EDITOR.match(e["user"]["username"])]
    assert events, "no profile's default-editor made a request: the profile tests did not reach the API server"
    return [
        Measured(
            Request.of(e),
            e["responseStatus"]["code"] == 403
            and e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow",
        )
        for e in events
    ]


def kubeflow_grants(plane: ControlPlane) -> list[tuple[str, dict[str, Any]]]:
    """(scope, rule): kubeflow-edit's rules as the aggregation controller filled them, in the profile's namespace;
    the ClusterRole Kubeflow Trainer binds to every authenticated user, everywhere."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
    edit = rbac.read_cluster_role("kubeflow-edit").rules or []
    everyone = rbac.read_cluster_role(EVERYONE_BINDING["roleRef"]["name"]).rules or []
    return [(JOBS, plane.admin.sanitize_for_serialization(r)) for r in edit] + [
        ("", plane.admin.sanitize_for_serialization(r)) for r in everyone
    ]


def test_a_profiles_default_editor_needs_of_render_rbac_only_what_kubeflow_does_not_grant(
    profile_measured: list[Measured], control_plane: ControlPlane
) -> None:
    """As a profile's default-editor the steps met no 403; each request is granted by Kubeflow (kubeflow-edit in the
    profile, its grant to everyone), the cluster's own grants or render-rbac --kubeflow-profile; and each rendered rule
    grants some request that nothing else would: nothing is granted twice."""
    refused = [m.request for m in profile_measured if m.refused_by_rbac]
    assert not refused, f"RBAC refused a profile's default-editor:\n{table(refused)}"
    kubeflow = kubeflow_grants(control_plane)
    own = cluster_grants(control_plane)
    beyond = [
        m.request
        for m in profile_measured
        if not any(scope in ("", m.request.scope) and rule_allows(rule, m.request) for scope, rule in kubeflow)
        and not any(rule_allows(rule, m.request) for rule in own)
        and not installed_grant(m.request)
    ]
    profile = Subject("hyperpod-t0-profile", PROFILE_ACCOUNT)  # its Roles there would be read as JOBS: it has none

    def rendered(cluster_read: bool) -> list[Permission]:
        return [
            p
            for api in RBAC_JOB_APIS
            for p in granted_to(
                f"render-rbac --kubeflow-profile --job-api {api}",
                list(yaml.safe_load_all(render(profile, api, cluster_read=cluster_read, kubeflow_profile=True))),
                profile.namespace,
                PROFILE_ACCOUNT,
            )
        ]

    needed = [r for r in beyond if not granted(r, rendered(cluster_read=True))]
    assert not needed, f"requests neither Kubeflow nor render-rbac --kubeflow-profile grants:\n{table(needed)}"
    # The optional cluster-wide reads are deploy/rbac-cluster-read.yaml's rules, held to requests above.
    unused = {str(p) for p in rendered(cluster_read=False) if not any(p.allows(r) for r in beyond)}
    assert not unused, "rendered rules no request needs beyond Kubeflow's grants:\n" + "\n".join(sorted(unused))


# -- the files themselves -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("file", [path.name for path in RBAC_FILES])
def test_the_deploy_files_are_what_render_rbac_writes(file: str) -> None:
    """deploy/rbac*.yaml are `render-rbac --split deploy` for kubeflow/pipeline-runner: one model of the rules
    (components/preflight/access.py) for the files, the command and the preflight."""
    assert (REPO / "deploy" / file).read_text() == render_file(file), (
        f"deploy/{file} differs from render-rbac's: run hyperpod-pretrain render-rbac --split deploy"
    )


@pytest.mark.parametrize("api_name", RBAC_JOB_APIS)
def test_the_launchers_access_check_asks_for_what_the_roles_grant(api_name: str) -> None:
    """The preflight's SelfSubjectAccessReviews (launcher_access) ask, for each job API, about the launcher Role's
    grants and that API's Role's, for the launcher and the exit step's clean-up: all of them, and nothing else. The
    launcher Role's PVC read is the preflight's own."""
    api = job_api(api_name)
    path = next(p for p in JOB_API_FILES if p.name == f"rbac-{api_name}.yaml")
    role = {(p.verb, p.group, *p.resource.partition("/")[::2]) for p in permissions(RBAC) if p.role == LAUNCHER_ROLE}
    role |= {(p.verb, p.group, p.resource, "") for p in permissions(path) if p.role in JOB_ROLES}
    access = launcher_access(api)
    asked = {(verb, group, resource, subresource) for verb, group, resource, subresource, _ in access}
    assert role - asked == {("get", "", "persistentvolumeclaims", "")}
    assert asked <= role and len(asked) == len(access)


def test_the_grants_hold_no_wildcard_no_secret_and_write_only_the_jobs() -> None:
    for path in RBAC_FILES:
        for doc in deploy_grants((path,)):
            if doc["kind"].endswith("Binding"):
                assert doc["subjects"] == [
                    {"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": "kubeflow"}
                ], doc
        for permission in permissions(path):
            assert "*" not in (permission.group, permission.resource, permission.verb), permission
            assert permission.resource != "secrets", permission
            jobs = ("pytorchjobs", "trainjobs", "hyperpodpytorchjobs")
            assert permission.verb in ("get", "list", "watch") or permission.resource in jobs, permission


def test_the_matcher_reads_rules_as_rbac_does() -> None:
    """rule_allows on the cases RuleAllows tells apart (so that the tests above cannot pass by a kind matcher)."""
    log = Request("get", "", "pods", "log", "w-0", JOBS)
    assert rule_allows({"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}, log)
    assert rule_allows({"apiGroups": [""], "resources": ["*/log"], "verbs": ["get"]}, log)
    assert not rule_allows({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}, log), "pods is not pods/log"
    crd = {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["get"],
        "resourceNames": ["pytorchjobs.kubeflow.org"],
    }
    assert rule_allows(
        crd, Request("get", "apiextensions.k8s.io", "customresourcedefinitions", "", "pytorchjobs.kubeflow.org", "")
    )
    assert not rule_allows(crd, Request("list", "apiextensions.k8s.io", "customresourcedefinitions", "", "", ""))
    assert not rule_allows(crd, Request("get", "", "customresourcedefinitions", "", "pytorchjobs.kubeflow.org", ""))
    assert rule_allows(
        {"verbs": ["get"], "nonResourceURLs": ["/api", "/api/*"]}, Request("get", "", "", "", "", "", "/api/v1")
    )
