"""What `planner probe` measures, and the spec's constants fitted from what it measured.

Pure module: the sweep (``ProbeTask``) and the fits. The measuring is ``planner.costs.probe``.

- **GEMMs.** A GPU's GEMM time is modelled as the roofline models it (``HardwareSpec.gemm_efficiency``):
  ``t = F / (R * d / (d + h))`` with ``F = 2mnk`` FLOPs, ``d = min(m, n, k)``, ``R`` the sustained
  ceiling and ``h`` the half-saturation dimension. That is linear in ``(1/R, h/R)``:
  ``t = F/R + (F/d) (h/R)``, fitted by least squares on relative errors (each point's residual
  divided by its time, so a 10-us GEMM counts as much as a 10-ms one). The spec takes
  ``peak_flops[dtype] = R`` with ``matmul_efficiency = 1`` (only the product of a datasheet peak and an
  efficiency is observable). On a CPU the ceiling is the median FLOP/s of the GEMMs and ``h = 0``,
  as ``planner.costs.cpu`` calibrates this machine (a CPU's BLAS has no tile-sized cliff to fit).
- **Memory bandwidth**: the largest copy's bytes moved (read + write) over its time.
- **Operator overhead**: a tiny model's training step over the operators it dispatches.
- **Attention**: torch's FLOP count of ``scaled_dot_product_attention`` over its time, median over
  the shapes, as a fraction of the GEMM ceiling (at most 1).
- **Links**: the alpha-beta model (Hockney): one message of ``n`` bytes takes ``alpha + n / beta``.
  Ring collectives over ``p`` ranks (Thakur, Rabenseifner & Gropp 2005; what NCCL's tests call bus
  bandwidth) take ``a * alpha + b * n / beta`` with the terms of ``COST_TERMS``. ``alpha`` and ``1/beta``
  are fitted by least squares on relative errors over send/recv and the ring collectives together;
  all-to-all (pairwise exchanges) gets a fit of its own, recorded but not used.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from planner.core.levers.hardware import DTYPES, KERNEL_FLOOR_S, HardwareSpec
from planner.core.levers.hardware_file import CollectiveSweep, HardwareFile, Measured
from planner.errors import PlannerError
from planner.schema.costs import GLOO_CPU_LINK, NCCL_NVLINK_LINK

KiB, MiB, GiB = 1024, 1024**2, 1024**3

COLLECTIVES = ("send_recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all")
RING = ("send_recv", "all_reduce", "all_gather", "reduce_scatter")
"""The operations the link's alpha-beta fit uses (all-to-all is pairwise: fitted apart)."""

COST_TERMS: dict[str, Callable[[int], tuple[float, float]]] = {
    # op -> p -> (latency terms a, share b of the n bytes each rank sends), t = a*alpha + b*n/beta
    "send_recv": lambda p: (1.0, 1.0),  # n: the message
    "all_reduce": lambda p: (2.0 * (p - 1), 2.0 * (p - 1) / p),  # n: the tensor reduced
    "all_gather": lambda p: (p - 1.0, (p - 1.0) / p),  # n: the gathered output
    "reduce_scatter": lambda p: (p - 1.0, (p - 1.0) / p),  # n: the input before scattering
    "all_to_all": lambda p: (p - 1.0, (p - 1.0) / p),  # n: each rank's input
}


