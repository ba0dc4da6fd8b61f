"""render-iam-policy allows exactly the S3 calls the project's code makes, measured on an S3 server.

One run's S3 traffic, made by the code itself against moto's server on loopback (tests/s3_server.py records every
request it answers, with the access key that signed it): staging a corpus and a tokenizer directory from S3
(components/stage_data), the trainer's checkpoint copies (trainer/durable.py: a multipart upload, a second copy,
the newest found, one downloaded, the other pruned) and the export's upload (common/s3.upload_directory). The test's
own setup signs with another key and is left out. Each request is mapped to the IAM action and resource S3
authorizes it with (AWS, S3 User Guide, "Required permissions for Amazon S3 API operations"; Service Authorization
Reference, "Actions, resources, and condition keys for Amazon S3": ListObjectsV2 -> s3:ListBucket on the bucket
with s3:prefix; HeadObject, GetObject -> s3:GetObject; PutObject, CreateMultipartUpload, UploadPart,
CompleteMultipartUpload -> s3:PutObject; AbortMultipartUpload -> s3:AbortMultipartUpload; DeleteObject ->
s3:DeleteObject, and DeleteObjects -> s3:DeleteObject for each key), then evaluated against the rendered policy
with IAM's matching (action names, Resource ARNs with * and ?, a StringLike condition, false when its key is not in
the request; IAM User Guide, "Policy evaluation logic" and "IAM JSON policy elements: Condition operators").
A request the server answered 404 on an object must stay a 404 on AWS: S3 says 404 for a missing key only to a caller
with s3:ListBucket on the bucket, else 403 (Amazon S3 API Reference, HeadObject and GetObject, "Permissions"); that
check carries no s3:prefix, so a role that may list only its prefixes gets 403 there, which the code reads as access
denied. The run below reaches the places where the code asks whether something exists (an interrupted checkpoint
copy, a source naming an object that is not there): the code asks with a listing.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import boto3
import pytest

from common.errors import InputError
from common.s3 import S3Settings, S3Source, upload_directory
from components.stage_data.core import stage_data
from pipelines.deploy.iam import policy, service_account
from tests.s3_server import S3Server
from tests.test_durable import CHUNK, committed
from tests.test_formats import corpus_of_every_format, expected_documents
from tests.tokenizer_kinds import make_tokenizer, save_pretrained
from trainer.durable import CheckpointMirror, MirrorError

BUCKET = "iam-run"
SETTINGS = {
    "source": f"s3://{BUCKET}/corpus/",
    "tokenizer": f"s3://{BUCKET}/tokenizers/llama3/",
    "checkpoints": f"s3://{BUCKET}/checkpoints/",
    "export": f"s3://{BUCKET}/exports/",
}
PROJECT_KEY, SETUP_KEY = "project-role", "test-setup"
# What no request here reaches: s3transfer aborts a multipart upload only after one of its parts failed for good.
NOT_REACHED = {"s3:AbortMultipartUpload": "s3transfer's abort of a multipart upload that failed"}


@dataclass(frozen=True)
class Authorization:
    action: str
    resource: str
    prefix: str | None = None  # s3:prefix, for ListBucket; None: the request does not carry it


def authorizations(request: dict[str, Any]) -> list[Authorization]:
    """What S3 checks for one recorded request (path-style: /bucket[/key])."""
    bucket, _, key = unquote(request["path"]).lstrip("/").partition("/")
    query = parse_qs(request["query"], keep_blank_values=True)
    method, arn = request["method"], f"arn:aws:s3:::{bucket}"
    if not key:
        if method == "GET" and query.get("list-type") == ["2"]:
            return [Authorization("s3:ListBucket", arn, (query.get("prefix") or [""])[0])]
        if method == "POST" and "delete" in query:
            return [Authorization("s3:DeleteObject", f"{arn}/{k}") for k in request["delete_keys"]]
    else:
        if method in ("GET", "HEAD"):  # a 404 on AWS needs s3:ListBucket too, with no s3:prefix in the request
            missing = [Authorization("s3:ListBucket", arn)] if request["status"] == 404 else []
            return [Authorization("s3:GetObject", f"{arn}/{key}"), *missing]
        if method in ("PUT", "POST"):  # PutObject, UploadPart; CreateMultipartUpload, CompleteMultipartUpload
            return [Authorization("s3:PutObject", f"{arn}/{key}")]
        if method == "DELETE":
            action = "s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject"
            return [Authorization(action, f"{arn}/{key}")]
    raise AssertionError(f"an S3 request this test cannot map to its IAM action: {request}")


def _arn_matches(pattern: str, arn: str) -> bool:
    """IAM's Resource matching: * any run of characters (slashes too), ? one character."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."), arn) is not None


