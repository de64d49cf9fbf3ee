"""A function run on one process per rank, launched as `planner run` launches its ranks (`planner probe`).

The same machinery as ``planner.run.launch``: torch elastic's ``LocalElasticAgent`` with
``max_restarts=0``, workers forked from the kept ``forkserver`` (``planner.run.forkserver``),
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
``OMP_NUM_THREADS`` set to the ranks' threads, elastic's chatter silenced, the watch that kills a
worker that cannot stop, and this process's signal handlers kept. What differs is what the workers
run: any top-level function (the caller's package may be one ``run`` cannot import, as
``planner.costs.probe``), whose return value comes back per rank; a failure comes back as one line.

One node: the c10d store on a free port of localhost (``torchrun --standalone``). Several nodes: every
node runs the same command with the same ``rdzv_endpoint`` (c10d), as ``planner run --nnodes``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters, RendezvousTimeoutError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from planner.errors import PlannerError, RunFailed
from planner.run.forkserver import LaunchContext, prepare_forkserver, rank_modules
from planner.run.launch import _env, _FixedNodes, _quiet_elastic, _signal_handlers_kept, elastic_agent
from planner.run.watch import Watch
from planner.schema.jsonfile import write_atomic


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], error_dir: str, context: LaunchContext) -> Any:
    """What each worker runs: take the launcher's stdout, stderr and environment, then ``fn(*args)``;
    a failure leaves its one line (and traceback) in ``error_dir/rank<R>.json`` and exits 1."""
    context.attach()
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher as a record
        rank = int(os.environ.get("RANK", -1))
        record = {
            "rank": rank,
            "type": type(e).__name__,
            "message": " ".join(str(e).split()) or type(e).__name__,
            "planner_error": isinstance(e, PlannerError),
            "traceback": traceback.format_exc(),
        }
        write_atomic(Path(error_dir) / f"rank{rank}.json", json.dumps(record).encode())
        sys.stdout.flush()
        raise SystemExit(1) from None


def launch_function(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc: int,
    nnodes: int = 1,
    threads: int,
    rdzv_endpoint: str | None = None,
    timeout_s: float = 300.0,
    preload: tuple[str, ...] = (),
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` processes of this node, torchrun-style, and gather what they return.

    Args:
        fn: a top-level function (pickled by name); it may join the process group from the environment.
        args: its arguments (picklable).
        nproc: processes on this node.
        nnodes: nodes in all (each runs the same call with the same ``rdzv_endpoint``).
        threads: intra-op threads per process (``OMP_NUM_THREADS``).
        rdzv_endpoint: ``host:port`` of the rendezvous store (None: localhost, one node).
        timeout_s: how long nodes may take to join.
        preload: modules the fork server imports once for every worker (besides torch's).

    Returns:
        Global rank -> ``fn``'s return value, for this node's ranks.

    Raises:
        PlannerError: a rank failed (its one line; a planner error as it was), or several nodes without
            an endpoint.
        RunFailed: interrupted (Ctrl-C, SIGTERM).
    """
    if nnodes > 1 and not rdzv_endpoint:
        raise PlannerError(f"{nnodes} nodes need a rendezvous every node reaches: give --rdzv-endpoint HOST:PORT")
    seconds = max(1, math.ceil(timeout_s))
    params = RendezvousParameters(
        "c10d",
        rdzv_endpoint or "localhost:0",
        "planner-probe",
        nnodes,
        nnodes,
        join_timeout=seconds,
        read_timeout=min(seconds, 60),
    )
    with tempfile.TemporaryDirectory(prefix="planner-spawn-") as tmp:
        error_dir = Path(tmp) / "errors"
        error_dir.mkdir()
        watch = Watch(error_dir)
        with _quiet_elastic(), _env(OMP_NUM_THREADS=str(threads)), _signal_handlers_kept():
            try:
                context = prepare_forkserver([*rank_modules(), *preload])
                spec = WorkerSpec(
                    role="planner",
                    local_world_size=nproc,
                    entrypoint=_entry,
                    args=(fn, args, str(error_dir), context),
                    rdzv_handler=_FixedNodes(rdzv_registry.get_rendezvous_handler(params)),
                    max_restarts=0,
                    monitor_interval=0.1,
                )
                agent = elastic_agent(spec, watch, Path(tmp) / "logs")
                try:
                    result = agent.run()
                except SignalException as e:
                    raise RunFailed(f"interrupted ({e.sigval.name})", exit_code=128 + int(e.sigval)) from None
                except (RendezvousError, torch.distributed.DistError, TimeoutError) as e:
                    if watch.pids:  # the nodes met and a worker started: not the rendezvous's doing
                        raise
                    raise _rendezvous_error(params, e, nnodes, seconds) from None
                finally:
                    spec.rdzv_handler.shutdown()
            finally:
                watch.finish()
        if result is not None and not result.is_failed():
            return dict(result.return_values)
        raise _failure(error_dir)


def _rendezvous_error(params: RendezvousParameters, error: BaseException, nnodes: int, seconds: int) -> PlannerError:
    """One line for nodes that never met (``error``: what torch raised before any worker started)."""
    if isinstance(error, RendezvousTimeoutError):
        return PlannerError(
            f"--rdzv-endpoint {params.endpoint}: the {nnodes} nodes did not all join within {seconds} s "
            f"(--timeout {seconds}); start the same command, with the same --gpus, --gpus-per-node and "
            "--rdzv-endpoint, on every node"
        )
    reason = " ".join(str(error).split())[:200]
    return PlannerError(f"--rdzv-endpoint {params.endpoint}: the rendezvous failed ({type(error).__name__}: {reason})")


def _failure(error_dir: Path) -> PlannerError:
    """The one line of the first rank that failed (by rank), or a generic one when none wrote a record."""
    records = []
    for path in sorted(error_dir.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    if not records:
        return PlannerError("a rank stopped without saying why (killed, or out of memory)")
    first = min(records, key=lambda r: int(r.get("rank", 0)))
    if first.get("planner_error"):
        return PlannerError(str(first["message"]))
    return PlannerError(f"rank {first['rank']} failed: {first['type']}: {first['message']}")
