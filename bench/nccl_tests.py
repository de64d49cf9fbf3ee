"""NCCL's cost model (``planner.core.levers.collectives``) at published nccl-tests points, into docs/collectives.md.

    python -m bench.nccl_tests            # a second; pure Python, no GPU

Every point is a bus bandwidth someone published for one collective, system, GPU count and size
(nccl-tests' ``busbw`` column, or a figure an NVIDIA engineer stated for it), with its source. The
model is evaluated at each as it stands: its constants come from NCCL's source and the datasheets,
none was tuned to these points, and the errors are reported as they are. The section between the
markers of docs/collectives.md is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.common import DOCS, pct_error, table, write_between_markers
from planner.core.levers.collectives import Collective, bus_factor, collective_time
from planner.core.levers.hardware import get_hardware, nccl_fabric
from planner.schema.costs import NcclFabric

BEGIN, END = "<!-- nccl-tests:begin -->", "<!-- nccl-tests:end -->"
GiB = 1 << 30


def _fabric(gpu: str, **update: object) -> NcclFabric:
    fabric = nccl_fabric(get_hardware(gpu))
    assert fabric is not None
    return fabric.model_copy(update=update)


H100 = _fabric("h100")
A100 = _fabric("a100-80g")
# nccl-tests#178: two A100 SXM4 joined by 12 NVLinks directly (nvidia-smi topo: NV12), no NVSwitch
A100_PAIR = _fabric("a100-80g", nvswitch=False)
# nccl-tests#119: DGX-A100-like nodes with four HDR cards for eight GPUs and Intel Xeon 8358 hosts
A100_4HDR = _fabric("a100-40g", gpus_per_nic=2, cpu="intel")


@dataclass(frozen=True)
class Point:
    """One published bus bandwidth."""

    source: str
    url: str
    system: str
    fabric: NcclFabric
    op: Collective
    ranks: int
    local: int
    nbytes: int
    busbw_GBps: float
    algorithm: str | None = None  # NCCL_ALGO as the run set it (None: NCCL's own choice)


NCCL_1455 = "https://github.com/NVIDIA/nccl/issues/1455"
POINTS = [
    # NVIDIA/nccl-tests#212, sjeaugey (NCCL team): "NCCL can get an effective NVLink bandwidth of
    # 370GB/s ... as BusBw when running non-allreduce operations, or ... NCCL_ALGO=RING"; "On 8 GPUs,
    # you should reach a peak busBw of ~480GB/s" with NVLink SHARP (large sizes: 8 GiB here).
    *(
        Point(
            "nccl-tests#212 (NCCL team)",
            "https://github.com/NVIDIA/nccl-tests/issues/212",
            "DGX/HGX H100, 1 node",
            H100,
            op,
            8,
            8,
            8 * GiB,
            bw,
            algo,
        )
        for op, bw, algo in (
            ("all_reduce", 480.0, None),
            ("all_reduce", 370.0, "ring"),
            ("all_gather", 370.0, None),
            ("reduce_scatter", 370.0, None),
        )
    ),
    # NVIDIA/nccl#1455: 8 x H100 SXM, all_reduce_perf -b 2G -e 4G: "ALGO=RING, busbw is about
    # 365-370 GBps when gpus from 2 to 8"; "ALGO=NVLS ... about 365-370 GBps when gpus from 2 to 4
    # ... 370 to 420, 440, 460, and 480 GBps when gpus increase from 4 to 5, 6, 7, and 8" (4 GiB).
    *(
        Point("nccl#1455", NCCL_1455, "HGX H100, 1 node", H100, "all_reduce", n, n, 4 * GiB, 367.5, "ring")
        for n in (2, 4, 8)
    ),
    *(
        Point("nccl#1455", NCCL_1455, "HGX H100, 1 node", H100, "all_reduce", n, n, 4 * GiB, bw, "nvls")
        for n, bw in ((2, 367.5), (4, 367.5), (5, 420.0), (6, 440.0), (7, 460.0), (8, 480.0))
    ),
    # NVIDIA/nccl-tests#149: HPE Apollo 6500, 8 x A100 80GB SXM on NVSwitch, NCCL 2.18, all_reduce
    # busbw "~200 GB/s" at 1 GiB.
    Point(
        "nccl-tests#149",
        "https://github.com/NVIDIA/nccl-tests/issues/149",
        "HGX A100 (Apollo 6500), 1 node",
        A100,
        "all_reduce",
        8,
        8,
        GiB,
        200.0,
    ),
    # NVIDIA/nccl-tests#178: two A100 joined by NV12, all_reduce_perf -b 8 -e 12G -t 2: "Bus_BW: 208 GBps".
    Point(
        "nccl-tests#178",
        "https://github.com/NVIDIA/nccl-tests/issues/178",
        "2 x A100 SXM4 over NV12",
        A100_PAIR,
        "all_reduce",
        2,
        2,
        12 * GiB,
        208.0,
    ),
    # NVIDIA/nccl-tests#119: 3 servers of 8 A100 SXM4 40GB with 4 HDR cards each (Xeon 8358),
    # all_reduce_perf -b 8 -e 128M: "peak performance reaches about 96GB/s" (at the top size).
    Point(
        "nccl-tests#119",
        "https://github.com/NVIDIA/nccl-tests/issues/119",
        "3 nodes x 8 A100 40GB, 4 x HDR a node",
        A100_4HDR,
        "all_reduce",
        24,
        8,
        128 << 20,
        96.0,
    ),
]


def predicted_busbw(point: Point) -> tuple[float, str]:
    """The model's bus bandwidth at a point (GB/s), and the algorithm/protocol it runs."""
    t = collective_time(point.op, point.nbytes, point.ranks, point.local, point.fabric, point.algorithm)
    return point.nbytes / t.seconds * bus_factor(point.op, point.ranks) / 1e9, t.label


def _size(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes >> 20} MiB"


def body() -> str:
    """The page section: the table and its summary."""
    rows, errors = [], []
    for p in POINTS:
        busbw, label = predicted_busbw(p)
        err = pct_error(busbw, p.busbw_GBps)
        errors.append((abs(err), p))
        forced = f" (NCCL_ALGO={p.algorithm})" if p.algorithm else ""
        rows.append(
            [
                f"[{p.source}]({p.url})",
                p.system,
                f"{p.op}{forced}",
                p.ranks,
                _size(p.nbytes),
                f"{p.busbw_GBps:.0f}",
                f"{busbw:.0f}",
                label,
                f"{err:+.1f}",
            ]
        )
    headers = ["source", "system", "collective", "GPUs", "size", "published busbw", "predicted", "as", "error %"]
    mean = sum(e for e, _ in errors) / len(errors)
    worst, at = max(errors, key=lambda x: x[0])
    summary = (
        f"{len(POINTS)} points: mean |error| {mean:.1f} %, worst {worst:.1f} % "
        f"({at.source}, {at.op}, {at.ranks} GPUs, {_size(at.nbytes)})."
    )
    return table(rows, headers) + "\n\n" + summary


def main() -> None:
    """Write the table between the markers of docs/collectives.md."""
    text = body()
    print(text)
    write_between_markers(DOCS / "collectives.md", BEGIN, END, text)


if __name__ == "__main__":
    main()
