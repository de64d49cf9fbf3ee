"""Hardware the planner can estimate costs for without having it: a table of accelerators.

Pure module: pydantic only, never torch (the analytical estimator ``planner.costs.estimate`` and the CPU
calibration ``planner.costs.cpu`` are the torch side).

A ``HardwareSpec`` holds what a roofline model needs (Williams, Waterman & Patterson, "Roofline: an
insightful visual performance model", CACM 2009): peak dense FLOP/s per dtype, memory bandwidth,
and how much of each a real kernel reaches (efficiency factors), plus memory capacity and the
links between ranks. ``planner.costs.estimate`` turns FLOPs and bytes per operator into seconds with it:
``max(flops / (peak[dtype] * efficiency), bytes / (memory_Bps * memory_efficiency))``, where the
efficiency depends on the operation's class: a GEMM's on its shape (``gemm_efficiency``), fused
attention's on the kernel and direction (``attention_efficiency``). docs/gpu_costs.md gives every
number with its source.

Numbers are the vendors' *dense* peaks (datasheets quote "with sparsity" figures, twice as large,
which training never reaches). Link bandwidths are per direction, for one peer: a pipeline stage
talks to one neighbour at a time.

The links of an NVIDIA GPU (``arch`` set) are NCCL links: what they cost comes from NCCL's own model
(``planner.core.levers.collectives``), which reads the node as NCCL does: its NVLinks per GPU
(``nvlinks``, at NCCL's per-link bandwidth), NVSwitch or not, the GPU's PCIe link, the network cards
(``inter_node_Bps``, ``gpus_per_nic``) and the host CPU. ``link_efficiency`` is then unused; it
stays for the links NCCL does not drive (a device without ``arch``: AMD's RCCL has tables of its own,
not ported; a probed or CPU spec), whose collectives are alpha-beta rings.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.core.levers.collectives import p2p_link
from planner.core.levers.links import NodeLinks
from planner.errors import PlannerError
from planner.schema.costs import GpuArch, LinkCost, NcclFabric

DTYPES = ("fp32", "tf32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element a parameter/activation takes in each planning dtype (tf32 stores fp32)."""


UNFUSED_ATTENTION = "unfused"
"""``--attention-kernel``'s name for attention before fused kernels (``HardwareSpec.with_attention``)."""


class HardwareError(PlannerError):
    """Unknown hardware name, or a dtype the hardware does not support."""


# The least a GPU kernel is charged (``HardwareSpec.op_overhead_s``'s default; a GPU probe measures the
# host's time per operator instead, ``dispatch_s``, and leaves this).
KERNEL_FLOOR_S = 5e-6


