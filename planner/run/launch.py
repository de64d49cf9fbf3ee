"""``planner run``: check a plan against its model, then train it.

A 1-stage plan trains in this process (``planner.run.single``). Otherwise one process per stage
is started the way ``torchrun`` starts them: ``torch.distributed.launcher.api.elastic_launch``
with a c10d rendezvous (multi-node through ``nnodes`` / ``rdzv_endpoint`` / ``rdzv_id``, exactly
torchrun's flags), ``max_restarts=0`` and ``spawn``. Each worker runs
``planner.run.worker.run_worker``, which returns that rank's ``RankResult``; they come back as
``{rank: result}`` and ``planner.run.loop.run_result`` makes the run's record of them.

Everything a user can get wrong is checked here, in the parent, before any process starts:
the model file loads, the plan's tracer still works, the traced fingerprint is the plan's, every
stage range can be cut, no parameter is shared by two stages, and nccl has a GPU per local rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from planner.capture.blocks import TracedModel
from planner.capture.load import ModelFile, check_train_batch
from planner.capture.stage import stage_module
from planner.errors import PlannerError
from planner.run.common import check_runnable, check_ties, load_plan_model, print_flushed, trace_for_plan
from planner.run.loop import run_result
from planner.run.single import train_model_file
from planner.schema.plan import Plan
from planner.schema.request import RunRequest
from planner.schema.result import RunResult
from planner.torch_compat import stop_forkserver

_NOISY_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)


def _free_port() -> int:
    """A TCP port that is free right now on localhost (for the single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _quiet_elastic() -> Iterator[None]:
    """Silence elastic's per-run INFO/WARNING chatter (run ids, SIGTERM notices, failure dumps).

    Its module loggers set their own levels, so each is set explicitly and restored afterwards.
    Worker failures are not lost: they come back as records and are raised as one error.
    """
    saved: dict[str, int] = {}
    manager = logging.Logger.manager
    for name in list(manager.loggerDict):
        if name.startswith(_NOISY_LOGGERS):
            logger = logging.getLogger(name)
            saved[name] = logger.level
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables inside the block (workers inherit them), restore them afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_stages(plan: Plan, traced: TracedModel) -> None:
    """Build every stage once (catches illegal cuts) and check the plan records every parameter
    that several stages read (tied weights), before any rank starts.

    Raises:
        TraceError: a stage cannot be cut out of the model.
        PlanFileError: a tie the plan does not record (``check_ties``).
    """
    for s in plan.stages:
        stage_module(traced, s.start, s.end)
    check_ties(plan, traced)


def _check_devices(plan: Plan, nproc_per_node: int) -> None:
    """nccl needs one visible GPU per rank on this node (gloo runs anywhere)."""
    if plan.profile.backend != "nccl":
        return
    have = torch.cuda.device_count()
    if have < nproc_per_node:
        raise PlannerError(
            f"the plan uses backend nccl with {nproc_per_node} ranks on this node but {have} CUDA device(s) "
            "are visible; nccl needs one GPU per rank: run on a machine with enough GPUs, spread the "
            "ranks over more nodes (--nnodes), or re-plan for CPU with backend gloo"
        )


def _worker_error(error_dir: Path, fallback: BaseException) -> Exception:
    """The earliest worker failure record as one error (later ones are usually its echo)."""
    records = []
    for f in error_dir.glob("rank*.json"):
        with contextlib.suppress(OSError, json.JSONDecodeError):
            records.append(json.loads(f.read_text()))
    if not records:
        return RuntimeError(
            f"a pipeline worker died without reporting an error ({' '.join(str(fallback).split())[:300]})"
        )
    first = min(records, key=lambda r: r["time"])
    msg = f"rank {first['rank']} failed: {first['message']}"
    if first["planner_error"]:
        return PlannerError(msg)
    return RuntimeError(f"{msg} ({first['type']}); worker traceback:\n{first['traceback']}")


def _check_endpoint(request: RunRequest) -> None:
    """A rendezvous host that does not resolve is one line now, not a hang or a traceback later."""
    host = request.rdzv_host
    if host is None:
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        raise PlannerError(
            f"--rdzv-endpoint {request.rdzv_endpoint}: host {host!r} cannot be resolved; "
            "give a host name or address every node can reach"
        ) from None


def changed_file_warning(plan: Plan, mf: ModelFile) -> str:
    """One line naming a model file edited since planning, and which of its contract parts changed."""
    old, new = plan.model.part_digests, mf.part_digests()
    parts = sorted(name for name in set(old) | set(new) if old.get(name) != new.get(name))
    what = f"{', '.join(parts)} changed" if parts and old else "its text changed"
    return (
        f"warning: {mf.path} changed since it was planned ({what}; digest {plan.model.file_digest} -> {mf.digest}); "
        "the run uses the file as it is now (re-run `planner plan` if the change matters)"
    )


def run_plan(plan: Plan, request: RunRequest, *, print_fn: Callable[[str], None] = print_flushed) -> RunResult:
    """Train ``plan`` for ``request.steps`` steps: in this process for one stage, else one process per stage.

    Args:
        plan: the plan to run.
        request: ``planner run``'s options: the plan's file (relative model paths resolve against
            its folder), steps, nodes (torchrun ``--nnodes``; each starts n_ranks / nnodes ranks),
            the c10d rendezvous ``host:port`` (default: a free port on localhost, single node
            only) and id (default derived from the plan's fingerprint), and whether to print one
            line per step (from the last rank) and a start line.
        print_fn: where this process's lines go (worker lines go to the inherited stdout).

    Returns:
        The measured run.

    Raises:
        PlannerError: the plan does not fit the model, the machine or the request (checked before
            any process starts), or a worker failed with a user error.
        RuntimeError: a worker failed otherwise; the message is the worker's error.
    """
    plan_path, nnodes = request.plan_file, request.nnodes
    check_runnable(plan)
    n = plan.n_ranks
    if n % nnodes:  # RunRequest keeps nnodes >= 1
        raise PlannerError(f"{n} ranks cannot be spread evenly over {nnodes} node(s); use an --nnodes that divides {n}")
    _check_endpoint(request)
    nproc = n // nnodes
    _check_devices(plan, nproc if n > 1 else 0)
    mf = load_plan_model(plan, plan_path)
    if mf.digest != plan.model.file_digest:
        print_fn(changed_file_warning(plan, mf))
    traced = trace_for_plan(plan, mf, mf.build(plan.model.seed))
    _check_stages(plan, traced)
    del traced
    check_train_batch(mf, plan.batch_size, plan.model.seed)
    if n == 1:
        if request.echo:
            print_fn(
                f"training 1 stage in this process ({plan.batch_size} samples/step, "
                f"{plan.n_microbatches} microbatch(es), {plan.profile.threads} thread(s))"
            )
        return train_model_file(
            plan,
            mf,
            request.steps,
            n_microbatches=plan.n_microbatches,
            echo=request.echo,
            print_fn=print_fn,
            plan_path=plan_path,
        )
    return _launch(plan, request, nproc, print_fn)


def _launch(plan: Plan, request: RunRequest, nproc: int, print_fn: Callable[[str], None]) -> RunResult:
    """Start ``nproc`` workers on this node (torchrun-style), wait for all, gather this node's ranks."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from planner.run.worker import run_worker

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.pipelining", "planner.run.worker"])
    n, nnodes = plan.n_ranks, request.nnodes
    endpoint = request.rdzv_endpoint or f"localhost:{_free_port()}"
    if request.echo:
        print_fn(
            f"launching {n} ranks ({nproc} per node, {plan.n_stages} stages, {plan.schedule}, "
            f"{plan.n_microbatches} microbatches, "
            f"backend {plan.profile.backend}, {plan.profile.threads} thread(s) each)"
        )
    with tempfile.TemporaryDirectory(prefix="planner-run-") as tmp:
        error_dir = Path(tmp) / "errors"
        error_dir.mkdir()
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nproc,
            run_id=request.rdzv_id or f"planner-{plan.model.fingerprint}",
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            max_restarts=0,
            # Workers fork from a server process that has imported torch and the worker once, instead
            # of each importing them afresh (about 2 s of CPU per rank). The server is started
            # fresh by this process, not forked from it, so no thread or CUDA state is inherited.
            start_method="forkserver",
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp) / "logs")),
        )
        args = (plan.to_json(), str(request.plan_file), request.steps, request.echo, str(error_dir))
        # OMP_NUM_THREADS reaches the workers through the agent; without it each rank's OpenMP
        # pool would size itself to every core and the ranks would oversubscribe the machine.
        with _quiet_elastic(), _env(OMP_NUM_THREADS=str(plan.profile.threads)):
            try:
                outputs = elastic_launch(config, run_worker)(*args)
            except ChildFailedError as e:
                raise _worker_error(error_dir, e) from None
            finally:
                stop_forkserver()  # the next launch's workers print where stdout is then
    return run_result(plan, list(outputs.values()), mode="pipeline", plan_path=request.plan_file)
