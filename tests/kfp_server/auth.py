"""KFP's multi-user authorization: who the caller is and whether it may act, asked of a real Kubernetes API server
(KubernetesAuthorizer), and each handler's check of a call (Authorized, the servers' canAccess*)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.kfp_server.errors import KfpError
from tests.kfp_server.records import Call


class KubernetesAuthorizer:
    """KFP's multi-user authorization, against a real Kubernetes API server (kubeflow/pipelines 2.17.0):

    - the user is the bearer token's, as a TokenReview with the audience pipelines.kubeflow.org says
      (backend/src/apiserver/auth/authenticator_token_review.go, doTokenReview; the audience is
      common.DefaultTokenReviewAudience, TOKEN_REVIEW_AUDIENCE unset); no token, or one the review does not
      authenticate: 401 Unauthenticated (resource/resource_manager.go IsAuthorized: "User identity is empty in the
      request header"). The kubeflow-userid header the UI's Istio gateway sets is not played: the CLI never sends it.
    - then a SubjectAccessReview for that user of group pipelines.kubeflow.org, version v1beta1, the resource type
      (experiments, runs, jobs for recurring runs, pipelines), the verb and the namespace (IsAuthorized); not
      allowed: 403 PermissionDenied, "User '<user>' is not authorized with reason: <reason> (request: ...)".
    """

    GROUP, VERSION, AUDIENCE = "pipelines.kubeflow.org", "v1beta1", "pipelines.kubeflow.org"

    def __init__(self, api_client: Any) -> None:
        import kubernetes

        self.authn = kubernetes.client.AuthenticationV1Api(api_client)
        self.authz = kubernetes.client.AuthorizationV1Api(api_client)

    def user(self, headers: Mapping[str, str]) -> str:
        header = headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise KfpError(
                401,
                "Failed to check authorization. User identity is empty in the request header: Request "
                "header error: there is no user identity header.",
                violation=False,
            )
        review = self.authn.create_token_review(
            {"spec": {"token": header.removeprefix("Bearer "), "audiences": [self.AUDIENCE]}}
        )
        if not review.status.authenticated or self.AUDIENCE not in (review.status.audiences or []):
            raise KfpError(
                401,
                "Failed to check authorization. User identity is empty in the request header: "
                "Authentication failure: Review.Status.Authenticated is false. Error "
                f"{review.status.error or ''}",
                violation=False,
            )
        return review.status.user.username

    def authorize(self, headers: Mapping[str, str], resource: str, verb: str, namespace: str, name: str = "") -> None:
        user = self.user(headers)
        attributes = {
            "group": self.GROUP,
            "version": self.VERSION,
            "resource": resource,
            "verb": verb,
            "namespace": namespace,
            **({"name": name} if name else {}),
        }
        review = self.authz.create_subject_access_review({"spec": {"user": user, "resourceAttributes": attributes}})
        if not review.status.allowed:
            raise KfpError(
                403,
                f"User '{user}' is not authorized with reason: {review.status.reason or ''} "
                f"(request: {attributes}): Unauthorized access",
                violation=False,
            )


class Authorized:
    """The handlers' base: in multi-user mode (``multi_user`` with an ``authorizer``), each call is authorized."""

    multi_user: bool
    authorizer: KubernetesAuthorizer | None

    def _access(
        self, call: Call, resource: str, verb: str, namespace: str, wrap: str, empty: str, name: str = ""
    ) -> None:
        """Multi-user mode's check of a call (the servers' canAccessExperiment, canAccessRun, canAccessJob): a
        namespace is required, then the authorizer decides; its refusal is wrapped as the server wraps it."""
        if not (self.multi_user and self.authorizer is not None):
            return
        if not namespace:
            raise KfpError(400, f"Invalid input error: {empty}", violation=False)
        try:
            self.authorizer.authorize(call.headers, resource, verb, namespace, name)
        except KfpError as error:
            raise KfpError(error.status, f"{wrap}: {error.message}", violation=False) from None