def allowing(statements: list[dict[str, Any]], auth: Authorization) -> list[tuple[int, str, str]]:
    """(statement index, action, resource pattern) of each Allow that grants ``auth``; IAM allows when one does and no
    Deny does (the rendered policy has none)."""
    found = []
    for index, statement in enumerate(statements):
        assert statement["Effect"] == "Allow", statement
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        condition = statement.get("Condition", {})
        if auth.action not in actions:
            continue
        if condition:
            assert set(condition) == {"StringLike"} and set(condition["StringLike"]) == {"s3:prefix"}, condition
            if auth.prefix is None or not any(
                fnmatch.fnmatchcase(auth.prefix, p) for p in condition["StringLike"]["s3:prefix"]
            ):
                continue
        found += [(index, auth.action, r) for r in resources if _arn_matches(r, auth.resource)]
    return found


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The project's requests in one run's S3 traffic (staging, checkpoint copies, export), as the server saw them."""
    work = tmp_path_factory.mktemp("iam")
    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", PROJECT_KEY)
        env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_CONFIG_FILE", "/nonexistent")
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with S3Server(work / "server.log", record=work / "requests.jsonl") as server:
            setup = boto3.client(
                "s3",
                endpoint_url=server.endpoint,
                aws_access_key_id=SETUP_KEY,
                aws_secret_access_key="testing",
                region_name="us-east-1",
            )
            setup.create_bucket(Bucket=BUCKET)
            corpus = corpus_of_every_format(work / "corpus")
            texts = [t for _, _, t in expected_documents(corpus)]
            tokenizer = save_pretrained("llama3", make_tokenizer("llama3", texts), work / "tok")
            for prefix, directory in (("corpus/", corpus), ("tokenizers/llama3/", tokenizer)):
                for path in sorted(p for p in directory.rglob("*") if p.is_file()):
                    setup.put_object(
                        Bucket=BUCKET, Key=prefix + path.relative_to(directory).as_posix(), Body=path.read_bytes()
                    )
            s3 = S3Settings(endpoint_url=server.endpoint, chunk_size=CHUNK)  # a 3 MB checkpoint file: multipart
            stage_data(
                SETTINGS["source"],
                str(work / "fsx"),
                "web",
                endpoint_url=server.endpoint,
                tokenizer_path=SETTINGS["tokenizer"],
                val_fraction=0.2,
            )
            with CheckpointMirror(f"{SETTINGS['checkpoints']}run-1", s3) as mirror:
                mirror.upload(committed(work / "ckpt", 10, large=True))
                mirror.upload(committed(work / "ckpt", 20))
                interrupted = f"{SETTINGS['checkpoints'].removeprefix(f's3://{BUCKET}/')}run-1/step_00000030/"
                setup.put_object(Bucket=BUCKET, Key=f"{interrupted}__0_0.distcp", Body=b"no commit.json after it")
                newest = mirror.newest_complete()
                assert newest == "step_00000020"
                mirror.download(newest, work / "fetched")
                mirror.download("step_00000010", work / "older")  # a ranged download of the multipart copy
                with pytest.raises(MirrorError, match="no complete copy of step_00000030"):
                    mirror.download("step_00000030", work / "never")
                mirror.prune({newest})
            with pytest.raises(InputError, match="no objects under prefix 'corpus/missing.txt/'"):
                S3Source(f"{SETTINGS['source']}missing.txt", s3).list()  # a source naming one object, not there
            upload_directory(work / "fetched", f"{SETTINGS['export']}run-1", s3)
            requests = server.recorded()
    project = [r for r in requests if r["key_id"] == PROJECT_KEY]
    assert project and {r["key_id"] for r in requests} <= {PROJECT_KEY, SETUP_KEY, ""}, {r["key_id"] for r in requests}
    return project


def test_the_policy_allows_every_s3_call_of_a_run(recorded: list[dict[str, Any]]) -> None:
    statements = policy(**SETTINGS)["Statement"]
    refused = [
        (r["method"], r["path"], r["query"], r["status"], auth.action)
        for r in recorded
        for auth in authorizations(r)
        if not allowing(statements, auth)
    ]
    assert not refused, "S3 calls the rendered policy would refuse:\n" + "\n".join(map(str, refused))
    operations = {(r["method"], "uploads" in r["query"] or "uploadId" in r["query"]) for r in recorded}
    assert ("POST", True) in operations and ("PUT", True) in operations, "a multipart upload was measured"


def test_every_grant_of_the_policy_is_used_by_a_call(recorded: list[dict[str, Any]]) -> None:
    """Nothing more: each action on each resource pattern of each statement grants a recorded call, but the actions
    NOT_REACHED names (a path no test can reach without breaking S3 mid-upload)."""
    statements = policy(**SETTINGS)["Statement"]
    used = {grant for r in recorded for auth in authorizations(r) for grant in allowing(statements, auth)}
    unused = []
    for index, statement in enumerate(statements):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        unused += [
            (statement["Sid"], a, r)
            for a in actions
            for r in resources
            if (index, a, r) not in used and a not in NOT_REACHED
        ]
    assert not unused, "grants no call used:\n" + "\n".join(map(str, unused))
    listed = [a.prefix for r in recorded for a in authorizations(r) if a.prefix is not None]
    unused_prefixes = [
        value
        for s in statements
        for value in s.get("Condition", {}).get("StringLike", {}).get("s3:prefix", [])
        if not any(fnmatch.fnmatchcase(p, value) for p in listed)
    ]
    assert not unused_prefixes, f"s3:prefix values no listing used: {unused_prefixes}"
    assert {a for s in statements for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])} == {
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
    }


def test_the_matching_reads_policies_as_iam_does() -> None:
    """So that the tests above cannot pass by a kind matcher."""
    listing = {
        "Sid": "L",
        "Effect": "Allow",
        "Action": "s3:ListBucket",
        "Resource": "arn:aws:s3:::b",
        "Condition": {"StringLike": {"s3:prefix": ["data/*"]}},
    }
    assert allowing([listing], Authorization("s3:ListBucket", "arn:aws:s3:::b", "data/"))
    assert not allowing([listing], Authorization("s3:ListBucket", "arn:aws:s3:::b", "other/"))
    assert not allowing([listing], Authorization("s3:ListBucket", "arn:aws:s3:::b", ""))
    objects = {"Sid": "O", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["arn:aws:s3:::b/data/*"]}
    assert allowing([objects], Authorization("s3:GetObject", "arn:aws:s3:::b/data/x/y.bin"))
    assert not allowing([objects], Authorization("s3:GetObject", "arn:aws:s3:::b/database"))
    assert not allowing([objects], Authorization("s3:PutObject", "arn:aws:s3:::b/data/x"))
    missing = {"method": "HEAD", "path": "/b/data/x", "query": "", "status": 404}
    assert authorizations(missing) == [
        Authorization("s3:GetObject", "arn:aws:s3:::b/data/x"),
        Authorization("s3:ListBucket", "arn:aws:s3:::b"),
    ]
    assert not allowing([listing], authorizations(missing)[1]), "a listing only of a prefix: AWS answers it 403"
    delete = {"method": "POST", "path": "/b", "query": "delete", "delete_keys": ["a", "c/d"]}
    assert authorizations(delete) == [
        Authorization("s3:DeleteObject", "arn:aws:s3:::b/a"),
        Authorization("s3:DeleteObject", "arn:aws:s3:::b/c/d"),
    ]


def test_a_setting_without_a_trailing_slash_may_name_one_object_or_a_directory() -> None:
    """The code reads `s3://b/corpus/one.txt` as the directory corpus/one.txt/ when anything lies under it, else as
    the one object (common.s3.S3Source.list, asked with a listing of that exact key): both are granted."""
    listing, reading = policy(source="s3://b-1/corpus/one.txt", partition="aws-cn")["Statement"]
    assert listing["Resource"] == "arn:aws-cn:s3:::b-1"
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["corpus/one.txt", "corpus/one.txt/*"]}}
    assert reading["Resource"] == ["arn:aws-cn:s3:::b-1/corpus/one.txt", "arn:aws-cn:s3:::b-1/corpus/one.txt/*"]
    assert policy(source="s3://b-1/corpus/")["Statement"][0]["Condition"]["StringLike"]["s3:prefix"] == ["corpus/*"]


def test_render_iam_policy_and_service_account_commands() -> None:
    cli = [sys.executable, "-m", "pipelines.cli"]
    made = subprocess.run(
        [*cli, "render-iam-policy", "--source", SETTINGS["source"], "--checkpoint-s3-uri", SETTINGS["checkpoints"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout) == policy(source=SETTINGS["source"], checkpoints=SETTINGS["checkpoints"])
    refused = subprocess.run(
        [*cli, "render-iam-policy", "--source", "gs://bucket/x"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "--source 'gs://bucket/x' is not an s3:// URI"
    )
    role = "arn:aws:iam::123456789012:role/team-a-trainer"
    irsa = subprocess.run(
        [*cli, "render-service-account", "--namespace", "team-a", "--name", "trainer", "--role-arn", role],
        capture_output=True,
        text=True,
        timeout=60,
    )
    account = json.loads("".join(line for line in irsa.stdout.splitlines(True) if not line.startswith("#")))
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": role}
    assert '"system:serviceaccount:team-a:trainer"' in irsa.stdout
    pod_identity = subprocess.run(
        [
            *cli,
            "render-service-account",
            "--namespace",
            "team-a",
            "--name",
            "trainer",
            "--role-arn",
            role,
            "--pod-identity",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "aws eks create-pod-identity-association --cluster-name <cluster>" in pod_identity.stdout
    assert "annotations" not in pod_identity.stdout and '"pods.eks.amazonaws.com"' in pod_identity.stdout


def test_the_irsa_trust_policy_names_the_clusters_provider_in_the_roles_partition() -> None:
    issuer = "https://oidc.eks.cn-north-1.amazonaws.com.cn/id/5C6B0A1F2E"
    text = service_account(
        "team-a", "trainer", "arn:aws-cn:iam::123456789012:role/t", oidc_issuer=issuer, cluster="hp-1"
    )
    comments = [line.removeprefix("# ") for line in text.splitlines() if line.startswith("# ")]
    start = comments.index("The role's trust policy:") + 1
    trust = json.loads("\n".join(comments[start : comments.index("}", start) + 1]))
    provider = issuer.removeprefix("https://")
    assert trust["Statement"] == [
        {
            "Effect": "Allow",
            "Principal": {"Federated": f"arn:aws-cn:iam::123456789012:oidc-provider/{provider}"},
            "Action": "sts:AssumeRoleWithWebIdentity",
            "Condition": {
                "StringEquals": {
                    f"{provider}:sub": "system:serviceaccount:team-a:trainer",
                    f"{provider}:aud": "sts.amazonaws.com",
                }
            },
        }
    ]
    assert "aws eks describe-cluster --name hp-1 " in text
    with pytest.raises(InputError, match=r"^--oidc-issuer 'oidc.eks.x' is not an EKS cluster's OIDC issuer"):
        service_account("team-a", "trainer", "arn:aws:iam::123456789012:role/t", oidc_issuer="oidc.eks.x")
    with pytest.raises(InputError, match=r"^--role-arn 'arn:aws:iam::1:role/t' is not an IAM role ARN"):
        service_account("team-a", "trainer", "arn:aws:iam::1:role/t")
