"""The roofline's time of the split layers' GEMMs at their sharded shapes: the tensor-parallel
``slowdown`` of estimated costs (``planner.costs.tensor_parallel``; ``bench/gpu_check.py`` measures
``gemm_seconds`` against a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.core.levers.hardware import HardwareSpec


@dataclass(frozen=True)
class Gemm:
    """One GEMM inside a matched layer: ``(m x k) @ (k x n)``, the style saying which dimension splits
    (column-wise and colwise_rep: n, row-wise: k), ``width`` the bytes of an operand's element."""

    style: str
    m: int
    n: int
    k: int
    width: int


MAX_DEGREE = 64  # the largest degree a share lists a slowdown for (a node holds at most 8 GPUs today)


def gemm_seconds(hw: HardwareSpec, peak: float, m: int, n: int, k: int, width: int) -> float:
    """The roofline's time of one GEMM ``(m x k) @ (k x n)`` (``planner.costs.roofline``): its FLOPs at
    ``gemm_efficiency(m, n, k)`` of ``peak``, or its operands' and output's bytes at the memory's
    sustained bandwidth, whichever is longer, with the per-operator overhead.

    Args:
        hw: the hardware.
        peak: FLOP/s of the dtype the GEMM runs in.
        m: rows of the output.
        n: columns of the output.
        k: the reduced dimension.
        width: bytes of an element.

    Returns:
        Seconds.
    """
    compute = 2.0 * m * n * k / (peak * hw.gemm_efficiency(m, n, k))
    memory = (m * k + k * n + m * n) * width / (hw.memory_Bps * hw.memory_efficiency)
    roof = max(compute, memory)
    return max(roof, hw.op_overhead_s) if hw.async_launch else roof + hw.op_overhead_s


def gemm_slowdown(gemms: list[Gemm], tp: int, hw: HardwareSpec, peak: float) -> float:
    """How much longer the split layers' GEMMs take on one of ``tp`` ranks than 1/tp of their whole time.

    Args:
        gemms: the GEMMs of the split layers, at the whole shapes.
        tp: the degree (divides every split dimension).
        hw: the hardware.
        peak: FLOP/s of the planning dtype.

    Returns:
        sum of the sharded GEMMs' seconds / (sum of the whole GEMMs' seconds / tp); 1.0 with no GEMM.
    """
    whole = sum(gemm_seconds(hw, peak, g.m, g.n, g.k, g.width) for g in gemms)
    sharded = sum(
        gemm_seconds(
            hw,
            peak,
            g.m,
            max(1, g.n // tp) if g.style != "rowwise" else g.n,
            g.k if g.style != "rowwise" else max(1, g.k // tp),
            g.width,
        )
        for g in gemms
    )
    return sharded / (whole / tp) if whole > 0 else 1.0


__all__ = ["MAX_DEGREE", "Gemm", "gemm_seconds", "gemm_slowdown"]
