"""What several commands' parsers share: the parser and its help formatter, value types, and the flags of the
storage, the cluster and the platform."""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from components.evaluate_checkpoint.benchmarks import DEFAULT_BENCHMARKS
from components.launch_training.job_api import DEFAULT_JOB_API, JOB_APIS
from components.launch_training.log_rules import load_rules
from components.launch_training.manifest import DEFAULT_RUNTIME
from components.launch_training.platform import Platform

# The imports inside functions are heavy (torch, by trainer.mixture): only the command that runs takes them, and
# `hyperpod-pretrain --help` loads none.


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {value}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse as this command line wants it: no abbreviations (`--max-step 5` is not `--max-steps 5`), and an
    unknown flag answered with the command's closest one (`--text_field`: did you mean --text-field?)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = list(self._option_string_actions)
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None):
                    flags += list(action.choices[getattr(parsed, action.dest)]._option_string_actions)
            given = [extra.split("=")[0] for extra in extras if extra.startswith("--")]
            guesses = {flag: difflib.get_close_matches(flag.replace("_", "-"), flags, 1, 0.8) for flag in given}
            hints = "".join(f"; {flag}: did you mean {close[0]}?" for flag, close in guesses.items() if close)
            self.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return parsed


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is nothing to say (an
    off switch, an empty list); examples (the epilog) keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:  # the hook ArgumentDefaultsHelpFormatter uses
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default in ([], "", argparse.SUPPRESS)
        quiet = quiet or not action.option_strings
        if quiet or "default" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


