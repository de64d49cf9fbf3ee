"""The planner's domain errors: one small hierarchy the CLI turns into one-line messages,
``printable``, which keeps a message one line whatever it quotes, and ``listed``, which keeps a
list of names in one short.

Pure module: imports nothing from torch.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped (a line break, a tab, a record
    separator in a path the user gave), so an error stays the one line it was written as.

    Args:
        text: a message, or a value quoted in one.

    Returns:
        The text, each unprintable character as its escape (``\\n``, ``\\x1e``).
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def listed(names: list[str], most: int) -> str:
    """The first ``most`` of ``names``, comma-separated, and how many more there are.

    Args:
        names: names for a message.
        most: how many to write out.

    Returns:
        "a, b, c" or "a, b and 3 more".
    """
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


class PlannerError(ValueError):
    """Base of every error a user can cause (bad input, bad file, impossible request).

    The message names the value, what was expected and how to fix it. The CLI prints it on one
    line and exits with status 2; anything that is not a ``PlannerError`` is a bug in the planner.
    """


class ModelFileError(PlannerError):
    """A model file is missing, fails to import, or does not follow the model-file contract."""


class TraceError(PlannerError):
    """No tracer in the fallback chain could capture the model."""


class PlanFileError(PlannerError):
    """A plan.json is malformed, of another version, or made for a model that has since changed."""


class InfeasibleError(PlannerError):
    """No partition satisfies the request (too few legal cuts, memory limit, batch not divisible)."""


class DataError(PlannerError):
    """A data file given with ``--data`` is missing, empty, too short for one batch, or does not suit the model."""


class RunFailed(PlannerError):
    """A ``planner run`` stopped before its last step: a rank died, hung, or was interrupted.

    The message names the rank, what happened to it (exit code or signal) and the step; the run's
    record (run.json) is still written with the steps completed.

    Attributes:
        result: the run's record of the steps completed (a ``RunResult``; None: no step completed
            or no rank could report).
        exit_code: the status the CLI exits with: 2 when a rank stopped on a user error (a NaN
            loss, a data stream that fails), 130 after Ctrl-C (SIGINT), 143 after SIGTERM, 1 for
            any other failure.
    """

    def __init__(self, message: str, *, result: object | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.result = result
        self.exit_code = exit_code
