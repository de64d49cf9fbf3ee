"""Tier 1 (pure): NCCL's cost model of collectives (``planner.core.levers.collectives``) and where it is used.

Exact values are worked by hand from NCCL 2.30.7's src/graph/tuning.cc and search.cc; the rest are
the choices NCCL's model makes (LL for small messages, Simple for large, tree across nodes at
small sizes, NVLS on Hopper's NVSwitch) and properties every prediction keeps.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.core.levers.collectives import (
    _TREE_CORRECTION,
    bus_factor,
    collective_time,
    least_seconds_per_byte,
    p2p_link,
    tune,
)
from planner.core.levers.data_parallel import grad_reduce_s
from planner.core.levers.hardware import get_hardware, link_cost, nccl_fabric
from planner.core.levers.tensor_parallel import allreduce_s
from planner.schema.costs import GLOO_CPU_LINK, LinkCost, NcclFabric

A100 = nccl_fabric(get_hardware("a100-80g"))
H100 = nccl_fabric(get_hardware("h100"))
V100 = nccl_fabric(get_hardware("v100"))
L4 = nccl_fabric(get_hardware("l4"))
assert A100 is not None and H100 is not None and V100 is not None and L4 is not None
GiB = 1 << 30


def test_a_ring_all_reduce_by_hand() -> None:
    # DGX A100, 8 GPUs: 12 NVLinks of 20 GB/s = 240 GB/s a GPU; the search finds 6 channels at
    # 40 GB/s, ncclTopoDupChannels makes them 12 at 20. Ring/Simple all-reduce: bus bandwidth 12 x 20,
    # algorithm bandwidth x 8 / 14; latency baseLat 8.4 + 14 steps x hwLat[NVLINK][ring][Simple] 3.4.
    t = collective_time("all_reduce", GiB, 8, 8, A100)
    assert t.label == "ring/Simple"
    assert t.seconds == pytest.approx((8.4 + 14 * 3.4 + GiB / (1000 * 240 * 8 / 14)) * 1e-6, rel=1e-9)
    # the table NCCL prints at NCCL_DEBUG_SUBSYS=TUNING: the same latency and bandwidth
    lat, bw = tune(A100, 8, 8)[(0, 1, 2)]
    assert (lat, bw) == pytest.approx((56.0, 240 * 8 / 14))


def test_a_send_is_the_two_rank_ring() -> None:
    # one send inside an H100 node: 12 channels x 30 GB/s (18 x 20.6 GB/s of NVLink), 8.4 + 3.4 us
    assert p2p_link(H100) == pytest.approx((11.8e-6, 360e9))
    # between nodes: one 400 Gb/s card (NCCL's 48 GB/s speed: 2 channels x 24), 8.4 + 14 us
    inter = H100.model_copy(update={"network": True})
    assert p2p_link(inter) == pytest.approx((22.4e-6, 48e9))
    # enqueue.cc: LL up to NCCL_P2P_LL_THRESHOLD (16 KiB), then Simple
    assert collective_time("send_recv", 16384, 2, 2, H100).protocol == "LL"
    assert collective_time("send_recv", 16385, 2, 2, H100).protocol == "Simple"


def test_protocol_flips_with_size_as_nccl_does() -> None:
    small, mid, large = (collective_time("all_reduce", n, 8, 8, A100) for n in (1024, 16 << 20, GiB))
    assert (small.label, mid.protocol, large.label) == ("ring/LL", "LL128", "ring/Simple")
    # PCIe GPUs: LL128 needs NVLink (tuning.cc: typeIntra <= PATH_NVB)
    assert {collective_time("all_reduce", n, 8, 8, L4).protocol for n in (1 << k for k in range(4, 31))} == {
        "LL",
        "Simple",
    }


def test_tree_across_nodes_for_small_messages_ring_for_large() -> None:
    assert collective_time("all_reduce", 64 << 10, 64, 8, A100).algorithm == "tree"
    assert collective_time("all_reduce", 4 * GiB, 64, 8, A100).algorithm == "ring"
    # trees only all-reduce; all-gather and reduce-scatter are rings (or PAT, one GPU a node)
    assert collective_time("all_gather", 64 << 10, 64, 8, A100).algorithm == "ring"
    assert collective_time("all_gather", 1 << 20, 8, 1, A100).algorithm == "pat"


def test_nvls_on_hoppers_nvswitch_only() -> None:
    assert collective_time("all_reduce", 256 << 20, 8, 8, H100).algorithm == "nvls"
    assert collective_time("all_reduce", 256 << 20, 16, 8, H100).algorithm == "nvls_tree"
    assert "nvls" not in {collective_time("all_reduce", 1 << k, 8, 8, A100).algorithm for k in range(31)}
    # NVLS all-gather across nodes needs CollNet (SHARP), which is off
    assert collective_time("all_gather", GiB, 16, 8, H100).algorithm == "ring"


def test_all_gather_counts_its_output_as_reduce_scatter_its_input() -> None:
    for n in (4096, 1 << 20, GiB):
        assert collective_time("all_gather", n, 8, 8, A100) == collective_time("reduce_scatter", n, 8, 8, A100)
    assert collective_time("all_reduce", GiB, 1, 1, A100).seconds == 0.0
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75) and bus_factor("broadcast", 8) == 1.0


FABRICS = st.sampled_from([A100, H100, V100, L4])
OPS = st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"])


def _peak_GBps(fabric: NcclFabric, nodes: int) -> float:
    """The most a GPU moves: its NVLinks (NCCL's per-link figure; twice for NVLS, whose switch
    reduces), or its PCIe link; across nodes no more than its cards either."""
    from planner.core.levers.collectives import NVLINK_LINK_GBPS

    intra = fabric.nvlinks * NVLINK_LINK_GBPS[fabric.arch] or fabric.pcie_Bps / 1e9
    intra *= 2 if fabric.nvswitch and fabric.arch == "hopper" else 1
    return intra if nodes == 1 else max(intra, 8 * fabric.nic_Bps / 1e9)


@settings(max_examples=200, deadline=None)
@given(fabric=FABRICS, op=OPS, nodes=st.sampled_from([1, 2, 4, 16]), local=st.sampled_from([1, 2, 4, 8]))
def test_time_grows_with_bytes_and_bus_bandwidth_stays_under_the_links(
    fabric: NcclFabric, op: str, nodes: int, local: int
) -> None:
    ranks = nodes * local
    if ranks < 2:
        return
    last = 0.0
    for k in range(3, 34):
        t = collective_time(op, 1 << k, ranks, local, fabric)  # type: ignore[arg-type]
        assert t.seconds >= last
        last = t.seconds
        busbw = (1 << k) / t.seconds * bus_factor(op, ranks)  # type: ignore[arg-type]
        assert busbw <= _peak_GBps(fabric, nodes) * 1e9 * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(
    fabric=FABRICS,
    op=st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]),
    nodes=st.sampled_from([1, 2, 4, 16]),
    local=st.sampled_from([1, 2, 4, 8]),
    bits=st.integers(3, 35),
    scale=st.sampled_from([1.0, 1.3]),
)
def test_no_size_runs_faster_than_the_least_seconds_per_byte(
    fabric: NcclFabric, op: str, nodes: int, local: int, bits: int, scale: float
) -> None:
    """The search's floors charge a collective its bytes at ``least_seconds_per_byte``: never more than
    NCCL's model charges it at any size, an all-reduce's size corrections included (they only lower a
    bandwidth: every tree correction factor is at most 1), on a what-if's slower links too."""
    ranks = nodes * local
    if ranks < 2:
        return
    assert max(max(row) for row in _TREE_CORRECTION) <= 1.0
    scaled = fabric.model_copy(update={"time_scale": scale})
    rate = least_seconds_per_byte(op, ranks, local, scaled)  # type: ignore[arg-type]
    assert rate > 0
    for n in (1 << bits, (1 << bits) + 12_345, 3 << bits):
        assert collective_time(op, n, ranks, local, scaled).seconds >= n * rate * (1 - 1e-12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="covers"):
        least_seconds_per_byte("all_to_all", ranks, local, scaled)


def test_nccl_links_cost_collectives_by_nccls_model_gloo_keeps_alpha_beta() -> None:
    intra = link_cost(get_hardware("a100-80g"))
    assert grad_reduce_s(GiB, 8, "ddp", intra) == collective_time("all_reduce", GiB, 8, 8, A100).seconds
    # a tensor-parallel layer's 4 all-reduces of 1 MiB each, inside the node
    assert allreduce_s(4 << 20, 4, 8, intra) == pytest.approx(
        4 * collective_time("all_reduce", 1 << 20, 8, 8, A100).seconds
    )
    # gloo is not NCCL: the alpha-beta all-reduce, 2 ceil(log2 4) latencies and 2 (n-1)/n of the bytes
    link = GLOO_CPU_LINK
    assert link.nccl is None
    want = 4 * link.latency_s + 1.5 * GiB / link.bandwidth_Bps
    assert grad_reduce_s(GiB, 4, "ddp", link) == pytest.approx(want)
    old = LinkCost.model_validate_json('{"name": "l", "latency_s": 0.001, "bandwidth_Bps": 1e9}')
    assert old.nccl is None and old.local_ranks == 0  # plan.json of before reads as before
