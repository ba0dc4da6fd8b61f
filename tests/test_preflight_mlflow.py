"""The mlflow check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py), against a real MLflow tracking server (tests/mlflow_server.py)."""

from __future__ import annotations

from components.preflight.result import PASS, WARN
from tests.preflight_helpers import Site, check, others_pass


def test_an_mlflow_server_that_answers_passes_and_one_that_does_not_is_a_warning(site: Site, mlflow_server) -> None:
    """The trainer's tracking server asked once (a real MLflow server on loopback): a closed port or a server that is
    not MLflow warns, naming the URI, and the run goes ahead."""
    from tests.servers import free_port

    answered = site.run(mlflow_tracking_uri=mlflow_server.url)
    assert check(answered, "mlflow").status == PASS and answered.passed
    assert (
        check(answered, "mlflow").reason == f"{mlflow_server.url} answers; the run goes in experiment "
        "'hyperpod-pretrain'"
    )
    closed = f"http://127.0.0.1:{free_port()}"
    unanswered = site.run(mlflow_tracking_uri=closed)
    assert check(unanswered, "mlflow").status == WARN and unanswered.passed, unanswered.markdown()
    assert check(unanswered, "mlflow").reason.startswith(f"{closed} did not answer as an MLflow tracking server (")
    others_pass(unanswered, "mlflow")
