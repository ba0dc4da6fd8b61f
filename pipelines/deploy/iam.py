"""`render-iam-policy` and `render-service-account`: the AWS side of a run's S3 access, least privilege.

Who calls S3, with the project's one client (common/s3.py):
- the staging steps (KFP's pods, the pipeline's service account): list the source prefix and read its objects
  (ListObjectsV2, GetObject, HeadObject of a large listed object; s3transfer's ranged GETs), the same for a tokenizer;
- the trainer (the trainer pods' service account, compile --trainer-service-account): its checkpoint copies
  (trainer/durable.py: list, get, put, multipart uploads, DeleteObjects when pruning);
- the evaluation step (the pipeline's service account): the export's upload (PutObject and multipart).

Each operation needs one IAM action on one resource (AWS, "Required permissions for Amazon S3 API operations", S3 User
Guide, and "Actions, resources, and condition keys for Amazon S3", Service Authorization Reference): ListObjectsV2
needs s3:ListBucket on the bucket (its s3:prefix condition key is the request's prefix; the code asks whether an
object exists with a listing too, since a HeadObject of a missing key is a 403 to a role that may list only a prefix);
HeadObject and GetObject need s3:GetObject on the object; PutObject, CreateMultipartUpload, UploadPart and
CompleteMultipartUpload need s3:PutObject; AbortMultipartUpload needs s3:AbortMultipartUpload; DeleteObjects needs
s3:DeleteObject on each key it names. The policy grants exactly those, on the run's prefixes only; tests/test_iam.py
replays what the code sent to an S3 server against it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.errors import InputError

PARTITIONS = ("aws", "aws-cn", "aws-us-gov")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ROLE_ARN = re.compile(r"^arn:(aws|aws-cn|aws-us-gov):iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_OIDC_ISSUER = re.compile(r"^https://oidc\.eks\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/id/[A-Za-z0-9]+$")
_CLUSTER = re.compile(r"^[0-9A-Za-z][A-Za-z0-9_-]{0,99}$")  # EKS CreateCluster's name pattern
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"  # what the EKS Pod Identity Webhook reads (IRSA)


@dataclass(frozen=True)
class Prefix:
    """s3://bucket/prefix, as a run's setting names it (a directory; or one object, for a tokenizer file)."""

    flag: str
    bucket: str
    key: str  # no leading or trailing slash; "" for the whole bucket
    directory: bool  # given with a trailing slash (or the bucket): never one object of that name

    @classmethod
    def of(cls, flag: str, uri: str) -> Prefix:
        if not uri.startswith("s3://"):
            raise InputError(f"{flag} {uri!r} is not an s3:// URI")
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise InputError(f"{flag} {uri!r}: {bucket!r} is not an S3 bucket name")
        if any(c in key for c in "*?$\n") or "//" in key:
            raise InputError(f"{flag} {uri!r}: the prefix may not hold '*', '?', '$', '//' or a newline")
        return cls(flag, bucket, key.strip("/"), directory=uri.endswith("/") or not key.strip("/"))

    def bucket_arn(self, partition: str) -> str:
        return f"arn:{partition}:s3:::{self.bucket}"

    def objects(self, partition: str) -> list[str]:
        """The objects under it, and, unless it ends with a slash, the one object it may name (a source or a
        tokenizer.json given as a file: the code reads that object when nothing lies under the prefix)."""
        under = f"{self.bucket_arn(partition)}/{self.key}/*" if self.key else f"{self.bucket_arn(partition)}/*"
        return [under] if self.directory else [under, f"{self.bucket_arn(partition)}/{self.key}"]

    def listed(self) -> list[str]:
        """The s3:prefix values its listings send: <prefix>/ and below (the code lists a prefix as a directory), and,
        unless it ends with a slash, the prefix itself (common.s3.list_exact: whether that one object exists)."""
        if not self.key:
            return ["*"]
        return [f"{self.key}/*"] if self.directory else [f"{self.key}/*", self.key]


