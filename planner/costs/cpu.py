"""This machine's CPU as a ``HardwareSpec``: a few seconds of micro-benchmarks, cached per machine.

With it, ``planner.costs.estimate.estimate_blocks`` can be run for the CPU the planner measures on, and
the analytical model checked against ``planner.costs.measure.profile_model`` (bench/analytical_vs_measured.py).

Measured, at ``threads`` intra-op threads, median of repeats:

- sustained fp32 matmul FLOP/s: the median over a few GEMMs, 1024 x 1024 x 1024 and shapes of
  transformer layers at CPU sizes (a CPU's BLAS reaches its peak on none of them in particular);
- memory bandwidth: copying a 64 MiB tensor (read + write = 128 MiB moved), larger than the caches;
- operator overhead: a tiny two-layer MLP with layer norm trained forward and backward, whose
  arithmetic is negligible, divided by the aten operators it dispatches (counted the way
  ``planner.costs.roofline.Roofline`` counts them). It is the eager cost of one operator inside
  autograd-recording code — Python module calls, dispatch, allocation — which dominates small
  blocks on a CPU.

Efficiencies are 1.0: the peaks *are* sustained figures. The cache (JSON, default
``~/.cache/planner/cpu.json``) is keyed by hostname, threads and torch version.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from planner.core.levers.hardware import HardwareSpec
from planner.costs.roofline import Roofline, Tally
from planner.errors import PlannerError
from planner.schema.costs import GLOO_CPU_LINK
from planner.schema.jsonfile import write_atomic
from planner.threads import torch_threads

DEFAULT_CACHE = Path("~/.cache/planner/cpu.json")


def _median_time(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# (m, k, n, transpose a, transpose b): the square 1024^3 GEMM plus the shapes of transformer
# layers at CPU sizes (tokens x dim x 4dim, its transposes as backward runs them, a vocabulary head).
_GEMMS = (
    (1024, 1024, 1024, False, False),
    (256, 256, 1024, False, True),
    (1024, 256, 256, True, False),
    (512, 512, 2048, False, False),
    (256, 256, 8192, False, False),
)


def _matmul_flops(repeats: int = 3) -> float:
    rates = []
    for m, k, n, ta, tb in _GEMMS:
        a = torch.randn(k, m).t() if ta else torch.randn(m, k)
        b = torch.randn(n, k).t() if tb else torch.randn(k, n)
        rates.append(2 * m * k * n / _median_time(functools.partial(torch.mm, a, b), 1, repeats))
    return statistics.median(rates)


def _memory_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), 1, repeats)


def _op_overhead(repeats: int = 7, device: str = "cpu") -> float:
    """Seconds per operator of a tiny model's training step (``planner probe`` runs it on a GPU too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16))
    model = model.to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)
    cuda = torch.device(device).type == "cuda"

    def step() -> None:
        model(x).sum().backward()
        if cuda:  # the step's kernels finish inside the timed region
            torch.cuda.synchronize()

    spec = HardwareSpec(
        name="count",
        kind="cpu",
        peak_flops={"fp32": 1e12},
        memory_Bps=1e12,
        memory_bytes=1,
        intra_node_Bps=1,
        intra_node_latency_s=0,
        inter_node_Bps=1,
        inter_node_latency_s=0,
    )
    mode = Roofline(spec, "fp32")
    with mode.phase(Tally()) as tally:
        step()
    seconds = _median_time(step, 3, repeats)
    return seconds / max(1, tally.ops)


def _memory_capacity() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def measure_cpu(threads: int) -> HardwareSpec:
    """Run the micro-benchmarks now (about 1-5 s) at ``threads`` intra-op threads.

    Args:
        threads: intra-op threads (match what one pipeline rank gets).

    Returns:
        The spec, named ``cpu-<hostname>-<threads>t``.
    """
    if threads < 1:
        raise PlannerError(f"threads {threads}: need at least 1")
    with torch_threads(threads):
        flops = _matmul_flops()
        bandwidth = _memory_bandwidth()
        overhead = _op_overhead()
    host = socket.gethostname()
    return HardwareSpec(
        name=f"cpu-{host}-{threads}t",
        kind="cpu",
        peak_flops={"fp32": flops},
        memory_Bps=bandwidth,
        memory_bytes=_memory_capacity(),
        # Ranks on one CPU machine talk through gloo over loopback (planner.schema.costs.GLOO_CPU_LINK);
        # there is no second node.
        intra_node_Bps=GLOO_CPU_LINK.bandwidth_Bps,
        intra_node_latency_s=GLOO_CPU_LINK.latency_s,
        inter_node_Bps=GLOO_CPU_LINK.bandwidth_Bps,
        inter_node_latency_s=GLOO_CPU_LINK.latency_s,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        link_efficiency=1.0,
        op_overhead_s=overhead,
        source=f"planner.costs.cpu on {host}, {threads} thread(s), torch {torch.__version__}",
    )


def calibrated_cpu(threads: int = 1, path: str | Path | None = None, refresh: bool = False) -> HardwareSpec:
    """This machine's CPU spec at ``threads`` threads, from the cache or measured once and cached.

    Args:
        threads: intra-op threads.
        path: cache file (default ``~/.cache/planner/cpu.json``).
        refresh: measure again even when cached.

    Returns:
        The spec.
    """
    cache = Path(path if path is not None else DEFAULT_CACHE).expanduser()
    key = f"{socket.gethostname()}|{threads}t|torch-{torch.__version__}"
    entries: dict[str, dict] = {}
    if cache.exists():
        try:
            entries = json.loads(cache.read_text())
        except (OSError, ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            entries = {}  # a damaged cache is re-measured, not fatal
    if not refresh and key in entries:
        try:
            return HardwareSpec.model_validate(entries[key])
        except ValueError:
            pass
    spec = measure_cpu(threads)
    entries[key] = spec.model_dump()
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache, json.dumps(entries, indent=1, sort_keys=True))
    return spec
