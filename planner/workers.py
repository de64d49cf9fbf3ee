"""Processes that evaluate the search's layouts side by side (``planner plan --jobs``).

The search (``planner.core.layout.search``) is pure: a layout's evaluation depends on its arguments
alone. Given a ``SearchPool`` it hands the layouts next in its order over together and takes their
results in that order, so the plan is the same with any number of processes; only the time differs.

A search that ends within ``START_AFTER_S`` never starts a process (most plans: a worker costs about
half a second to start, more than they search). A longer one starts ``jobs`` workers, each
``python -m planner.workers``: a loop that reads a pickled call on its standard input and writes the
pickled result on its standard output. They import the pure core only (no torch), share nothing with
the planner's process (which may hold torch's threads: a forked copy of a threaded process can
deadlock) and never run the caller's script again (``multiprocessing``'s spawn re-imports the main
module: a library user's unguarded script would run twice). Each worker has one call at a time, so
neither side can block on a full pipe. A call's arguments and result are about a millisecond each
way for a 100-layer model, against tens of milliseconds of solving. Where a worker dies (killed, out
of memory) or processes cannot start, the rest of the search runs in the planner's own process.
"""

from __future__ import annotations

import os
import pickle
import selectors
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

START_AFTER_S = 1.0
"""Seconds a search runs in the planner's own process before it starts its workers."""

PER_JOB = 4
"""Layouts kept submitted ahead of the search per worker: each worker evaluates one at a time and
takes the next as it answers, so one slow layout (a second, beside many of ten milliseconds) does
not leave the others idle."""

_HEADER = struct.Struct("<Q")  # a frame: its length, then that many bytes of pickle