class ProbeTask(BaseModel):
    """What every rank of a probe measures (sent to the ranks as JSON).

    Attributes are the sweep: GEMM shapes ``(m, n, k)``, copy sizes, attention shapes
    ``(batch, heads, seq, head_dim)``, collective sizes in bytes, and how each point is timed.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(description="'cpu' or 'cuda'.")
    dtype: str = Field(description="GEMM and attention dtype, one of DTYPES.")
    gemms: list[tuple[int, int, int]]
    copies: list[int]
    attention: list[tuple[int, int, int, int]]
    sizes: list[int] = Field(description="Collective sizes, bytes.")
    gpus_per_node: int = Field(ge=1)
    threads: int = Field(ge=1)
    warmup: int = Field(ge=0)
    repeats: int = Field(ge=1)
    quick: bool = False
    progress: bool = True
    timeout_s: float = Field(default=300.0, gt=0)


def default_task(
    device: str, dtype: str, quick: bool, gpus_per_node: int, threads: int, gemms: Sequence[tuple[int, int, int]] = ()
) -> ProbeTask:
    """The default sweep for a device (CPU sizes fit this machine's seconds; a GPU's its milliseconds).

    Args:
        device: 'cpu' or 'cuda'.
        dtype: one of ``DTYPES``.
        quick: the shorter sweep (fewer, smaller points; fewer repeats).
        gpus_per_node: ranks per node.
        threads: intra-op threads per rank.
        gemms: GEMM shapes ``(m, n, k)`` (a model's linear layers); empty: square and skinny defaults.

    Returns:
        The task.

    Raises:
        PlannerError: an unknown dtype.
    """
    if dtype not in DTYPES:
        raise PlannerError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    cuda = device == "cuda"
    if not gemms:
        big = (1024, 2048, 4096, 8192) if cuda else (256, 512, 1024)
        skinny = (16, 64, 256) if cuda else (16, 64)
        side = big[-1] if cuda else 1024
        squares = [(d, d, d) for d in (big[:3] if quick else big)]
        # skinny: few tokens (m small), and a thin reduction (k small) as a weight gradient of few tokens is
        gemms = squares + [(s, side, side) for s in skinny] + [(side, side, s) for s in skinny]
    top = (256 * MiB if quick else GiB) if cuda else (4 * MiB if quick else 64 * MiB)
    return ProbeTask(
        device=device,
        dtype=dtype,
        gemms=list(gemms),
        copies=[MiB, 16 * MiB, 256 * MiB] if cuda else [MiB, 16 * MiB, 64 * MiB],  # the last past every cache
        attention=[(4, 16, 1024, 128), (1, 32, 4096, 128)] if cuda else [(4, 4, 128, 32), (2, 8, 256, 64)],
        sizes=sweep(4 * KiB, top),
        gpus_per_node=gpus_per_node,
        threads=threads,
        warmup=1 if quick else 2,
        repeats=3 if quick else 5,
        quick=quick,
    )


def sweep(smallest: int, largest: int) -> list[int]:
    """Sizes from ``smallest`` to ``largest`` bytes, four times apart.

    Args:
        smallest: the first size.
        largest: the last size at most.

    Returns:
        The sizes, ascending.
    """
    sizes = [smallest]
    while sizes[-1] * 4 <= largest:
        sizes.append(sizes[-1] * 4)
    return sizes


def _solve2(rows: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares of ``x1 * u + x2 * v = 1`` over ``rows`` of ``(x1, x2)``; None when singular."""
    s11 = sum(x1 * x1 for x1, _ in rows)
    s12 = sum(x1 * x2 for x1, x2 in rows)
    s22 = sum(x2 * x2 for _, x2 in rows)
    r1 = sum(x1 for x1, _ in rows)
    r2 = sum(x2 for _, x2 in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) <= 1e-12 * max(s11 * s22, 1e-300):
        return None
    return (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det


def _solve1(xs: Sequence[float]) -> float:
    """Least squares of ``x * u = 1``."""
    return sum(xs) / sum(x * x for x in xs)


def fit_alpha_beta(points: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Fit ``t = a * alpha + b / beta`` on relative errors.

    Args:
        points: ``(a, b, t)``: latency terms, bytes over the link, seconds (``COST_TERMS`` times n).

    Returns:
        ``(alpha, beta, rms)``: latency in s (>= 0), bandwidth in bytes/s, and the root mean square
        of the relative residuals.

    Raises:
        PlannerError: fewer than two points, or points from which no positive bandwidth follows.
    """
    if len(points) < 2:
        raise PlannerError("the link fit needs at least two sizes; probe without --quick, or with more sizes")
    rows = [(a / t, b / t) for a, b, t in points]
    solved = _solve2(rows)
    alpha, inv_beta = solved if solved is not None else (0.0, -1.0)
    if alpha < 0 or inv_beta <= 0:  # a latency the noise made negative: bandwidth alone
        alpha, inv_beta = 0.0, _solve1([x2 for _, x2 in rows])
    if inv_beta <= 0:
        raise PlannerError("the link fit found no positive bandwidth: the timings are noise; probe again")
    rms = statistics.fmean(((a * alpha + b * inv_beta) / t - 1.0) ** 2 for a, b, t in points) ** 0.5
    return alpha, 1.0 / inv_beta, rms


def link_points(sweep_: CollectiveSweep, ops: Sequence[str]) -> list[tuple[float, float, float]]:
    """The ``(a, b, t)`` rows of the alpha-beta fit for ``ops`` of one sweep.

    Args:
        sweep_: the measured group.
        ops: which operations (keys of ``COST_TERMS``).

    Returns:
        The rows, every size of every op measured.
    """
    rows = []
    for op in ops:
        for point in sweep_.ops.get(op, []):
            p = 2 if op == "send_recv" else sweep_.ranks
            a, b = COST_TERMS[op](p)
            rows.append((a, b * point.nbytes, point.seconds))
    return rows


def fit_gemms(points: Sequence[tuple[float, int, float]]) -> tuple[float, float]:
    """Fit the GEMM curve ``t = F / (R * d / (d + h))`` on relative errors.

    Args:
        points: ``(F, d, t)``: FLOPs, the smallest dimension, seconds.

    Returns:
        ``(R, h)``: the sustained ceiling in FLOP/s and the half-saturation dimension (>= 0).

    Raises:
        PlannerError: no points.
    """
    if not points:
        raise PlannerError("no GEMM was measured")
    rows = [(f / t, f / (d * t)) for f, d, t in points]
    solved = _solve2(rows) if len({d for _, d, _ in points}) > 1 else None
    if solved is None or solved[0] <= 0 or solved[1] < 0:
        return 1.0 / _solve1([x1 for x1, _ in rows]), 0.0
    inv_r, h_over_r = solved
    return 1.0 / inv_r, h_over_r / inv_r


def _gemm_constants(measured: Measured) -> tuple[float, float, str]:
    """The GEMM ceiling, half dimension and how they were found."""
    if measured.device == "cpu":  # as planner.costs.cpu: the median rate, no shape curve
        rate = statistics.median(g.flops / g.seconds for g in measured.gemms)
        return rate, 0.0, f"median FLOP/s of {len(measured.gemms)} GEMMs (measured.gemms), as planner.costs.cpu"
    rate, half = fit_gemms([(g.flops, min(g.m, g.n, g.k), g.seconds) for g in measured.gemms])
    return rate, half, f"least-squares fit of t = F (d + h) / (R d) over {len(measured.gemms)} GEMMs (measured.gemms)"


def _attention(measured: Measured, ceiling: float) -> tuple[float | None, float | None]:
    """Attention's forward and backward as fractions of the GEMM ceiling (None: none measured)."""
    if not measured.attention:
        return None, None
    fwd = statistics.median(a.fwd_flops / a.fwd_s for a in measured.attention) / ceiling
    bwd = statistics.median(a.bwd_flops / a.bwd_s for a in measured.attention) / ceiling
    return min(1.0, fwd), min(1.0, bwd)


def _link(sweep_: CollectiveSweep | None, fallback: tuple[float, float], what: str) -> tuple[float, float, str]:
    """A group's latency and bandwidth and how they were found (``fallback`` when none was measured)."""
    if sweep_ is None:
        return fallback[0], fallback[1], what
    alpha, beta, rms = fit_alpha_beta(link_points(sweep_, RING))
    ops = ", ".join(op for op in RING if sweep_.ops.get(op))
    return alpha, beta, f"alpha-beta least squares over {ops} on {sweep_.ranks} ranks (rms error {rms:.0%})"


def other_fits(measured: Measured) -> dict[str, str]:
    """Each collective's own alpha-beta fit, recorded for the reader (not used by the planner).

    Args:
        measured: the probe's points.

    Returns:
        ``'fit.<group>.<op>'`` -> a line with its latency, bandwidth and error.
    """
    lines = {}
    for group, sweep_ in (("intra_node", measured.intra_node), ("inter_node", measured.inter_node)):
        for op in COLLECTIVES:
            if sweep_ is None or len(sweep_.ops.get(op, [])) < 2:
                continue
            try:
                alpha, beta, rms = fit_alpha_beta(link_points(sweep_, [op]))
            except PlannerError as e:
                lines[f"fit.{group}.{op}"] = str(e)
                continue
            lines[f"fit.{group}.{op}"] = f"alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.3f} GB/s, rms error {rms:.0%}"
    return lines


def hardware_file_of(measured: Measured, name: str) -> HardwareFile:
    """The hardware file of a probe: the spec fitted from ``measured``, and how each field was.

    Args:
        measured: what the ranks measured.
        name: the spec's name (``--gpu-type`` plans record it).

    Returns:
        The document ``planner probe -o`` writes.

    Raises:
        PlannerError: a fit found nothing usable (no GEMM, no bandwidth in the links).
    """
    cpu = measured.device == "cpu"
    ceiling, half, gemm_how = _gemm_constants(measured)
    copy = max(measured.copies, key=lambda c: c.nbytes)
    fwd, bwd = _attention(measured, ceiling)
    default = GLOO_CPU_LINK if cpu else NCCL_NVLINK_LINK
    none = f"not measured (one rank): {default.name}'s figures"
    intra = _link(measured.intra_node, (default.latency_s, default.bandwidth_Bps), none)
    inter = _link(measured.inter_node, intra[:2], "not measured (one node): the intra-node figures")
    where = f"{measured.world_size} rank(s), {measured.gpus_per_node} per node, {measured.backend}"
    spec = HardwareSpec(
        name=name,
        kind="cpu" if cpu else "gpu",
        peak_flops={measured.dtype: ceiling},
        memory_Bps=2 * copy.nbytes / copy.seconds,
        memory_bytes=measured.memory_bytes,
        intra_node_Bps=intra[1],
        intra_node_latency_s=intra[0],
        inter_node_Bps=inter[1],
        inter_node_latency_s=inter[0],
        matmul_efficiency=1.0,
        gemm_half_dim=half,
        attention_kernel=f"torch's default scaled_dot_product_attention on {measured.device_name}",
        attention_fwd_efficiency=fwd,
        attention_bwd_efficiency=bwd,
        memory_efficiency=1.0,
        link_efficiency=1.0,
        # a CPU runs each operator inline after its dispatch; a GPU's host issues them ahead of its kernels
        op_overhead_s=measured.op_overhead_s if cpu else KERNEL_FLOOR_S,
        dispatch_s=measured.op_overhead_s,
        source=f"planner probe on {measured.host} ({measured.device_name}; {where}; "
        f"{measured.threads} thread(s); torch {measured.torch_version}; {measured.date})",
    )
    tiny = "a tiny model's training step over the operators it dispatches (measured.op_overhead_s)"
    attention = "median over measured.attention of torch's FLOP count / time, over the GEMM ceiling (at most 1)"
    derived = {
        f"peak_flops.{measured.dtype}": gemm_how,
        "matmul_efficiency": "1: the ceiling is sustained FLOP/s",
        "gemm_half_dim": gemm_how if not cpu else "0: a CPU's GEMMs have no tile-sized cliff (as planner.costs.cpu)",
        "memory_Bps": f"2 x {copy.nbytes} bytes over the largest copy's time (measured.copies)",
        "memory_efficiency": "1: the bandwidth is sustained",
        "attention_fwd_efficiency": attention,
        "attention_bwd_efficiency": attention,
        "op_overhead_s": tiny if cpu else "the spec's default: the least a GPU kernel takes, not measured",
        "dispatch_s": tiny if not cpu else "as op_overhead_s (not used on a CPU)",
        "intra_node_latency_s": intra[2],
        "intra_node_Bps": intra[2],
        "inter_node_latency_s": inter[2],
        "inter_node_Bps": inter[2],
        "link_efficiency": "1: the fitted bandwidth is what messages reach",
        "memory_bytes": "the device's capacity (a CPU: the machine's memory)",
        **other_fits(measured),
    }
    return HardwareFile(spec=spec, derived=derived, measured=measured)
