"""What the platform team applies once, rendered: render-runtime (the ClusterTrainingRuntime), render-rbac,
render-storage (FSx PVs and PVCs), render-iam-policy and render-service-account."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import yaml

from common.errors import InputError
from components.launch_training.job_api import DEFAULT_JOB_API, JOB_APIS
from components.launch_training.manifest import DEFAULT_RUNTIME, GPU_TOLERATION, JobSpec
from components.launch_training.platform import run_options
from components.launch_training.trainjob import render_runtime
from pipelines.cli.args import (
    add_platform_args,
    command,
    key_value,
    non_negative_int,
    note_given_flags,
    platform_from_args,
    positive_int,
)
from pipelines.cli.job import submitted_inputs
from pipelines.deploy import rbac
from pipelines.deploy.iam import render_policy, service_account
from pipelines.package import step_config

# The imports inside functions are heavy (kubernetes, boto3): only the command that runs takes them, and
# `hyperpod-pretrain --help` loads none.

log = logging.getLogger("hyperpod-pretrain")

EXAMPLES = {  # each command's example, ending its --help (a test parses each)
    "render-runtime": "render-runtime --fsx-pvc fsx-claim --restart-budget 5",
    "render-rbac": "render-rbac --namespace team-a --service-account default-editor --kubeflow-profile",
    "render-storage": "render-storage --namespace team-a --namespace team-b --file-system-id fs-0123456789abcdef0 "
    "--dns-name fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com --mount-name abcdefgh --capacity 2400Gi",
    "render-iam-policy": "render-iam-policy --source s3://my-bucket/corpus/ --checkpoint-s3-uri "
    "s3://my-bucket/checkpoints/",
    "render-service-account": "render-service-account --namespace team-a --name trainer --role-arn "
    "arn:aws:iam::123456789012:role/team-a-trainer",
}


def add_commands(sub: Any) -> None:
    add_render_runtime(sub)
    add_render_rbac(sub)
    add_render_storage(sub)
    add_render_iam_policy(sub)
    add_render_service_account(sub)


def add_render_runtime(sub: Any) -> None:
    """render-runtime: the ClusterTrainingRuntime of a --job-api trainjob pipeline."""
    p = command(
        sub,
        "render-runtime",
        "print the ClusterTrainingRuntime a --job-api trainjob pipeline needs (apply it once, as a cluster admin)",
        EXAMPLES["render-runtime"],
    )
    add_platform_args(p, mount_path="/fsx", mount_help="default: %(default)s")
    p.add_argument("--instance-type", default="p5.48xlarge", help="sets GPUs, EFA devices and memory per node")
    p.add_argument(
        "--restart-budget",
        type=int,
        default=3,
        help="whole-group restarts a TrainJob survives (JobSet failurePolicy.maxRestarts; default: %(default)s)",
    )
    p.add_argument(
        "--grace-period-s",
        type=positive_int,
        default=120,
        help="the pods' default termination grace period, the SIGTERM checkpoint's time (a run may change "
        "it: job option grace_period_s; default: %(default)s)",
    )
    p.add_argument("--image", default="", help="a default trainer image (each TrainJob names its own)")
    p.add_argument(
        "--pipeline-file",
        default="",
        metavar="PATH",
        help="the runtime a compiled --job-api trainjob pipeline's TrainJobs need, from its compiled "
        "platform settings and defaults (overridden by --param), as its preflight compares it; the "
        "platform flags are refused beside it (--restart-budget and --grace-period-s stay the runtime's "
        "own)",
    )
    p.add_argument(
        "--param",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of --pipeline-file (instance_type, job_options), as submit takes it",
    )
    p.add_argument("--pipeline-run-id", default="", help=argparse.SUPPRESS)
    note_given_flags(p)
    p.set_defaults(func=cmd_render_runtime)


def cmd_render_runtime(args: argparse.Namespace) -> int:
    """Our ClusterTrainingRuntime for the platform's settings, as the platform team applies it once (a cluster
    admin: ClusterTrainingRuntimes are cluster-scoped)."""
    image, instance_type, grace_s, budget = args.image, args.instance_type, args.grace_period_s, args.restart_budget
    if args.pipeline_file:  # the settings a submission of it has: compiled in, its defaults and the --param values
        args.given_flags -= {"--restart-budget", "--grace-period-s"}  # the runtime's own, not the pipeline's
        inputs = submitted_inputs(args, "preflight")
        assert inputs is not None
        config = step_config(inputs)
        platform, image, instance_type = config.platform, config.image, config.instance_type
        if platform.job_api != "trainjob":
            raise InputError(
                f"--pipeline-file {args.pipeline_file}: compiled for --job-api {platform.job_api}; a "
                "ClusterTrainingRuntime is for a --job-api trainjob pipeline"
            )
        options = run_options(config.job_options, platform.job_api)
        grace_s, budget = options.get("grace_period_s", grace_s), options.get("restart_budget", budget)
    else:
        platform = platform_from_args(args, namespaces=[], registries=[])
        if image:
            platform.check_image(image)
    spec = JobSpec(
        name=platform.runtime_name,
        image=image,
        trainer_args=[],
        job_api="trainjob",
        runtime_name=platform.runtime_name,
        instance_type=instance_type,
        mount_path=platform.mount_path,
        pvc_name=platform.pvc_name,
        grace_period_s=grace_s,
        restart_budget=budget,
        service_account=platform.service_account,
        automount_service_account_token=platform.automount_service_account_token,
        tolerations=[GPU_TOLERATION, *platform.tolerations],
        health_affinity=platform.health_affinity,
        node_selector=dict(platform.node_selector),
        image_pull_secrets=list(platform.image_pull_secrets),
        env=dict(platform.env),
    )
    print(yaml.safe_dump(render_runtime(spec), sort_keys=False), end="")
    return 0


def add_render_rbac(sub: Any) -> None:
    """render-rbac: the pipeline's service account's Roles and bindings."""
    p = command(
        sub, "render-rbac", "print the Roles and bindings the pipeline's service account needs", EXAMPLES["render-rbac"]
    )
    p.add_argument(
        "--namespace",
        default="kubeflow",
        help="the service account's namespace, where the jobs go (a Kubeflow profile's; default: "
        "%(default)s, standalone KFP's)",
    )
    p.add_argument(
        "--service-account",
        default="pipeline-runner",
        help="what the pipeline's pods run as (default: %(default)s, standalone KFP's; a profile's: default-editor)",
    )
    p.add_argument("--jobs-namespace", default="", help="where the jobs go, if not in the service account's namespace")
    p.add_argument("--job-api", choices=JOB_APIS, default=DEFAULT_JOB_API, help="the compiled pipeline's job API")
    p.add_argument("--runtime-name", default=DEFAULT_RUNTIME, help="trainjob: the ClusterTrainingRuntime's name")
    p.add_argument(
        "--kubeflow-profile",
        action="store_true",
        help="the service account is a Kubeflow profile's default-editor: leave out what kubeflow-edit and "
        "Kubeflow's own grants already give it",
    )
    p.add_argument(
        "--cluster-read",
        action="store_true",
        help="add the preflight's optional cluster-wide reads (deploy/rbac-cluster-read.yaml)",
    )
    p.add_argument(
        "--split",
        metavar="DIR",
        help="write one file per deploy/ file, for every job API, instead (render-rbac --split deploy "
        "writes deploy/ as checked in)",
    )
    p.set_defaults(func=cmd_render_rbac)


def cmd_render_rbac(args: argparse.Namespace) -> int:
    subject = rbac.Subject(args.namespace, args.service_account, args.jobs_namespace)
    if args.split:
        if args.kubeflow_profile or args.cluster_read:
            raise InputError(
                "--split writes deploy/'s files, all of them in full: leave out --kubeflow-profile and --cluster-read"
            )
        if not Path(args.split).is_dir():
            raise InputError(f"--split {args.split}: not a directory")
        for path in rbac.write_deploy(Path(args.split), subject, args.runtime_name):
            log.info("wrote %s", path)
        return 0
    print(rbac.render(subject, args.job_api, args.runtime_name, args.cluster_read, args.kubeflow_profile), end="")
    return 0


def add_render_storage(sub: Any) -> None:
    """render-storage: an FSx file system's PVs and PVCs."""
    p = command(
        sub,
        "render-storage",
        "print a PV and PVC per namespace for one FSx for Lustre file system",
        EXAMPLES["render-storage"],
    )
    p.add_argument(
        "--namespace",
        action="append",
        required=True,
        metavar="NS",
        help="a namespace whose runs use the file system (repeatable: one PV and PVC each)",
    )
    p.add_argument("--file-system-id", required=True, help="the FSx file system (aws fsx describe-file-systems)")
    p.add_argument("--dns-name", required=True, help="its DNSName")
    p.add_argument("--mount-name", required=True, help="its LustreConfiguration.MountName")
    p.add_argument("--capacity", required=True, help="its StorageCapacity, e.g. 2400Gi")
    p.add_argument("--pvc-name", default="fsx-lustre-pvc", help="the PVC's name (compile --fsx-pvc)")
    p.add_argument(
        "--deployment-type",
        default="",
        help="its DeploymentType, recorded on the PVs for the preflight's "
        "checkpoint-throughput check (a static PV has no StorageClass to say it)",
    )
    p.add_argument(
        "--per-unit-storage-throughput",
        type=non_negative_int,
        default=0,
        help="a PERSISTENT file system's PerUnitStorageThroughput (MB/s/TiB), recorded too",
    )
    p.set_defaults(func=cmd_render_storage)


