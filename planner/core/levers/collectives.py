"""NCCL's own cost model of a collective: the algorithm and protocol NCCL picks, and the time it predicts.

Pure module (no torch). Ported from NVIDIA/nccl at commit 5067397c2676d5aed50042fc39e5c8ee96eb0027
(NCCL 2.30.7, makefiles/version.mk), function by function:

* ``_system`` / ``_graph``: the channels NCCL's topology search builds (src/graph/search.cc,
  ``ncclTopoSearchInit``, ``ncclTopoCompute`` pass 1 and 2, ``ncclTopoDupChannels``, the speed
  arrays; src/init.cc: the tree graph gets the ring's channel count, PAT uses the tree graph,
  NVLS_TREE the NVLS graph). The search itself walks NCCL's topology graph link by link; here a
  node is a pool: a GPU's NVLinks (``nvlinks`` x topo.h's per-link bandwidth) or PCIe link, and
  ``nics`` cards of ``min(card, PCIe)`` each. A channel at speed s takes s of a card and s of every
  GPU's NVLink it crosses (an NVLS channel 2 s of its head's), as ``followPath`` subtracts it.
* ``tune``: ``ncclTopoTuneModel`` (src/graph/tuning.cc): per collective, algorithm and protocol a
  latency (``baseLat`` + ``hwLat`` per hop) and a bandwidth (channels x per-channel bandwidth, the
  LL / LL128 / tree factors, the per-architecture caps), converted from bus to algorithm
  bandwidth; the protocol and algorithm enables (LL128 over NVLink only, NVLS_TREE across nodes,
  NVLS inside one node, CollNet off: SHARP is not modelled).
* ``collective_time``: ``ncclTopoGetAlgoTime`` (the tree correction factors, the ring plateau)
  and ``topoGetAlgoInfo`` (src/enqueue.cc: the least predicted time wins, first found on a tie).

Message bytes follow NCCL's ``ncclFuncMaxSendRecvCount`` (src/include/enqueue.h): an all-reduce's
or a broadcast's buffer; an all-gather's *output* (count x ranks) and a reduce-scatter's *input*;
nccl-tests' ``size`` column in every case. Send/receive and all-to-all are not in tuning.cc (NCCL
runs them as point-to-point operations outside the algorithm selection): a send is costed as the
ring broadcast between two ranks (the same channels, latencies and per-channel bandwidth), with
the protocol ``enqueue.cc`` gives p2p (LL up to ``NCCL_P2P_LL_THRESHOLD`` = 16 KiB, else Simple);
an all-to-all as the grouped sends it is, every peer at once, the intra-node share over NVLink and
the rest over the node's cards.

What is not modelled: CollNet / IB SHARP, the symmetric-memory kernels (registered buffers), PXN
and cross-NIC rings, channel counts NCCL lowers for small messages (they do not enter its time
model either), the tuner plugins, and the NVLink topology of a node without NVSwitch (a pool here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from planner.errors import InfeasibleError
from planner.schema.costs import NcclFabric

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all"]
COLLECTIVES: tuple[Collective, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "send_recv",
    "all_to_all",
)

# src/include/plugin/nccl_tuner.h: algorithm, protocol and hardware indices.
TREE, RING, COLLNET_DIRECT, COLLNET_CHAIN, NVLS, NVLS_TREE, PAT = range(7)
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
LL, LL128, SIMPLE = range(3)
PROTOCOLS = ("LL", "LL128", "Simple")
_NVLINK, _PCI, _NET = range(3)
_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER, _BROADCAST = range(4)
_FUNCS: dict[str, int] = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "broadcast": 3}

# tuning.cc: compCapIndex (Volta, Ampere, Hopper, Blackwell) and the lowest compute capability of each.
_ARCH_INDEX = {"volta": 0, "ampere": 1, "hopper": 2, "blackwell": 3}
_COMPCAP = {"volta": 70, "ampere": 80, "hopper": 90, "blackwell": 100}

# tuning.cc, ncclTunerConstantsDefaults: baseLatencies[algorithm][protocol], microseconds.
_BASE_LAT = ((6.8, 14.0, 8.4), (6.6, 14.0, 8.4), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0), (8.0, 8.0, 8.0))
# hwLatencies[NVLINK / PCI / NET][algorithm][protocol], microseconds.
_HW_LAT = (
    ((0.6, 1.25, 4.0), (0.6, 1.9, 3.4), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 25), (0, 0, 25), (0, 0, 4.0)),
    ((1.0, 1.9, 4.0), (1.0, 2.5, 5.7), (0, 0, 3.7), (0, 0, 2.8), (0, 0, 0), (0, 0, 0), (0, 0, 4.0)),
    ((5.0, 8.5, 14), (2.7, 4.0, 14.0), (0, 0, 31), (0, 0, 30), (0, 0, 18), (0, 0, 20.9), (0, 0, 14)),
)
# llMaxBws[index1][nodes index], GB/s: index1 is the GPU generation on one node, else the CPU
# (row 0 "Intel", row 1 "AMD").
_LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
# per-channel caps [arch][nodes index: 1, 2, more], GB/s.
_RING_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
_TREE_LL128_BW = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
_NVLS_TREE_BW = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
_NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)  # tuning.cc nvlsEfficiency
# tuning.cc treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MB.
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9, 0.9, 0.9, 0.9, 1.0, 1.0),
    (0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.7, 0.7, 0.8, 0.9, 0.9),
)
# tuning.cc getNetOverhead: microseconds a network step costs the CPU proxy.
_NET_OVERHEAD = {"intel": 1.0, "amd": 2.0, "arm": 1.0}
# src/graph/topo.h: NVLink bandwidth per link as NCCL counts it, GB/s (SM70/SM80/SM90/SM100_NVLINK_BW).
NVLINK_LINK_GBPS = {"volta": 20.0, "ampere": 20.0, "hopper": 20.6, "blackwell": 40.1}
# src/graph/search.cc: the per-channel speeds the search tries, GB/s (intra: one node; inter: several).
_SPEEDS_INTRA = {
    "default": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    "blackwell": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
_SPEEDS_INTER = {
    "default": (
        48.0,
        30.0,
        28.0,
        24.0,
        20.0,
        18.0,
        15.0,
        12.0,
        10.0,
        9.0,
        7.0,
        6.0,
        5.0,
        4.0,
        3.0,
        2.4,
        1.2,
        0.24,
        0.12,
    ),
    "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
    "blackwell": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0)
    + (20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12),
}
_RING_MAX_CHANNELS = 32  # init.cc: ringGraph->maxChannels = MAXCHANNELS / 2
_NVLS_MAX_ARITY = 32  # device.h NCCL_MAX_NVLS_ARITY
_P2P_LL_THRESHOLD = 16384  # enqueue.cc NCCL_PARAM(P2pLLThreshold, "P2P_LL_THRESHOLD", 16384)
_GB = 1e9  # NCCL's GB/s are 10^9 bytes a second (time_us = bytes / (1000 x GB/s))


@dataclass(frozen=True)
class CollectiveTime:
    """What NCCL predicts for one collective: seconds, and the algorithm and protocol it chose."""

    seconds: float
    algorithm: str
    protocol: str

    @property
    def label(self) -> str:
        """``algorithm/protocol``, as a report names it ("ring/LL128")."""
        return f"{self.algorithm}/{self.protocol}"


@dataclass(frozen=True)
class _System:
    """One communicator's topology as the tuning model reads it (bandwidths in NCCL's GB/s)."""

    arch: str
    ranks: int
    local: int  # ranks per node
    nodes: int
    nvlink: bool  # the GPUs of a node talk over NVLink (else PCIe)
    intra_bw: float  # a GPU's NVLink (or PCIe) bandwidth: getTotalBw
    nics: int  # cards the group's ranks of one node use
    net_bw: float  # one GPU-to-card path: min(card, PCIe)
    nvls: bool  # NVLink SHARP possible (Hopper+ on NVSwitch)
    cpu: str


@dataclass(frozen=True)
class _Graph:
    """A searched graph: channels and per-channel bandwidth inside and between nodes (struct ncclTopoGraph)."""

    channels: int
    bw_intra: float
    bw_inter: float


def _system(fabric: NcclFabric, ranks: int, local: int) -> _System:
    """The topology of a group of ``ranks`` ranks with ``local`` of them on each node."""
    local = max(1, min(local, ranks))
    nodes = max(1, -(-ranks // local))
    nvlink = fabric.nvlinks > 0
    pcie = fabric.pcie_Bps / _GB
    intra = fabric.nvlinks * NVLINK_LINK_GBPS[fabric.arch] if nvlink else pcie
    return _System(
        arch=fabric.arch,
        ranks=ranks,
        local=local,
        nodes=nodes,
        nvlink=nvlink,
        intra_bw=max(intra, pcie),  # search.cc getTotalBw: max(PCIe, the NVLinks' sum)
        nics=max(1, local // fabric.gpus_per_nic),
        net_bw=min(fabric.nic_Bps, fabric.pcie_Bps) / _GB,
        nvls=fabric.nvswitch and _COMPCAP[fabric.arch] >= 90,
        cpu=fabric.cpu,
    )


def _speeds(sys_: _System) -> tuple[float, ...]:
    """search.cc ncclTopoCompute: the speed array for the GPU generation, intra- or inter-node."""
    key = sys_.arch if sys_.arch in ("hopper", "blackwell") else "default"
    return (_SPEEDS_INTER if sys_.nodes > 1 else _SPEEDS_INTRA)[key]


def _channels_fit(sys_: _System, pattern: int, bw_intra: float, bw_inter: float) -> int:
    """The most channels of ``pattern`` (RING, TREE or NVLS) the links carry at these speeds.

    A ring or tree channel crosses every GPU of the node once (its NVLink or PCIe out), and enters
    and leaves a node through a card; the GPU it leaves by does not send on NVLink for it. An NVLS
    channel takes its speed from every GPU's NVLink and twice from its head's (search.cc
    ``ncclTopoSearchTryNvls``).
    """
    eps = 1e-6  # search.cc SUB_ROUND rounds the links' remaining bandwidth to 1/1000
    limit = _RING_MAX_CHANNELS
    if sys_.nodes > 1:
        limit = sys_.nics * int(sys_.net_bw / bw_inter + eps)
    if pattern == NVLS:
        return min(limit, min(sys_.local, _NVLS_MAX_ARITY), max(int(sys_.intra_bw / bw_intra + eps) - 1, 0))
    if sys_.local == 1:
        return min(limit, _RING_MAX_CHANNELS)
    for c in range(min(limit, _RING_MAX_CHANNELS), 0, -1):
        # with a card per GPU each GPU is the exit of 1 / local of the channels, else of none
        busy = c - c // sys_.local if sys_.nodes > 1 and sys_.nics >= sys_.local else c
        if busy * bw_intra <= sys_.intra_bw + eps:
            return c
    return 0


def _first_pass(sys_: _System, pattern: int, min_ch: int, max_ch: int) -> tuple[int, float] | None:
    """ncclTopoCompute's first pass: from the fastest speed the links allow, down while the speed is
    above half the best found, keeping the best channels x speed (a tie keeps the first)."""
    speeds = _speeds(sys_)
    max_bw = sys_.net_bw if sys_.nodes > 1 else sys_.intra_bw  # ncclTopoSearchInit: maxBw
    total = sys_.intra_bw
    if sys_.local > 1 and pattern != RING:  # "increase the NVLink bw artificially"
        total *= sys_.local / (sys_.local - 1)
    i = 0
    while (speeds[i] > max_bw or speeds[i] * min_ch > total) and i < len(speeds) - 1:
        i += 1
    best: tuple[int, float] | None = None
    while True:
        s = speeds[i]
        c = min(_channels_fit(sys_, pattern, s, s), max_ch)
        if c >= min_ch and (best is None or c * s > best[0] * best[1]):
            best = (c, s)
        if best is not None and (best[0] == max_ch or best[0] * best[1] >= sys_.intra_bw):
            return best  # perfect (every channel found) or all of the GPU's bandwidth used
        if i < len(speeds) - 1 and (best is None or speeds[i + 1] / best[1] > 0.49):
            i += 1
            continue
        return best


@lru_cache(maxsize=1024)
def _graph(sys_: _System, pattern: int, min_ch: int = 1) -> _Graph:
    """The graph ncclTopoCompute returns for ``pattern`` (RING, TREE or NVLS): pass 1, the channel
    duplication (ncclTopoDupChannels), then pass 2's raise of the speed (rings), of the intra-node
    speed (trees, up to twice the inter-node one) or of the inter-node speed (NVLS)."""
    nvls_local = min(sys_.local, _NVLS_MAX_ARITY)
    if pattern == NVLS:
        min_ch = nvls_local if sys_.nodes == 1 else 1
        max_ch = nvls_local
    else:
        max_ch = _RING_MAX_CHANNELS if pattern == RING else min_ch
    found = _first_pass(sys_, pattern, min_ch, max_ch)
    if found is None:
        # search.cc: "Could not find a path ... falling back to simple order": one channel at 0.1 GB/s
        return _Graph(0 if pattern == NVLS else 1, 0.1, 0.1)
    c, bw = found
    bw_intra = bw_inter = bw
    cc = _COMPCAP[sys_.arch]
    if pattern != NVLS and bw >= 25.0 and not (cc > 80 and bw < 50.0 and c > 4):
        dup = min(2 * c, max_ch)  # a tree's channels are capped at the ring's (init.cc)
        div = -(-dup // c)
        c, bw_intra, bw_inter = dup, bw / div, bw / div
    speeds = _speeds(sys_)
    i = next((k for k, s in enumerate(speeds) if s <= bw_inter), len(speeds) - 1)
    if pattern == RING:
        while i > 0 and _channels_fit(sys_, RING, speeds[i - 1], speeds[i - 1]) >= c:
            i -= 1
            bw_intra = bw_inter = speeds[i]
    elif pattern == NVLS:
        while i > 0 and bw_inter < 2 * bw_intra and _channels_fit(sys_, NVLS, bw_intra, speeds[i - 1]) >= c:
            i -= 1
            bw_inter = speeds[i]
    elif speeds[i] == bw_intra:
        while i > 0 and bw_intra < 2 * bw_inter and _channels_fit(sys_, TREE, speeds[i - 1], bw_inter) >= c:
            i -= 1
            bw_intra = speeds[i]
    return _Graph(c, bw_intra, bw_inter)


def _graphs(sys_: _System) -> dict[int, _Graph]:
    """init.cc: the ring, then the tree with the ring's channel count, both cut to the fewer of the
    two; NVLS where NVLink SHARP is possible; PAT on the tree graph, NVLS_TREE on the NVLS one."""
    ring = _graph(sys_, RING)
    tree = _graph(sys_, TREE, ring.channels)
    channels = min(ring.channels, tree.channels)
    ring = _Graph(channels, ring.bw_intra, ring.bw_inter)
    tree = _Graph(channels, tree.bw_intra, tree.bw_inter)
    out = {RING: ring, TREE: tree, PAT: tree}
    if sys_.nvls:
        nvls = _graph(sys_, NVLS)
        if nvls.channels:
            out[NVLS] = out[NVLS_TREE] = nvls
    return out


def _bus_bw(sys_: _System, g: _Graph, func: int, algo: int, proto: int) -> float:
    """tuning.cc ncclTopoTuneModel: the bus bandwidth of one (collective, algorithm, protocol), GB/s,
    before the conversion to algorithm bandwidth (0: not used)."""
    a_idx = _ARCH_INDEX[sys_.arch]
    n_idx = sys_.nodes - 1 if sys_.nodes <= 2 else 2
    cpu_idx = 1 if sys_.cpu == "amd" else 0
    ll_max = _LL_MAX_BW[a_idx if sys_.nodes == 1 else cpu_idx][n_idx]
    ppn = sys_.ranks / sys_.nodes
    bw = g.bw_intra if sys_.nodes <= 2 else g.bw_inter
    if algo in (NVLS, NVLS_TREE):
        if g.channels < 2:
            return 0.0
        intra = g.bw_intra * _NVLS_EFFICIENCY[a_idx] * (g.channels - 1) / g.channels
        intra *= 2.0 if func == _ALL_REDUCE else (ppn - 1) / ppn  # all-reduce pipelines two operations
        inter = g.bw_inter * (2 if sys_.nodes <= 2 and algo == NVLS_TREE else 1)
        bw = min(intra, inter, _NVLS_TREE_BW[a_idx][n_idx] if algo == NVLS_TREE else math.inf)
    bus = g.channels * bw
    if algo == RING and proto == LL:
        bus = min(ll_max, bus * 0.5)
    if algo == RING and proto == LL128:
        bus = min(bus * 0.92, g.channels * _RING_LL128_BW[a_idx][n_idx])
    if algo == TREE and func == _ALL_REDUCE:
        bus = min(bus * 0.92, g.channels * _TREE_BW[a_idx][n_idx])
    if algo == TREE and proto == LL:
        bus = min(bus / 3.8, ll_max)
    if algo == TREE and proto == LL128:
        factor = 7.0 / 9.0 if sys_.nodes == 1 else 120.0 / 128.0
        bus = min(bus * factor, g.channels * _TREE_LL128_BW[a_idx][n_idx])
    if algo == PAT:
        bus *= 0.75
    if algo == NVLS and func != _ALL_REDUCE and sys_.nodes > 1:
        bus = 0.0  # all-gather / reduce-scatter over NVLS across nodes needs CollNet
    return bus


def _latency(sys_: _System, func: int, algo: int, proto: int) -> float:
    """tuning.cc ncclTopoTuneModel: the latency of one (collective, algorithm, protocol), us."""
    intra_hw = _NVLINK if sys_.nvlink else _PCI
    hw = intra_hw if sys_.nodes == 1 else _NET
    ppn = sys_.ranks / sys_.nodes
    steps = 2 * (sys_.ranks - 1) if func == _ALL_REDUCE else sys_.ranks - 1 if func != _BROADCAST else sys_.ranks
    lat = _BASE_LAT[algo][proto]
    intra_lat = _HW_LAT[intra_hw][algo][proto]
    # "With ppn=1 latencies are fully exposed, use the Tree network latency"; the graph's own
    # network latency (latencyInter) is 0 for the IB plugin's cards.
    inter_lat = _HW_LAT[_NET][TREE if ppn == 1 else algo][proto]
    local = sys_.ranks // sys_.nodes
    log_nodes = int(math.log2(sys_.nodes))
    if algo == RING:
        hop = _HW_LAT[hw][algo][proto]
        if func == _BROADCAST:
            return lat + hop  # the ring graph has the same channels each way (sameChannels)
        overhead = 0.0
        if sys_.nodes > 1:  # inter-node rings still launch nsteps x the network overhead
            overhead = _NET_OVERHEAD[sys_.cpu] * (3 if proto == SIMPLE else 1)
        intra_lat = max(intra_lat, overhead)
        inter_steps = 0 if sys_.nodes == 1 else 2 * (sys_.nodes - 1) if func == _ALL_REDUCE else sys_.nodes - 1
        return lat + (steps - inter_steps) * intra_lat + inter_steps * inter_lat
    if algo == TREE:
        return lat + (2 * ((local - 1) * intra_lat + log_nodes * inter_lat) if func == _ALL_REDUCE else 0.0)
    if algo == NVLS:
        return intra_lat + (inter_lat if sys_.nodes > 1 else 0.0)
    if algo == NVLS_TREE:
        return lat + intra_lat + 2 * log_nodes * inter_lat
    if algo == PAT and func in (_ALL_GATHER, _REDUCE_SCATTER):
        return lat + log_nodes * (inter_lat / 3.5) + sys_.ranks * 2.8
    return lat


def _enabled(sys_: _System, graphs: dict[int, _Graph], func: int, algo: int, proto: int) -> bool:
    """Which (collective, algorithm, protocol) NCCL considers: the loops' skips in
    ncclTopoTuneModel, its enables (LL128 over NVLink only, NVLS_TREE across nodes, NVLS inside a
    node without CollNet, PAT for one rank a node) and updateCollCostTable's (src/enqueue.cc)."""
    if algo not in graphs or algo in (COLLNET_DIRECT, COLLNET_CHAIN):
        return False  # CollNet needs SHARP (collnetEnable), not modelled
    if func == _BROADCAST and algo != RING:
        return False
    if func in (_ALL_GATHER, _REDUCE_SCATTER) and algo not in (PAT, RING, NVLS):
        return False
    if func == _ALL_REDUCE and algo == PAT:
        return False
    if algo in (NVLS, NVLS_TREE) and proto != SIMPLE:
        return False
    if algo == PAT and (proto != SIMPLE or sys_.nodes != sys_.ranks):
        return False  # ncclPatEnable: only one GPU per node
    if algo == NVLS_TREE and sys_.nodes == 1:
        return False
    if algo == NVLS and sys_.nodes > 1:
        return False
    # LL128: Hopper+ up to PXN, older up to PXB (the DGX / HGX card shares the GPU's PCIe switch),
    # and the node's GPUs on NVLink (typeIntra <= PATH_NVB); never before Volta.
    return not (proto == LL128 and not sys_.nvlink)


