"""The job APIs the launcher drives, found by name (`job_api`, as --job-api spells it) or by a rendered or stored
job's apiVersion and kind (`api_of`): pytorchjob.py, trainjob.py and hyperpodpytorchjob.py, each a `JobApi`
(job_api.py)."""

from __future__ import annotations

from typing import Any

from common.errors import InputError
from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.job_api import JOB_APIS, JobApi
from components.launch_training.pytorchjob import PYTORCHJOB
from components.launch_training.trainjob import TRAINJOB

_BY_NAME: dict[str, JobApi] = {api.name: api for api in (PYTORCHJOB, TRAINJOB, HYPERPODPYTORCHJOB)}


def job_api(name: str) -> JobApi:
    """The API named as --job-api spells it."""
    if name not in _BY_NAME:
        raise InputError(f"job API {name!r} is unknown: choose one of {', '.join(JOB_APIS)}")
    return _BY_NAME[name]


def api_of(job: dict[str, Any]) -> JobApi:
    """The API of a rendered or stored job, from its apiVersion and kind."""
    for name in JOB_APIS:
        api = job_api(name)
        if job.get("apiVersion") == api.api_version and job.get("kind") == api.kind:
            return api
    raise InputError(f"{job.get('apiVersion')} {job.get('kind')} is not a job API the launcher drives")