def cmd_render_storage(args: argparse.Namespace) -> int:
    from pipelines.deploy.storage import FileSystem, render

    file_system = FileSystem(
        args.file_system_id,
        args.dns_name,
        args.mount_name,
        args.capacity,
        args.deployment_type,
        args.per_unit_storage_throughput,
    )
    print(render(file_system, args.namespace, args.pvc_name), end="")
    return 0


def add_render_iam_policy(sub: Any) -> None:
    """render-iam-policy: the IAM policy of a run's S3 settings."""
    p = command(
        sub,
        "render-iam-policy",
        "print the IAM policy a run's S3 settings need, and nothing more",
        EXAMPLES["render-iam-policy"],
    )
    p.add_argument("--source", default="", help="the corpus prefix (s3://bucket/prefix/): list and read")
    p.add_argument("--tokenizer-path", default="", help="a tokenizer in S3: read")
    p.add_argument(
        "--checkpoint-s3-uri",
        default="",
        help="where the runs' checkpoint copies go (the trainer's role): list, read, write, prune",
    )
    p.add_argument("--export-s3-uri", default="", help="where evaluation exports the model: write")
    p.add_argument("--partition", default="aws", help="the AWS partition of the ARNs (aws, aws-cn, aws-us-gov)")
    p.set_defaults(func=cmd_render_iam_policy)


