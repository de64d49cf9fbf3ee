"""What happened when a launched run stopped early: the one line that names the cause.

When one rank of a pipeline fails, every other rank fails soon after: the ranks that send to it or
receive from it see "Connection reset by peer", or wait until ``--timeout`` and give up, or are
stopped by the launcher. Their errors are echoes; the user needs the one failure that started it.
``diagnose`` finds it from what the launcher gathers once every worker of its node has ended:

- the failure record each worker writes (``planner.run.worker.run_worker``: ``rank<R>.json``);
- the exit code of every worker process of this node (negative: the signal that ended it), which
  is all a rank killed from outside (SIGKILL, the out-of-memory killer, a crash) leaves behind;
- the ranks the launcher itself killed because they stopped responding (a stopped process, or
  one still running well after the others had failed);
- the signal the launcher received, if the user interrupted the run (Ctrl-C, SIGTERM);
- where a rank that crashed (a segmentation fault, an abort) was: Python's fault handler writes its
  stack to ``rank<R>.fault`` (``send_faults_to``) instead of the console, and the line names the
  frame (``fault_site``).

No torch, no processes; ``diagnose`` is tested on synthetic records.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import re
import signal
import sysconfig
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

# What the launcher receiving a signal means for the run (it exits with 128 + the signal's number).
_INTERRUPTED = {"SIGINT": "interrupted", "SIGTERM": "terminated"}

# Words of the errors a rank raises when a peer is silent or gone: it is a victim, not the cause.
_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_PEER_WORDS = ("connection reset", "connection closed", "broken pipe", "connection refused")

# Python's fault handler: "Current thread 0x... (most recent call first):", then a frame per line.
_CURRENT_THREAD = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)$')

# The fault files this process writes to (faulthandler keeps only the descriptor: the file must stay open).
_FAULT_FILES: list[IO[str]] = []

# The C++ source location gloo puts before its messages: "[/path/to/pair.cc:537] ".
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


@dataclass(frozen=True)
class RankRecord:
    """The failure record one worker wrote before exiting (``rank<R>.json``).

    Attributes:
        rank: the global rank.
        time: when it was written (``time.time()``), to order the failures.
        type: the exception's class name.
        planner_error: whether it is a ``PlannerError`` (a user error, such as a NaN loss).
        message: the exception's message on one line.
        signal: the signal this rank received ("SIGINT", "SIGTERM"), None when none.
        step: the step it was in (None: before training started).
        done: the steps it completed.
        traceback: the worker's traceback.
    """

    rank: int
    time: float
    type: str
    planner_error: bool
    message: str
    signal: str | None = None
    step: int | None = None
    done: int = 0
    traceback: str = ""

    @property
    def where(self) -> str:
        """Where in the run the rank failed: "at step K", "after step K" (between two steps: K
        completed, the next not begun), or "before the first step"."""
        if self.step is None:
            return "before the first step"
        return f"after step {self.step}" if self.done >= self.step else f"at step {self.step}"

    @property
    def timed_out(self) -> bool:
        """Whether the rank gave up waiting on another (a receive, a send, a collective past ``--timeout``)."""
        return self._victim_of(_TIMEOUT_WORDS)

    @property
    def lost_peer(self) -> bool:
        """Whether the rank failed because another rank's end of a connection went away."""
        return self._victim_of(_LOST_PEER_WORDS)

    @property
    def raised(self) -> bool:
        """Whether the rank failed by an error of its own: no signal, no timeout, no lost connection."""
        return self.signal is None and not self.timed_out and not self.lost_peer

    def _victim_of(self, words: tuple[str, ...]) -> bool:
        text = f"{self.type} {self.message}".lower()
        return self.signal is None and not self.planner_error and any(w in text for w in words)