@lru_cache(maxsize=4096)
def tune(fabric: NcclFabric, ranks: int, local: int) -> dict[tuple[int, int, int], tuple[float, float]]:
    """NCCL's tuning table for a group: ``(collective, algorithm, protocol) -> (latency us, bandwidth GB/s)``.

    Args:
        fabric: the node and network.
        ranks: ranks of the group (2 or more).
        local: its ranks on each node.

    Returns:
        Every enabled entry (collectives as ``_FUNCS`` numbers them), its bandwidth already converted
        from bus to algorithm bandwidth as ncclTopoTuneModel stores it.
    """
    sys_ = _system(fabric, ranks, local)
    graphs = _graphs(sys_)
    table: dict[tuple[int, int, int], tuple[float, float]] = {}
    for func in range(4):
        steps = 2 * (ranks - 1) if func == _ALL_REDUCE else ranks - 1 if func != _BROADCAST else ranks
        for algo in graphs:
            for proto in range(3):
                if not _enabled(sys_, graphs, func, algo, proto):
                    continue
                bus = _bus_bw(sys_, graphs[algo], func, algo, proto)
                if bus <= 0:
                    continue
                # "Convert bus BW to algorithm BW" (not for all-gather / reduce-scatter off the ring)
                if not (algo != RING and func in (_ALL_GATHER, _REDUCE_SCATTER)):
                    bus *= ranks / steps if algo in (RING, NVLS, NVLS_TREE) else 0.5
                table[(func, algo, proto)] = (_latency(sys_, func, algo, proto), bus)
    return table


