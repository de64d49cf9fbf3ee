"""The forkserver kept between launches (planner.run.forkserver): a kept server's forks print where
the launcher prints now and see its environment now; a change the server cannot hand over (a
variable read at import, other preloaded modules, a dead server) starts a fresh one."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import pytest

from planner.run.forkserver import LaunchContext, environment_changes, forkserver_pid, prepare_forkserver

VAR = "PLANNER_TEST_FORKSERVER_VAR"


class Seen(NamedTuple):
    """What one forked worker saw."""

    pid: int
    server: int
    value: str | None
    cache: str | None  # TORCHINDUCTOR_CACHE_DIR


def _worker(context: LaunchContext, reply: Connection) -> None:
    """A worker as the launcher's are: take the context first, then print and report."""
    context.attach()
    print(f"worker {os.getpid()} prints", flush=True)
    reply.send(Seen(os.getpid(), os.getppid(), os.environ.get(VAR), os.environ.get("TORCHINDUCTOR_CACHE_DIR")))


def _launch(context: LaunchContext) -> Seen:
    """Start one worker from the forkserver and wait for its report."""
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_worker, args=(context, send))
    process.start()
    send.close()
    seen = receive.recv()
    process.join(30)
    assert process.exitcode == 0
    return seen


@contextmanager
def _stdout_to(path: str) -> Iterator[None]:
    """This process's file descriptor 1 on ``path`` inside the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _wait_until_dead(pid: int) -> None:
    """Wait until ``pid`` has ended (a zombie, left for the forkserver module to reap)."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


def test_environment_changes_lists_each_differing_variable_with_both_values() -> None:
    before = {"A": "1", "B": "2", "C": "3"}
    now = {"A": "1", "B": "4", "D": "5"}
    assert environment_changes(before, now) == {"B": ("2", "4"), "C": ("3", None), "D": (None, "5")}
    assert environment_changes(now, now) == {}


def test_attach_takes_the_launchers_changes_but_keeps_what_the_agent_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANNER_T_CHANGED", "old")
    monkeypatch.setenv("PLANNER_T_GONE", "x")
    monkeypatch.delenv("PLANNER_T_NEW", raising=False)
    monkeypatch.setenv("RANK", "1")  # the agent set this rank's own value over the server's "0"
    context = LaunchContext(
        {
            "PLANNER_T_CHANGED": ("old", "new"),
            "PLANNER_T_GONE": ("x", None),
            "PLANNER_T_NEW": (None, "n"),
            "RANK": ("0", "5"),
        }
    )
    context.attach()
    assert os.environ["PLANNER_T_CHANGED"] == "new"
    assert "PLANNER_T_GONE" not in os.environ
    assert os.environ["PLANNER_T_NEW"] == "n"
    assert os.environ["RANK"] == "1"


@pytest.mark.slow
def test_a_kept_server_forks_workers_that_print_and_see_what_the_launcher_does_now(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(VAR, "first")
    first = _launch(prepare_forkserver([]))
    monkeypatch.setenv(VAR, "second")
    # torch sets this one in the launcher when it first needs it, and reads it when it uses it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    printed = str(tmp_path / "stdout.txt")
    with _stdout_to(printed):
        second = _launch(prepare_forkserver([]))
    assert second.server == first.server == forkserver_pid(), "the server was not kept"
    assert (first.value, second.value) == ("first", "second")
    assert second.cache == str(tmp_path / "cache")
    with open(printed) as f:
        assert f.read() == f"worker {second.pid} prints\n"

    monkeypatch.delenv(VAR)
    third = _launch(prepare_forkserver([]))
    assert third.server == first.server and third.value is None


@pytest.mark.slow
def test_a_variable_read_at_import_other_preloads_or_a_dead_server_start_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VAR, "kept")
    server = _launch(prepare_forkserver([])).server
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive" if os.environ.get("OMP_WAIT_POLICY") != "passive" else "active")
    fresh = _launch(prepare_forkserver([]))
    assert fresh.server != server and fresh.value == "kept"

    other = _launch(prepare_forkserver(["json"])).server
    assert other != fresh.server

    os.kill(other, signal.SIGKILL)
    _wait_until_dead(other)
    monkeypatch.setenv(VAR, "after")
    revived = _launch(prepare_forkserver(["json"]))
    assert revived.server not in (other, fresh.server) and revived.value == "after"
    assert _launch(prepare_forkserver(["json"])).server == revived.server
