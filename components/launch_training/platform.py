"""Who owns which knob of the job: the platform team's settings, compiled in, and what a run may choose.

A platform team uploads the pipeline once and lets many people run it. Whatever touches privileges (which job API
runs the trainer and, for a TrainJob, which runtime, the trainer pods' service account and its token, tolerations,
node selector, image pull secrets, extra environment, where images may come from, which namespaces jobs may go to,
the FSx volume, the Kueue queue) is `Platform`: `compile` flags, baked into the YAML as a constant. A run chooses
sizes, counts, timeouts and training settings only: its parameters, and in `job_options` the names in RUN_OPTIONS,
each with its type and bounds (and only those its job API has a place for). Anything else is refused, with one line
naming it, before any API call.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from common.errors import InputError
from components.launch_training.apis import job_api
from components.launch_training.hyperpodpytorchjob import topology_labels
from components.launch_training.job_api import DEFAULT_JOB_API, JOB_APIS
from components.launch_training.log_rules import check_rules
from trainer.config import JOB_OPTION, check_setting, run_settings

_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_REGISTRY = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._/-][a-z0-9]+)*)?$")
TOLERATION_KEYS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})


@dataclass(frozen=True)
class Platform:
    """The platform team's settings (compile time). Empty `namespaces`/`registries`: any (the CLI, tests)."""

    job_api: str = DEFAULT_JOB_API  # pytorchjob (Training Operator v1) or trainjob (Kubeflow Trainer v2)
    runtime_name: str = "hyperpod-pretrain"  # trainjob: the ClusterTrainingRuntime (deploy/trainjob-runtime.yaml)
    pvc_name: str = "fsx-lustre-pvc"
    # One volume, one path: the PVC is mounted here in every step and in the job's pods, so a storage root under it
    # names the same directory everywhere. Empty (the CLI, tests): at the storage root itself.
    mount_path: str = ""
    queue_name: str = ""  # Kueue LocalQueue of HyperPod task governance; empty: no queue
    priority_class: str = ""  # Kueue WorkloadPriorityClass; empty: the queue's default
    namespaces: tuple[str, ...] = ()  # where jobs may go
    registries: tuple[str, ...] = ()  # where trainer images may come from: a registry host, optionally with a path
    service_account: str = ""  # the trainer pods' (empty: the namespace's default)
    automount_service_account_token: bool = False  # the trainer needs no Kubernetes API
    tolerations: tuple[dict[str, Any], ...] = ()  # besides the GPU toleration every job has
    health_affinity: bool = True  # only nodes HyperPod calls healthy (off for a cluster without its labels)
    node_selector: dict[str, str] = field(default_factory=dict)
    image_pull_secrets: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the trainer (NCCL/EFA tuning, proxies)
    # hyperpodpytorchjob: Kueue topology-aware placement of the job's pods over a topology.k8s.aws/... node label
    # ("": none), required or only preferred; and log monitoring rules in place of those derived from the trainer's
    # lines (empty: derived; log_rules.py).
    topology_label: str = ""
    topology_required: bool = False
    hyperpod_log_rules: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.job_api not in JOB_APIS:
            raise InputError(f"job API {self.job_api!r} is unknown: choose one of {', '.join(JOB_APIS)}")
        names = [self.runtime_name, self.queue_name, self.priority_class, *self.namespaces, *self.image_pull_secrets]
        for value in [n for n in names if n]:
            if len(value) > 63 or not _DNS_1123.match(value):
                raise InputError(f"platform setting {value!r} is not a DNS-1123 label")
        if self.service_account and (len(self.service_account) > 253 or not _DNS_SUBDOMAIN.match(self.service_account)):
            raise InputError(f"service account {self.service_account!r} is not a DNS-1123 subdomain")
        for registry in self.registries:
            if not _REGISTRY.match(registry):
                raise InputError(f"allowed registry {registry!r} is not a registry host (and path)")
        for toleration in self.tolerations:
            if not isinstance(toleration, dict) or set(toleration) - TOLERATION_KEYS:
                raise InputError(f"toleration {toleration!r}: only {', '.join(sorted(TOLERATION_KEYS))}")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise InputError(f"environment variable name {name!r} is not valid")
        hyperpod = (
            ("topology_label", self.topology_label),
            ("topology_required", self.topology_required),
            ("hyperpod_log_rules", self.hyperpod_log_rules),
        )
        for name, value in hyperpod:
            if value and self.job_api != "hyperpodpytorchjob":
                raise InputError(f"platform setting {name} is for --job-api hyperpodpytorchjob, not {self.job_api}")
        if self.topology_required and not self.topology_label:
            raise InputError("platform setting topology_required needs a topology_label to require")
        if self.topology_label and self.topology_label not in topology_labels():
            raise InputError(
                f"platform setting topology_label {self.topology_label!r} is not a topology layer Kueue places "
                f"HyperPod pods by: choose one of {', '.join(topology_labels())}"
            )
        if self.hyperpod_log_rules:
            check_rules(list(self.hyperpod_log_rules), "platform setting hyperpod_log_rules")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Platform:
        """From the compiled constant (JSON): lists become tuples; a wrong type is the compile's bug, said plainly."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise InputError(f"platform setting(s) {', '.join(map(repr, unknown))} unknown: {', '.join(known)}")
        defaults = cls()
        converted: dict[str, Any] = {}
        for name, value in values.items():
            default = getattr(defaults, name)
            if isinstance(default, tuple):
                if not isinstance(value, list | tuple):
                    raise InputError(f"platform setting {name}: a list, not {value!r}")
                value = tuple(value)
            elif not isinstance(value, type(default)):
                raise InputError(f"platform setting {name}: a {type(default).__name__}, not {value!r}")
            converted[name] = value
        return cls(**converted)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the compiled YAML."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def check_image(self, image: str) -> None:
        if self.registries and not any(image.startswith(r.rstrip("/") + "/") for r in self.registries):
            raise InputError(
                f"trainer_image {image!r} is not from an allowed registry ({', '.join(self.registries)}; "
                "set at compile time by the platform team)"
            )

    def check_namespace(self, namespace: str) -> None:
        if self.namespaces and namespace not in self.namespaces:
            raise InputError(
                f"namespace {namespace!r} is not one jobs may go to ({', '.join(self.namespaces)}; set at "
                "compile time by the platform team)"
            )


# What a run may set in `job_options`: sizes, counts, timeouts and training settings, with their bounds. Strings
# are checked by JobSpec.validate (quantities, policy names).
RUN_OPTIONS: dict[str, tuple[type, int, int]] = {
    "cpu": (str, 0, 0),
    "memory": (str, 0, 0),
    "shm_size": (str, 0, 0),
    "gpus_per_node": (int, 0, 16),
    "efa_per_node": (int, 0, 64),
    "grace_period_s": (int, 1, 3600),
    "shutdown_timeout_s": (int, 0, 3600),
    "max_restarts": (int, 0, 100),
    "restart_budget": (int, 0, 100),
    "ttl_after_finished_s": (int, 0, 90 * 24 * 3600),
    "auto_resume": (bool, 0, 0),
    "auto_resume_max_retries": (int, 1, 100),
    "auto_resume_wait_s": (int, 0, 24 * 3600),
    "restart_policy": (str, 0, 0),
    "clean_pod_policy": (str, 0, 0),
    "rdzv_backend": (str, 0, 0),
    # hyperpodpytorchjob: what its derived log monitoring rules are made of (log_rules.py)
    "startup_allowance_s": (int, 60, 24 * 3600),
    "expected_step_ms": (int, 0, 3600 * 1000),
    "min_tokens_per_s": (int, 0, 10**12),
}
# Training settings a run may set in `job_options` (trainer/config.py's JOB_OPTION): handed to the trainer as its
# flags, checked as it checks them.
TRAINER_OPTIONS = run_settings(JOB_OPTION)
MAX_OPTION_STRING = 64
# Options that were renamed, with what replaced them: a run that still sets one is told in one line.
RENAMED_OPTIONS = {
    "backoff_limit": "'restart_budget': whole-job restarts the job survives (the PyTorchJob's job-wide backoffLimit "
    "is derived: restart_budget x nodes + 1)",
}


def run_options(options: dict[str, Any], api_name: str = DEFAULT_JOB_API) -> dict[str, Any]:
    """`job_options` as a run gave them, checked: only RUN_OPTIONS, of their type, within their bounds, and only
    those the compiled job API has a place for."""
    for key, value in options.items():
        if key in RENAMED_OPTIONS:
            raise InputError(f"job option {key!r} is now {RENAMED_OPTIONS[key]}")
        if key in TRAINER_OPTIONS:
            try:
                check_setting(key, value)
            except ValueError as exc:
                raise InputError(f"job option {key!r}: {exc}") from None
            continue
        if key not in RUN_OPTIONS:
            raise InputError(
                f"job option {key!r} is not a run option (the platform team's settings are compiled in); "
                f"a run may set: {', '.join(sorted([*RUN_OPTIONS, *TRAINER_OPTIONS]))}"
            )
        kind, low, high = RUN_OPTIONS[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise InputError(f"job option {key!r} must be an integer from {low} to {high}, got {value!r}")
        if kind is bool and not isinstance(value, bool):
            raise InputError(f"job option {key!r} must be true or false, got {value!r}")
        if kind is str and (not isinstance(value, str) or len(value) > MAX_OPTION_STRING):
            raise InputError(
                f"job option {key!r} must be a string of at most {MAX_OPTION_STRING} characters, got "
                f"{str(value)[:80]!r}"
            )
    job_api(api_name).refuse_options(options)
    return dict(options)
