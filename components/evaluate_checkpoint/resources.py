"""What the evaluate step runs with on the cluster: one GPU of the training nodes (the default), or none (the CPU),
and its CPUs and memory limit. The compile puts these on the step's pod (pipelines/pipeline.py) and hands the same
values to the preflight, whose evaluation-memory check holds the model's need against them
(components/preflight/evaluation_memory.py): one definition, so the pod and the check cannot disagree. No torch, no
kfp: the CLI and the preflight read it."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from common.errors import InputError

# The forms KFP's task settings take (kfp/dsl/pipeline_task.py, _validate_cpu_request_limit and
# _validate_memory_request_limit): refused here in one line, before KFP raises its own ValueError mid-compile.
_CPU = re.compile(r"^([0-9]*[.])?[0-9]+m?$")
_MEMORY = re.compile(r"^[0-9]+(E|Ei|P|Pi|T|Ti|G|Gi|M|Mi|K|Ki)?$")


@dataclass(frozen=True)
class EvaluationResources:
    """The evaluate step's pod: `gpus` 1 runs it on a GPU of the training nodes (the model in bf16, in the evaluator
    image), 0 on the CPU (fp32, in the components image)."""

    gpus: int = 1
    cpu: str = "8"
    memory: str = "32Gi"

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus not in (0, 1):
            raise InputError(
                f"--evaluation-gpus {self.gpus!r}: 1 (the evaluation loads the model on one GPU) or 0 (on the CPU)"
            )
        if not isinstance(self.cpu, str) or not _CPU.match(self.cpu):
            raise InputError(f"--evaluation-cpu {self.cpu!r}: CPUs as Kubernetes writes them, e.g. 8 or 500m")
        if not isinstance(self.memory, str) or not _MEMORY.match(self.memory):
            raise InputError(f"--evaluation-memory {self.memory!r}: a whole amount with its unit, e.g. 64Gi")

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EvaluationResources:
        """From the compiled constant the preflight step is given."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise InputError(f"evaluation setting(s) {', '.join(map(repr, unknown))} unknown: {', '.join(known)}")
        gpus = values.get("gpus", cls.gpus)
        if isinstance(gpus, float) and gpus.is_integer():  # KFP writes a struct's numbers as JSON's: 1.0
            values = {**values, "gpus": int(gpus)}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the compiled YAML."""
        return dataclasses.asdict(self)