def read_records(error_dir: Path) -> dict[int, RankRecord]:
    """The failure records the workers left in ``error_dir``, by rank (an unreadable one is skipped).

    Args:
        error_dir: the folder handed to every worker.

    Returns:
        rank -> its record.
    """
    records: dict[int, RankRecord] = {}
    for path in sorted(error_dir.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            raw: dict[str, Any] = json.loads(path.read_text())
            fields = RankRecord.__dataclass_fields__
            record = RankRecord(**{k: v for k, v in raw.items() if k in fields})
            records[record.rank] = record
    return records


class WorkerTraceback(Exception):
    """A failing worker's traceback (its text is the message), chained under ``RunFailed`` so that
    ``--debug`` shows where the worker failed and not only where the launcher noticed."""


@dataclass(frozen=True)
class Diagnosis:
    """Why a run stopped early.

    Attributes:
        message: one line naming the cause: the rank, what happened to it, the step.
        status: the run's status in run.json: "failed", or "interrupted" (Ctrl-C, SIGTERM).
        exit_code: what the command exits with: 2 for a user error on a rank (as a mistake caught
            in the parent), 130 after SIGINT, 143 after SIGTERM, else 1.
        traceback: the failing worker's traceback, when it wrote one (for ``--debug``).
    """

    message: str
    status: Literal["failed", "interrupted"]
    exit_code: int
    traceback: str | None = None


def send_faults_to(error_dir: Path, rank: int) -> None:
    """Have Python's fault handler write this process's stacks to ``error_dir/rank<R>.fault``
    (``fault_site`` reads it) instead of the console: a crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE,
    SIGILL) then costs the user one line naming where, not a page of every thread's frames (torch
    elastic's worker wrapper enables the handler on stderr).

    Args:
        error_dir: the launch's folder of failure records.
        rank: this worker's global rank.
    """
    file = (error_dir / f"rank{rank}.fault").open("w")
    _FAULT_FILES.append(file)
    faulthandler.enable(file=file, all_threads=True)


def read_faults(error_dir: Path) -> dict[int, str]:
    """The fault handler's dumps the ranks left (``send_faults_to``), by rank; empty ones left out.

    Args:
        error_dir: the launch's folder of failure records.

    Returns:
        rank -> the dump's text.
    """
    dumps: dict[int, str] = {}
    for path in sorted(error_dir.glob("rank*.fault")):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text(errors="replace")
            if text.strip():
                dumps[int(path.stem.removeprefix("rank"))] = text
    return dumps


def fault_site(dump: str) -> str | None:
    """Where a fault handler's dump says the crashing thread was, as "in NAME (FILE:LINE)": its
    innermost frame outside Python's library and installed packages (the user's model file, or a
    checkout's), else its innermost frame; None when the dump names no frame.

    Args:
        dump: the text ``faulthandler`` wrote.

    Returns:
        The site, or None.
    """
    lines = dump.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if _CURRENT_THREAD.match(line)), None)
    if start is None:
        return None
    frames = []
    for line in lines[start:]:
        frame = _FRAME.match(line)
        if frame is None:
            break
        frames.append(frame)
    if not frames:
        return None
    own = next((f for f in frames if not _installed(f["file"])), frames[0])
    return f"in {own['name']} ({own['file']}:{own['line']})"


def _installed(file: str) -> bool:
    """Whether a frame's file is Python's or an installed package's (not the user's, nor a checkout's)."""
    if file.startswith("<"):  # "<string>", "<frozen runpy>": no file of anyone's
        return True
    parts = Path(file).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    library = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib")}
    return any(Path(file).is_relative_to(folder) for folder in library if folder)


def signal_name(exit_code: int) -> str:
    """The name of the signal a negative exit code stands for (``-9`` -> "SIGKILL").

    Args:
        exit_code: a process's exit code, negative when a signal ended it.

    Returns:
        The signal's name, or "signal N" for a number this platform does not name.
    """
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _position(records: Mapping[int, RankRecord]) -> str:
    """Where the run stopped, as " at step K" (leading space), "" when no record says.

    It is where the rank that got least far was when it failed: a rank that died without a record
    was in the step its peers were waiting in, and no rank gets a whole step ahead of another
    (each step ends with an all-reduce over all of them).
    """
    if not records:
        return ""
    return " " + min(records.values(), key=lambda r: (r.step or 0, r.done)).where


def _death(rank: int, code: int | None, at: str, dump: str | None) -> str:
    """One line for a rank that ended without writing a record (``dump``: its fault handler's, if any)."""
    site = fault_site(dump) if dump else None
    where = f" {site}" if site else ""
    if code is None:
        return f"rank {rank} ended without reporting an error{at}{where}"
    if code < 0:
        return f"rank {rank} was killed by {signal_name(code)}{at}{where}"
    return f"rank {rank} exited with code {code}{at}{where}"


def _reason(message: str, limit: int = 200) -> str:
    """A worker's error message, short: of gloo's, only the first sentence after its C++ source
    location (the rest is generic advice); cut to ``limit``."""
    text = " ".join(message.split())
    short = _SOURCE_LOCATION.sub("", text)
    if short != text:
        short = short.split(". ")[0]
    return short if len(short) <= limit else short[: limit - 3] + "..."


