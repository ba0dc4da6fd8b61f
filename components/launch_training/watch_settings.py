"""How the kubernetes backend follows a job: the settings of its loop (follow.py), its readers (readers.py,
log_stream.py) and its deadlines, in one place."""

from __future__ import annotations

from dataclasses import dataclass

DIAGNOSE_EVERY_S = 10.0  # how often the job's pods and events are read for the diagnosis


@dataclass(frozen=True)
class WatchSettings:
    deadline_s: float = 0  # 0: none; time spent queued (suspended by Kueue) does not count
    watch_timeout_s: int = 60  # each watch request ends after this and is reopened
    poll_interval_s: float = 10.0  # when watching is refused
    logs: str = "worker-0"  # or "all" or "none"
    log_reconnect_s: float = 1.0  # after a stream ends or a read fails; doubled per failed read, up to the max
    log_reconnect_max_s: float = 15.0
    # A log stream from a node that went away sends nothing and never closes: past this silence it is reopened
    # (from where it stopped, so nothing repeats). Quiet trainers cost a reconnect, nothing else.
    log_read_timeout_s: float = 120.0
    # Until the job first runs with its minimum of pods: pods Pending this long, or no pods this long after it could
    # run (created, or admitted), delete it (0: never).
    pending_timeout_s: float = 0
    # With no Pending deadline: an admitted job whose operator reported it could not make its pods (a Warning event
    # on the job) and made none this long is deleted all the same: such a job would wait for ever.
    creation_timeout_s: float = 600
    # After that: fewer than the minimum running this long (a lost node not yet replaced) deletes it (0: never).
    recovery_timeout_s: float = 0
    queue_timeout_s: float = 0  # suspended (queued by Kueue) this long deletes it (0: wait as long as it takes)
    replace_timeout_s: float = 600  # a failed earlier attempt's job must be gone within this before a new one
    # A Failed job with HyperPod auto-resume on is watched this long more, in case auto-resume brings it back (0: no).
    auto_resume_wait_s: float = 0
    diagnose_every_s: float = DIAGNOSE_EVERY_S
    training_check_s: float = 5.0  # how often the trainer's status.json on the volume is read (progress.py)
