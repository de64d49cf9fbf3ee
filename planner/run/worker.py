"""One pipeline rank: the function ``elastic_launch`` starts in every worker process.

Rank r runs the plan's stages placed on it (one, or several for interleaved, looped and V-shaped
schedules) as ``torch.distributed.pipelining.PipelineStage`` objects under torch's own class for
the plan's schedule (``get_schedule_class``: ``ScheduleGPipe`` / ``Schedule1F1B`` with one stage,
``PipelineScheduleMulti`` subclasses with a list). Every rank rebuilds the whole model from the
model file with the plan's seed, traces it the same way the planner did and keeps only its own
stages (``build_stage_module`` shares parameters with the trace, so the rest is freed).

This module is the rank's orchestration: join the group (``mesh``), build the stages
(``stages``), resume, train with the one loop (``loop``), evaluate, checkpoint, report. What it
orchestrates lives by concern: the wrappers around a stage (``wrappers``), the gradient finishing
(``gradients``), the data streams (``streams``), the stop signals (``signals``).

Every rank iterates the same data stream so the ranks agree on the step count; the rank holding
stage 0 feeds the inputs, the rank holding the last stage the target (under a V placement both
are rank 0), the others call ``step()`` with nothing.

A failure is written as a short JSON record to ``error_dir/rank<R>.json`` and the process exits
with status 1 (``SystemExit``, so neither torch.multiprocessing nor elastic prints a traceback);
the launcher turns the earliest record into one error message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import pickle
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from planner.capture.graph_file import RankGraphs
from planner.errors import PlannerError
from planner.run.checkpoint import (
    RankState,
    is_run_id,
    keep_vocab,
    latest_checkpoint,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)
from planner.run.console import print_flushed
from planner.run.faults import send_faults_to
from planner.run.forkserver import LaunchContext
from planner.run.loop import Progress, RankModel, RankResult, train_steps
from planner.run.measure import StageProbe, probes_installed, recv_buffers
from planner.run.mesh import RankMesh, group_of_one, joined_group
from planner.run.model import load_plan_model, planned_source
from planner.run.optim import make_scheduler
from planner.run.pipeline import Pipeline, runner_hooks
from planner.run.signals import SIGNAL_NAMES, ignore_stop_signals, raise_on_stop_signals
from planner.run.stages import build_stages
from planner.run.streams import model_stream, text_stream
from planner.schema.jsonfile import write_atomic
from planner.schema.plan import Plan
from planner.schema.run_request import RunRequest
from planner.torch_compat import retain_graph_compile


def _quiet() -> None:
    """Silence library chatter in the worker; real errors still reach the launcher."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch\.distributed\..*")


def _train(plan: Plan, request: RunRequest, progress: Progress, graphs: RankGraphs | None) -> RankResult:
    """Join the process group torchrun-style (from the environment), train this rank, leave the group."""
    with joined_group(plan, request) as (mesh, device):
        return _train_rank(plan, request, mesh, device, progress, graphs)


def _train_rank(
    plan: Plan,
    request: RunRequest,
    mesh: RankMesh,
    device: torch.device,
    progress: Progress,
    graphs: RankGraphs | None = None,
) -> RankResult:
    """Build this rank's stages and schedule, resume if asked, and train them with the one training loop."""
    # A compiled stage compiles at its first call, in training: its backward must allow the split
    # backward's retained graph (planner.torch_compat.retain_graph_compile), as the profiler's did.
    with retain_graph_compile() if plan.compile else contextlib.nullcontext():
        return _RankRun(plan, request, mesh, device, graphs).train(progress)