class HardwareSpec(BaseModel):
    """One device type: peak compute, memory, links and the efficiency a real kernel reaches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Short name, e.g. 'h100' or 'cpu-myhost-1t'.")
    kind: Literal["gpu", "cpu"] = Field(default="gpu", description="Accelerator or this machine's CPU.")
    peak_flops: dict[str, float] = Field(
        description="Peak dense FLOP/s per dtype ('fp32', 'tf32', 'bf16', 'fp16', 'fp8': the FP8 tensor cores of "
        "--dtype fp8's GEMMs); a missing key means unsupported."
    )
    memory_Bps: float = Field(gt=0, description="Peak memory (HBM/GDDR/DRAM) bandwidth, bytes/s.")
    memory_bytes: int = Field(gt=0, description="Memory capacity, bytes.")
    intra_node_Bps: float = Field(
        gt=0, description="Link bandwidth to a peer in the same node, bytes/s, one direction."
    )
    intra_node_latency_s: float = Field(ge=0, description="Small-message latency to a peer in the same node, s.")
    inter_node_Bps: float = Field(
        gt=0,
        description="Bandwidth of one network card to another node, bytes/s, one direction (a card per GPU on "
        "DGX / HGX nodes; gpus_per_nic GPUs share it elsewhere).",
    )
    inter_node_latency_s: float = Field(ge=0, description="Small-message latency to another node, s.")
    gpus_per_nic: int = Field(
        default=1,
        ge=1,
        description="GPUs sharing one network card of inter_node_Bps (1: a card per GPU, the DGX / HGX design): "
        "a collective with k ranks on a node crosses nodes over k // gpus_per_nic cards at once.",
    )
    matmul_efficiency: float = Field(
        default=0.65,
        gt=0,
        le=1,
        description="Fraction of peak FLOP/s large GEMMs sustain (cuBLAS on big bf16 GEMMs: ~0.6-0.75).",
    )
    fp8_matmul_efficiency: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of the FP8 peak large FP8 GEMMs sustain (--dtype fp8; None: matmul_efficiency).",
    )
    gemm_half_dim: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="GEMM shape curve: a GEMM whose smallest dimension is d reaches "
        "matmul_efficiency * d / (d + gemm_half_dim) of peak (0: every GEMM reaches matmul_efficiency).",
    )
    attention_kernel: str = Field(default="", description="The fused attention kernel the attention figures are for.")
    attention_backend: str = Field(
        default="flash",
        description="torch's scaled_dot_product_attention backend that kernel is ('flash', 'cudnn', 'efficient'): "
        "the one the torch this planner pins picks on the device by default.",
    )
    other_attention: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description="Other SDPA backends measured on the device: backend -> (forward, backward) fraction of peak "
        "(--attention-kernel costs one of them instead of the default).",
    )
    attention_fwd_efficiency: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of peak fused attention's forward reaches (None: matmul_efficiency).",
    )
    attention_bwd_efficiency: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Fraction of peak fused attention's backward reaches (None: the forward's).",
    )
    memory_efficiency: float = Field(
        default=0.8, gt=0, le=1, description="Fraction of peak bandwidth streaming kernels sustain (~0.8 on HBM)."
    )
    link_efficiency: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="Fraction of link bandwidth p2p sends reach, on links NCCL's model does not cost (no arch).",
    )
    arch: GpuArch | None = Field(
        default=None,
        description="NVIDIA GPU generation for NCCL's tuning tables (None: not an NCCL device; its links are "
        "alpha-beta at link_efficiency).",
    )
    nvlinks: int = Field(default=0, ge=0, description="NVLink links per GPU (0: PCIe only).")
    nvswitch: bool = Field(default=False, description="The node's NVLinks meet in NVSwitches (DGX / HGX).")
    pcie_Bps: float = Field(
        default=24e9,
        gt=0,
        description="The GPU's PCIe link as NCCL counts it, bytes/s: lanes x GT/s / 8 x 128/130 rounded as "
        "src/graph/topo.cc does (x16 Gen3 12, Gen4 24, Gen5 48 GB/s).",
    )
    host_cpu: Literal["intel", "amd", "arm"] = Field(
        default="intel", description="The host CPU vendor of the reference platform (NCCL tunes by it)."
    )
    op_overhead_s: float = Field(
        default=KERNEL_FLOOR_S,
        ge=0,
        description="Fixed cost per operator. On a CPU it adds: an operator costs overhead + roofline (eager "
        "dispatch and the kernel run inline). On a GPU it is the least a kernel takes: max(overhead, roofline).",
    )
    dispatch_s: float = Field(
        default=27e-6,
        ge=0,
        description="On a GPU: host time eager PyTorch spends issuing one operator (views included), s. A kernel "
        "starts once it is issued and the one before it is done, so operators shorter than this leave the GPU "
        "waiting on the host. Default: planner probe's tiny model on lent H200 machines, 20-30 us per operator "
        "over six probes, median 27 (docs/gpu_costs.md, 'Measured on an H200'). Not used on a CPU.",
    )
    source: str = Field(default="", description="Where the numbers come from.")

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``.

        Args:
            dtype: one of ``DTYPES``.

        Returns:
            FLOP/s.

        Raises:
            HardwareError: when the device has no such dtype (V100 has no bf16 tensor cores).
        """
        if dtype not in self.peak_flops:
            raise HardwareError(
                f"dtype {dtype!r} is not supported on {self.name} (it has {', '.join(self.peak_flops)}); "
                f"choose one of those with --dtype"
            )
        return self.peak_flops[dtype]

    def gemm_efficiency(self, m: int, n: int, k: int, fp8: bool = False) -> float:
        """Fraction of peak a GEMM of ``(m x k) @ (k x n)`` sustains.

        ``matmul_efficiency * d / (d + gemm_half_dim)`` with ``d = min(m, n, k)``: large square GEMMs
        approach ``matmul_efficiency`` (the measured best-shape ceiling, MAMF); a dimension near one
        thread-block tile (128 on A100/H100) wastes much of the tile and of the waves over the SMs,
        so small and skinny GEMMs reach much less (NVIDIA, "Matrix Multiplication Background User's
        Guide": tile and wave quantization). Whether the GEMM is memory-bound is decided by the
        roofline separately (bytes / bandwidth), not here.

        Args:
            m: rows of the output (batch dimensions folded in).
            n: columns of the output.
            k: the reduced dimension.
            fp8: a GEMM of float8 operands on the FP8 tensor cores (``fp8_matmul_efficiency``).

        Returns:
            A fraction in (0, matmul_efficiency] (fp8: ``fp8_matmul_efficiency``).
        """
        d = max(1, min(m, n, k))
        ceiling = self.fp8_matmul_efficiency if fp8 and self.fp8_matmul_efficiency else self.matmul_efficiency
        return ceiling * d / (d + self.gemm_half_dim)

    def with_attention(self, backend: str) -> HardwareSpec:
        """This device with its attention figures taken from another SDPA backend.

        Which attention kernel runs is torch's choice, not the device's: torch 2.5.1 to 2.10 run
        FlashAttention-2 (the ``flash`` backend) on an H100 where torch 2.11 and later run cuDNN's
        (pytorch/pytorch#138522 made cuDNN opt-in; ``check_prefer_cudnn_attention`` in
        ``sdp_utils.cpp`` prefers it again once the bundled cuDNN is 9.15.1 or newer), and its
        forward and backward reach half the speed (docs/gpu_costs.md). A plan for an older stack,
        or for a model that forces a backend, names it.

        ``unfused`` is attention as code before FlashAttention (2022) ran it, on any device: two
        batched GEMMs around one scale-mask-softmax kernel, the scores written to memory and the
        probabilities saved for backward (Megatron-LM's ``baddbmm``, ``FusedScaleMaskSoftmax`` and
        ``bmm``); its GEMMs take the GEMM figures, its softmax the memory bandwidth
        (``planner.costs.roofline``), so it needs no figures of its own.

        Args:
            backend: 'flash', 'cudnn', 'efficient' or 'unfused' (the default backend returns this spec).

        Returns:
            The spec with ``attention_*`` set for that backend.

        Raises:
            HardwareError: when the table has no figures for that backend on this device.
        """
        key = backend.strip().lower()
        if key == self.attention_backend:
            return self
        if key == UNFUSED_ATTENTION:
            return self.model_copy(
                update={
                    "attention_kernel": "unfused: two batched GEMMs around a scale-mask-softmax kernel",
                    "attention_backend": key,
                }
            )
        if key not in self.other_attention:
            known = ", ".join([self.attention_backend, *self.other_attention, UNFUSED_ATTENTION])
            raise HardwareError(
                f"--attention-kernel {backend!r}: the table has no figures for it on {self.name} "
                f"(it has: {known}); measure them with python -m bench.gpu_check on the device, "
                "or leave the option out for the default"
            )
        fwd, bwd = self.other_attention[key]
        return self.model_copy(
            update={
                "attention_kernel": f"torch's {key} backend",
                "attention_backend": key,
                "attention_fwd_efficiency": fwd,
                "attention_bwd_efficiency": bwd,
            }
        )

    def attention_efficiency(self, backward: bool) -> float:
        """Fraction of peak the fused attention kernel (``attention_kernel``) sustains.

        Args:
            backward: the backward kernel (dQ, dK, dV with the scores recomputed) instead of the forward.

        Returns:
            The fraction (the GEMM ceiling when the table has no attention figure).
        """
        fwd = self.attention_fwd_efficiency if self.attention_fwd_efficiency is not None else self.matmul_efficiency
        if backward and self.attention_bwd_efficiency is not None:
            return self.attention_bwd_efficiency
        return fwd

    @property
    def async_launch(self) -> bool:
        """Whether operator overhead overlaps device work (GPUs queue kernels; a CPU runs them inline)."""
        return self.kind == "gpu"