def cmd_render_iam_policy(args: argparse.Namespace) -> int:
    print(
        render_policy(
            source=args.source,
            tokenizer=args.tokenizer_path,
            checkpoints=args.checkpoint_s3_uri,
            export=args.export_s3_uri,
            partition=args.partition,
        ),
        end="",
    )
    return 0


def add_render_service_account(sub: Any) -> None:
    """render-service-account: a ServiceAccount bound to an IAM role."""
    p = command(
        sub,
        "render-service-account",
        "print a ServiceAccount bound to an IAM role (IRSA or Pod Identity)",
        EXAMPLES["render-service-account"],
    )
    p.add_argument("--namespace", required=True, help="its namespace (a profile's, or where the jobs run)")
    p.add_argument("--name", required=True, help="its name (compile --trainer-service-account for the trainer's)")
    p.add_argument("--role-arn", required=True, help="the IAM role its pods assume")
    p.add_argument(
        "--pod-identity",
        action="store_true",
        help="EKS Pod Identity instead of IRSA: no annotation; prints the association to make",
    )
    p.add_argument(
        "--oidc-issuer",
        default="",
        help="IRSA: the cluster's OIDC issuer URL, for the trust policy (aws eks describe-cluster --query "
        "cluster.identity.oidc.issuer); default: placeholders",
    )
    p.add_argument("--cluster-name", default="", help="the EKS cluster, for the commands printed")
    p.set_defaults(func=cmd_render_service_account)


def cmd_render_service_account(args: argparse.Namespace) -> int:
    print(
        service_account(
            args.namespace, args.name, args.role_arn, args.pod_identity, args.oidc_issuer, args.cluster_name
        ),
        end="",
    )
    return 0