class _RankRun:
    """One rank's run: its stages and schedule, data stream, checkpoints and evaluations.

    Every rank of the run makes the same calls in the same order (each step, each evaluation,
    each checkpoint is collective), so no rank waits on another that skipped one.
    """

    def __init__(
        self, plan: Plan, request: RunRequest, mesh: RankMesh, device: torch.device, graphs: RankGraphs | None = None
    ) -> None:
        self.plan, self.request, self.mesh, self.device = plan, request, mesh, device
        self.mf = load_plan_model(plan, str(request.plan_file))
        # the launcher's graphs (``graphs_for_ranks``), rebuilt instead of exporting the model again
        source = dataclasses.replace(planned_source(plan, self.mf), graphs=graphs)
        built = build_stages(plan, source, mesh, device, want_vocab=request.data is not None)
        self.built = built
        self.pipe = Pipeline(plan, built, mesh, device)  # what a user's own script trains through too
        self.run_microbatches, self.sum_for_norm = runner_hooks(self.pipe)
        self.mine = plan.stages_of(mesh.pp_rank)
        self.scores = self.pipe.is_last  # the target and the loss
        self.text = text_stream(plan, request, self.mf, mesh, built.vocab_size) if built.vocab_size else None
        self.scheduler = make_scheduler(built.optimizer, request.steps, request.warmup, request.lr_decay)
        self.state = RankState(
            mesh.rank, built.tensors, built.optimizer, self.scheduler, self.text, device, shards=built.shards
        )
        self.probes = [
            StageProbe(s.index, clock, [b.name for b in plan.blocks[s.start : s.end]])
            for s, clock in zip(self.mine, built.clocks)
        ]
        self.evals: list[tuple[int, float, int]] = []
        self.written: list[str] = []
        # The run's id, recorded with each checkpoint: only rank 0's counts (it alone writes planner.json
        # and latest), so the ranks need not agree on a fresh one; a resumed run takes its checkpoint's.
        self.run_id = uuid.uuid4().hex

    def evaluate(self, step: int) -> None:
        """Loss and perplexity on the held-out part of ``--data`` (forward only, every rank)."""
        assert self.text is not None
        for probe in self.probes:
            probe.begin_step()  # the evaluation's timings are dropped below
        total, count = 0.0, 0
        for inputs, target in self.text.eval_batches(self.request.eval_batches or None):
            batch_loss = self.pipe.evaluate(inputs, target)
            total += 0.0 if batch_loss is None else float(batch_loss)
            count += 1
        for probe in self.probes:
            probe.discard_step()
        if self.scores and count:
            loss = total / count
            self.evals.append((step, loss, count))
            if self.request.echo and self.mesh.replica == 0 and self.mesh.tp_rank == 0:
                print_flushed(f"eval after step {step}: loss {loss:.4f}, perplexity {math.exp(min(loss, 700)):.2f}")

    def save(self, step: int) -> None:
        """A checkpoint after ``step`` (every rank writes its part)."""
        plan = self.plan
        meta = {
            "plan_fingerprint": plan.model.fingerprint,
            "starts": [s.start for s in plan.stages],
            "schedule": plan.schedule,
            "dp": plan.dp,
            "world_size": plan.world_size,
            "tp": plan.tp,
            "run_id": self.run_id,
        }
        if self.text is not None and self.mesh.rank == 0:
            # rank 0 publishes the checkpoint (a rename, after every rank wrote): never without its ids;
            # a fresh run's first save replaces an earlier run's, its later saves find its own kept
            keep_vocab(
                self.request.checkpoint_root, self.text.vocab, fresh=not self.request.resume and not self.written
            )
        # a resumed run keeps the folders written before runs had ids: it may be continuing them
        path = save_checkpoint(self.request.checkpoint_root, step, self.state, meta, keep_unnamed=self.request.resume)
        self.written.append(str(path))
        if self.request.echo and self.mesh.rank == 0:
            print_flushed(f"checkpoint after step {step}: {path}")

    def after_step(self, step: int) -> None:
        """Evaluation and checkpoint when due (the last step's come after the loop)."""
        request = self.request
        if step == request.steps:
            return
        if self.text is not None and request.eval_every and step % request.eval_every == 0:
            self.evaluate(step)
        if request.save_checkpoints and request.checkpoint_every and step % request.checkpoint_every == 0:
            self.save(step)

    def _resume(self) -> int:
        """The first step to run: after the checkpoint ``latest`` names when resuming, else 1."""
        if not self.request.resume:
            return 1
        found = latest_checkpoint(self.request.checkpoint_root)
        if found is None:
            raise PlannerError(f"--resume: no complete checkpoint in {self.request.checkpoint_root}")
        run_id = (read_meta(found) or {}).get("run_id")
        if is_run_id(run_id):  # else written before runs had ids: the fresh id names the run from now on
            self.run_id = run_id
        return load_checkpoint(found, self.state) + 1

    def _rank_model(self) -> RankModel:
        built = self.built
        return RankModel(
            rank=self.mesh.rank,
            stages=[(s.index, s.first_block, s.last_block) for s in self.mine],
            module=torch.nn.ModuleList(built.modules),
            params=built.params,
            optimizer=built.optimizer,
            device=self.device,
            run_microbatches=self.run_microbatches,
            reduce=self.sum_for_norm,
            finish_grads=built.finish_grads,
            counted=built.counted,
            scheduler=self.scheduler,
            # the receive buffers exist from the first step on; read them when the tracked step starts
            extra_tensors=lambda: [b for st in built.stages for b in recv_buffers(st)],
        )

    def train(self, progress: Progress) -> RankResult:
        """Resume if asked, train to ``--steps``, evaluate and save the final checkpoint."""
        plan, request = self.plan, self.request
        first_step = self._resume()
        batches: Iterator[tuple[Any, torch.Tensor]] = (
            iter(self.text) if self.text is not None else model_stream(self.mf, plan, self.mesh, skip=first_step - 1)
        )
        with probes_installed(list(zip(self.built.stages, self.probes)), self.built.schedule):
            result = train_steps(
                self._rank_model(),
                batches,
                request.steps,
                max_norm=plan.optimizer.grad_clip,
                probes=self.probes,
                # one rank prints the losses
                echo=request.echo and self.scores and self.mesh.replica == 0 and self.mesh.tp_rank == 0,
                print_fn=print_flushed,
                progress=progress,
                first_step=first_step,
                after_step=self.after_step,
            )
            if self.text is not None:
                self.evaluate(request.steps)
        if request.save_checkpoints:
            self.save(request.steps)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return dataclasses.replace(
            result,
            replica=self.mesh.replica,
            first_step=first_step,
            peak_device_bytes=peak,
            evals=tuple(self.evals),
            checkpoints=tuple(self.written) if self.mesh.rank == 0 else (),
        )


