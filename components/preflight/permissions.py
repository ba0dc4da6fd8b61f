"""The permissions check: the step's service account may do, in the jobs' namespace, everything the launcher will
ask of the API server (access.py's rules, asked one by one with SelfSubjectAccessReviews); when not, the
render-rbac command that grants what is missing."""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from components.launch_training.pytorchjob import PYTORCHJOB
from components.preflight.access import JOBS, PROFILE_ACCOUNT, kubeflow_source, launcher_access
from components.preflight.context import Context, forbidden
from components.preflight.result import FAIL, PASS, WARN, Check

LAUNCHER_ACCESS = launcher_access(PYTORCHJOB)


def whoami(ctx: Context) -> str:
    """The step's own user name (a SelfSubjectReview, which every authenticated user may make: the bootstrap
    ClusterRole system:basic-user), or "" where the server cannot say."""
    review = client.V1SelfSubjectReview(metadata=client.V1ObjectMeta())
    try:
        answer = ctx.kube.call("review identity", ctx.authn.create_self_subject_review, review)
    except ApiException:
        return ""
    return (answer.status.user_info.username or "") if answer.status and answer.status.user_info else ""


def rbac_fix(ctx: Context, user: str) -> str:
    """The command that renders what is missing for the step's service account and the jobs' namespace (a Kubeflow
    profile's default-editor: less what kubeflow-edit gives it)."""
    prefix = "system:serviceaccount:"
    if user.startswith(prefix):
        account_ns, _, account = user.removeprefix(prefix).partition(":")
    else:
        account_ns, account = "<its namespace>", "<the pipeline steps' service account>"
    where = f"--namespace {account_ns}"
    if account_ns != ctx.namespace:
        where += f" --jobs-namespace {ctx.namespace}"
    profile = " --kubeflow-profile" if account == PROFILE_ACCOUNT and account_ns == ctx.namespace else ""
    return (
        f"hyperpod-pretrain render-rbac {where} --service-account {account} --job-api {ctx.api.name}{profile} "
        "| kubectl apply -f -"
    )


def granted_by(ctx: Context, user: str, access: tuple[tuple[str, str, str, str, bool], ...]) -> str:
    """Which roles are expected to grant the launcher's access: for a Kubeflow profile's default-editor, Kubeflow's
    aggregated into kubeflow-edit where they cover it; render-rbac's Roles for the rest."""
    profile = user == f"system:serviceaccount:{ctx.namespace}:{PROFILE_ACCOUNT}"
    sources: dict[str, int] = {}
    for verb, group, resource, subresource, _ in access:
        kubeflow = profile and kubeflow_source(
            ctx.api.name, JOBS, verb, group, f"{resource}/{subresource}" if subresource else resource
        )
        name = f"Kubeflow's {kubeflow.role} (kubeflow-edit)" if kubeflow else "render-rbac's Roles"
        sources[name] = sources.get(name, 0) + 1
    return "; ".join(f"{count} from {name}" for name, count in sources.items())


def check_permissions(ctx: Context) -> Check:
    ns = ctx.namespace
    missing: list[tuple[str, str, bool]] = []
    access = launcher_access(ctx.api)
    user = whoami(ctx)
    fix = rbac_fix(ctx, user)
    for verb, group, resource, subresource, needed in access:
        attrs = client.V1ResourceAttributes(
            namespace=ns, verb=verb, group=group, resource=resource, subresource=subresource or None
        )
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
        try:
            answer = ctx.kube.call("review access", ctx.authz.create_self_subject_access_review, review)
        except ApiException as exc:
            if not forbidden(exc):
                raise
            return Check(
                "permissions",
                WARN,
                "cannot review the service account's access (SelfSubjectAccessReview forbidden)",
                fix,
            )
        if not (answer.status and answer.status.allowed):
            qualified = f"{resource}.{group}" if group else resource
            missing.append((verb, f"{qualified}/{subresource}" if subresource else qualified, needed))
    who = user.removeprefix("system:serviceaccount:").replace(":", "/") or "the service account"
    needed = [f"{verb} {what}" for verb, what, must in missing if must]
    optional = [f"{verb} {what}" for verb, what, must in missing if not must]
    if needed:
        also = f"; also {', '.join(optional)} (the pods' events)" if optional else ""
        return Check("permissions", FAIL, f"{who} may not, in namespace {ns}: {', '.join(needed)}{also}", fix)
    if optional:
        return Check(
            "permissions",
            WARN,
            f"{who} may not {', '.join(optional)} in {ns}: the launcher runs but cannot show the pods' events",
            fix,
        )
    return Check(
        "permissions",
        PASS,
        f"all {len(access)} permissions the launcher uses, in namespace {ns}, for {who} "
        f"({granted_by(ctx, user, access)})",
    )