def default_jobs() -> int:
    """The cores this process may run on (its CPU affinity where the system has one, else every core).

    Returns:
        At least 1.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def _send(stream: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next frame's object; EOFError where the other side is gone."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the other side closed")
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed mid-frame")
    return pickle.loads(data)


class _Died(Exception):
    """A worker that stopped answering (it exited, was killed or ran out of memory)."""


class SearchPool:
    """The search's evaluations, in ``jobs`` worker processes once the search has run ``after_s``
    seconds (``planner.core.layout.pending.Pool``); a context manager that stops them on exit.

    Calls wait in the order they were submitted and go to whichever worker is free, one at a time
    each; ``take`` reads the answers as they come until the one asked for is in. A call discarded
    (the search ruled its layout out) is not started, or its answer not kept.

    Args:
        jobs: worker processes (1: none, every evaluation here; None: ``default_jobs()``).
        after_s: seconds from this pool's creation before the workers start.
    """

    def __init__(self, jobs: int | None, after_s: float = START_AFTER_S) -> None:
        self.jobs = default_jobs() if jobs is None else jobs
        self.after_s = after_s
        self._since = time.monotonic()
        self._workers: list[subprocess.Popen[bytes]] = []
        self._gave_up = self.jobs <= 1  # one job, or workers that could not start or died: evaluate here
        self._calls: dict[int, tuple[Callable[[Any], Any], object]] = {}  # submitted, not yet answered
        self._waiting: deque[int] = deque()  # submitted, not yet sent, in submission order
        self._busy: dict[int, int] = {}  # worker index -> the key it is evaluating
        self._answers: dict[int, tuple[str, Any]] = {}
        self._unwanted: set[int] = set()  # discarded while a worker had them: their answers dropped
        self._tickets = 0

    def width(self) -> int:
        """How many calls to keep submitted ahead: ``PER_JOB x jobs`` once the workers run (started
        here when ``after_s`` has passed), else 1.

        Returns:
            The count.
        """
        if not self._workers and not self._gave_up and time.monotonic() - self._since >= self.after_s:
            self._start()
        return PER_JOB * len(self._workers) if self._workers else 1

    def _start(self) -> None:
        """Start the workers (``_spawn``)."""
        try:
            for _ in range(self.jobs):
                self._workers.append(_spawn())
        except OSError:  # no processes to be had here (limits, a sandbox): run here
            self._give_up()

    def submit(self, fn: Callable[[Any], Any], arg: object) -> int:
        """Queue ``fn(arg)``; it starts as soon as a worker is free.

        Args:
            fn: a module-level function (the workers import it by name).
            arg: its argument.

        Returns:
            Its ticket (``take`` asks for it).
        """
        key = self._tickets = self._tickets + 1
        self._calls[key] = (fn, arg)
        self._waiting.append(key)
        try:
            self._dispatch()
        except _Died:
            self._give_up()
        return key

    def discard(self, tickets: Iterable[int]) -> None:
        """Calls whose results will not be taken: dropped where they wait, their answers not kept
        where a worker has them (it finishes them first: a few tens of milliseconds).

        Args:
            tickets: their tickets.
        """
        dropped = set(tickets)
        self._waiting = deque(key for key in self._waiting if key not in dropped)
        for key in dropped:
            self._calls.pop(key, None)
            self._answers.pop(key, None)
        self._unwanted |= dropped & set(self._busy.values())

    def take(self, key: int) -> Any:
        """The result of the call of ticket ``key``, waiting for the workers' answers as they come
        (here, where there are no workers).

        Args:
            key: a ticket of ``submit``'s.

        Returns:
            What the call returned.

        Raises:
            Exception: what the call raised, as it would have here.
        """
        while key not in self._answers and self._workers and self._busy:
            try:
                self._receive_one()
                self._dispatch()
            except _Died:  # the rest of the search runs here
                self._give_up()
        if key not in self._answers:  # no workers (any more): here
            fn, arg = self._calls.pop(key)
            return fn(arg)
        self._calls.pop(key, None)
        kind, value = self._answers.pop(key)
        if kind == "raised":
            raise value
        return value

    def _dispatch(self) -> None:
        """Send the oldest waiting calls to the free workers."""
        free = [i for i in range(len(self._workers)) if i not in self._busy]
        while free and self._waiting:
            i, key = free.pop(0), self._waiting.popleft()
            fn, arg = self._calls[key]
            try:
                _send(self._workers[i].stdin, (fn, arg))  # type: ignore[arg-type]  # a pipe: set in _start
            except OSError as e:  # BrokenPipeError: it has gone
                self._waiting.appendleft(key)
                raise _Died(str(e)) from e
            self._busy[i] = key

    def _receive_one(self) -> None:
        """Wait for the next answer of any busy worker and keep it."""
        with selectors.DefaultSelector() as selector:
            for i in self._busy:
                selector.register(self._workers[i].stdout, selectors.EVENT_READ, i)  # type: ignore[arg-type]  # a pipe
            i = selector.select()[0][0].data
        key = self._busy.pop(i)
        try:
            answer = _receive(self._workers[i].stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise _Died(str(e)) from e
        if key in self._unwanted:
            self._unwanted.discard(key)
        else:
            self._answers[key] = answer

    def _give_up(self) -> None:
        """Stop the workers; every call not answered yet is made here when it is taken."""
        self.close()
        self._gave_up = True
        self._busy.clear()
        self._waiting.clear()

    def close(self) -> None:
        """Stop the workers: their input closed, they exit; any still running after a few seconds is killed."""
        _stop(self._workers)
        self._workers = []

    def __enter__(self) -> SearchPool:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class Background:
    """One call made in a worker process (``python -m planner.workers``, as the search's) while this
    process goes on; ``result`` waits for it. Where no process can start or the worker dies, the
    call is made here when its result is asked for: the same result, later. A context manager that
    stops the worker on exit, its result taken or not.

    Args:
        fn: a module-level function (the worker imports it by name).
        arg: its argument (pickled to the worker).
    """

    def __init__(self, fn: Callable[[Any], Any], arg: object) -> None:
        self._call = (fn, arg)
        self._worker: subprocess.Popen[bytes] | None = None
        try:
            self._worker = _spawn()
            _send(self._worker.stdin, self._call)  # type: ignore[arg-type]  # a pipe
        except (OSError, pickle.PicklingError, TypeError, AttributeError):  # no process, or nothing to send it
            self.close()

    def result(self) -> Any:
        """What the call returned, made here where the worker could not.

        Returns:
            The result.

        Raises:
            Exception: what the call raised, as it would have here.
        """
        answer: tuple[str, Any] | None = None
        if self._worker is not None:
            try:
                answer = _receive(self._worker.stdout)  # type: ignore[arg-type]  # a pipe
            except (EOFError, OSError, pickle.UnpicklingError):
                answer = None  # it died: made here
            self.close()
        if answer is None:
            fn, arg = self._call
            return fn(arg)
        kind, value = answer
        if kind == "raised":
            raise value
        return value

    def close(self) -> None:
        """Stop the worker at once: it has answered, or its answer is no longer wanted."""
        if self._worker is not None:
            self._worker.kill()
            _stop([self._worker])
            self._worker = None

    def __enter__(self) -> Background:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _spawn() -> subprocess.Popen[bytes]:
    """A worker process, with this planner first on its path and one thread for numpy. It starts in
    the planner's own directory: ``python -m`` puts the working directory before every other path,
    and the caller's (a project of its own with a ``planner`` package, or another checkout of this
    one) would give the worker a planner other than the caller's.

    Raises:
        OSError: no process can start here (limits, a sandbox).
    """
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "planner.workers"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=root,
        start_new_session=True,  # Ctrl-C stops the planner, which stops them (``close``)
    )


def _stop(workers: Iterable[subprocess.Popen[bytes]]) -> None:
    """Stop workers: their input closed, they exit; any still running after a few seconds is killed."""
    workers = list(workers)
    for worker in workers:
        for stream in (worker.stdin, worker.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
    for worker in workers:
        try:
            worker.wait(timeout=5)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def serve(source: IO[bytes], sink: IO[bytes]) -> None:
    """A worker's loop: read a pickled ``(fn, item)``, write ``("done", fn(item))`` or ``("raised",
    the exception)``, until its input closes.

    Args:
        source: where the calls come from (the worker's standard input).
        sink: where the results go (its standard output).
    """
    while True:
        try:
            fn, item = _receive(source)
        except EOFError:
            return
        try:
            result: tuple[str, object] = ("done", fn(item))
        except Exception as e:  # handed back and raised there, as it would have been
            result = ("raised", e)
        try:
            _send(sink, result)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an exception that cannot be pickled
            _send(sink, ("raised", RuntimeError(f"a search worker's result could not be sent back: {e!r}")))


if __name__ == "__main__":
    # the answers go on a copy of the standard output; anything printed goes to the standard error
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, answers)


__all__ = ["PER_JOB", "START_AFTER_S", "Background", "SearchPool", "default_jobs", "serve"]