def _log2i(n: int) -> int:
    """NCCL's log2i: floor(log2 n), -1 for 0."""
    return n.bit_length() - 1


def _algo_time_us(
    sys_: _System, ring_channels: int, key: tuple[int, int, int], entry: tuple[float, float], nbytes: int
) -> float:
    """tuning.cc ncclTopoGetAlgoTime with one operation in flight (numPipeOps 1), us."""
    func, algo, proto = key
    lat, bw = entry
    log_size = _log2i(nbytes >> 6)
    if algo == TREE and func == _ALL_REDUCE and 0 <= log_size < 23:
        bw *= _TREE_CORRECTION[proto][log_size]
    if (
        algo == NVLS_TREE
        and func == _ALL_REDUCE
        and 0 <= log_size < 23
        and sys_.arch == "blackwell"
        and sys_.cpu != "arm"
    ):
        bw *= _TREE_CORRECTION[proto][log_size]
    if algo == RING and proto == SIMPLE and sys_.nodes > 1 and func == _ALL_REDUCE:
        if nbytes // (ring_channels * sys_.ranks) >= 64:
            lat *= 1.9 if _COMPCAP[sys_.arch] < 80 else 1.4  # "Plateau effect of ring"
    return lat + nbytes / (1000 * bw)


# a search asks the same few questions thousands of times (a bucket's all-reduce, a unit's gathers in every layout)
@lru_cache(maxsize=1 << 16)
def _select(fabric: NcclFabric, func: int, nbytes: int, group: tuple[int, int], only: str | None) -> CollectiveTime:
    """enqueue.cc topoGetAlgoInfo: the (algorithm, protocol) of least predicted time, first on a tie
    (``only``: that algorithm alone, as ``NCCL_ALGO`` restricts it)."""
    ranks, local = group
    sys_ = _system(fabric, ranks, local)
    channels = _graphs(sys_)[RING].channels
    best: tuple[float, int, int] | None = None
    for key, entry in tune(fabric, ranks, local).items():
        if key[0] != func or (only is not None and ALGORITHMS[key[1]] != only):
            continue
        t = _algo_time_us(sys_, channels, key, entry, nbytes)
        if best is None or t < best[0]:
            best = (t, key[1], key[2])
    if best is None:
        raise InfeasibleError(f"NCCL runs no {only or 'algorithm'} for collective {func} over {ranks} ranks here")
    return CollectiveTime(best[0] * 1e-6, ALGORITHMS[best[1]], PROTOCOLS[best[2]])


