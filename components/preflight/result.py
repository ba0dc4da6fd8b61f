"""What a check answers (pass, warn, fail or n/a, with a one-line reason and fix) and the report of all of them: kept
apart from the checks so that the component, the CLI and the tests read a result without importing a check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PASS, WARN, FAIL, NOT_APPLICABLE = "pass", "warn", "fail", "n/a"

SEED_FIX = {  # the seed's troubleshooting table
    "pending": "Check kubectl describe node for allocatable GPUs",
    "efa": "Ensure aws-efa-k8s-device-plugin DaemonSet is running",
    "oom": "Increase memory in resources",
    "ecr": "Re-run aws ecr get-login-password or use IRSA",
}
READ_FIX = (
    "grant the step's service account {what} to run this check: kubectl apply -f deploy/rbac.yaml (the CRD, "
    "the Training Operator in kubeflow, the PVC), kubectl apply -f deploy/rbac-cluster-read.yaml (optional: "
    "nodes, pods, DaemonSets and Deployments in all namespaces, PersistentVolumes and "
    "StorageClasses)"
)


@dataclass
class Check:
    name: str
    status: str  # pass, warn, fail, n/a
    reason: str  # one line
    fix: str = ""  # one line; empty when there is nothing to do


@dataclass
class PreflightResult:
    checks: list[Check]
    warn_only: bool = False
    target: str = ""  # what was checked: the PyTorchJob's namespace/name and its size

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def passed(self) -> bool:
        """No check failed, or failures are allowed (warn_only)."""
        return self.warn_only or not self.failures

    def verdict(self) -> str:
        failed, warned = len(self.failures), len(self.warnings)
        tail = f", {warned} warning(s)" if warned else ""
        if not failed:
            return f"passed{tail}"
        if self.warn_only:
            return f"passed: {failed} failed check(s) allowed (warn_only){tail}"
        return f"FAILED ({failed} check(s){tail})"

    def markdown(self) -> str:
        icon = {PASS: "PASS", FAIL: "**FAIL**", WARN: "warn", NOT_APPLICABLE: "n/a"}
        lines = [f"# Preflight: {self.verdict()}", ""]
        if self.target:
            lines += [self.target, ""]
        lines += ["| check | status | reason | fix |", "| --- | --- | --- | --- |"]
        lines += [f"| {c.name} | {icon[c.status]} | {_cell(c.reason)} | {_cell(c.fix)} |" for c in self.checks]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "warn_only": self.warn_only,
            "verdict": self.verdict(),
            "target": self.target,
            "failed": [c.name for c in self.failures],
            "warned": [c.name for c in self.warnings],
            "checks": [{"name": c.name, "status": c.status, "reason": c.reason, "fix": c.fix} for c in self.checks],
        }


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def failure_message(result: PreflightResult) -> str:
    """One line naming each failed check with its reason and fix: a failed KFP step uploads no artifact, so the
    Markdown report never reaches the UI, only this message (the exception's) and the log do."""
    if not result.failures:
        return f"preflight {result.verdict()}"
    parts = [f"{c.name}: {c.reason.rstrip('.')}." + (f" Fix: {c.fix}" if c.fix else "") for c in result.failures]
    return "preflight failed: " + "; ".join(parts)
