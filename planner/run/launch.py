"""``planner run``: check a plan against its model, then train it.

A 1-stage plan trains in this process (``planner.run.single``). Otherwise one process per rank
is started the way ``torchrun`` starts them: torch elastic's ``LocalElasticAgent`` (what
``elastic_launch`` runs) with ``max_restarts=0``, ``forkserver`` and torchrun's rendezvous: c10d on
``localhost:0`` by default (the store binds a free port itself, as ``torchrun --standalone``),
multi-node through ``nnodes`` / ``rdzv_endpoint`` / ``rdzv_id``, or static with ``node_rank``
(torchrun's ``--node-rank``). Each worker runs ``planner.run.worker.run_worker``, which returns that
rank's ``RankResult``; they come back as ``{rank: result}`` and ``planner.run.loop.run_result``
makes the run's record of them.

A run that stops early (a rank killed, hung or failing, Ctrl-C, SIGTERM) ends within seconds of
the fault, or ``--timeout`` for a hung rank: ``planner.run.watch.Watch`` kills a worker that cannot stop by itself.
It raises ``RunFailed`` with one line naming the cause (``planner.run.faults``) and the run's
record of the steps every rank completed.

Everything a user can get wrong is checked here, in the parent, before any process starts:
the model file loads, the plan's tracer still works, the traced fingerprint is the plan's, every
stage range can be cut, no parameter is shared by two stages, and nccl has a GPU per local rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from planner.capture.contract import check_train_batch
from planner.capture.float8 import check_float8, require_torchao
from planner.capture.graph_file import RankGraphs
from planner.errors import PlannerError, RunFailed
from planner.run.console import print_flushed
from planner.run.faults import WorkerTraceback, diagnose, read_faults, read_records
from planner.run.forkserver import kill_forkserver, prepare_forkserver, rank_preload
from planner.run.loop import RankResult, run_result
from planner.run.mesh import threads_per_rank
from planner.run.model import (
    changed_file_warning,
    check_edited_contract,
    check_runnable,
    graphs_for_ranks,
    load_plan_model,
    planned_source,
    trace_for_plan,
)
from planner.run.preflight import check_checkpoint_dir, check_data, check_resume, check_stages
from planner.run.watch import GRACE_S, Watch
from planner.schema.plan import Plan
from planner.schema.result import RunResult
from planner.schema.run_request import RunRequest
from planner.torch_compat import watched_elastic_agent

_NOISY_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)


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


def _check_devices(plan: Plan, nproc_per_node: int) -> None:
    """nccl needs one visible GPU per rank on this node (gloo runs anywhere); float8 layers need torchao,
    and FP8 tensor cores on a GPU (``check_float8``: refused before any rank starts)."""
    if plan.profile.float8 is not None:
        require_torchao()
        gpu = plan.profile.backend == "nccl" and torch.cuda.is_available()
        check_float8(torch.device("cuda", 0) if gpu else torch.device("cpu"), plan.compile)
    if plan.profile.backend != "nccl":
        return
    have = torch.cuda.device_count()
    if have < nproc_per_node:
        raise PlannerError(
            f"the plan uses backend nccl with {nproc_per_node} ranks on this node but {have} CUDA device(s) "
            "are visible; nccl needs one GPU per rank: run on a machine with enough GPUs, spread the "
            "ranks over more nodes (--nnodes), or re-plan for CPU with backend gloo"
        )


def _check_endpoint(request: RunRequest) -> None:
    """A rendezvous endpoint that cannot work is one line now, not a hang or a traceback later.

    Without ``--rdzv-endpoint`` the store binds a free port itself: nothing to check. Otherwise:
    the host must resolve; a port on this machine that this node would host the store on must be
    free (another program, or another run, may hold it); and a store hosted elsewhere must answer
    as one within ``--timeout`` (torch's store client waits forever on a program that accepts the
    connection but never answers).

    Raises:
        PlannerError: the host does not resolve, the port is taken, nothing answers within
            ``--timeout``, or what answers is not a rendezvous store.
    """
    host, endpoint = request.rdzv_host, request.rdzv_endpoint
    if host is None or endpoint is None:
        return
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        raise PlannerError(
            f"--rdzv-endpoint {endpoint}: host {host!r} cannot be resolved; "
            "give a host name or address every node can reach"
        ) from None
    port = int(endpoint.rpartition(":")[2])
    if port == 0:
        if request.nnodes > 1:
            raise PlannerError(
                f"--rdzv-endpoint {endpoint}: port 0 lets the store pick any free port, which the other nodes "
                "cannot know; give a fixed port, the same on every node"
            )
        return
    # c10d: whichever node runs on the endpoint's host hosts the store; static: node 0 does.
    may_host = request.node_rank in (None, 0)
    if may_host and any(_is_this_machine(a) for a in addresses):
        if _port_free(port):
            return
        if request.nnodes == 1 or request.node_rank == 0:
            raise PlannerError(
                f"--rdzv-endpoint {endpoint}: port {port} on this machine is in use (by another program, or "
                "another planner run); choose a free port, or leave --rdzv-endpoint out to get one"
            )
        # held: by another node of this run on this machine, or by a stranger (checked below)
    _wait_for_store(host, port, request)


def _is_this_machine(address: str) -> bool:
    """Whether ``address`` is one of this machine's (only those can be bound)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on every address of this machine (as the store does).

    ``SO_REUSEADDR`` as the store sets it: a port left in TIME_WAIT by an earlier run counts as free.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _wait_for_store(host: str, port: int, request: RunRequest) -> None:
    """Wait up to ``--timeout`` for HOST:PORT to accept connections (another node may start later),
    then check that what answers is a rendezvous store.

    Raises:
        PlannerError: nothing accepted a connection within ``--timeout``, or a program that is not a
            store did.
    """
    endpoint, seconds = request.rdzv_endpoint, f"{request.timeout_s:g}"
    deadline = time.monotonic() + request.timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                break
        except OSError:
            if time.monotonic() >= deadline:
                raise PlannerError(
                    f"--rdzv-endpoint {endpoint}: nothing answered there within {seconds} s (--timeout {seconds}); "
                    "start the first node's `planner run` with the same --rdzv-endpoint, and check that "
                    f"{host} is reachable from this machine"
                ) from None
            time.sleep(0.5)
    if not _answers_as_store(host, port, min(request.timeout_s, 10.0)):
        raise PlannerError(
            f"--rdzv-endpoint {endpoint}: the program listening there is not a rendezvous store (another "
            "program holds the port); choose a free port, the same on every node"
        )