def diagnose(
    records: Mapping[int, RankRecord],
    exit_codes: Mapping[int, int | None],
    timeout_s: float,
    nnodes: int = 1,
    *,
    hung: Collection[int] = (),
    parent_signal: str | None = None,
    faults: Mapping[int, str] | None = None,
) -> Diagnosis:
    """The cause of a run that stopped early, from what its ranks left behind.

    The rules, first match wins:

    1. The launcher received SIGINT / SIGTERM: "interrupted at step K" / "terminated at step K".
    2. A rank ended without a record (killed by a signal, crashed, exited): it is the cause, not
       the ranks that then lost their connection to it; its step is the step they were in.
    3. A rank failed with a user error (``planner_error``, e.g. a NaN loss or a data stream that
       ran out): the one in the earliest step (then the earliest written) is the cause.
    4. A rank the launcher killed because it stopped responding: "rank R stopped responding" —
       unless another rank raised an error of its own (not an echo: no timeout, lost connection or
       signal), which it waited for: that one is the cause.
    5. Otherwise the earliest record: a rank that received a signal is the cause; when the
       earliest is a timeout, a rank the launcher had to stop afterwards is (it had hung); a
       timeout or a lost connection with no such rank here points at another node, or, when
       the run has one node, at a step slower than ``--timeout`` (every rank was here).

    Args:
        records: the failure records, by rank.
        exit_codes: rank -> the exit code of its process, for this node's ranks (None: unknown).
        timeout_s: ``--timeout``: how long a rank waits on another before giving up.
        nnodes: the run's nodes (``--nnodes``): with one, no rank elsewhere can be the cause.
        hung: the ranks the launcher killed because they stopped responding (one that had written
            a record was only slow to exit: its record speaks for it).
        parent_signal: the signal the launcher received ("SIGINT", "SIGTERM", ...), None when none.
        faults: rank -> the fault handler's dump it left (``read_faults``): a crashed rank's line
            names its frame, and the dump is the traceback ``--debug`` shows.

    Returns:
        The one line, the run's status and the exit code.
    """
    at = _position(records)
    silent = sorted(r for r in hung if r not in records)
    if parent_signal is not None:
        what = _INTERRUPTED.get(parent_signal, f"stopped by {parent_signal}")
        number = getattr(signal.Signals, parent_signal, signal.SIGTERM).value
        return Diagnosis(f"{what}{at or ' before the first step'}", "interrupted", 128 + number)
    dead = sorted(r for r, code in exit_codes.items() if r not in records and r not in silent and code != 0)
    if dead:
        dump = (faults or {}).get(dead[0])
        return Diagnosis(_death(dead[0], exit_codes[dead[0]], at, dump), "failed", 1, dump)
    user = sorted((r for r in records.values() if r.planner_error), key=lambda r: (r.step or 0, r.time))
    if user:
        first = user[0]
        # a message that names its step (a NaN loss) says it already
        said = first.step is None or f"step {first.step}" in first.message
        return Diagnosis(
            f"rank {first.rank} failed: {first.message}{'' if said else f' ({first.where})'}",
            "failed",
            2,  # a user error (a NaN loss, a broken data stream): exit 2, as in one process
            first.traceback,
        )
    seconds = f"{timeout_s:g}"
    stuck = f"stopped responding: no progress for {seconds} s{at} (--timeout {seconds})"
    raised = sorted((r for r in records.values() if r.raised), key=lambda r: r.time)
    if silent and raised:
        # the silent ranks waited for it in a call with no timeout of its own (dist.new_group)
        return _failed(raised[0])
    if silent:
        return Diagnosis(f"rank {silent[0]} {stuck}", "failed", 1)
    if not records:
        return Diagnosis("the run stopped and no rank reported why", "failed", 1)
    return _from_records(records, at, stuck, nnodes)


def _from_records(records: Mapping[int, RankRecord], at: str, stuck: str, nnodes: int) -> Diagnosis:
    """Rule 5 of ``diagnose``: every rank here wrote a record and none is a user error."""
    ordered = sorted(records.values(), key=lambda r: r.time)
    first = ordered[0]
    if first.signal is not None:
        what = "interrupted by" if first.signal == "SIGINT" else "terminated by"
        return Diagnosis(f"rank {first.rank} was {what} {first.signal} {first.where}", "failed", 1)
    if first.timed_out:
        # The ranks that timed out waited on one that did not answer; the launcher then stopped
        # that one (a signal record): it had hung in Python (a loop, a lock, a sleep).
        stopped = [r for r in ordered if r.signal is not None]
        if stopped:
            return Diagnosis(f"rank {stopped[0].rank} {stuck}", "failed", 1, stopped[0].traceback)
    if first.timed_out or first.lost_peer:
        what = "got no answer from" if first.timed_out else "lost its connection to"
        if nnodes == 1:  # every rank ran here, and none failed or was stopped: a step slower than --timeout
            return Diagnosis(
                f"rank {first.rank} {what} another rank {first.where} ({_reason(first.message)}): no rank "
                "failed, so a step or a save took longer than --timeout; give a larger --timeout",
                "failed",
                1,
                first.traceback,
            )
        # Nothing on this node caused it: the rank it waited on or lost is on another node.
        return Diagnosis(
            f"rank {first.rank} {what} another rank {first.where} ({_reason(first.message)}): "
            "a rank on another node failed or stopped responding first; see that node's output",
            "failed",
            1,
            first.traceback,
        )
    return _failed(first)


def _failed(record: RankRecord) -> Diagnosis:
    """A rank that raised an error of its own (not a user error) is the cause."""
    return Diagnosis(
        f"rank {record.rank} failed {record.where}: {record.type}: {_reason(record.message, 300)}",
        "failed",
        1,
        record.traceback,
    )
