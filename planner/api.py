"""The library's entry points: what ``planner plan`` does, as one call.

load → trace → profile → solve (+ baselines) → predict → Plan. The CLI is a thin wrapper around
``make_plan``; tests and notebooks call it directly.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from pathlib import Path
from typing import Any

import torch

from planner.costs import GLOO_CPU_LINK, BlockCost, NCCL_NVLINK_LINK, LinkCost, OptimizerSpec
from planner.errors import InfeasibleError
from planner.load import load_model_file
from planner.plan import ModelRef, Plan, ProfileInfo
from planner.predict import predict
from planner.profile import profile_blocks
from planner.schedules import SCHEDULES
from planner.solve import param_balanced, solve, uniform_layers
from planner.trace import trace_model

METHODS = ("optimal", "uniform", "params")


def _layers_or_all(blocks: list[BlockCost]) -> list[BlockCost]:
    """Blocks for the uniform-layer baseline: a model without repeated layers counts every block."""
    if any(b.is_layer for b in blocks):
        return blocks
    return [b.model_copy(update={"is_layer": True}) for b in blocks]


def default_threads(n_stages: int) -> int:
    """Intra-op threads per rank so that ``n_stages`` CPU ranks do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // n_stages)


def make_plan(
    model_path: str | Path,
    gpus: int,
    *,
    size: str | None = None,
    overrides: dict[str, Any] | None = None,
    batch_size: int = 32,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    method: str = "optimal",
    memory_limit_bytes: int | None = None,
    optimizer: OptimizerSpec | None = None,
    seed: int = 0,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
    link: LinkCost | None = None,
    plan_dir: str | Path | None = None,
    progress: bool = True,
) -> Plan:
    """Plan a pipeline for a model file: trace, profile, solve and predict.

    Args:
        model_path: a model file following the contract (DESIGN.md).
        gpus: number of pipeline stages / ranks.
        size: a key of the file's SIZES (None: the file's defaults).
        overrides: config entries to replace (``--set``).
        batch_size: samples per training step (global batch).
        microbatches: microbatches per step; default 2 x gpus (at least 1), capped at batch_size.
        schedule: "gpipe" or "1f1b".
        method: which partition the plan uses: "optimal" (exact solver), "uniform" (equal layer
            counts, torchtitan/Megatron) or "params" (parameter-balanced, DeepSpeed).
        memory_limit_bytes: per-rank memory limit for the solver; None for no limit.
        optimizer: optimizer of the run (default AdamW, lr 1e-3, clip 1.0).
        seed: seed for building the model and its example batch.
        warmup: untimed runs per block when profiling.
        repeats: timed runs per block (median kept).
        threads: intra-op threads per rank (CPU); default cores // gpus.
        link: message cost between ranks; default gloo on CPU, NVLink-class with nccl.
        plan_dir: folder the plan will be written to (the model path is stored relative to it).
        progress: show progress bars.

    Returns:
        The plan (not yet written to disk).

    Raises:
        PlannerError: for any bad input (model file, sizes, batch/microbatch mismatch, impossible split).
    """
    if gpus < 1:
        raise InfeasibleError(f"--gpus {gpus}: need at least 1")
    if schedule not in SCHEDULES:
        raise InfeasibleError(f"--schedule {schedule}: expected one of {', '.join(SCHEDULES)}")
    if method not in METHODS:
        raise InfeasibleError(f"--method {method}: expected one of {', '.join(METHODS)}")
    m = microbatches if microbatches is not None else min(batch_size, 2 * gpus)
    if m < 1 or batch_size % m:
        raise InfeasibleError(
            f"batch size {batch_size} does not split into {m} equal microbatches; "
            f"choose --batch-size as a multiple of --microbatches (e.g. --batch-size {m * max(1, batch_size // m)})"
        )
    optimizer = optimizer or OptimizerSpec()
    mf = load_model_file(model_path, size, overrides)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    link = link or (NCCL_NVLINK_LINK if use_cuda else GLOO_CPU_LINK)
    threads = threads or default_threads(gpus)

    model = mf.build(seed=seed).to(device)
    inputs, target = mf.batch(batch_size // m, seed=seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to(device)
    traced = trace_model(model, inputs)
    if gpus > len(traced.blocks):
        names = [b.name for b in traced.blocks]
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise InfeasibleError(f"--gpus {gpus}: the model has only {len(names)} blocks ({shown}); use at most {len(names)}")
    blocks = profile_blocks(traced, inputs, target, mf.loss_fn, warmup=warmup, repeats=repeats,
                            threads=threads if not use_cuda else None, progress=progress, optimizer=optimizer)

    solvers = {
        "optimal": lambda: solve(blocks, gpus, link, schedule=schedule, n_microbatches=m, optimizer=optimizer,
                                 memory_limit_bytes=memory_limit_bytes),
        "uniform": lambda: uniform_layers(_layers_or_all(blocks), gpus, link),
        "params": lambda: param_balanced(blocks, gpus, link),
    }
    predictions = {method: predict(blocks, solvers[method]().starts, link, schedule, m, optimizer)}
    for name, solver in solvers.items():
        if name != method:
            try:  # a baseline that cannot split this model is left out of the comparison, not fatal
                predictions[name] = predict(blocks, solver().starts, link, schedule, m, optimizer)
            except InfeasibleError:
                pass
    stages, prediction = predictions[method]
    model_file: Path = mf.path
    if plan_dir is not None:
        # Relative when the model sits under the plan's folder (a project can move as a whole).
        rel = Path(os.path.relpath(mf.path, Path(plan_dir).resolve()))
        if not rel.parts or rel.parts[0] != "..":
            model_file = rel
    return Plan(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=ModelRef(
            path=str(model_file),
            size=mf.size,
            config=mf.config,
            file_digest=mf.digest,
            fingerprint=traced.fingerprint,
            trace_method=traced.method,  # type: ignore[arg-type]
            trace_failures=traced.failures,
            seed=seed,
        ),
        profile=ProfileInfo(
            device=str(device),
            backend=backend,  # type: ignore[arg-type]
            threads=threads,
            torch_version=torch.__version__,
            hostname=socket.gethostname(),
            warmup=warmup,
            repeats=repeats,
        ),
        link=link,
        optimizer=optimizer,
        method=method,  # type: ignore[arg-type]
        schedule=schedule,  # type: ignore[arg-type]
        n_stages=gpus,
        batch_size=batch_size,
        n_microbatches=m,
        blocks=blocks,
        stages=stages,
        prediction=prediction,
        baselines={name: pred for name, (_, pred) in predictions.items() if name != method},
    )