def policy(
    source: str = "", tokenizer: str = "", checkpoints: str = "", export: str = "", partition: str = "aws"
) -> dict[str, Any]:
    """The IAM policy for a run's S3 settings: read (list and get) the source and tokenizer; read, write and prune the
    checkpoint copies; write the export. An empty setting grants nothing."""
    if partition not in PARTITIONS:
        raise InputError(f"--partition {partition!r}: one of {', '.join(PARTITIONS)}")
    reads = [Prefix.of(flag, uri) for flag, uri in (("--source", source), ("--tokenizer-path", tokenizer)) if uri]
    copies = Prefix.of("--checkpoint-s3-uri", checkpoints) if checkpoints else None
    out = Prefix.of("--export-s3-uri", export) if export else None
    if not (reads or copies or out):
        raise InputError("give at least one of --source, --tokenizer-path, --checkpoint-s3-uri, --export-s3-uri")
    statements: list[dict[str, Any]] = []

    def listing(sid: str, prefixes: list[Prefix]) -> None:
        for bucket in sorted({p.bucket for p in prefixes}):
            values = sorted({v for p in prefixes if p.bucket == bucket for v in p.listed()})
            statements.append(
                {
                    "Sid": f"{sid}{len(statements)}",
                    "Effect": "Allow",
                    "Action": "s3:ListBucket",
                    "Resource": f"arn:{partition}:s3:::{bucket}",
                    "Condition": {"StringLike": {"s3:prefix": values}},
                }
            )

    def objects(sid: str, actions: list[str], prefixes: list[Prefix]) -> None:
        resources = sorted({r for p in prefixes for r in p.objects(partition)})
        statements.append(
            {"Sid": f"{sid}{len(statements)}", "Effect": "Allow", "Action": actions, "Resource": resources}
        )

    if reads:
        listing("ListInputs", reads)
        objects("ReadInputs", ["s3:GetObject"], reads)
    if copies:
        listing("ListCheckpointCopies", [copies])
        objects(
            "CheckpointCopies", ["s3:AbortMultipartUpload", "s3:DeleteObject", "s3:GetObject", "s3:PutObject"], [copies]
        )
    if out:
        objects("WriteExport", ["s3:AbortMultipartUpload", "s3:PutObject"], [out])
    return {"Version": "2012-10-17", "Statement": statements}


def render_policy(**settings: str) -> str:
    return json.dumps(policy(**settings), indent=2) + "\n"


def service_account(
    namespace: str, name: str, role_arn: str, pod_identity: bool = False, oidc_issuer: str = "", cluster: str = ""
) -> str:
    """A ServiceAccount for IRSA (annotated with the role; the EKS Pod Identity Webhook then gives its pods web
    identity credentials) or for EKS Pod Identity (no annotation: the association is made with the EKS API), with
    the role's trust policy and what to run, as comments: one file that kubectl applies as it is, and the platform
    team reads the rest from. The cluster's OIDC issuer and name fill those in; without them, placeholders.

    IRSA's trust: the cluster's OIDC provider as a Federated principal, sts:AssumeRoleWithWebIdentity, and
    StringEquals on the token's sub (this service account) and aud (sts.amazonaws.com) (EKS User Guide, "Assign IAM
    roles to Kubernetes service accounts"). Pod Identity's: the service principal pods.eks.amazonaws.com with
    sts:AssumeRole and sts:TagSession (EKS User Guide, "Create IAM role with trust policy required by EKS Pod
    Identity").
    """
    if not _DNS_1123.match(namespace) or len(namespace) > 63:
        raise InputError(f"--namespace {namespace!r} is not a namespace name (a DNS-1123 label)")
    if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", name) or len(name) > 253:
        raise InputError(f"--name {name!r} is not a service account name")
    role = _ROLE_ARN.match(role_arn)
    if not role:
        raise InputError(f"--role-arn {role_arn!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
    if oidc_issuer and not _OIDC_ISSUER.match(oidc_issuer):
        raise InputError(
            f"--oidc-issuer {oidc_issuer!r} is not an EKS cluster's OIDC issuer "
            "(https://oidc.eks.<region>.amazonaws.com/id/<id>)"
        )
    if cluster and not _CLUSTER.match(cluster):
        raise InputError(f"--cluster-name {cluster!r} is not an EKS cluster name")
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {"app.kubernetes.io/part-of": "hyperpod-pretrain"},
    }
    if pod_identity:
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Service": "pods.eks.amazonaws.com"},
                    "Action": ["sts:AssumeRole", "sts:TagSession"],
                }
            ],
        }
        how = [
            f"EKS Pod Identity: associate the role with {namespace}/{name} (the EKS Pod Identity Agent add-on must "
            "run on the cluster):",
            f"  aws eks create-pod-identity-association --cluster-name {cluster or '<cluster>'} --namespace "
            f"{namespace} --service-account {name} --role-arn {role_arn}",
        ]
    else:
        metadata["annotations"] = {IRSA_ANNOTATION: role_arn}
        partition, account = role.group(1), role_arn.split(":")[4]
        provider = oidc_issuer.removeprefix("https://") or "oidc.eks.<region>.amazonaws.com/id/<id>"
        trust = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Federated": f"arn:{partition}:iam::{account}:oidc-provider/{provider}"},
                    "Action": "sts:AssumeRoleWithWebIdentity",
                    "Condition": {
                        "StringEquals": {
                            f"{provider}:sub": f"system:serviceaccount:{namespace}:{name}",
                            f"{provider}:aud": "sts.amazonaws.com",
                        }
                    },
                }
            ],
        }
        how = [
            f"IRSA: the cluster's OIDC provider (aws eks describe-cluster --name {cluster or '<cluster>'} --query "
            "cluster.identity.oidc.issuer) must be an IAM identity provider; the role trusts it for this account "
            "only:"
        ]
    lines = [
        *how,
        "The role's trust policy:",
        *json.dumps(trust, indent=2).splitlines(),
        "Its permissions: hyperpod-pretrain render-iam-policy with the run's S3 settings.",
    ]
    doc = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata}
    return "\n".join(f"# {line}" for line in lines) + "\n" + json.dumps(doc, indent=2) + "\n"