def command(sub: Any, name: str, helptext: str, example: str) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with an example of its use (its group's EXAMPLES, which a test parses)."""
    usage = f"%(prog)s [options]{' [PATH ...]' if name == 'verify-nccl' else ''}"  # the flags are listed below
    return sub.add_parser(
        name,
        help=helptext,
        description=helptext,
        usage=usage,
        formatter_class=HelpFormatter,
        epilog=f"example:\n  hyperpod-pretrain {example}",
    )


def use_defaults(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Give `p`'s flags these defaults (required ones become optional), and say so in their help (in place of what
    it said of a default)."""
    for action in p._actions:  # argparse has no public way to change an added argument
        if action.dest in defaults:
            action.default, action.required = defaults[action.dest], False
            said = re.sub(r"\s*\(default: [^)]*\)$", "", action.help or "")
            action.help = f"{said} (default: {defaults[action.dest]})".strip().replace("%", "%%")


def note_given_flags(p: argparse.ArgumentParser) -> None:
    """Have `p` put on its namespace, as `given_flags`, the flags its command line gave: argparse keeps only values,
    and a flag given its default value looks like one not given. The line is parsed a second time with no defaults
    (so abbreviations and --flag=value count), once the first parse has taken it."""
    parse = p.parse_known_args  # argparse calls a subcommand's parser by this attribute

    def parse_noting_given(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = parse(args, namespace)
        defaults = {action: action.default for action in p._actions}  # argparse has no public way to do this
        try:
            for action in defaults:
                action.default = argparse.SUPPRESS
            given = vars(parse(args, None)[0])
        finally:
            for action, default in defaults.items():
                action.default = default
        flags = [a for a in p._actions if a.option_strings and a.dest in given]
        parsed.given_flags = {max(a.option_strings, key=len) for a in flags}
        return parsed, rest

    p.parse_known_args = parse_noting_given  # type: ignore[method-assign]


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def toleration(text: str) -> dict[str, str]:
    """KEY:EFFECT (operator Exists) or KEY=VALUE:EFFECT (operator Equal), as kubectl taint writes taints."""
    spec, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not spec:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write KEY:EFFECT or KEY=VALUE:EFFECT, EFFECT one of NoSchedule, PreferNoSchedule, NoExecute"
        )
    key, eq, value = spec.partition("=")
    if eq:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


def job_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, VALUE read as YAML: --job-option restart_budget=5 --job-option 'node_selector={a: b}'."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not YAML ({exc})") from None


def add_storage_args(
    p: argparse.ArgumentParser,
    dataset: bool = True,
    run_id: bool = True,
    root_default: str | None = None,
    mixture: bool = False,
) -> None:
    p.add_argument(
        "--storage-root",
        required=root_default is None,
        default=root_default,
        help="root of the shared volume (/fsx on the cluster, any directory locally)",
    )
    if dataset:
        p.add_argument(
            "--dataset",
            required=not mixture,
            help="dataset name: <root>/datasets/<name>" + (" (or --mixture)" if mixture else ""),
        )
    if mixture:
        add_mixture_arg(p, staged=True)
    if run_id:
        p.add_argument("--run-id", required=True, help="run id: <root>/runs/<run_id>")


def add_mixture_arg(p: argparse._ActionsContainer, staged: bool) -> None:
    p.add_argument(
        "--mixture",
        type=mixture_weights,
        default=[],
        metavar="DATASET=WEIGHT,...",
        help="train on several datasets, each global batch drawn from them in proportion to the weights "
        "(e.g. web=0.8,code=0.2); all staged with one tokenizer"
        + (", staged before" if staged else "; each staged from its --mixture-source, or as staged before"),
    )


def mixture_weights(text: str) -> list[dict[str, Any]]:
    """--mixture's text as the pipeline's and the launcher's entries, checked as the trainer checks its own."""
    from trainer.mixture import parse_weights

    try:
        return [{"dataset": name, "weight": weight} for name, weight in parse_weights(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--mixture: ")) from None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Where the kubernetes backend runs the job (the local backend ignores these)."""
    p.add_argument("--image", default="", help="the trainer image (docker/build.sh builds and pushes it)")
    p.add_argument("--namespace", default="kubeflow", help="where the job is created")
    p.add_argument("--instance-type", default="p5.48xlarge", help="sets GPUs and EFA devices per node")
    p.add_argument("--max-nodes", type=int, default=0, help="elastic: up to this many nodes (0: --nnodes)")
    p.add_argument("--pipeline-run-id", default="", help="names the job, so that a retry re-attaches (default: run id)")
    p.add_argument(
        "--job-option",
        type=job_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other JobSpec setting, e.g. memory=512Gi or auto_resume=false",
    )
    p.add_argument(
        "--stream-logs",
        choices=["worker-0", "all", "none"],
        default="worker-0",
        help="whose log the launcher prints as the job runs: node 0's pod, every pod's or none",
    )
    p.add_argument("--no-owner-reference", action="store_true", help="do not tie the job's life to the launcher pod")


def add_deadline_args(p: argparse.ArgumentParser) -> None:
    """How long each phase of a job may take before the launcher deletes it and fails the step."""
    p.add_argument("--timeout-s", type=int, default=0, help="deadline for training in seconds (0: none)")
    p.add_argument(
        "--pending-timeout-s",
        type=int,
        default=1800,
        help="a job that never started: pods Pending this long delete it and fail the step (0: never)",
    )
    p.add_argument(
        "--recovery-timeout-s",
        type=int,
        default=3600,
        help="after it ran: fewer than its minimum of pods this long (a lost node) fails it (0: never)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=int,
        default=0,
        help="queued (suspended by Kueue) this long fails it (0: wait as long as it takes)",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=int,
        default=0,
        help="no training step completed this long deletes the job and fails it (0: derived from the step time, "
        "at least 900 s)",
    )


def add_platform_args(p: argparse.ArgumentParser, mount_path: str, mount_help: str) -> None:
    """The platform team's settings of the training job (components/launch_training/platform.py), compiled into
    the pipeline: no run can change them."""
    p.add_argument(
        "--job-api",
        choices=JOB_APIS,
        default=DEFAULT_JOB_API,
        help="pytorchjob: a kubeflow.org/v1 PyTorchJob (Training Operator v1, what HyperPod runs and "
        "auto-resumes); trainjob: a trainer.kubeflow.org/v1alpha1 TrainJob (Kubeflow Trainer v2, what the "
        "Kubeflow distribution installs since July 2026); hyperpodpytorchjob: a sagemaker.amazonaws.com/v1 "
        "HyperPodPyTorchJob (the HyperPod training operator, its workers under hyperpodrun, in the "
        "trainer-hyperpod image: docker/build.sh --job-api hyperpodpytorchjob). Default: %(default)s",
    )
    p.add_argument(
        "--runtime-name",
        default=DEFAULT_RUNTIME,
        help="trainjob: the ClusterTrainingRuntime every TrainJob names (render-runtime prints it; "
        "default: %(default)s)",
    )
    p.add_argument("--fsx-pvc", default="fsx-lustre-pvc", help="the FSx PVC every step and the training job mount")
    p.add_argument(
        "--mount-path", default=mount_path, help=f"where they mount it; a storage root must lie under it ({mount_help})"
    )
    p.add_argument("--queue-name", default="", help="Kueue LocalQueue of the job (HyperPod task governance)")
    p.add_argument("--priority-class", default="", help="Kueue WorkloadPriorityClass of the job")
    p.add_argument(
        "--job-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="a namespace jobs may go to (repeatable; compile default: kubeflow; elsewhere any)",
    )
    p.add_argument(
        "--allowed-registry",
        action="append",
        default=[],
        metavar="REGISTRY",
        help="where trainer images may come from, a host and optional path (repeatable; compile default: "
        "--image-registry's, if given; none: any)",
    )
    p.add_argument("--trainer-service-account", default="", help="the trainer pods' service account")
    p.add_argument(
        "--automount-service-account-token",
        action="store_true",
        help="mount its token in the trainer pods (the trainer needs none)",
    )
    p.add_argument(
        "--trainer-toleration",
        type=toleration,
        action="append",
        default=[],
        metavar="KEY[=VALUE]:EFFECT",
        help="for the trainer pods, besides the GPU one (repeatable)",
    )
    p.add_argument(
        "--trainer-node-selector",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="for the trainer pods (repeatable)",
    )
    p.add_argument(
        "--trainer-image-pull-secret",
        action="append",
        default=[],
        metavar="NAME",
        help="for the trainer pods (repeatable)",
    )
    p.add_argument(
        "--trainer-env",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the trainer, e.g. NCCL or EFA settings (repeatable)",
    )
    p.add_argument(
        "--no-health-affinity",
        action="store_true",
        help="do not require HyperPod's node-health label (a cluster without HyperPod)",
    )
    p.add_argument(
        "--topology-label",
        default="",
        metavar="LABEL",
        help="hyperpodpytorchjob: place the job's pods together under this node label by Kueue's topology-aware "
        "scheduling, e.g. topology.k8s.aws/network-node-layer-3 (preferred, unless --topology-required)",
    )
    p.add_argument(
        "--topology-required", action="store_true", help="hyperpodpytorchjob: require --topology-label's placement"
    )
    p.add_argument(
        "--hyperpod-log-rules",
        default="",
        metavar="FILE.json",
        help="hyperpodpytorchjob: the operator's log monitoring rules (a JSON list of logMonitoringConfiguration "
        "rules) in place of those derived from the trainer's lines",
    )


def platform_from_args(args: argparse.Namespace, namespaces: list[str], registries: list[str]) -> Platform:
    return Platform(
        job_api=args.job_api,
        runtime_name=args.runtime_name,
        pvc_name=args.fsx_pvc,
        mount_path=args.mount_path,
        queue_name=args.queue_name,
        priority_class=args.priority_class,
        namespaces=tuple(args.job_namespace or namespaces),
        registries=tuple(args.allowed_registry or registries),
        service_account=args.trainer_service_account,
        automount_service_account_token=args.automount_service_account_token,
        tolerations=tuple(args.trainer_toleration),
        node_selector=dict(args.trainer_node_selector),
        image_pull_secrets=tuple(args.trainer_image_pull_secret),
        env=dict(args.trainer_env),
        health_affinity=not args.no_health_affinity,
        topology_label=args.topology_label,
        topology_required=args.topology_required,
        hyperpod_log_rules=load_rules(Path(args.hyperpod_log_rules)) if args.hyperpod_log_rules else (),
    )


# run-local's --include when none is given (its help and run_local_arguments). The built-in demo corpus (the stdlib's
# email package) is Python source beside compiled and other files: only its .py files are staged. A corpus of one's
# own (--source) is staged whole, less DEFAULT_EXCLUDE, unless --include says.
DEMO_INCLUDE = ["*.py"]
SOURCE_INCLUDE = ["*"]


def add_benchmark_args(p: argparse._ActionsContainer) -> None:
    """The benchmarks an evaluation runs (evaluate's and run-local's flags)."""
    p.add_argument(
        "--benchmarks",
        default="",
        help=f"lm-evaluation-harness tasks to score, task or task:shots, comma-separated (e.g. {DEFAULT_BENCHMARKS}); "
        "their data must be staged (--benchmark-data)",
    )
    p.add_argument(
        "--benchmark-data",
        default="",
        help="where the tasks' data is mirrored, one folder per task (s3://bucket/prefix or a local directory): "
        "staged onto the storage root first; empty: what is staged already",
    )
    p.add_argument("--benchmark-limit", type=non_negative_int, default=0, help="items of each task at most (0: all)")
    p.add_argument(
        "--benchmark-gate",
        default="",
        help="gate: thresholds on benchmark metrics, e.g. 'hellaswag:acc_norm>=0.30,piqa:acc>0.6'",
    )
