"""Stop signals as exceptions: the one SIGTERM handler of the ``planner`` command and of every rank.

SIGTERM (a scheduler, ``kill``, the launcher stopping its ranks) raises ``Terminated``, and SIGINT
(Ctrl-C) ``KeyboardInterrupt``, so that the code stopped unwinds: the command writes its outputs
atomically and prints one line, a rank writes its failure record. No torch: the CLI installs the
handler around every command.
"""

from __future__ import annotations

import functools
import signal

__all__ = ["SIGNAL_NAMES", "Terminated", "ignore_stop_signals", "raise_on_signal", "raise_on_stop_signals"]


class Terminated(BaseException):
    """SIGTERM reached this process (a scheduler or ``kill`` stopping the command, the launcher stopping a rank).

    A ``BaseException``, like ``KeyboardInterrupt``: no ``except Exception`` on the way up may
    swallow it.
    """


SIGNAL_NAMES: dict[type[BaseException], str] = {KeyboardInterrupt: "SIGINT", Terminated: "SIGTERM"}
"""The exception a stop signal raises -> the signal's name (as a rank's failure record names it)."""


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT from now on (a rank that is already stopping)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def raise_on_signal(signum: int, frame: object, *, once: bool = False) -> None:
    """The signal handler: SIGINT raises ``KeyboardInterrupt``, SIGTERM (any other) ``Terminated``.

    Args:
        signum: the signal received.
        frame: the interrupted frame (unused).
        once: ignore SIGTERM and SIGINT before raising, so that a second signal cannot interrupt
            what the first one started (a rank writing its failure record would lose it).

    Raises:
        KeyboardInterrupt: for SIGINT.
        Terminated: for SIGTERM.
    """
    if once:
        ignore_stop_signals()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt()
    raise Terminated()


def raise_on_stop_signals() -> None:
    """A rank's handlers: the first SIGTERM or SIGINT raises (``raise_on_signal``), later ones are ignored."""
    handler = functools.partial(raise_on_signal, once=True)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
