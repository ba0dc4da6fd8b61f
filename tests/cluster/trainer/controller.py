"""Trainer v2.3.0's TrainJob controller (``pkg/controller/trainjob_controller.go``): ``Reconcile``
(``removeFailedCondition``, ``reconcileObjects``, ``setSuspendedCondition``, ``setTrainJobStatus``,
``reconcileDeadline``, one status merge patch), with the JobSet plugin's ``Build`` (runtime.py, build.py) and
``Status``.

It polls the namespace's TrainJobs and JobSets every POLL_S and reconciles a TrainJob when it or its JobSet changed
(``Owns`` through the JobSet plugin's watch), or its deadline timer is due."""

from __future__ import annotations

import calendar
import contextlib
import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster import jobset as js_player
from tests.cluster.controller import POLL_S, PolledController
from tests.cluster.trainer.api import (
    CLUSTER_RUNTIME_KEY,
    COMPLETE,
    CONTROLLER_NAME,
    DEADLINE_MESSAGE,
    DEADLINE_REASON,
    FAILED,
    GROUP,
    NOT_SUPPORTED_REASON,
    PLURAL,
    RESUMED_MESSAGE,
    RESUMED_REASON,
    RUNTIME_KEY,
    SUSPENDED,
    SUSPENDED_MESSAGE,
    SUSPENDED_REASON,
    VERSION,
    now,
    server_side_apply,
)
from tests.cluster.trainer.build import build_jobset
from tests.cluster.trainer.events import EventRecorder, go_error
from tests.cluster.trainer.runtime import resolve_runtime, runtime_key

log = logging.getLogger(__name__)


def seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))


def set_status_condition(conditions: list[dict[str, Any]], new: dict[str, Any]) -> None:
    """apimachinery ``meta.SetStatusCondition``: a new condition or a changed status takes the given transition time
    (now when it has none); reason and message are always updated."""
    current = next((c for c in conditions if c["type"] == new["type"]), None)
    if current is None:
        conditions.append({**new, "lastTransitionTime": new.get("lastTransitionTime") or now()})
        return
    if current["status"] != new["status"]:
        current["status"] = new["status"]
        current["lastTransitionTime"] = new.get("lastTransitionTime") or now()
    current["reason"], current["message"] = new.get("reason", ""), new.get("message", "")
    if "observedGeneration" in new:
        current["observedGeneration"] = new["observedGeneration"]


def is_finished(trainjob: dict[str, Any]) -> bool:
    """``IsTrainJobFinished``: Complete or Failed True."""
    return js_player.condition_true(trainjob, COMPLETE) or js_player.condition_true(trainjob, FAILED)


