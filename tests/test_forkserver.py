"""The forkserver kept between launches (planner.run.forkserver): a kept server's forks print where
the launcher prints now and see its environment now; a change the server cannot hand over (a
variable read at import, a module it did not preload, a dead server) starts a fresh one, which
keeps what the last one preloaded."""

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

from planner.run import forkserver
from planner.run.forkserver import (
    LaunchContext,
    environment_changes,
    forkserver_pid,
    installed_modules,
    lacking_packages,
    prepare_forkserver,
    rank_modules,
    rank_preload,
)

VAR = "PLANNER_TEST_FORKSERVER_VAR"
PRELOADS = ("tabnanny", "wave")  # modules nothing here imports but a server told to


class Seen(NamedTuple):
    """What one forked worker saw."""

    pid: int
    server: int
    value: str | None
    cache: str | None  # TORCHINDUCTOR_CACHE_DIR
    preloaded: tuple[str, ...]  # which of PRELOADS the worker found imported, imported by none of its own


def _worker(context: LaunchContext, reply: Connection) -> None:
    """A worker as the launcher's are: take the context first, then print and report."""
    context.attach()
    print(f"worker {os.getpid()} prints", flush=True)
    preloaded = tuple(name for name in PRELOADS if name in sys.modules)
    reply.send(
        Seen(os.getpid(), os.getppid(), os.environ.get(VAR), os.environ.get("TORCHINDUCTOR_CACHE_DIR"), preloaded)
    )


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


@pytest.fixture
def bare_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the server earlier tests of this process left, with its preloads: a fresh server
    started here imports only what the test names (a run test's would import torch and more)."""
    forkserver.stop_forkserver()
    monkeypatch.setitem(forkserver._server, "preload", [])


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
@pytest.mark.usefixtures("bare_server")
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
@pytest.mark.usefixtures("bare_server")
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


@pytest.mark.slow
@pytest.mark.usefixtures("bare_server")
def test_a_server_that_preloaded_more_is_kept_and_a_fresh_one_keeps_the_last_ones_modules() -> None:
    first = _launch(prepare_forkserver(["tabnanny"]))
    assert first.preloaded == ("tabnanny",)
    assert _launch(prepare_forkserver([])).server == first.server, "a server with more preloaded was not kept"
    both = _launch(prepare_forkserver(["wave"]))
    assert both.server != first.server, "a module the server lacks did not start a fresh one"
    assert both.preloaded == ("tabnanny", "wave")
    assert _launch(prepare_forkserver(["tabnanny"])).server == both.server


@pytest.mark.slow
@pytest.mark.usefixtures("bare_server")
def test_a_further_module_of_a_package_the_server_holds_keeps_it() -> None:
    first = _launch(prepare_forkserver(["email.mime.text"]))
    # another module of the same package: the ranks import it on top of the loaded package
    assert _launch(prepare_forkserver(["email.mime.image"])).server == first.server
    fresh = _launch(prepare_forkserver(["email.mime.image", "wave"]))
    assert fresh.server != first.server, "a module of a package the server never imported did not start a fresh one"
    assert fresh.preloaded == ("wave",)


def test_lacking_packages_are_those_of_packages_no_preloaded_module_belongs_to() -> None:
    held = ["torch", "planner.run.worker", "transformers.models.llama.modeling_llama"]
    wanted = ["torch", "transformers.models.gpt2.modeling_gpt2", "torchvision.models.resnet", "transformers"]
    assert lacking_packages(wanted, held) == ["torchvision.models.resnet"]
    assert lacking_packages(["wave"], []) == ["wave"]
    assert lacking_packages([], ["wave"]) == []


def test_installed_modules_are_the_site_packages_that_define_the_classes() -> None:
    import click
    import torch

    from planner.schema.plan import Plan

    class Local(torch.nn.Module):  # the user's own code: a model file, or a test
        pass

    classes = [torch.nn.Linear, torch.nn.Linear, click.Command, Local, Plan, int]
    assert installed_modules(classes) == ["click.core", "torch.nn.modules.linear"]


@pytest.mark.slow  # imports transformers
def test_a_hugging_face_model_s_modules_are_preloaded_for_its_ranks() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    names = installed_modules({type(m) for m in model.modules()})
    assert "transformers.models.llama.modeling_llama" in names
    assert all(n.startswith(("transformers.", "torch.")) for n in names), names
    # torch's own layers are loaded with torch: naming them would change the preload per model
    preload = rank_preload({type(m) for m in model.modules()})
    assert preload[: len(rank_modules())] == list(rank_modules())
    extra = preload[len(rank_modules()) :]
    assert "transformers.models.llama.modeling_llama" in extra
    assert all(n.startswith("transformers.") for n in extra), extra


def test_models_of_torch_layers_alone_share_one_preload() -> None:
    import torch

    mlp = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.BatchNorm2d(1))
    assert rank_preload({type(m) for m in mlp.modules()}) == rank_preload({type(m) for m in conv.modules()})
    assert rank_preload(()) == list(rank_modules())


def test_a_server_still_importing_is_killed_at_once() -> None:
    """A stopped launch kills its server (``kill_forkserver``): one still importing torch used to run on
    at a full core for seconds after the command ended (``stop_forkserver`` waits for its imports)."""
    forkserver.stop_forkserver()
    prepare_forkserver(["torch", "torch.distributed.pipelining"])  # returns while the server imports them
    pid = forkserver_pid()
    assert pid is not None and Path(f"/proc/{pid}").exists()
    start = time.perf_counter()
    forkserver.kill_forkserver()
    took = time.perf_counter() - start
    assert not Path(f"/proc/{pid}").exists() and forkserver_pid() is None
    assert took < 0.5, took  # importing torch alone takes seconds