def train_in_process(plan: Plan, request: RunRequest) -> RankResult:
    """Train a plan of one rank (one stage, one replica) in this process, as its one worker would.

    The same stage, schedule, data stream, checkpoints and evaluation as a launched run, on a
    process group of one (a gloo group over an in-memory store): no process is started.

    Args:
        plan: a plan whose ``world_size`` is 1.
        request: ``planner run``'s options.

    Returns:
        The rank's figures.
    """
    with group_of_one(plan, request) as (mesh, device):
        return _train_rank(plan, request, mesh, device, Progress())


def _read_graphs(path: str) -> RankGraphs | None:
    """The launcher's graphs file, None where there is none or it cannot be read (the rank then traces)."""
    if not path:
        return None
    try:
        return RankGraphs.from_bytes(Path(path).read_bytes())
    except OSError:
        return None


def run_worker(
    plan_json: str, request_json: str, error_dir: str, context: LaunchContext, graph_file: str = ""
) -> RankResult:
    """Entry point of one worker process (top level, so ``spawn`` can pickle it).

    Args:
        plan_json: the plan's JSON text.
        request_json: ``planner run``'s options (a ``RunRequest`` as JSON).
        error_dir: where to leave a failure record.
        context: the launcher's stdout, stderr and environment, which this rank takes first.
        graph_file: the launcher's torch.export graphs of the model (``graphs_for_ranks``), which the
            rank rebuilds instead of exporting the model again ("": none).

    Returns:
        This rank's measurements (losses only on the last rank).

    Raises:
        SystemExit: any failure, after writing its record to ``error_dir``: ``rank<R>.json`` (the
            rank, the time, the exception's type and one-line message, whether it is a user error,
            the signal that stopped the rank if one did (SIGINT, SIGTERM), the step it was in and
            the steps it completed, the traceback) and, when a step completed,
            ``rank<R>.partial.pkl`` (the pickled ``RankResult`` of the completed steps).
    """
    context.attach()
    send_faults_to(Path(error_dir), int(os.environ.get("RANK", -1)))  # a crash: one line, not every thread's stack
    _quiet()
    raise_on_stop_signals()
    # torch.fx's interpreter makes a tqdm bar, whose default lock is a multiprocessing semaphore: a
    # rank killed by SIGKILL would leak it ("leaked semaphore objects" at exit). A thread lock does not.
    tqdm.set_lock(threading.RLock())
    progress = Progress()
    try:
        request = RunRequest.model_validate_json(request_json)
        plan = Plan.from_json(plan_json, str(request.plan_file))
        return _train(plan, request, progress, _read_graphs(graph_file))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher as a record
        ignore_stop_signals()  # a second signal while the record is written must not leave half a record
        rank = int(os.environ.get("RANK", -1))
        record = {
            "rank": rank,
            "time": time.time(),
            "type": type(e).__name__,
            "planner_error": isinstance(e, PlannerError),
            "message": " ".join(str(e).split()) or type(e).__name__,
            "signal": SIGNAL_NAMES.get(type(e)),
            "step": progress.step or None,
            "done": progress.done,
            "traceback": traceback.format_exc(),
        }
        folder = Path(error_dir)
        if progress.partial is not None:
            write_atomic(folder / f"rank{rank}.partial.pkl", pickle.dumps(progress.partial))
        write_atomic(folder / f"rank{rank}.json", json.dumps(record).encode())
        sys.stdout.flush()
        raise SystemExit(1) from None