def _p2p(fabric: NcclFabric, nbytes: int, same_node: bool) -> CollectiveTime:
    """One send of ``nbytes`` to one peer: the ring broadcast between two ranks (tuning.cc has no
    p2p row), at the protocol enqueue.cc gives p2p: LL up to 16 KiB, else Simple."""
    table = tune(fabric, 2, 2 if same_node else 1)
    proto = LL if nbytes <= _P2P_LL_THRESHOLD else SIMPLE
    lat, bw = table[(_BROADCAST, RING, proto)]
    return CollectiveTime((lat + nbytes / (1000 * bw)) * 1e-6, "p2p", PROTOCOLS[proto])


def p2p_link(fabric: NcclFabric) -> tuple[float, float]:
    """The (latency s, bandwidth bytes/s) of one large send over ``fabric`` (``_p2p`` at Simple), for a
    ``LinkCost``'s affine ``send_s`` (a pipeline boundary's activations are megabytes).

    Args:
        fabric: the link (``network`` set: between two nodes, else inside one).

    Returns:
        Seconds of fixed cost and bytes per second.
    """
    lat, bw = tune(fabric, 2, 1 if fabric.network else 2)[(_BROADCAST, RING, SIMPLE)]
    return lat * 1e-6, bw * _GB


def _all_to_all(fabric: NcclFabric, nbytes: int, ranks: int, local: int) -> CollectiveTime:
    """An all-to-all of ``nbytes`` per rank (``nbytes / ranks`` to each peer), as NCCL runs it: grouped
    sends to every peer at once. The peers on the node share the GPU's NVLink (the p2p bandwidth
    inside a node), the others the node's cards: the inter-node ring's channels of the node, or the
    cards the node's ``local`` ranks send from (``nic_Bps`` each, ``gpus_per_nic`` ranks to a card),
    whichever carries more, a ``1 / local`` share each. A ring's channels also cross the node's NVLink
    (an H800's 8 links hold its channels to 22 GB/s), which a send to another node does not: each rank
    sends from its own card (DeepSeek-V3's report, section 3.2.2: 50 GB/s of InfiniBand per H800). The
    slower share, with its send's latency, sets the time."""
    local = max(1, min(local, ranks))
    piece = nbytes / ranks
    proto = LL if piece <= _P2P_LL_THRESHOLD else SIMPLE
    seconds = 0.0
    if local > 1:
        lat, bw = tune(fabric, 2, 2)[(_BROADCAST, RING, proto)]
        seconds = lat * 1e-6 + (local - 1) * piece / (bw * _GB)
    if ranks > local:
        sys_ = _system(fabric, ranks, local)
        g = _graphs(sys_)[RING]
        ring_bw = g.channels * (g.bw_intra if sys_.nodes <= 2 else g.bw_inter) * _GB
        node_bw = max(ring_bw, max(1, local // fabric.gpus_per_nic) * fabric.nic_Bps)
        lat, _ = tune(fabric, 2, 1)[(_BROADCAST, RING, proto)]
        seconds = max(seconds, lat * 1e-6 + (ranks - local) * piece / (node_bw / local))
    return CollectiveTime(seconds, "p2p", PROTOCOLS[proto])


def collective_time(
    op: Collective, nbytes: float, ranks: int, local: int, fabric: NcclFabric, algorithm: str | None = None
) -> CollectiveTime:
    """What NCCL predicts for one collective, and the algorithm and protocol it picks.

    Args:
        op: the collective.
        nbytes: its size as NCCL and nccl-tests count it: an all-reduce's or a broadcast's buffer, an
            all-gather's output, a reduce-scatter's input, one send's message, an all-to-all's send
            buffer of one rank.
        ranks: ranks of the group.
        local: of them on each node (``ranks`` for a group inside one node; 1 for one per node).
        fabric: the node and network.
        algorithm: only this one of ``ALGORITHMS`` (``NCCL_ALGO=ring``); None: NCCL's choice.

    Returns:
        Seconds with the algorithm and protocol (``p2p`` for sends and all-to-all); 0 seconds for a
        group of one or no bytes.

    Raises:
        InfeasibleError: an unknown collective, or an algorithm NCCL does not run it with here.
    """
    size = max(0, int(math.ceil(nbytes)))
    if ranks <= 1 or size == 0:
        return CollectiveTime(0.0, "none", "none")
    if op == "send_recv":
        found = _p2p(fabric, size, local >= 2)
    elif op == "all_to_all":
        found = _all_to_all(fabric, size, ranks, local)
    elif op not in _FUNCS:
        raise InfeasibleError(f"unknown collective {op!r}; expected one of {', '.join(COLLECTIVES)}")
    else:
        found = _select(fabric, _FUNCS[op], size, (ranks, local), algorithm)
    if fabric.time_scale != 1.0:  # a what-if (planner.core.layout.robust): NCCL's choice is made at 1.0
        found = CollectiveTime(found.seconds * fabric.time_scale, found.algorithm, found.protocol)
    return found


@lru_cache(maxsize=1 << 12)
def least_seconds_per_byte(op: Collective, ranks: int, local: int, fabric: NcclFabric) -> float:
    """The least seconds per byte NCCL's model charges an all-gather, a reduce-scatter or an
    all-reduce over this group, at any size: each of its algorithm and protocol options costs its
    latency plus the bytes over its bandwidth (``_algo_time_us``: no size correction for the first
    two; an all-reduce's only lower a bandwidth, ``_TREE_CORRECTION`` being at most 1, or raise a
    latency), so no size runs faster than the bytes over the largest bandwidth. ``collective_time(op,
    n, ...) >= n x this`` for every ``n``: the search's floors take it (``planner.core.layout.bounds``).

    Args:
        op: "all_gather", "reduce_scatter" or "all_reduce".
        ranks: ranks of the group.
        local: of them on each node.
        fabric: the node and network.

    Returns:
        Seconds per byte (0 for a group of one).

    Raises:
        ValueError: another collective (sends and all-to-all are not NCCL's tuned algorithms).
    """
    if op not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"least_seconds_per_byte covers all_gather, reduce_scatter and all_reduce, not {op!r}")
    if ranks <= 1:
        return 0.0
    func = _FUNCS[op]
    widest = max((bw for (f, _, _), (_, bw) in tune(fabric, ranks, local).items() if f == func), default=0.0)
    if widest <= 0:
        return 0.0  # (nothing runs it: collective_time refuses, and a floor of 0 holds)
    return 1e-9 / widest * fabric.time_scale  # us = bytes / (1000 x GB/s)


def bus_factor(op: Collective, ranks: int) -> float:
    """nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md): busbw = algbw x this.

    Args:
        op: the collective.
        ranks: ranks of the group.

    Returns:
        ``2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather, reduce-scatter and
        all-to-all, 1 for broadcast and send/receive.
    """
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "NVLINK_LINK_GBPS",
    "PROTOCOLS",
    "Collective",
    "CollectiveTime",
    "bus_factor",
    "collective_time",
    "least_seconds_per_byte",
    "p2p_link",
    "tune",
]