_GB = 1e9
# Memory capacities are what CUDA reports, ``torch.cuda.get_device_properties(i).total_memory``
# (cudaDeviceProp.totalGlobalMem), not the datasheet's "80 GB": the driver keeps a share of the
# chips for itself (ECC, its own reservations), so an "80 GB" H100 shows 79.2 GiB and a "24 GB" L4
# 22.5 GiB. The default limit (95 % of this) then never exceeds what an allocator can get.
# The figures are printed device properties (MiB); docs/gpu_costs.md lists where each comes from.
_MiB = 1024**2
_T = 1e12
# The GEMM shape curve's half-saturation dimension: one 128-wide thread-block tile of cuBLAS /
# CUTLASS on Ampere and Hopper (docs/gpu_costs.md).
_TILE = 128.0

# Typical links of the platforms these devices ship in. Datasheets give intra-node links; the
# inter-node figure is the usual NIC per GPU of the reference platform (DGX/HGX or the cloud
# instance named), not a property of the chip. Latencies are NCCL-level small-message p2p
# latencies (a few microseconds over NVLink, ~10-20 us over InfiniBand/RoCE, more over TCP/EFA).
_NDR_IB = 400e9 / 8  # ConnectX-7 NDR InfiniBand, 400 Gb/s per GPU (DGX H100/H200 reference design)
_HDR_IB = 200e9 / 8  # ConnectX-6 HDR InfiniBand, 200 Gb/s per GPU (DGX A100 reference design)
_EDR_IB = 100e9 / 8  # EDR InfiniBand, 100 Gb/s (DGX-1 / DGX-2 era)
_CLOUD_100G = 100e9 / 8  # 100 Gb/s instance networking (AWS g5/g6/g6e, GCP g2 upper tiers), shared per node
_PCIE4_X16 = 32e9  # PCIe 4.0 x16: 64 GB/s bidirectional = 32 GB/s per direction (no NVLink on these cards)
# The GPU's PCIe link as NCCL counts it (src/graph/topo.cc: width x speed / 80 with speed in 100 Mb/s
# a lane: kvDictPciGen 8 GT/s -> 60, 16 GT/s -> 120, 32 GT/s -> 240): x16 Gen3 12, Gen4 24, Gen5 48 GB/s.
_NCCL_PCIE3, _NCCL_PCIE4, _NCCL_PCIE5 = 12e9, 24e9, 48e9

