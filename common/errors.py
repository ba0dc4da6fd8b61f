"""The two ways a step fails on purpose; the CLI prints either as one line, never a traceback."""


class InputError(ValueError):
    """An input of the step is wrong: the message names it and says what is wrong."""


class StepFailed(RuntimeError):
    """The step ran and what it checked or launched failed: the message says what and where."""
