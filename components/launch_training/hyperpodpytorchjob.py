"""The HyperPodPyTorchJob (sagemaker.amazonaws.com/v1, the SageMaker HyperPod training operator): its manifest, the
check of it against the published job template, and how its status reads.

The operator is not open source and no CRD is published; what follows is read in what is: the SDK's models
(PyPI sagemaker-hyperpod 3.12.0, `training/config/hyperpod_pytorch_job_unified_config.py`, the `_HyperPodPytorchJob`
spec and `HyperPodPytorchJobStatus`), the CLI's job template (PyPI hyperpod-pytorch-job-template 1.5.0, `v1_1`), the
agent (PyPI hyperpod-elastic-agent 1.1.3, sdist), AWS's guide "Using the training operator to run jobs"
(docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-eks-operator-usage.html) and AWS's sample
(awslabs/awsome-distributed-training 8ac49bd, `3.test_cases/pytorch/FSDP/kubernetes/llama3_2_1b-fsdp-hpto.yaml`).

The manifest:
- `spec.nprocPerNode` (a string, as the model types it) and one replica group, `replicaSpecs[0]` (name REPLICA, all
  the run's nodes) whose pod is every API's (rendering.pod_template) with the container `pytorch` (the sample's) and
  the agent's port 8080 (the guide: "the port that HyperPodElasticAgent listens to"). No pod restartPolicy: the
  operator restarts the pods, and neither the guide nor the sample sets one.
- The worker command: `hyperpodrun` as PID 1 in exec form (the agent's PyPI page: PID 1, or forwarded SIGTERM), with
  torchrun's `--nnodes` / `--nproc-per-node` (the agent's parser is torch's `get_args_parser` plus its own flags:
  `run.py`, `main`), the agent's `--server-port` (8080), `--shutdown-signal=SIGTERM` (its default is SIGKILL: the
  trainer's preemption checkpoint needs SIGTERM) and `--shutdown-timeout`, the time the agent waits between SIGTERM
  and SIGKILL (`run.py`, `add_additional_hyperpod_args`; default 15 s), set to the job's shutdown timeout
  (JobSpec.shutdown_timeout: the grace period less the launcher's margin, what the other APIs give torchrun) or, where
  a run set 0, left to the agent's default; `--tee=3 --log_dir=/tmp/hyperpod` as the guide and the sample give them (the
  log agent reads the files: log_rules.py); `--rdzv-backend=hyperpod`, which the agent uses whatever it is given
  (`run.py`, `run`: "Overriding rdzv_backend='hyperpod'"; the PyPI page calls the flag optional) and which takes no
  endpoint: the operator gives each node its rank and the master's address with /start (`server/api_models.py`,
  `StartRequest`). The agent's rendezvous reads NNODES from the environment (`rendezvous/
  hyperpod_rendezvous_backend.py`, `HyperPodRendezvousBackend.__init__`: `os.environ["NNODES"]`), which the sample
  does not set and nothing published says the operator sets: the pod sets it. TRAINER_MONITOR_LINES has the trainer
  print the lines the log rules read (trainer/monitor.py). (On this project's torch 2.13 the agent cannot build its
  parser: torchrun declares --shutdown-timeout itself, and the agent's `add_argument` of it again is argparse's
  conflict error; which torch the image runs is issue 59's image question.)
- `spec.runPolicy`: the run's restart settings mapped onto the operator's two levels (the SDK's RestartPolicy:
  "standard" process-level restarts in place, then a "full job restart"):
  - `restartPolicy.numRestartBeforeFullJobRestart` = `max_restarts`: torchrun's restarts of the worker group in place
    on the other APIs, the process-level restarts here;
  - `restartPolicy.maxFullJobRestarts` = `restart_budget`: the whole-job restarts the job survives, on every API;
  - `restartPolicy.evalPeriodSeconds` (required; "the period of evaluating the restart limit") = the run's whole
    length: its deadline, or RESTART_WINDOW_S without one, so that the budget counts over the run as it does on the
    other APIs;
  - `jobMaxRetryCount` = every restart the two allow: `max_restarts` in each of the `restart_budget + 1` incarnations
    plus the `restart_budget` full restarts. AWS's guide calls it the "maximum number of restarts at the process
    level", its sample sets 50 beside 3 and 1; set so, it stops nothing the two limits above allow, whichever restarts
    it counts;
  - `cleanPodPolicy` from the run's clean pod policy, in the operator's values (AWS's guide: `All`, `OnlyComplete`,
    `None`): `All` and `None` as they are; the default `Running` (running pods go with the job, finished ones stay for
    their logs) as `None`, since every pod of a finished HyperPodPyTorchJob has ended;
  - `ttlSecondsAfterFinished`, `activeDeadlineSeconds` from the settings of the same names;
  - `logMonitoringConfiguration`: log_rules.py.
- Metadata as every API's (rendering.job_metadata): Kueue's queue-name and priority-class labels (the template's
  `to_domain` puts the same two on the job), our labels and annotations; and, where the platform compiled one in,
  Kueue's topology annotation (`kueue.x-k8s.io/podset-preferred-topology` or `-required-topology` with a
  `topology.k8s.aws/...` node label), on the job and on the pod template as the template renders it (`v1_1/
  template.py`), the label one of those the template's schema allows.

Checked against the published template before it is sent (`check_against_template`): the template's models cannot
be imported without the SDK (its `v1_1/model.py` imports `sagemaker.hyperpod`, whose distribution pins pytest, ruff,
click and requests to versions this project does not use), and the template describes the CLI's flat settings, not
the manifest. So the settings the flat config has are read back out of the rendered manifest (`template_config`)
and validated against the template's own `v1_1/schema.json` (JSON Schema, shipped in the wheel), with the rules its
model adds in code (`PyTorchJobConfig` validators: environment names are C identifiers, command and arguments
non-empty strings, volume mount paths absolute and none twice). What the template has no field for
(restartPolicy, logMonitoringConfiguration, ...) is refused where it is made (HyperPodPyTorchJobApi.validate,
log_rules.check_rules).

Status (the SDK's HyperPodPytorchJobStatus): `conditions` (type, status, reason, message, lastTransitionTime),
`startTime` ("first acknowledged by the controller. When using kueue, the job is also admitted"), `completionTime`,
`restartCount`, `restartStatus {currentEvalPeriod, fullJobRestartCount, restartCount}` and `latestFaultyPodInstanceList
{restartType (PLR or JLR), faultyPodList, faultyRankList, faultyInstanceIdList}`. The condition types are not
published: the CLI shows a job's last true condition as its status and looks up `Created` (`cli/commands/training.py`);
the agent's design notes name the job's states Created, Starting, Running, Faulted and Completed (sdist `doc/
unified_state_machine.md`); the SDK's condition model says "Complete or Failed". So Running means running, and any of
Completed, Complete or Succeeded means done. Pods carry the label `HPJob=<job>` (the SDK's `HyperPodPytorchJob.
list_pods` and `hyp list-pods`, `cli/service/list_pods.py`); no label is published that tells one node's pod from
another's (a node's rank is given with /start, not by the pod), so a node's selector is the job's.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from common.errors import InputError
from components.launch_training.job_api import JobApi, seconds, true_condition
from components.launch_training.log_rules import RULE_SETTINGS, check_rules, job_rules
from components.launch_training.rendering import (
    PRIORITY_CLASS_LABEL,
    QUEUE_LABEL,
    job_metadata,
    owned_by_launcher,
    pod_template,
)
from trainer.monitor import MONITOR_ENV

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

JOB_LABEL = "HPJob"  # on every pod of the job (module docstring)
REPLICA = "pods"  # the replica group's name, as AWS's sample names it
CONTAINER = "pytorch"
AGENT_PORT = 8080  # hyperpodrun --server-port: where the operator calls the agent
AGENT_LOG_DIR = "/tmp/hyperpod"  # where the agent's log agent reads the workers' output (AWS's guide and sample)
NNODES_ENV = "NNODES"  # read by the agent's rendezvous
# evalPeriodSeconds without a deadline: the longest run a run may ask for (config.LIMITS["timeout_s"]), so the restart
# limits count over the whole run.
RESTART_WINDOW_S = 90 * 24 * 3600
PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
SUCCEEDED_TYPES = ("Completed", "Complete", "Succeeded")  # module docstring: the operator's own is not published
TEMPLATE = "hyperpod-pytorch-job-template 1.5.0 v1_1"
CLEAN_POD_POLICIES = {"All": "All", "None": "None", "Running": "None"}  # ours -> the operator's (module docstring)
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class HyperPodPyTorchJobApi(JobApi):
    name = "hyperpodpytorchjob"
    kind = "HyperPodPyTorchJob"
    group, version, plural = "sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs"
    container = CONTAINER
    # its workers run hyperpodrun: the trainer on the agent's stack (trainer/stack-hyperpod.txt; docker/build.sh
    # --job-api hyperpodpytorchjob builds it)
    trainer_repository = "hyperpod-pretrain-trainer-hyperpod"
    succeeded = SUCCEEDED_TYPES[0]
    operator = "the SageMaker HyperPod training operator"
    crd = "the installed HyperPod training operator's CRD lacks a field this job sets; update the add-on"
    install = (
        "install the EKS add-on amazon-sagemaker-hyperpod-training-operator (aws eks create-addon --cluster-name "
        "<cluster> --addon-name amazon-sagemaker-hyperpod-training-operator)"
    )
    kueue_framework = ""  # the name HyperPod task governance's Kueue lists the kind under is not published
    refused_options = {
        "restart_policy": "the operator restarts the pods itself (restart_budget: full job restarts, max_restarts: "
        "process-level restarts before one)",
        "rdzv_backend": "hyperpodrun always uses its own rendezvous, the operator giving each node its rank",
        "auto_resume": "the HyperPod training operator restarts its jobs itself (restart_budget, max_restarts); the "
        "auto-resume annotations are for PyTorchJobs",
        "auto_resume_max_retries": "the operator's retries follow restart_budget and max_restarts",
        "auto_resume_wait_s": "the operator restarts a job before it fails, not after",
    }

    def validate(self, spec: JobSpec) -> None:
        if spec.min_nodes != spec.max_nodes:
            raise InputError(
                f"max_nodes {spec.max_nodes} above nnodes {spec.min_nodes}: hyperpodrun 1.1.3 runs a fixed "
                "number of nodes (run.py: 'Elastic cluster size is currently not supported'); give max_nodes 0"
            )
        if spec.auto_resume:
            raise InputError(f"auto_resume: {self.refused_options['auto_resume']}")
        for setting in ("max_restarts", "restart_budget"):
            if getattr(spec, setting) < 0:
                raise InputError(
                    f"{setting} {getattr(spec, setting)}: a retry count cannot be below zero (it sets the "
                    "HyperPodPyTorchJob's restartPolicy and jobMaxRetryCount)"
                )
        if spec.topology_label and spec.topology_label not in topology_labels():
            raise InputError(
                f"topology label {spec.topology_label!r} is not one Kueue's topology placement on HyperPod "
                f"knows: choose one of {', '.join(topology_labels())}"
            )
        if spec.log_rules is not None:
            check_rules(list(spec.log_rules), "the platform's log monitoring rules")
        for setting in RULE_SETTINGS:
            if getattr(spec, setting) < 0:
                raise InputError(f"{setting} {getattr(spec, setting)} cannot be negative")

    def render(self, spec: JobSpec) -> dict[str, Any]:
        pod = pod_template(spec, self.container, hyperpodrun_command(spec))
        container = pod["spec"]["containers"][0]
        agent_env = {NNODES_ENV: str(spec.min_nodes), MONITOR_ENV: "1"}
        container["env"] = [e for e in container["env"] if e["name"] not in agent_env] + [
            {"name": name, "value": value} for name, value in agent_env.items()
        ]
        container["ports"] = [{"containerPort": AGENT_PORT}]
        metadata = job_metadata(spec)
        if spec.topology_label:
            topology = {REQUIRED_TOPOLOGY if spec.topology_required else PREFERRED_TOPOLOGY: spec.topology_label}
            metadata["annotations"] |= topology
            pod["metadata"]["annotations"] |= topology
        rules = job_rules(spec)
        check_rules(rules, "the job's log monitoring rules")
        run_policy: dict[str, Any] = {
            "jobMaxRetryCount": job_max_retry_count(spec),
            "cleanPodPolicy": CLEAN_POD_POLICIES[spec.clean_pod_policy],
            "ttlSecondsAfterFinished": spec.ttl_after_finished_s,
            "restartPolicy": {
                "numRestartBeforeFullJobRestart": spec.max_restarts,
                "maxFullJobRestarts": spec.restart_budget,
                "evalPeriodSeconds": spec.active_deadline_s or RESTART_WINDOW_S,
            },
            "logMonitoringConfiguration": rules,
        }
        if spec.active_deadline_s:
            run_policy["activeDeadlineSeconds"] = spec.active_deadline_s
        job: dict[str, Any] = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": metadata,
            "spec": {
                "nprocPerNode": str(spec.nproc),
                "replicaSpecs": [{"name": REPLICA, "replicas": spec.min_nodes, "template": pod}],
                "runPolicy": run_policy,
            },
        }
        check_against_template(job)
        return owned_by_launcher(job, spec)

    def pod_selector(self, name: str) -> str:
        return f"{JOB_LABEL}={name}"

    def node_selector(self, name: str, index: int) -> str:
        """Every pod of the job: nothing published tells one node's pod from another's (module docstring)."""
        return self.pod_selector(name)

    def nodes(self, job: dict[str, Any]) -> tuple[int, int]:
        replicas = sum(int(group.get("replicas") or 0) for group in job["spec"]["replicaSpecs"])
        return replicas, replicas

    def latest_condition(self, job: dict[str, Any]) -> dict[str, Any] | None:
        true = [c for c in self.conditions(job) if c.get("status") == "True"]
        terminal = [c for c in true if c["type"] in (*SUCCEEDED_TYPES, self.failed)]
        return (terminal or true or [None])[-1]

    def is_succeeded(self, job: dict[str, Any]) -> bool:
        return any(true_condition(job, type_) for type_ in SUCCEEDED_TYPES)

    def is_suspended(self, job: dict[str, Any]) -> bool:
        """Kueue holds it through runPolicy.suspend (the SDK's RunPolicy: "Suspend suspends HyperPodPytorchJob")."""
        return bool((job.get("spec", {}).get("runPolicy") or {}).get("suspend"))

    def is_running(self, job: dict[str, Any]) -> bool:
        return true_condition(job, "Running")

    def restarts(self, job: dict[str, Any], pods: list[Any]) -> int:
        """The operator's count of the job's restarts (status.restartCount), plus containers restarted in place."""
        in_place = sum(c.restart_count or 0 for pod in pods for c in pod.status.container_statuses or [])
        return int(job.get("status", {}).get("restartCount") or 0) + in_place

    def faults(self, job: dict[str, Any]) -> str:
        return latest_faults(job)

    def times(self, job: dict[str, Any]) -> tuple[float | None, float | None]:
        """Queued: creation to status.startTime (acknowledged, and under Kueue admitted); running: to completionTime."""
        status = job.get("status", {})
        created = seconds(job.get("metadata", {}).get("creationTimestamp"))
        started, ended = seconds(status.get("startTime")), seconds(status.get("completionTime"))
        return (started - created if started and created else None), (ended - started if ended and started else None)


def hyperpodrun_command(spec: JobSpec) -> list[str]:
    """The worker container's command (module docstring): the agent, its flags, then the trainer and its own."""
    shutdown = [f"--shutdown-timeout={spec.shutdown_timeout}"] if spec.shutdown_timeout else []
    return [
        "hyperpodrun",
        f"--nnodes={spec.min_nodes}",
        f"--nproc-per-node={spec.nproc}",
        "--rdzv-backend=hyperpod",
        f"--server-port={AGENT_PORT}",
        "--shutdown-signal=SIGTERM",
        *shutdown,
        "--tee=3",
        f"--log_dir={AGENT_LOG_DIR}",
        "-m",
        "trainer.train_ddp",
        *spec.trainer_args,
    ]


def job_max_retry_count(spec: JobSpec) -> int:
    """Every restart max_restarts and restart_budget allow (module docstring)."""
    return (spec.restart_budget + 1) * spec.max_restarts + spec.restart_budget


def latest_faults(job: dict[str, Any]) -> str:
    """The operator's account of the latest restart, one line ("" when it gives none): its type (PLR: process level,
    JLR: whole job) and the faulty pods and ranks (status.latestFaultyPodInstanceList)."""
    faults = job.get("status", {}).get("latestFaultyPodInstanceList") or {}
    parts = [
        f"{label} {', '.join(map(str, faults[key]))}"
        for key, label in (("faultyPodList", "pods"), ("faultyRankList", "ranks"))
        if faults.get(key)
    ]
    kind = faults.get("restartType") or ""
    return f"{kind} restart: {'; '.join(parts)}".strip() if parts or kind else ""


# -- the published job template -------------------------------------------------------------------------------------


@cache
def template_schema() -> dict[str, Any]:
    """The template's v1_1 JSON schema, shipped in its wheel (read as data: importing v1_1 needs the SDK)."""
    return json.loads((resources.files("hyperpod_pytorch_job_template") / "v1_1" / "schema.json").read_text())


def topology_labels() -> tuple[str, ...]:
    """The node labels Kueue's topology placement may name, as the template's schema lists them."""
    return tuple(template_schema()["$defs"]["topologyLabels"]["enum"])


def template_config(job: dict[str, Any]) -> dict[str, Any]:
    """The template's flat settings (v1_1 PyTorchJobConfig) that the rendered job carries, read back out of it: what
    the CLI would be given to make the same job, as far as its fields reach."""
    metadata, spec = job["metadata"], job["spec"]
    pod = spec["replicaSpecs"][0]["template"]["spec"]
    container = pod["containers"][0]
    annotations = metadata.get("annotations", {})
    resources_ = container.get("resources", {}).get("requests", {})
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    config = {
        "job_name": metadata["name"],
        "image": container["image"],
        "namespace": metadata.get("namespace"),
        "command": container.get("command"),
        "args": container.get("args"),
        "environment": {e["name"]: e["value"] for e in container.get("env", []) if "value" in e},
        "replica_count": spec["replicaSpecs"][0].get("replicas"),
        "tasks_per_node": spec.get("nprocPerNode"),
        "label_selector": pod.get("nodeSelector"),
        "queue_name": metadata.get("labels", {}).get(QUEUE_LABEL),
        "priority": metadata.get("labels", {}).get(PRIORITY_CLASS_LABEL),
        "accelerators": resources_.get("nvidia.com/gpu"),
        "efa": resources_.get("vpc.amazonaws.com/efa"),
        "max_retry": spec.get("runPolicy", {}).get("jobMaxRetryCount"),
        "service_account_name": pod.get("serviceAccountName"),
        "preferred_topology": annotations.get(PREFERRED_TOPOLOGY),
        "required_topology": annotations.get(REQUIRED_TOPOLOGY),
        "volume": [
            {
                "name": m["name"],
                "type": "pvc",
                "mount_path": m["mountPath"],
                "claim_name": claims[m["name"]]["claimName"],
            }
            for m in container.get("volumeMounts", [])
            if m["name"] in claims
        ],
    }
    return {key: value for key, value in config.items() if value not in (None, {}, [])}


def check_against_template(job: dict[str, Any]) -> None:
    """The rendered job's flat settings valid for the template's schema and its model's own rules, or InputError in
    one line naming the field (module docstring)."""
    import jsonschema  # only where a HyperPodPyTorchJob is rendered

    config = template_config(job)
    validator = jsonschema.Draft202012Validator(template_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is not None:
        field = ".".join(map(str, error.absolute_path)) or "(top)"
        raise InputError(f"the HyperPodPyTorchJob fails {TEMPLATE}'s schema at {field}: {error.message}")
    for name in config.get("environment", {}):
        if not _C_IDENTIFIER.match(name):
            raise InputError(f"environment variable {name!r}: {TEMPLATE} takes C identifiers only")
    for key in ("command", "args"):
        if any(not isinstance(item, str) or not item.strip() for item in config.get(key, [])):
            raise InputError(f"the container's {key} holds an empty string, which {TEMPLATE} refuses")
    volumes = config.get("volume", [])
    for key in ("name", "mount_path"):
        values = [volume[key] for volume in volumes]
        if len(values) != len(set(values)):
            raise InputError(f"two volumes share a {key}, which {TEMPLATE} refuses")
    if any(not volume["mount_path"].startswith("/") for volume in volumes):
        raise InputError(f"a volume's mount path is not absolute, which {TEMPLATE} refuses")


HYPERPODPYTORCHJOB = HyperPodPyTorchJobApi()
