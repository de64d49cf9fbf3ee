"""Throughput of a plan as published runs report it: samples/s, tokens/s (per GPU) and MFU.

Pure module (no torch): everything is read from the plan. Model FLOPs utilisation follows PaLM
(Chowdhery et al. 2022, appendix B): the model's FLOPs per step, without recomputation, over the
step time times the devices' peak. The model's FLOPs are the blocks' counted ones
(``torch.utils.flop_counter``, causal attention at half, see ``planner.costs.estimate``), so a
published MFU that counts causal attention in full (torchtitan, llm-foundry) reads a few points
higher for the same speed (docs/gpu_costs.md).

With data-parallel replicas every figure is the whole job's: the global batch per step over the
``world_size`` devices (a replica's blocks and microbatches times ``dp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.levers.hardware import GPUS, HardwareError
from planner.schema.plan import Plan


@dataclass(frozen=True)
class Throughput:
    """What a plan's predicted step amounts to.

    Attributes:
        samples_per_s: samples per second over all replicas (the global batch per step).
        tokens_per_s: tokens per second (None: the plan does not know the tokens per sample).
        tokens_per_s_per_gpu: ``tokens_per_s`` over every rank (``world_size``).
        model_flops: the model's FLOPs per step over all replicas, forward and backward, no
            recomputation (None: some block's FLOPs were not counted).
        peak_flops: the peak dense FLOP/s of one device in the plan's dtype (None: not known).
        mfu: model FLOPs utilisation of the predicted step.
        busy_mfu: the same over the time the ranks compute (the step without its bubble:
            ``pipeline_time_s * (1 - bubble_fraction)``): what the kernels alone reach.
    """

    samples_per_s: float
    tokens_per_s: float | None
    tokens_per_s_per_gpu: float | None
    model_flops: float | None
    peak_flops: float | None
    mfu: float | None
    busy_mfu: float | None


def peak_flops(plan: Plan) -> float | None:
    """Peak dense FLOP/s of one of the plan's devices in its dtype, when the hardware table has it.

    Args:
        plan: a plan estimated for ``--gpu-type`` (measured plans and the CPU have no table entry).

    Returns:
        FLOP/s, or None.
    """
    hw = GPUS.get(plan.profile.hardware or "")
    if hw is None:
        return None
    try:
        return hw.peak(plan.profile.dtype)
    except HardwareError:
        return None


def throughput(plan: Plan, peak: float | None = None) -> Throughput:
    """Samples/s, tokens/s (per GPU) and MFU of the plan's predicted step.

    Args:
        plan: the plan.
        peak: one device's peak FLOP/s (None: ``peak_flops(plan)``).

    Returns:
        The figures; those that cannot be known are None.
    """
    pred = plan.prediction
    step = pred.step_time_s
    samples = plan.batch_size / step if step > 0 else 0.0
    tokens = plan.profile.tokens_per_sample
    tokens_s = samples * tokens if tokens is not None else None
    per_gpu = tokens_s / plan.world_size if tokens_s is not None else None
    counted = [b.flops_fwd + b.flops_bwd for b in plan.blocks if b.flops_fwd is not None and b.flops_bwd is not None]
    # the blocks are one microbatch of one replica of the mesh (a context-parallel rank's share of the
    # sequence): every replica runs accumulation passes of n_microbatches of them
    flops = (
        sum(counted) * plan.n_microbatches * plan.accumulation * plan.replicas
        if len(counted) == len(plan.blocks)
        else None
    )
    peak = peak if peak is not None else peak_flops(plan)
    mfu = busy = None
    if flops is not None and peak:
        capacity = plan.world_size * peak
        mfu = flops / (step * capacity) if step > 0 else None
        busy_s = pred.pipeline_time_s * (1.0 - pred.bubble_fraction)
        busy = flops / (busy_s * capacity) if busy_s > 0 else None
    return Throughput(samples, tokens_s, per_gpu, flops, peak, mfu, busy)


def throughput_line(plan: Plan) -> str:
    """One line for the report: samples/s, tokens/s and per GPU, and MFU where a peak is known."""
    t = throughput(plan)
    parts = [f"{t.samples_per_s:.4g} samples/s"]
    if t.tokens_per_s is not None and t.tokens_per_s_per_gpu is not None:
        parts.append(f"{t.tokens_per_s:.5g} tokens/s ({t.tokens_per_s_per_gpu:.5g} per GPU)")
    if t.mfu is not None and t.busy_mfu is not None:
        of = " of the bf16 peak, which float8 GEMMs double" if plan.profile.float8 is not None else ""
        parts.append(f"MFU {100 * t.mfu:.1f}% ({100 * t.busy_mfu:.1f}% without the bubble){of}")
    return "throughput: " + ", ".join(parts)
