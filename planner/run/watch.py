"""This node's worker processes, watched from a thread while they run: a worker that cannot stop by
itself (stopped, or blocked in a hung collective) is killed once the run is failing, and every
worker's exit code is kept (``planner run`` and ``planner probe`` start them through torch elastic's
agent, ``planner.run.launch.elastic_agent``).

Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

# How long the ranks may take to stop once the run has failed (write their records, leave the
# process group) before they are killed; also the agent's wait after SIGINT / SIGTERM.
GRACE_S = 10


class Watch:
    """This node's worker processes, watched from a thread while they run (Linux: ``/proc``).

    When a worker fails, elastic stops the others with SIGTERM and waits up to 30 s for each before
    SIGKILL. A stopped process (SIGSTOP, a debugger) cannot act on SIGTERM, and one blocked in a
    C++ call (a hung collective) only when the call returns: either would hold the run for those
    30 s. So once the run is failing (a worker wrote its failure record, or a worker is gone), the
    watch kills a stopped worker at once, and any worker still running ``GRACE_S`` after the
    first record. Both are remembered as ranks that stopped responding (``hung``).

    It also keeps each worker's ``multiprocessing`` process object: the workers are children of
    the forkserver, so that object is the only place their exit codes reach this process.

    Attributes:
        error_dir: where the workers write their failure records.
        pids: global rank -> pid of this node's workers.
        processes: global rank -> the worker's process object.
        hung: the ranks the watch killed.
    """

    def __init__(self, error_dir: Path) -> None:
        self.error_dir = error_dir
        self.pids: dict[int, int] = {}
        self.processes: dict[int, BaseProcess] = {}
        self.hung: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="planner-watch", daemon=True)

    def start(self, pids: dict[int, int]) -> None:
        """Watch these workers (global rank -> pid); called by the agent right after starting them."""
        # active_children() polls only children that are not running (none of these yet): called
        # here, in the agent's thread, it cannot race the agent reading their exit statuses.
        children = {p.pid: p for p in multiprocessing.active_children()}
        self.pids = dict(pids)
        self.processes = {rank: children[pid] for rank, pid in pids.items() if pid in children}
        if not self._thread.is_alive():
            self._thread.start()

    def _watch(self) -> None:
        failed_at: float | None = None
        while not self._done.wait(0.1):
            states = {rank: _process_state(pid) for rank, pid in self.pids.items()}
            if failed_at is None and any(self.error_dir.glob("rank*.json")):
                failed_at = time.monotonic()
            gone = any(state in (None, "Z") for state in states.values())
            late = failed_at is not None and time.monotonic() - failed_at > GRACE_S
            for rank, state in states.items():
                stopped = state in ("T", "t") and (failed_at is not None or gone)
                if stopped or (late and state not in (None, "Z")):
                    _kill(self.pids[rank])
                    self.hung.add(rank)

    def settle(self, seconds: float) -> None:
        """Wait up to ``seconds`` until every worker has written its record or is gone."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(
                (self.error_dir / f"rank{rank}.json").exists() or _process_state(pid) in (None, "Z")
                for rank, pid in self.pids.items()
            ):
                return
            time.sleep(0.05)

    def finish(self) -> dict[int, int | None]:
        """Stop watching, kill any worker still running (the agent itself was interrupted), and
        return every worker's exit code (negative: the signal that ended it; None: unknown)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        for pid in self.pids.values():
            if _process_state(pid) not in (None, "Z"):
                _kill(pid)
        codes: dict[int, int | None] = dict.fromkeys(self.pids)
        for rank, process in self.processes.items():
            process.join(GRACE_S)
            codes[rank] = process.exitcode
        return codes


def _process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, D, T, Z, ...) from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]  # after the name, which may hold spaces
    except (OSError, IndexError):
        return None


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
