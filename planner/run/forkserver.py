"""The server process the ranks fork from, kept from one launch to the next.

The launcher starts its workers with multiprocessing's ``forkserver`` method: a server process,
started by the launcher (not forked from it, so it inherits no thread or CUDA state), imports torch
and the worker once, and every rank is a fork of it. Starting the server costs seconds (the import
of torch), so a process that launches many runs (the tests, a bench, a notebook) keeps it.

A kept server still has the stdout, stderr and environment of the launch that started it, and so
would its forks. Each worker therefore receives a ``LaunchContext`` among its arguments and takes
the launcher's present stdout, stderr and environment from it first thing. A variable that a
library reads once, when it is loaded (OpenMP's thread settings, torch's and CUDA's, Python's
own), cannot be handed over that way: when one of those differs from the server's, the server is
started afresh (``IMPORT_TIME_PREFIXES``).

Besides torch and the worker, the server imports the installed packages the model's own classes
come from (``installed_modules``: a Hugging Face model's ``transformers`` modules take seconds to
import, in every rank otherwise). A kept server that already imported what a launch needs serves
it. One that lacks a module of a package it never imported is started afresh, importing what it
had and the new ones. One that lacks only further modules of packages it holds (another
``transformers`` family's modeling file, beside the one it preloaded) is kept: the package's own
base (``transformers.modeling_utils``, seconds) is loaded already, and each rank imports the
family's file on top of it in a fraction of a second, where a fresh server would import torch
and the package again (about 10 s of CPU; the suite switches families dozens of times).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import Any

# Variables with these prefixes may be read when a library is loaded (libgomp and MKL read their
# thread settings then, torch its logging and compile settings, the interpreter PYTHON*), which a
# kept server did long ago: a change to one starts a fresh server.
IMPORT_TIME_PREFIXES = (
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH",
    "PYTORCH_",
    "PYTHON",
    "LD_",
    "CUDA",
    "NCCL_",
    "GLOO_",
    "TRITON_",
)

# ... except these, which torch sets in its own process the first time it needs them (to the value it
# would compute anyway: torch._inductor.runtime.cache_dir_utils) and reads on every use: a kept
# server's ranks take them from the LaunchContext like any other variable.
READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})

_STDIO_FDS = (1, 2)


def rank_modules() -> tuple[str, ...]:
    """What every rank imports, once in the server it forks from: torch, its pipelining, its
    distributed checkpoint (every rank saves with it at the end of a run; a tenth of a second to
    import in each), the export tracer (every transformers model's rank traces with torch.export),
    the memory tracker of the tracked step (a quarter of a second in each) and the worker.

    A function, not a constant, so that this module imports no torch: a process forked from a bare
    server (tests/test_forkserver.py) unpickles its ``LaunchContext`` from here in milliseconds,
    where ``import torch`` took 1.7 s.

    Returns:
        The modules' names, in import order.
    """
    from planner.torch_compat import EXPORT_TRACER_MODULE, MEMORY_TRACKER_MODULE

    return (
        "torch",
        "planner.run.quiet_imports",  # before anything imports torchao
        "torch.distributed.pipelining",
        "torch.distributed.checkpoint",
        EXPORT_TRACER_MODULE,
        MEMORY_TRACKER_MODULE,
        "planner.run.worker",
    )


# the running server as this process started it: its pid, preloaded modules and environment
_server: dict[str, Any] = {"pid": None, "preload": [], "environment": {}}


class LaunchContext:
    """What a worker takes from its launcher first thing: stdout, stderr and the environment.

    Pickled for a worker, as multiprocessing pickles a new process's arguments, it sends the
    launcher's stdout and stderr descriptors along (``reduction.DupFd`` passes them over the
    server's socket) with the environment's changes since the server started.
    """

    def __init__(
        self, changes: dict[str, tuple[str | None, str | None]], handles: tuple[Any, ...] | None = None
    ) -> None:
        """Args:
        changes: variable -> (its value in the server, its value in the launcher now); None: unset.
        handles: the received descriptors, in a worker (None on the launcher's side).
        """
        self.changes = changes
        self._handles = handles

    def __reduce__(self) -> tuple[Any, ...]:
        handles = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in _STDIO_FDS)
        return (LaunchContext, (self.changes, handles))

    def attach(self) -> None:
        """In a worker: print where the launcher prints, and see the launcher's environment.

        A variable the launching agent set for this rank (RANK, MASTER_PORT, ...) no longer has the
        server's value and is left as the agent set it.
        """
        for name, (before, now) in self.changes.items():
            if os.environ.get(name) != before:
                continue
            if now is None:
                del os.environ[name]
            else:
                os.environ[name] = now
        if self._handles is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for handle, fd in zip(self._handles, _STDIO_FDS, strict=True):
            if handle is not None:
                received = handle.detach()
                os.dup2(received, fd)
                os.close(received)


def prepare_forkserver(preload: Sequence[str]) -> LaunchContext:
    """Make sure a server the workers can fork from runs, and say what they must take from here.

    A server this process started earlier is kept unless it died, it imported nothing of a package
    a module of ``preload`` belongs to (``lacking_packages``), or a variable read at import (``IMPORT_TIME_PREFIXES``, but not ``READ_WHEN_USED``)
    changed since; otherwise a fresh one is started under the present environment, importing
    ``preload`` and what the last one had imported (so that launches alternating between two
    models' packages do not restart it each time).

    Args:
        preload: the modules the server imports once for all its forks, in order.

    Returns:
        The context to pass to every worker (``LaunchContext.attach``).
    """
    environment, wanted = dict(os.environ), list(preload)
    changes = environment_changes(_server["environment"], environment)
    read_at_import = [name for name in changes if name.startswith(IMPORT_TIME_PREFIXES) and name not in READ_WHEN_USED]
    stale = bool(read_at_import) or bool(lacking_packages(wanted, _server["preload"]))
    if forkserver_pid() != _server["pid"] or stale:
        stop_forkserver()  # not the one we started (none, or another caller's), or a stale one
        imports: list[str] = list(dict.fromkeys([*wanted, *_server["preload"]]))
    else:
        imports = _server["preload"]
    multiprocessing.set_forkserver_preload(imports)
    multiprocessing.forkserver.ensure_running()  # starts one if none runs, or the last one died
    if forkserver_pid() != _server["pid"]:  # started just now, under the present environment
        _server.update(pid=forkserver_pid(), preload=imports, environment=environment)
        changes = {}
    return LaunchContext(changes)


def lacking_packages(wanted: Iterable[str], preloaded: Iterable[str]) -> list[str]:
    """The modules of ``wanted`` from packages none of ``preloaded`` belongs to: what only a fresh
    server could give the ranks at no cost (a further module of a package the server holds costs
    each rank little: its package's base is loaded already).

    Args:
        wanted: the modules a launch would have preloaded.
        preloaded: the modules a kept server imported.

    Returns:
        Those of ``wanted`` whose top-level package is none of ``preloaded``'s, in order.
    """
    held = {name.partition(".")[0] for name in preloaded}
    return [name for name in wanted if name.partition(".")[0] not in held]


def rank_preload(classes: Iterable[type]) -> list[str]:
    """What a server imports for ranks that build a model of ``classes``: torch, the worker, and the
    installed packages' modules that define those classes (``installed_modules``), but none of
    torch's own: ``import torch`` loads them already, and naming them would make each model's mix of
    torch layers a different preload, so a launch of another model would restart a kept server.

    Args:
        classes: the classes a rank will instantiate (a model's modules' types).

    Returns:
        The modules' names, ``rank_modules()`` first.
    """
    first = rank_modules()
    loaded = {name.split(".")[0] for name in first}
    return [*first, *(name for name in installed_modules(classes) if name.split(".")[0] not in loaded)]


def installed_modules(classes: Iterable[type]) -> list[str]:
    """The modules of installed packages that define ``classes``, for a server to import ahead.

    Only modules loaded from the interpreter's site-packages count: a model file, or a module
    beside it, is the user's code, which each rank imports itself as it loads the model file.

    Args:
        classes: the classes a rank will instantiate (a model's modules' types).

    Returns:
        Their modules' names, sorted, each once.
    """
    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    names: set[str] = set()
    for cls in classes:
        module = sys.modules.get(cls.__module__)
        where = getattr(module, "__file__", None)
        if where and any(root in Path(where).resolve().parents for root in roots):
            names.add(cls.__module__)
    return sorted(names)


def stop_forkserver() -> None:
    """Stop multiprocessing's forkserver (Python's private ``ForkServer._stop``), so the next launch
    starts a fresh one. A Python without the method keeps its server."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if callable(stop):
        stop()


def kill_forkserver() -> None:
    """Kill multiprocessing's forkserver at once, as a stopped launch leaves (``stop_forkserver``
    would wait for it to finish importing torch: seconds of a core, after the command has ended)."""
    pid = forkserver_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    stop_forkserver()


def forkserver_pid() -> int | None:
    """The process id of multiprocessing's forkserver, once started (Python's private
    ``ForkServer._forkserver_pid``; None: none started, or a Python without the field)."""
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def environment_changes(before: dict[str, str], now: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Each variable whose value differs between two environments.

    Args:
        before: the earlier environment.
        now: the later one.

    Returns:
        name -> (value before, value now), None where unset; sorted by name.
    """
    return {
        name: (before.get(name), now.get(name))
        for name in sorted(before.keys() | now.keys())
        if before.get(name) != now.get(name)
    }


def _is_open(fd: int) -> bool:
    """Whether this process has ``fd`` open (a launcher started with stdout closed has not)."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
