"""The trainer's bad input beside its settings' (trainer/config.py SettingError): each is one line and exit 2
(train_ddp.main). Here, not beside the code that raises them, so that staging, the launcher and the CLI can name
them without importing torch (2 s of a step's start)."""


class CheckpointError(Exception):
    """No usable checkpoint, or one that does not fit this run."""


class DataError(Exception):
    """The dataset cannot feed this run (missing, empty, or too small for one global batch)."""
