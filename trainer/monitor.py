"""The lines a per-node log monitor reads: one per logged step and one when training stops, on stdout, from the first
process of every node.

The HyperPod training operator's hang and slow-job rules are evaluated by the HyperPod elastic agent on each node,
against local rank 0's stdout only (hyperpod-elastic-agent 1.1.3: `HyperPodElasticAgent.start_log_monitoring` starts
the log agent for local ranks {0}; `LogAgent._monitor_log_loop` reads `<attempt dir>/<local rank>/stdout.log`), each
line tried with Python's `re.match` and a rule's first group read with `float()` (`logagent/log_agent.py`,
`LogEvaluator.evaluate`). The console lines (metrics.py) do not serve it: they are rank 0's alone, on stderr, with the
throughput rounded for reading (`tok/s 7.1k`, which `float()` cannot read). So with MONITOR_ENV set to "1" (the
HyperPodPyTorchJob's pods: components/launch_training/hyperpodpytorchjob.py) local rank 0 of every node also prints
these, the figures exact; components/launch_training/log_rules.py holds the patterns that read them.
"""

from __future__ import annotations

import logging
import os
import sys

MONITOR_ENV = "TRAINER_MONITOR_LINES"


def monitor_step_line(step: int, tokens_per_s: float) -> str:
    """A logged step, with the job's throughput (every rank computes the same figure) as a whole number."""
    return f"monitor: step {step} tokens_per_s {tokens_per_s:.0f}"


def monitor_stop_line(step: int, reason: str) -> str:
    """No more step lines: the loop ended (the final checkpoint, which may take long, comes after it)."""
    return f"monitor: training stopped at step {step} ({reason})"


def monitor_logger(enabled: bool) -> logging.Logger:
    """The monitor's logger: the bare line on stdout when `enabled`, nothing otherwise (no handler, not propagated)."""
    logger = logging.getLogger("trainer.monitor")
    logger.propagate = False
    if enabled and not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


def monitored() -> bool:
    """Whether this process prints the monitor's lines: asked for, and the first process of its node."""
    return os.environ.get(MONITOR_ENV) == "1" and os.environ.get("LOCAL_RANK", "0") == "0"