# torch's FlashAttention-2 (the SDPA ``flash`` backend) measured on an H100 SXM with torch 2.11
# (docs/gpu_check.md: causal, head dim 128, 8,192 tokens, 64 heads: 312-324 TFLOP/s forward,
# 294-301 backward). The H200 has the same SMs and clocks; the kernel is compute-bound.
_H100_FLASH2 = (0.32, 0.30)

# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP32 67 TFLOPS; TF32 Tensor Core
# 989 TFLOPS with sparsity (494.5 dense); BF16/FP16 Tensor Core 1,979 with sparsity (989.5
# dense); FP8 Tensor Core 3,958 with sparsity (1,979 dense); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s
# total (450 GB/s per direction). Large FP8 GEMMs run 1.75x as fast as BF16 ones on Hopper (NVIDIA,
# "Boosting Matrix Multiplication Speed and Flexibility with NVIDIA cuBLAS 12.9", 2025: "a 1.75x speedup
# for large matmuls ... compared to the BF16 baseline"), not the peaks' 2x: fp8_matmul_efficiency is
# matmul_efficiency x 1.75 / 2.
_H100 = HardwareSpec(
    name="h100",
    peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T, "fp8": 1979 * _T},
    memory_Bps=3.35e12,
    memory_bytes=81_089 * _MiB,  # 79.2 GiB as CUDA reports it (torch 2.7, CUDA 12.8)
    intra_node_Bps=450 * _GB,
    intra_node_latency_s=10e-6,
    inter_node_Bps=_NDR_IB,
    inter_node_latency_s=20e-6,
    # H100 SXM5: 18 fourth-generation NVLinks (datasheet: 900 GB/s), four NVSwitch chips on DGX H100 /
    # HGX H100 (NVIDIA DGX H100 User Guide); PCIe Gen5 x16; DGX H100 hosts two Intel Xeon Platinum 8480C.
    arch="hopper",
    nvlinks=18,
    nvswitch=True,
    pcie_Bps=_NCCL_PCIE5,
    host_cpu="intel",
    matmul_efficiency=0.75,
    fp8_matmul_efficiency=0.75 * 1.75 / 2,
    gemm_half_dim=_TILE,
    attention_kernel="FlashAttention-3 / cuDNN",
    attention_backend="cudnn",
    attention_fwd_efficiency=0.60,
    attention_bwd_efficiency=0.45,
    other_attention={"flash": _H100_FLASH2},
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM",
)

