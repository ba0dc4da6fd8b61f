"""What every component wrapper shares: the image it runs in, logging, and reporting a result to KFP.

Kept free of kfp imports so that the cores and the CLI can use it too.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any, Protocol

# The components image carries kfp and this project (docker/ comes with the cluster pipeline issue);
# no step installs packages when it starts.
COMPONENTS_IMAGE = "hyperpod-pretrain-components:0.1.0"
# The evaluate step's image on a GPU: the trainer image's CUDA stack, with kfp and this project
# (docker/evaluator.Dockerfile).
EVALUATOR_IMAGE = "hyperpod-pretrain-evaluator:0.1.0"


class MetricsSink(Protocol):
    def log_metric(self, metric: str, value: float) -> None: ...


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def log_numbers(sink: MetricsSink, values: Any) -> None:
    """Log every numeric field of a dataclass (or dict) as a KFP metric."""
    items = dataclasses.asdict(values).items() if dataclasses.is_dataclass(values) else dict(values).items()
    for key, value in items:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            sink.log_metric(key, float(value))
