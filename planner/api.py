"""The library's entry points: what ``planner plan`` does, as one call.

load → trace → costs (measured here, or estimated for hardware that is not here) → optional
calibration → solve (+ baselines) → predict → Plan. The CLI is a thin wrapper around
``make_plan``; tests and notebooks call it directly.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.core.calibrate import Calibration, apply_calibration
from planner.schema.costs import GLOO_CPU_LINK, NCCL_NVLINK_LINK, BlockCost, LinkCost, OptimizerSpec
from planner.errors import InfeasibleError, PlanFileError
from planner.core.hardware import HardwareSpec, get_hardware, link_cost
from planner.capture.load import ModelFile, check_forward, load_model_file
from planner.schema.plan import ModelRef, Plan, ProfileInfo
from planner.core.predict import predict
from planner.core.schedules import SCHEDULES
from planner.core.solve import param_balanced, solve, uniform_layers
from planner.capture.blocks import TracedModel
from planner.capture.trace import trace_model

METHODS = ("optimal", "uniform", "params")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Share of a GPU's memory the solver may plan for: the CUDA context, the caching allocator's
# fragmentation and NCCL buffers take the rest (~1-2 GiB and a few percent on an 80 GB card).
GPU_MEMORY_HEADROOM = 0.95


def _layers_or_all(blocks: list[BlockCost]) -> list[BlockCost]:
    """Blocks for the uniform-layer baseline: a model without repeated layers counts every block."""
    if any(b.is_layer for b in blocks):
        return blocks
    return [b.model_copy(update={"is_layer": True}) for b in blocks]


def default_threads(n_stages: int) -> int:
    """Intra-op threads per rank so that ``n_stages`` CPU ranks do not oversubscribe the cores."""
    return max(1, (os.cpu_count() or 1) // n_stages)


@dataclass
class _Costs:
    """What the cost step produced, with the facts the plan records about it."""

    traced: TracedModel
    blocks: list[BlockCost]
    link: LinkCost
    profile: ProfileInfo
    memory_bytes: int | None  # the device's capacity the solver plans for, when known


def _check_gpus(gpus: int, traced: TracedModel) -> None:
    if gpus > len(traced.blocks):
        names = [b.name for b in traced.blocks]
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise InfeasibleError(f"--gpus {gpus}: the model has only {len(names)} blocks ({shown}); use at most {len(names)}")


def _measured_costs(mf: ModelFile, gpus: int, microbatch: int, seed: int, optimizer: OptimizerSpec,
                    threads: int, warmup: int, repeats: int, progress: bool,
                    reuse: Plan | None) -> _Costs:
    """Trace and profile on this machine's device (a CUDA GPU when there is one, else the CPU)."""
    from planner.costs.measure import profile_blocks

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    model = mf.build(seed=seed).to(device)
    inputs, target = mf.batch(microbatch, seed=seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    check_forward(mf, model, inputs, target.to(device))
    traced = trace_model(model, inputs)
    _check_gpus(gpus, traced)
    info = ProfileInfo(device=str(device), backend="nccl" if use_cuda else "gloo", threads=threads,
                       torch_version=torch.__version__, hostname=socket.gethostname(), warmup=warmup, repeats=repeats,
                       cores=None if use_cuda else os.cpu_count())
    if reuse is not None and (reuse.microbatch_size, reuse.profile.threads, reuse.profile.device, reuse.optimizer,
                              reuse.profile.source) == (microbatch, threads, str(device), optimizer, "measured"):
        # A calibration was fitted against exactly these costs; re-profiling would only add fresh noise.
        blocks = list(reuse.blocks)
    else:
        blocks = profile_blocks(traced, inputs, target.to(device), mf.loss_fn, warmup=warmup, repeats=repeats,
                                threads=None if use_cuda else threads, progress=progress, optimizer=optimizer)
    capacity = int(torch.cuda.get_device_properties(device).total_memory * GPU_MEMORY_HEADROOM) if use_cuda else None
    return _Costs(traced, blocks, NCCL_NVLINK_LINK if use_cuda else GLOO_CPU_LINK, info, capacity)


def _estimated_costs(mf: ModelFile, gpus: int, microbatch: int, seed: int, optimizer: OptimizerSpec,
                     hw: HardwareSpec, dtype: str, threads: int, multi_node: bool, progress: bool) -> _Costs:
    """Build the model on the meta device (no weights allocated) and estimate its costs on ``hw``."""
    from planner.costs.estimate import estimate_blocks

    with torch.device("meta"):
        model = mf.build(seed=seed)
    model = model.to(DTYPES[dtype])
    inputs, target = mf.batch(microbatch, seed=seed)
    inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to("meta")
    check_forward(mf, model, inputs, target)
    traced = trace_model(model, inputs)
    _check_gpus(gpus, traced)
    blocks = estimate_blocks(traced, inputs, target, mf.loss_fn, hw, dtype=dtype, optimizer=optimizer, progress=progress)
    on_cpu = hw.kind == "cpu"
    info = ProfileInfo(device="cpu" if on_cpu else "cuda", backend="gloo" if on_cpu else "nccl",
                       threads=threads if on_cpu else 1, torch_version=torch.__version__,
                       hostname=socket.gethostname(), warmup=0, repeats=0, source="estimated",
                       hardware=hw.name, dtype=dtype, cores=os.cpu_count() if on_cpu else None)
    link = GLOO_CPU_LINK if on_cpu else link_cost(hw, intra_node=not multi_node)
    return _Costs(traced, blocks, link, info, None if on_cpu else int(hw.memory_bytes * GPU_MEMORY_HEADROOM))


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
    recompute: str = "auto",
    optimizer: OptimizerSpec | None = None,
    seed: int = 0,
    warmup: int = 2,
    repeats: int = 5,
    threads: int | None = None,
    gpu_type: str | None = None,
    dtype: str | None = None,
    multi_node: bool = False,
    calibrate_from: tuple[Plan, Calibration] | None = None,
    plan_dir: str | Path | None = None,
    progress: bool = True,
) -> Plan:
    """Plan a pipeline for a model file: trace, cost, solve and predict.

    Args:
        model_path: a model file following the contract (DESIGN.md).
        gpus: number of pipeline stages / ranks.
        size: a key of the file's SIZES (None: the file's defaults).
        overrides: config entries to replace (``--set``).
        batch_size: samples per training step (global batch).
        microbatches: microbatches per step; default 2 x gpus, capped at batch_size.
        schedule: "gpipe" or "1f1b".
        method: which partition the plan uses: "optimal" (exact solver), "uniform" (equal layer
            counts, torchtitan/Megatron) or "params" (parameter-balanced, DeepSpeed).
        memory_limit_bytes: per-rank memory limit for the solver; default: the GPU's capacity
            (less headroom) when it is known, else no limit.
        recompute: activation checkpointing per stage: "auto" (only where a stage would not fit),
            "never" or "always".
        optimizer: optimizer of the run (default AdamW, lr 1e-3, clip 1.0).
        seed: seed for building the model and its example batch.
        warmup: untimed runs per block when profiling.
        repeats: timed runs per block (median kept).
        threads: intra-op threads per rank (CPU); default cores // gpus.
        gpu_type: plan for hardware that is not here ("h100", "a100-80g", ... or "cpu" for this
            machine's calibrated CPU): the model is built on the meta device and its costs are
            estimated by the roofline model instead of measured.
        dtype: "bf16", "fp16" or "fp32" for estimated costs (default bf16 on GPUs, fp32 on CPU);
            measured costs use the model's own dtype.
        multi_node: estimated plans: ranks talk over the inter-node network, not NVLink.
        calibrate_from: an earlier plan of this model and the calibration fitted to a run of it
            (``planner.core.calibrate.load_calibration``); its factors and link latency correct the
            costs before solving (applied to that plan's own costs when they match this request).
        plan_dir: folder the plan will be written to (the model path is stored relative to it).
        progress: show progress bars.

    Returns:
        The plan (not yet written to disk).

    Raises:
        PlannerError: for any bad input (model file, sizes, batch/microbatch mismatch, unknown
            hardware, impossible split or memory limit).
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
    if dtype is not None and dtype not in DTYPES:
        raise InfeasibleError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if multi_node and gpu_type is None:
        raise InfeasibleError("--multi-node applies to estimated costs only; add --gpu-type (measured plans use this machine's link)")
    if dtype is not None and gpu_type is None:
        raise InfeasibleError("--dtype applies to estimated costs only; add --gpu-type (measured costs use the model's own dtype)")
    optimizer = optimizer or OptimizerSpec()
    threads = threads or default_threads(gpus)
    mf = load_model_file(model_path, size, overrides)
    if gpu_type is not None:
        if gpu_type == "cpu":
            from planner.costs.cpu import calibrated_cpu

            hw = calibrated_cpu(threads)
        else:
            hw = get_hardware(gpu_type)
        costs = _estimated_costs(mf, gpus, batch_size // m, seed, optimizer, hw, dtype or ("fp32" if hw.kind == "cpu" else "bf16"),
                                 threads, multi_node, progress)
    else:
        costs = _measured_costs(mf, gpus, batch_size // m, seed, optimizer, threads, warmup, repeats, progress,
                                calibrate_from[0] if calibrate_from else None)
    link = costs.link
    # The last stage keeps the model's output per live microbatch until backward (memory model).
    blocks = costs.blocks[:-1] + [costs.blocks[-1].model_copy(update={"output_bytes": costs.traced.output_bytes})]
    if calibrate_from is not None:
        if calibrate_from[1].plan_fingerprint != costs.traced.fingerprint:
            raise PlanFileError(
                f"the calibration was measured on a model with fingerprint {calibrate_from[1].plan_fingerprint}, "
                f"this one is {costs.traced.fingerprint}; calibrate from a run of a plan of this model"
            )
        if calibrate_from[1].microbatch_size != batch_size // m:
            raise PlanFileError(
                f"the calibration was measured with microbatches of {calibrate_from[1].microbatch_size}, this plan uses "
                f"{batch_size // m}; its factors would not carry over: calibrate from a run with the same -b/-m"
            )
        blocks, link = apply_calibration(blocks, link, calibrate_from[1])
    limit = memory_limit_bytes if memory_limit_bytes is not None else costs.memory_bytes
    # CPU ranks share this machine's cores: more busy ranks than cores / threads slow each other.
    slots = costs.profile.cores / costs.profile.threads if costs.profile.cores else None

    solvers = {
        "optimal": lambda: solve(blocks, gpus, link, schedule=schedule, n_microbatches=m, optimizer=optimizer,
                                 memory_limit_bytes=limit, recompute=recompute),
        "uniform": lambda: uniform_layers(_layers_or_all(blocks), gpus, link),
        "params": lambda: param_balanced(blocks, gpus, link),
    }
    predictions = {}
    for name, solver in solvers.items():
        try:
            part = solver()
        except InfeasibleError:
            if name == method:
                raise
            continue  # a baseline that cannot split this model is left out of the comparison
        predictions[name] = predict(blocks, part.starts, link, schedule, m, optimizer, part.recompute, slots)
    stages, prediction = predictions[method]
    if limit is not None and prediction.max_memory_bytes > limit:
        # The baselines split by layer or parameter counts and know nothing of memory.
        worst = max(stages, key=lambda st: st.memory_bytes)
        raise InfeasibleError(
            f"the {method} split needs {worst.memory_bytes / 2**30:.2f} GiB on stage {worst.index} "
            f"({worst.first_block} .. {worst.last_block}), over the {limit / 2**30:.2f} GiB limit; "
            "use --method optimal (it recomputes activations where needed) or raise --memory-limit"
        )
    return Plan(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=ModelRef(
            path=str(_stored_path(mf.path, plan_dir)),
            size=mf.size,
            config=mf.config,
            file_digest=mf.digest,
            fingerprint=costs.traced.fingerprint,
            trace_method=costs.traced.method,  # type: ignore[arg-type]
            trace_failures=costs.traced.failures,
            seed=seed,
        ),
        profile=costs.profile,
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


def _stored_path(model: Path, plan_dir: str | Path | None) -> Path:
    """The model path as the plan stores it: relative when under the plan's folder (so a project
    can move as a whole), absolute otherwise."""
    if plan_dir is None:
        return model
    rel = Path(os.path.relpath(model, Path(plan_dir).resolve()))
    return rel if rel.parts and rel.parts[0] != ".." else model