class TrainJobController(PolledController):
    """The TrainJob controller for one namespace. ``on_created(trainjob)`` runs (in its own thread) when a TrainJob is
    first seen: the test's timeline for it, as :class:`tests.cluster.training_operator.TrainingOperator` does."""

    def __init__(
        self,
        admin: kubernetes.client.ApiClient,
        namespace: str,
        on_created: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = POLL_S,
    ):
        super().__init__(f"trainer-{namespace}", poll_s)
        self.api = admin
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace, self.on_created = namespace, on_created
        self.seen: set[str] = set()
        self.build_errors: list[str] = []  # what v2.3.0 reports as TrainJobResourcesCreationFailed events
        self.events = EventRecorder(admin, "trainer-trainjob-controller")  # pkg/controller/setup.go
        self._versions: dict[str, tuple[str, ...]] = {}
        self._timers: dict[str, float] = {}  # TrainJob uid -> when its deadline check is due
        self.start()

    def reconcile_all(self) -> None:
        trainjobs = json.loads(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
            ).data
        )["items"]
        jobsets = json.loads(
            self.custom.list_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, _preload_content=False
            ).data
        )["items"]
        for trainjob in trainjobs:
            meta = trainjob["metadata"]
            uid = meta["uid"]
            if uid not in self.seen:
                self.seen.add(uid)
                if self.on_created is not None:
                    threading.Thread(
                        target=self.on_created, args=(trainjob,), daemon=True, name=f"timeline-{meta['name']}"
                    ).start()
            owned = [
                j
                for j in jobsets
                if any(o.get("uid") == uid and o.get("controller") for o in j["metadata"].get("ownerReferences") or [])
            ]
            versions = (meta["resourceVersion"], *sorted(j["metadata"]["resourceVersion"] for j in owned))
            due = self._timers.get(uid)
            timer = due is not None and time.monotonic() >= due
            if versions == self._versions.get(uid) and not timer:
                continue
            if timer:
                del self._timers[uid]
            if self.reconcile(trainjob):
                self._versions[uid] = versions

    def reconcile(self, trainjob: dict[str, Any]) -> bool:
        """``TrainJobReconciler.Reconcile``; False when it met an error (retried at the next pass)."""
        meta, spec = trainjob["metadata"], trainjob["spec"]
        if (spec.get("managedBy") or CONTROLLER_NAME) != CONTROLLER_NAME:
            return True
        # No look at deletionTimestamp: v2.3.0 reconciles a TrainJob being deleted like any other, so one held by a
        # foreground deletion after its JobSet went gets a new JobSet (the same gap as kubeflow/trainer#3779; JobSet
        # fixed it for itself in kubernetes-sigs/jobset#561).
        status = copy.deepcopy(trainjob.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.setdefault("conditions", [])
        failed = next((c for c in conditions if c["type"] == FAILED), None)
        if failed is not None and failed.get("reason") != DEADLINE_REASON:  # removeFailedCondition
            conditions.remove(failed)
        view = {**trainjob, "status": status}
        ok = True
        key = runtime_key(trainjob)
        if key not in (CLUSTER_RUNTIME_KEY, RUNTIME_KEY):
            set_status_condition(
                conditions,
                {
                    "type": FAILED,
                    "status": "True",
                    "reason": NOT_SUPPORTED_REASON,
                    "message": f"unsupported runtime: {key}",
                },
            )
            ok = False
        elif not is_finished(view):
            try:
                self._reconcile_objects(trainjob)
            except (ApiException, LookupError, ValueError) as exc:
                error = go_error(exc)
                message = f"TrainJob resources reconciliation failed: {error[:950]}" + (
                    " ..." if len(error) > 950 else ""
                )
                log.info("%s/%s: %s", self.namespace, meta["name"], message)
                self.build_errors.append(message)
                self.events.warn(trainjob, "TrainJobResourcesCreationFailed", "Reconciling", message)
                ok = False
        self._set_suspended_condition(trainjob, conditions)
        if key in (CLUSTER_RUNTIME_KEY, RUNTIME_KEY):
            ok = self._set_status_from_jobset(view, status) and ok
        self._reconcile_deadline(view, status)
        if not status.get("conditions"):
            status.pop("conditions", None)
        if status != before:
            patch = {k: status.get(k) for k in {*status, *before}}
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, meta["name"], {"status": patch}, _preload_content=False
            )
        return ok

    # reconcileObjects -----------------------------------------------------------------------------------------------

    def _reconcile_objects(self, trainjob: dict[str, Any]) -> None:
        """``reconcileObjects`` with the JobSet plugin's ``Build``: the JobSet applied unless it exists and neither
        it nor the TrainJob is suspended."""
        runtime = resolve_runtime(self.api, self.core, self.custom, self.namespace, trainjob)
        name = trainjob["metadata"]["name"]
        try:
            old = self.custom.get_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            old = None
        if old is not None and not trainjob["spec"].get("suspend") and not old["spec"].get("suspend"):
            return
        body = build_jobset(trainjob, runtime)
        path = f"/apis/{js_player.GROUP}/{js_player.VERSION}/namespaces/{self.namespace}/{js_player.PLURAL}/{name}"
        server_side_apply(self.api, path, body)

    # status ---------------------------------------------------------------------------------------------------------

    @staticmethod
    def _set_suspended_condition(trainjob: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
        """``setSuspendedCondition``: Suspended True while ``spec.suspend``; False (Resumed) once resumed."""
        if trainjob["spec"].get("suspend"):
            new = {"type": SUSPENDED, "status": "True", "reason": SUSPENDED_REASON, "message": SUSPENDED_MESSAGE}
        elif any(c["type"] == SUSPENDED and c["status"] == "True" for c in conditions):
            new = {"type": SUSPENDED, "status": "False", "reason": RESUMED_REASON, "message": RESUMED_MESSAGE}
        else:
            return
        set_status_condition(conditions, new)

    def _set_status_from_jobset(self, view: dict[str, Any], status: dict[str, Any]) -> bool:
        """``setTrainJobStatus`` with the JobSet plugin's ``Status``: the JobSet's Completed and Failed conditions
        copied as Complete and Failed (reason, message and transition time kept), ``jobsStatus`` from its
        ``replicatedJobsStatus``; a DeadlineExceeded Failed condition kept. False when the JobSet is missing while the
        TrainJob is not finished (an error there)."""
        try:
            jobset = self.custom.get_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, view["metadata"]["name"]
            )
        except ApiException as exc:
            if exc.status == 404:
                return is_finished(view)
            raise
        conditions = status.setdefault("conditions", [])
        for source, target in ((js_player.COMPLETED, COMPLETE), (js_player.FAILED, FAILED)):
            found = js_player.find_condition(jobset, source)
            if found is not None and found["status"] == "True":
                deadline = next(
                    (c for c in conditions if c["type"] == FAILED and c.get("reason") == DEADLINE_REASON), None
                )
                set_status_condition(conditions, {**found, "type": target})
                if deadline is not None and target == FAILED:
                    set_status_condition(conditions, deadline)
        statuses = [
            {
                "name": s["name"],
                "ready": s.get("ready", 0),
                "succeeded": s.get("succeeded", 0),
                "failed": s.get("failed", 0),
                "active": s.get("active", 0),
                "suspended": s.get("suspended", 0),
            }
            for s in (jobset.get("status") or {}).get("replicatedJobsStatus") or []
        ]
        if statuses:
            status["jobsStatus"] = statuses
        else:
            status.pop("jobsStatus", None)
        return True

    def _reconcile_deadline(self, view: dict[str, Any], status: dict[str, Any]) -> None:
        """``reconcileDeadline``: ``activeDeadlineSeconds`` from creation, or from the last resume; past it Failed
        (DeadlineExceeded) and the JobSet deleted; before it a timer for the moment it passes."""
        deadline_s = view["spec"].get("activeDeadlineSeconds") or 0
        if not deadline_s or is_finished(view) or view["spec"].get("suspend"):
            return
        start = seconds(view["metadata"]["creationTimestamp"])
        suspended = next((c for c in status.get("conditions") or [] if c["type"] == SUSPENDED), None)
        if suspended is not None and suspended["status"] == "False":
            start = seconds(suspended["lastTransitionTime"])
        remaining = start + deadline_s - time.time()
        if remaining < 0:
            set_status_condition(
                status.setdefault("conditions", []),
                {"type": FAILED, "status": "True", "reason": DEADLINE_REASON, "message": DEADLINE_MESSAGE},
            )
            with contextlib.suppress(ApiException):
                self.custom.delete_namespaced_custom_object(
                    js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, view["metadata"]["name"]
                )
            return
        self._timers[view["metadata"]["uid"]] = time.monotonic() + max(remaining, 1.0)