def _answers_as_store(host: str, port: int, seconds: float) -> bool:
    """Whether a torch store client connects to HOST:PORT within ``seconds``.

    The client runs in a daemon thread that is left behind when it hangs (on a program that accepts
    the connection and never answers, it waits forever whatever its timeout). Its retry warnings
    (C++ logging, straight to stderr) are muted meanwhile.
    """
    answered = threading.Event()

    def connect() -> None:
        with contextlib.suppress(Exception):
            torch.distributed.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
            answered.set()

    thread = threading.Thread(target=connect, name="planner-store-probe", daemon=True)
    with _stderr_muted():
        thread.start()
        thread.join(seconds + 1)
    return answered.is_set()


@contextlib.contextmanager
def _stderr_muted() -> Iterator[None]:
    """Send this process's file descriptor 2 to /dev/null inside the block (C++ logging writes there)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_plan(plan: Plan, request: RunRequest, *, print_fn: Callable[[str], None] = print_flushed) -> RunResult:
    """Train ``plan`` for ``request.steps`` steps: here for a one-rank plan, else one process per rank.

    Args:
        plan: the plan to run.
        request: ``planner run``'s options: the plan's file (relative model paths resolve against
            its folder), steps, nodes (torchrun ``--nnodes``; each starts world_size / nnodes ranks),
            the rendezvous ``host:port`` (default: localhost, a port the store picks, single node
            only), id (default derived from the plan's fingerprint) and node rank (a static
            rendezvous, as torchrun's ``--node-rank``), ``--timeout`` (every wait on another rank
            or node), and whether to print one line per step (from the last rank) and a start line.
        print_fn: where this process's lines go (worker lines go to the inherited stdout).

    Returns:
        The measured run.

    Raises:
        PlannerError: the plan does not fit the model, the machine or the request, or the
            rendezvous endpoint cannot work (checked before any process starts).
        RunFailed: the ranks started and the run stopped early (a rank failed, was killed or hung;
            Ctrl-C; SIGTERM): one line naming the cause, the exit code, and the run's record of
            the steps completed (``result``).
    """
    plan_path, nnodes = request.plan_file, request.nnodes
    check_runnable(plan)
    n = world_size = plan.world_size  # dp replicas x n_ranks pipeline ranks x tp tensor-parallel ranks
    if world_size % nnodes:  # RunRequest keeps nnodes >= 1
        raise PlannerError(f"{n} ranks cannot be spread evenly over {nnodes} node(s); use an --nnodes that divides {n}")
    _check_endpoint(request)
    nproc = world_size // nnodes
    _check_devices(plan, nproc if world_size > 1 else 0)
    mf = load_plan_model(plan, plan_path)
    if mf.digest != plan.model.file_digest:
        print_fn(changed_file_warning(plan, mf))
    source = planned_source(plan, mf)
    check_edited_contract(plan, mf, source.model)
    traced = trace_for_plan(plan, source.model, source.example)
    # written before the checks below use the trace, so the ranks rebuild the graph as traced here;
    # the checks add the graph at a tp rank's sizes
    graphs = graphs_for_ranks(traced) if world_size > 1 else None
    check_stages(plan, traced, source, graphs)
    check_train_batch(mf, plan.batch_size, plan.model.seed)
    check_resume(plan, request)
    check_checkpoint_dir(plan, request, print_fn)
    check_data(plan, request, mf, traced, print_fn)
    preload = rank_preload({type(m) for m in source.model.modules()})
    del traced, source
    if world_size == 1:
        if request.echo:
            print_fn(
                f"training 1 stage in this process ({plan.batch_size} samples/step, "
                f"{plan.n_microbatches} microbatch(es), {plan.profile.threads} thread(s))"
            )
        from planner.run.worker import train_in_process

        rank = train_in_process(plan, request)
        return run_result(plan, [rank], mode="local", plan_path=plan_path)
    return _launch(plan, request, nproc, print_fn, preload, graphs)


def launch_line(plan: Plan, nproc: int) -> str:
    """What ``planner run`` says as it starts the ranks: how many, and how the plan places them.

    Args:
        plan: the plan.
        nproc: ranks per node.

    Returns:
        One line.
    """
    sequence = " with sequence parallelism" if plan.sequence_parallel else ""
    split = f"each stage split over {plan.tp} tensor-parallel ranks{sequence}, " if plan.tp > 1 else ""
    experts = f"experts sharded over {plan.ep} ranks, " if plan.ep > 1 else ""
    context = (
        f"each sequence split over {plan.cp} context-parallel ranks ({plan.cp_attention}), " if plan.cp > 1 else ""
    )
    return (
        f"launching {plan.world_size} ranks ({nproc} per node, {plan.n_stages} stages, {plan.schedule}, "
        f"{plan.n_microbatches} microbatches, {split}{experts}{context}backend {plan.profile.backend}, "
        f"{threads_per_rank(plan)} thread(s) each)"
    )


def _launch(
    plan: Plan,
    request: RunRequest,
    nproc: int,
    print_fn: Callable[[str], None],
    preload: list[str],
    graphs: RankGraphs | None = None,
) -> RunResult:
    """Start ``nproc`` workers here (torchrun-style, forked from a server of ``preload``), wait, gather them;
    ``graphs``: this launcher's traces for the ranks to rebuild (``graphs_for_ranks``; None: they trace).

    Raises:
        PlannerError: the rendezvous could not be formed (before any rank started).
        RunFailed: the ranks started and the run stopped early; its ``result`` holds the steps
            this node's ranks completed.
    """
    from planner.run.worker import run_worker

    if request.echo:
        print_fn(launch_line(plan, nproc))
    params, master_addr, master_port = _rendezvous_parameters(plan, request)
    with tempfile.TemporaryDirectory(prefix="planner-run-") as tmp:
        error_dir = Path(tmp) / "errors"
        error_dir.mkdir()
        graph_file = graphs.written(Path(tmp)) if graphs is not None else ""
        watch = Watch(error_dir)
        # OMP_NUM_THREADS reaches the workers through the agent; without it each rank's OpenMP
        # pool would size itself to every core and the ranks would oversubscribe the machine.
        with _quiet_elastic(), _env(OMP_NUM_THREADS=str(threads_per_rank(plan))), _signal_handlers_kept():
            try:
                # inside _env, so the server (or the ranks of a kept one) see this OMP_NUM_THREADS
                context = prepare_forkserver(preload)
                spec = WorkerSpec(
                    role="planner",
                    local_world_size=nproc,
                    entrypoint=run_worker,
                    args=(plan.to_json(), request.model_dump_json(), str(error_dir), context, graph_file),
                    rdzv_handler=_FixedNodes(_rendezvous_handler(params, request)),
                    max_restarts=0,
                    monitor_interval=0.1,
                    master_addr=master_addr,
                    master_port=master_port,
                )
                agent = elastic_agent(spec, watch, Path(tmp) / "logs")
                values, parent_signal = _run_agent(agent, spec, watch, request, params)
            finally:
                exit_codes = watch.finish()
        if values is not None:
            if parent_signal is not None:  # it came as the ranks finished: nothing was cut short
                print_fn(f"note: {parent_signal} came after every rank had finished; the run is complete")
            return run_result(plan, list(values.values()), mode="pipeline", plan_path=request.plan_file)
        if parent_signal is not None:  # stopped: a server still importing would outlive the command by seconds
            kill_forkserver()
        error, cause = _failure(plan, request, error_dir, exit_codes, watch.hung, parent_signal, agent.returned)
    raise error from cause


def _rendezvous_parameters(plan: Plan, request: RunRequest) -> tuple[RendezvousParameters, str | None, int | None]:
    """torchrun's rendezvous for this request, and the store address the workers use when it is fixed.

    Every wait in it (joining, each store operation) is bounded by ``--timeout``.
    """
    run_id = request.rdzv_id or f"planner-{plan.model.fingerprint}"
    nodes = request.nnodes
    seconds = max(1, math.ceil(request.timeout_s))
    if request.node_rank is not None and request.rdzv_endpoint is not None:
        # torchrun --node-rank: a static rendezvous; node 0 hosts the store at the endpoint.
        host, _, port = request.rdzv_endpoint.rpartition(":")
        params = RendezvousParameters(
            "static", request.rdzv_endpoint, run_id, nodes, nodes, rank=request.node_rank, timeout=seconds
        )
        return params, host.strip("[]"), int(port)
    # c10d, as torchrun --standalone when no endpoint is given: on port 0 the store binds a free
    # port itself, and the workers learn it from the rendezvous (nothing can take it in between).
    endpoint = request.rdzv_endpoint or "localhost:0"
    params = RendezvousParameters(
        "c10d", endpoint, run_id, nodes, nodes, join_timeout=seconds, read_timeout=min(seconds, 60)
    )
    return params, None, None


def _rendezvous_handler(params: RendezvousParameters, request: RunRequest) -> RendezvousHandler:
    """The rendezvous handler (for c10d this connects to, or hosts, its store).

    Raises:
        PlannerError: the store cannot be reached or hosted.
    """
    try:
        return rdzv_registry.get_rendezvous_handler(params)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds; all mean the endpoint failed
        raise _rendezvous_error(request, params, e) from None


def _rendezvous_error(request: RunRequest, params: RendezvousParameters, error: BaseException) -> PlannerError:
    """One line for a rendezvous that could not be formed (``error``: what torch raised)."""
    where = f"--rdzv-endpoint {params.endpoint}" if request.rdzv_endpoint else "the rendezvous on this machine"
    seconds = f"{request.timeout_s:g}"
    if isinstance(error, RendezvousTimeoutError):
        return PlannerError(
            f"{where}: the {request.nnodes} nodes of the run did not all join rendezvous {params.run_id!r} within "
            f"{seconds} s (--timeout {seconds}); start `planner run` with the same --nnodes, --rdzv-endpoint and "
            "--rdzv-id on every node"
        )
    if isinstance(error, (RendezvousClosedError, RendezvousGracefulExitError)):
        return PlannerError(
            f"{where}: rendezvous {params.run_id!r} belongs to a run that already has its {request.nnodes} node(s) "
            "(or has ended); give this run its own --rdzv-id or --rdzv-endpoint"
        )
    reason = " ".join(str(error).split())[:200]
    return PlannerError(f"{where}: the rendezvous failed ({type(error).__name__}: {reason})")


def _run_agent(
    agent: Any, spec: WorkerSpec, watch: Watch, request: RunRequest, params: RendezvousParameters
) -> tuple[dict[int, Any] | None, str | None]:
    """Run the agent (``elastic_agent``'s) until its workers end.

    Returns:
        The workers' results by global rank (None: the run failed, or was stopped before every
        worker had returned), and the signal that interrupted this process (None: none).

    Raises:
        PlannerError: the rendezvous could not be formed.
    """
    try:
        result = agent.run()
    except SignalException as e:
        # The agent has stopped the workers with the same signal. As elastic_launch, leave the
        # rendezvous open: a node that was interrupted may join it again. Where every worker had
        # returned already, the run was done: its results stand.
        done = bool(watch.pids) and set(agent.returned) >= set(watch.pids)
        return (dict(agent.returned) if done else None), e.sigval.name
    except (RendezvousError, torch.distributed.DistError, TimeoutError) as e:
        spec.rdzv_handler.shutdown()
        if not watch.pids:  # no worker started: the nodes never met (or their store failed)
            raise _rendezvous_error(request, params, e) from None
        raise
    spec.rdzv_handler.shutdown()
    if result is None:  # elastic swallows RendezvousGracefulExitError: the rendezvous had no room
        raise _rendezvous_error(request, params, RendezvousGracefulExitError())
    return (None, None) if result.is_failed() else (dict(result.return_values), None)


def _failure(
    plan: Plan,
    request: RunRequest,
    error_dir: Path,
    exit_codes: dict[int, int | None],
    hung: set[int],
    parent_signal: str | None,
    returned: dict[int, Any],
) -> tuple[RunFailed, WorkerTraceback | None]:
    """The error a failed run raises: one line naming the cause, the run's record of the steps
    completed (``returned``: the results of the ranks that had finished), and the failing worker's
    traceback to chain under it (``--debug`` shows it)."""
    ranks: list[RankResult] = list(returned.values())
    for path in sorted(error_dir.glob("rank*.partial.pkl")):
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, AttributeError):
            ranks.append(pickle.loads(path.read_bytes()))  # written by our own workers, in our temp folder
    ranks = [r for r in ranks if isinstance(r, RankResult) and r.times]
    # A rank stopped just after a step's figures were kept, before it counted the step as done:
    # its figures say how far it got, so the line and run.json agree on the steps completed.
    completed = {r.rank: r.first_step - 1 + len(r.times) for r in ranks}
    records = {
        rank: dataclasses.replace(rec, done=max(rec.done, completed.get(rank, 0)))
        for rank, rec in read_records(error_dir).items()
    }
    faults = read_faults(error_dir)  # a crashed rank's stack: its line names the frame
    diagnosis = diagnose(
        records, exit_codes, request.timeout_s, request.nnodes, hung=hung, parent_signal=parent_signal, faults=faults
    )
    result = None
    if ranks:  # run_result cuts every rank to the fewest steps any completed
        result = run_result(plan, ranks, mode="pipeline", plan_path=request.plan_file).model_copy(
            update={"status": diagnosis.status, "stopped": diagnosis.message}
        )
    cause = WorkerTraceback(diagnosis.traceback) if diagnosis.traceback else None
    return RunFailed(diagnosis.message, result=result, exit_code=diagnosis.exit_code), cause


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put this process's signal handlers back after the block.

    When the workers start, elastic installs handlers that raise ``SignalException`` for SIGTERM,
    SIGINT, SIGHUP and SIGQUIT (its ``PContext.start``) and never removes them: a later Ctrl-C
    would raise that instead of ``KeyboardInterrupt``.
    """
    if threading.current_thread() is not threading.main_thread():  # elastic installs none there
        yield
        return
    signums = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    saved = {s: signal.getsignal(s) for s in signums}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


class _FixedNodes(RendezvousHandler):
    """A rendezvous handler that never reports nodes waiting to join.

    elastic's agent restarts every worker of a healthy run when a node waits to join its
    rendezvous (to scale up). A planner run has a fixed set of nodes: another ``planner run``
    started on the same endpoint and id must not restart this one, but wait and give up after
    ``--timeout``.
    """

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def elastic_agent(spec: WorkerSpec, watch: Watch, log_dir: Path) -> Any:
    """torch elastic's agent starting ``spec``'s workers for `planner run` and `planner probe` (``run()`` it)."""
    return watched_elastic_agent(
        watch.start,
        # Ctrl-C (or a scheduler's SIGTERM to the process group) reaches the workers too, and this process
        # signals them again: a second signal while a worker writes its failure record would lose it.
        lambda: watch.settle(1.0),
        spec=spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        # Workers fork from a kept server that imported torch and the worker once (about 2 s of CPU a rank
        # saved); started by this process, not forked from it, so no thread or CUDA state is inherited.
        start_method="forkserver",
        shutdown_timeout=GRACE_S,  # after Ctrl-C / SIGTERM: how long ranks may take to write records
    )