# The HBM2e H100 SXM of Meta's Grand Teton hosts, on which torchtitan publishes its H100 figures
# (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: "96GB HBM2e with 2.4 TB/sec peak
# memory bandwidth", NVLink, 400 Gb/s RDMA per GPU, a 500 W power limit; the TorchTitan paper,
# Liang et al., ICLR 2025, section 3.1: "95 GiB memory"). Same SMs as the H100 SXM, so the same
# peaks; the power limit lowers the clocks its GEMMs sustain by an amount nobody published
# (torchtitan: "between SXM and NVL", whose datasheet peaks are 989.5 and 835.5 dense bf16),
# which the table does not model (docs/gpu_costs.md).
_H100_HBM2E = _H100.model_copy(
    update={
        "name": "h100-hbm2e",
        "memory_Bps": 2.4e12,
        "memory_bytes": 95 * 1024 * _MiB,  # 95 GiB as torchtitan reports it
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100 96GB HBM2e)",
    }
)

GPUS: dict[str, HardwareSpec] = {
    "h100": _H100,
    "h100-hbm2e": _H100_HBM2E,
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM (FP32 67 TFLOPS,
    # TF32 989 / BF16 1,979 / FP16 1,979 / FP8 3,958 TFLOPS with sparsity); 141 GB HBM3e at 4.8 TB/s;
    # NVLink 900 GB/s: the H100's figures otherwise.
    "h200": _H100.model_copy(
        update={
            "name": "h200",
            "memory_Bps": 4.8e12,
            "memory_bytes": 143_156 * _MiB,  # 139.8 GiB as CUDA reports it
            "source": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM",
        }
    ),
    # The H800 SXM, the H100 made for export to China on which DeepSeek-V3 trained: the H100 SXM's SMs,
    # clocks and 80 GB of HBM3 at 3.35 TB/s, its NVLink cut to 400 GB/s total (8 of the 18 links:
    # 200 GB/s per direction); DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2.2):
    # "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)", each GPU with
    # its own 400 Gb/s InfiniBand card, 8 GPUs a node on NVSwitch (section 3.1). NVIDIA publishes no
    # H800 datasheet; the 400 GB/s is DeepSeek's ("Insights into DeepSeek-V3", arXiv 2505.09343).
    "h800": _H100.model_copy(
        update={
            "name": "h800",
            "intra_node_Bps": 200 * _GB,
            "nvlinks": 8,
            "source": "H100 SXM datasheet figures with NVLink 400 GB/s (DeepSeek-V3 report, arXiv 2412.19437 "
            "and 2505.09343)",
        }
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): FP32 19.5 TFLOPS; TF32 156 (312
    # sparse); BF16/FP16 312 (624 sparse); 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s total.
    "a100-80g": HardwareSpec(
        name="a100-80g",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        memory_Bps=2.039e12,
        memory_bytes=81_050 * _MiB,  # 79.2 GiB as CUDA reports it
        intra_node_Bps=300 * _GB,
        intra_node_latency_s=10e-6,
        inter_node_Bps=_HDR_IB,
        inter_node_latency_s=20e-6,
        # A100 SXM4: 12 third-generation NVLinks (datasheet: 600 GB/s), six NVSwitches on DGX A100 /
        # HGX A100 (DGX A100 User Guide); PCIe Gen4 x16; DGX A100 hosts two AMD EPYC 7742.
        arch="ampere",
        nvlinks=12,
        nvswitch=True,
        pcie_Bps=_NCCL_PCIE4,
        host_cpu="amd",
        matmul_efficiency=0.80,
        gemm_half_dim=_TILE,
        attention_kernel="FlashAttention-2",
        attention_fwd_efficiency=0.60,
        attention_bwd_efficiency=0.50,
        source="NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM",
    ),
    # Same datasheet, A100 40GB SXM: same compute; 40 GB HBM2 at 1,555 GB/s; NVLink 600 GB/s.
    "a100-40g": HardwareSpec(
        name="a100-40g",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        memory_Bps=1.555e12,
        memory_bytes=40_536 * _MiB,  # 39.6 GiB as CUDA reports it
        intra_node_Bps=300 * _GB,
        intra_node_latency_s=10e-6,
        inter_node_Bps=_HDR_IB,
        inter_node_latency_s=20e-6,
        # A100 SXM4: 12 third-generation NVLinks (datasheet: 600 GB/s), six NVSwitches on DGX A100 /
        # HGX A100 (DGX A100 User Guide); PCIe Gen4 x16; DGX A100 hosts two AMD EPYC 7742.
        arch="ampere",
        nvlinks=12,
        nvswitch=True,
        pcie_Bps=_NCCL_PCIE4,
        host_cpu="amd",
        matmul_efficiency=0.80,
        gemm_half_dim=_TILE,
        attention_kernel="FlashAttention-2",
        attention_fwd_efficiency=0.60,
        attention_bwd_efficiency=0.50,
        source="NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM",
    ),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS; TF32 120 (sparse; 60 dense);
    # BF16/FP16 242 (sparse; 121 dense); FP8 485 (sparse; 242.5 dense); 24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16 64 GB/s, no NVLink.
    # Inter-node: AWS g6 / GCP g2 instance networking (up to 100 Gb/s).
    "l4": HardwareSpec(
        name="l4",
        peak_flops={"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T},
        memory_Bps=300 * _GB,
        memory_bytes=23_034 * _MiB,  # 22.5 GiB as CUDA reports it
        intra_node_Bps=_PCIE4_X16,
        intra_node_latency_s=20e-6,
        inter_node_Bps=_CLOUD_100G,
        inter_node_latency_s=50e-6,
        gpus_per_nic=8,  # the instance's one network, shared by all its GPUs
        # Ada (sm_89) is in tuning.cc's Ampere row (compCapIndex: 80 <= cc < 90); PCIe Gen4 x16, no
        # NVLink; AWS g6 / g6e hosts AMD EPYC (EC2 instance type pages).
        arch="ampere",
        pcie_Bps=_NCCL_PCIE4,
        host_cpu="amd",
        matmul_efficiency=0.6,
        gemm_half_dim=_TILE,
        attention_kernel="FlashAttention-2",
        attention_fwd_efficiency=0.45,
        attention_bwd_efficiency=0.35,
        source="NVIDIA L4 Tensor Core GPU datasheet",
    ),
    # NVIDIA L40S GPU datasheet: FP32 91.6 TFLOPS; TF32 183 (366 sparse); BF16/FP16 362.05
    # (733 sparse); FP8 733 (1,466 sparse); 48 GB GDDR6 at 864 GB/s; PCIe Gen4 x16 64 GB/s, no NVLink.
    # Inter-node: AWS g6e instance networking (up to 100 Gb/s on the mid sizes).
    "l40s": HardwareSpec(
        name="l40s",
        peak_flops={"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T, "fp8": 733 * _T},
        memory_Bps=864 * _GB,
        memory_bytes=45_589 * _MiB,  # 44.5 GiB as CUDA reports it
        intra_node_Bps=_PCIE4_X16,
        intra_node_latency_s=20e-6,
        inter_node_Bps=_CLOUD_100G,
        inter_node_latency_s=50e-6,
        gpus_per_nic=8,  # the instance's one network, shared by all its GPUs
        # Ada (sm_89) is in tuning.cc's Ampere row (compCapIndex: 80 <= cc < 90); PCIe Gen4 x16, no
        # NVLink; AWS g6 / g6e hosts AMD EPYC (EC2 instance type pages).
        arch="ampere",
        pcie_Bps=_NCCL_PCIE4,
        host_cpu="amd",
        matmul_efficiency=0.6,
        gemm_half_dim=_TILE,
        attention_kernel="FlashAttention-2",
        attention_fwd_efficiency=0.45,
        attention_bwd_efficiency=0.35,
        source="NVIDIA L40S GPU datasheet",
    ),
    # AWS EC2 G5's A10G. NVIDIA publishes no A10G datasheet; compute is taken from the NVIDIA A10
    # Tensor Core GPU datasheet (FP32 31.2 TFLOPS; TF32 62.5 (125 sparse); BF16/FP16 125 (250
    # sparse)); AWS G5 page: 24 GB GDDR6 per GPU; 600 GB/s (A10 datasheet). The A10G runs at lower
    # clocks than the A10, so its real tensor throughput is lower: matmul_efficiency is set to 0.5.
    # PCIe Gen4, no NVLink; g5 networking up to 100 Gb/s.
    "a10g": HardwareSpec(
        name="a10g",
        peak_flops={"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T},
        memory_Bps=600 * _GB,
        memory_bytes=22_587 * _MiB,  # 22.1 GiB as CUDA reports it
        intra_node_Bps=_PCIE4_X16,
        intra_node_latency_s=20e-6,
        inter_node_Bps=_CLOUD_100G,
        inter_node_latency_s=50e-6,
        gpus_per_nic=8,  # the instance's one network, shared by all its GPUs
        # sm_86: tuning.cc's Ampere row; PCIe Gen4 x16, no NVLink; AWS g5 hosts AMD EPYC (EC2 G5 page).
        arch="ampere",
        pcie_Bps=_NCCL_PCIE4,
        host_cpu="amd",
        matmul_efficiency=0.5,
        gemm_half_dim=_TILE,
        attention_kernel="FlashAttention-2",
        attention_fwd_efficiency=0.40,
        attention_bwd_efficiency=0.30,
        source="NVIDIA A10 Tensor Core GPU datasheet (A10G: AWS EC2 G5 instance page)",
    ),
    # NVIDIA V100 Tensor Core GPU datasheet (V100 SXM2 32GB): FP32 15.7 TFLOPS; FP16 Tensor Core
    # 125 TFLOPS; no TF32 and no BF16 (Volta has neither); 32 GB HBM2 at 900 GB/s; NVLink 300 GB/s
    # total (150 GB/s per direction). Inter-node: DGX-1/DGX-2 EDR InfiniBand, 100 Gb/s.
    "v100": HardwareSpec(
        name="v100",
        peak_flops={"fp32": 15.7 * _T, "fp16": 125 * _T},
        memory_Bps=900 * _GB,
        memory_bytes=32_510 * _MiB,  # 31.7 GiB as CUDA reports it
        intra_node_Bps=150 * _GB,
        intra_node_latency_s=10e-6,
        inter_node_Bps=_EDR_IB,
        inter_node_latency_s=20e-6,
        gpus_per_nic=2,  # DGX-1: four EDR cards for eight GPUs
        # V100 SXM2: 6 second-generation NVLinks (datasheet: 300 GB/s) in DGX-1's hybrid cube-mesh (no
        # NVSwitch); PCIe Gen3 x16; DGX-1 hosts two Intel Xeon E5-2698 v4.
        arch="volta",
        nvlinks=6,
        pcie_Bps=_NCCL_PCIE3,
        host_cpu="intel",
        matmul_efficiency=0.6,
        gemm_half_dim=_TILE,
        attention_kernel="memory-efficient attention (xFormers / PyTorch)",
        attention_backend="efficient",
        attention_fwd_efficiency=0.35,
        attention_bwd_efficiency=0.25,
        source="NVIDIA V100 Tensor Core GPU datasheet, V100 SXM2 32GB",
    ),
    # AMD Instinct MI300X accelerator data sheet: FP32 (matrix) 163.4 TFLOPS; TF32 653.7 TFLOPS;
    # BF16/FP16 1,307.4 TFLOPS dense (2,614.9 with sparsity); FP8 2,614.9 dense; 192 GB HBM3 at 5.3 TB/s; 7 AMD
    # Infinity Fabric links, 896 GB/s aggregate = 128 GB/s per link, i.e. 64 GB/s per direction
    # to one peer in the fully connected 8-GPU platform. Inter-node: 400 Gb/s NIC per GPU.
    # ROCm GEMMs reach a smaller fraction of peak than cuBLAS (MAMF 60 %): matmul_efficiency 0.55.
    "mi300x": HardwareSpec(
        name="mi300x",
        peak_flops={
            "fp32": 163.4 * _T,
            "tf32": 653.7 * _T,
            "bf16": 1307.4 * _T,
            "fp16": 1307.4 * _T,
            "fp8": 2614.9 * _T,
        },
        memory_Bps=5.3e12,
        memory_bytes=196_592 * _MiB,  # 192.0 GiB as ROCm reports it (less 16 MiB)
        intra_node_Bps=64 * _GB,
        intra_node_latency_s=10e-6,
        inter_node_Bps=_NDR_IB,
        inter_node_latency_s=20e-6,
        matmul_efficiency=0.55,
        gemm_half_dim=_TILE,
        attention_kernel="CK FlashAttention-2 (ROCm)",
        attention_fwd_efficiency=0.35,
        attention_bwd_efficiency=0.25,
        source="AMD Instinct MI300X accelerator data sheet",
    ),
}


def get_hardware(name: str) -> HardwareSpec:
    """The table entry for a device name (case-insensitive; 'H100', 'a100_80g' work too).

    Args:
        name: a key of ``GPUS``.

    Returns:
        Its ``HardwareSpec``.

    Raises:
        HardwareError: for an unknown name; the message lists the known ones.
    """
    key = name.strip().lower().replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    raise HardwareError(
        f"unknown hardware {name!r}: expected one of {', '.join(GPUS)} "
        "(or 'cpu' for this machine, measured by planner.costs.cpu)"
    )


def nccl_fabric(hw: HardwareSpec, intra_node: bool = True) -> NcclFabric | None:
    """The node and network of ``hw`` as NCCL's cost model reads them (None: not an NCCL device).

    Args:
        hw: the device.
        intra_node: the link inside a node, or the network between nodes.

    Returns:
        The ``NcclFabric`` of ``hw``'s links, or None when ``hw`` has no ``arch``.
    """
    if hw.arch is None:
        return None
    return NcclFabric(
        arch=hw.arch,
        nvlinks=hw.nvlinks,
        nvswitch=hw.nvswitch,
        pcie_Bps=hw.pcie_Bps,
        nic_Bps=hw.inter_node_Bps,
        gpus_per_nic=hw.gpus_per_nic,
        cpu=hw.host_cpu,
        network=not intra_node,
    )


def link_cost(hw: HardwareSpec, intra_node: bool = True) -> LinkCost:
    """The cost of one p2p message between neighbouring ranks on ``hw``.

    On an NCCL device (``arch`` set) the link carries its ``NcclFabric`` (collectives are costed by
    NCCL's model) and a send costs what that model gives one large send (``collectives.p2p_link``:
    the two-rank ring at the Simple protocol). Elsewhere the bandwidth is the link's per-direction
    peak times ``link_efficiency``.

    Args:
        hw: the device.
        intra_node: both ranks in one node (NVLink/PCIe) or in different nodes (network).

    Returns:
        A ``LinkCost`` for the solver and simulator.
    """
    fabric = nccl_fabric(hw, intra_node)
    if fabric is not None:
        latency, bandwidth = p2p_link(fabric)
        return LinkCost(
            name=f"{hw.name}-{'intra' if intra_node else 'inter'}",
            latency_s=latency,
            bandwidth_Bps=bandwidth,
            ranks_per_nic=0 if intra_node else hw.gpus_per_nic,
            nccl=fabric,
        )
    if intra_node:
        return LinkCost(
            name=f"{hw.name}-intra",
            latency_s=hw.intra_node_latency_s,
            bandwidth_Bps=hw.intra_node_Bps * hw.link_efficiency,
        )
    return LinkCost(
        name=f"{hw.name}-inter",
        latency_s=hw.inter_node_latency_s,
        bandwidth_Bps=hw.inter_node_Bps * hw.link_efficiency,
        ranks_per_nic=hw.gpus_per_nic,
    )


def dtype_bytes(dtype: str) -> int:
    """Bytes per element in a planning dtype.

    Args:
        dtype: one of ``DTYPES``.

    Returns:
        4 for fp32/tf32, 2 for bf16/fp16.

    Raises:
        HardwareError: for an unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise HardwareError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPE_BYTES[dtype]


def node_links(hw: HardwareSpec, n_ranks: int, gpus_per_node: int) -> LinkCost:
    """The links of ``n_ranks`` pipeline ranks on nodes of ``gpus_per_node`` devices of ``hw``.

    Args:
        hw: the device.
        n_ranks: pipeline ranks of one replica (--gpus / --dp; all ranks together are the world size).
        gpus_per_node: devices per node (rank r on node r // gpus_per_node).

    Returns:
        A ``planner.core.levers.links.NodeLinks``: the intra-node link, and the inter-node one for the
        boundaries between nodes (the solver and ``predict`` place them per schedule).
    """

    return NodeLinks(
        **link_cost(hw, intra_node=True).model_dump(),
        inter=link_cost(hw, intra_node=False),
        gpus_per_node=gpus_per_node,
        n_ranks=n_ranks,
    )
