"""Tier 1 (pure): the hardware table, lookups, links, and that the module imports no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from planner.core.levers.hardware import DTYPES, GPUS, HardwareError, HardwareSpec, dtype_bytes, get_hardware, link_cost
from planner.errors import PlannerError
from planner.schema.costs import LinkCost

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"h100", "h200", "a100-80g", "a100-40g", "l4", "l40s", "a10g", "v100", "mi300x"}


def test_table_has_the_required_devices_with_sane_numbers() -> None:
    assert REQUIRED <= set(GPUS)
    assert len({hw.name for hw in GPUS.values()}) == len(GPUS)
    for key, hw in GPUS.items():
        assert hw.name == key and hw.kind == "gpu" and hw.source
        assert set(hw.peak_flops) <= {*DTYPES, "fp8"}  # fp8: the FP8 tensor cores of --dtype fp8's GEMMs
        assert {"fp32", "fp16"} <= set(hw.peak_flops), key
        assert all(v > 0 for v in hw.peak_flops.values())
        # tensor-core dtypes are never slower than plain fp32
        assert all(hw.peak_flops[d] >= hw.peak_flops["fp32"] for d in hw.peak_flops)
        assert hw.memory_Bps > 0 and hw.memory_bytes >= 16 * 2**30
        assert hw.intra_node_Bps >= hw.inter_node_Bps > 0
        assert 0 < hw.matmul_efficiency <= 1 and 0 < hw.memory_efficiency <= 1


def test_fp8_tensor_cores_are_the_datasheets_twice_bf16() -> None:
    # Ada, Hopper and CDNA3 have FP8 tensor cores at twice their bf16 rate; Ampere, Volta and the A10G none
    for key in ("h100", "h100-hbm2e", "h200", "h800", "l4", "l40s", "mi300x"):
        assert GPUS[key].peak_flops["fp8"] == pytest.approx(2 * GPUS[key].peak_flops["bf16"], rel=0.02), key
    for key in ("a100-80g", "a100-40g", "a10g", "v100"):
        assert "fp8" not in GPUS[key].peak_flops, key


def test_dtypes_every_device_supports() -> None:
    for key in REQUIRED - {"v100"}:  # Ampere and later, and CDNA3, have bf16 and tf32
        assert {"fp32", "tf32", "bf16", "fp16"} <= set(GPUS[key].peak_flops), key
    assert "bf16" not in GPUS["v100"].peak_flops  # Volta has no bf16
    with pytest.raises(PlannerError, match="bf16.*v100.*fp32, fp16"):
        GPUS["v100"].peak("bf16")


def test_datasheet_numbers() -> None:
    h100 = get_hardware("h100")
    assert h100.peak("bf16") == pytest.approx(989.5e12)  # dense, not the 1979 "with sparsity"
    assert h100.memory_Bps == pytest.approx(3.35e12)
    assert get_hardware("a100-80g").memory_Bps > get_hardware("a100-40g").memory_Bps
    assert get_hardware("h200").peak("bf16") == h100.peak("bf16")


def test_lookup_is_forgiving_and_unknown_names_list_the_known_ones() -> None:
    assert get_hardware("H100") is GPUS["h100"]
    assert get_hardware("a100_80g") is GPUS["a100-80g"]
    with pytest.raises(PlannerError) as e:
        get_hardware("h900")
    for name in GPUS:
        assert name in str(e.value)


def test_link_cost() -> None:
    h100 = get_hardware("h100")
    intra, inter = link_cost(h100, intra_node=True), link_cost(h100, intra_node=False)
    assert isinstance(intra, LinkCost)
    # an NCCL link: one send is the two-rank ring's Simple protocol, 12 channels x 30 GB/s on an
    # H100's 18 NVLinks (NCCL's 20.6 GB/s a link), 8.4 + 3.4 us of latency (tuning.cc)
    assert intra.nccl is not None and inter.nccl is not None and inter.nccl.network
    assert intra.bandwidth_Bps == pytest.approx(360e9) and intra.latency_s == pytest.approx(11.8e-6)
    mi300x = link_cost(get_hardware("mi300x"))  # RCCL's tables are not ported: alpha-beta as before
    assert mi300x.nccl is None and mi300x.bandwidth_Bps == pytest.approx(64e9 * 0.7)
    assert inter.bandwidth_Bps < intra.bandwidth_Bps and inter.latency_s >= intra.latency_s
    assert intra.send_s(1 << 20) < inter.send_s(1 << 20)


def test_spec_is_frozen_and_round_trips() -> None:
    hw = get_hardware("l4")
    assert HardwareSpec.model_validate_json(hw.model_dump_json()) == hw
    with pytest.raises(pydantic.ValidationError):  # frozen
        hw.memory_Bps = 1.0  # type: ignore[misc]
    assert dtype_bytes("bf16") == 2 and dtype_bytes("tf32") == 4
    with pytest.raises(PlannerError):
        dtype_bytes("fp8")


def test_hardware_imports_no_torch() -> None:
    code = "import sys, planner.core.levers.hardware; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# Capacity as torch.cuda.get_device_properties().total_memory reports it, in GiB (docs/gpu_costs.md),
# and the datasheet's nominal figure it must stay under.
CUDA_GIB = {
    "h100": (79.19, 80),
    "h100-hbm2e": (95.0, 96),
    "h200": (139.8, 141),
    "h800": (79.19, 80),  # the H100 SXM's HBM3 (no H800 printout published: the H100's, same chips)
    "a100-80g": (79.15, 80),
    "a100-40g": (39.59, 40),
    "l4": (22.49, 24),
    "l40s": (44.52, 48),
    "a10g": (22.06, 24),
    "v100": (31.75, 32),
    "mi300x": (191.98, 192),
}


def test_capacities_are_what_cuda_reports_so_the_default_limit_fits_the_card() -> None:
    assert set(CUDA_GIB) == set(GPUS)
    for key, (gib, nominal) in CUDA_GIB.items():
        hw = GPUS[key]
        assert hw.memory_bytes / 2**30 == pytest.approx(gib, abs=0.005), key
        assert hw.memory_bytes % 2**20 == 0 and hw.memory_bytes < nominal * 2**30, key


def test_the_h800_is_an_h100_with_its_nvlink_cut_to_400_gb_s() -> None:
    from planner.core.levers.collectives import collective_time
    from planner.core.levers.hardware import link_cost

    h100, h800 = get_hardware("h100"), get_hardware("h800")
    assert h800.peak("bf16") == h100.peak("bf16") and h800.memory_Bps == h100.memory_Bps
    assert (h800.intra_node_Bps, h800.nvlinks) == (200e9, 8) and h800.inter_node_Bps == h100.inter_node_Bps
    # NCCL's model: an all-to-all inside a node runs on 8 of the 18 links' bandwidth
    fabric8, fabric18 = link_cost(h800, intra_node=True).nccl, link_cost(h100, intra_node=True).nccl
    assert fabric8 is not None and fabric18 is not None
    slow, fast = (collective_time("all_to_all", 2**28, 8, 8, f).seconds for f in (fabric8, fabric18))
    assert slow > 2 * fast


def test_gemm_efficiency_is_a_saturating_curve_in_the_smallest_dimension() -> None:
    h100 = get_hardware("h100")
    e, half = h100.matmul_efficiency, h100.gemm_half_dim
    assert half == 128.0
    assert h100.gemm_efficiency(8192, 8192, 8192) == pytest.approx(e * 8192 / (8192 + 128))
    assert h100.gemm_efficiency(8192, 1024, 8192) == pytest.approx(e * 1024 / 1152)  # skinny: the GQA k/v projections
    assert h100.gemm_efficiency(128, 8192, 8192) == pytest.approx(e / 2)
    effs = [h100.gemm_efficiency(d, 4096, 4096) for d in (16, 64, 256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[-1] < e
    flat = h100.model_copy(update={"gemm_half_dim": 0.0})  # the CPU model: one figure for every GEMM
    assert flat.gemm_efficiency(1, 1, 1) == flat.gemm_efficiency(10**5, 10**5, 10**5) == e


def test_attention_efficiency_by_kernel_and_direction() -> None:
    h100, a100 = get_hardware("h100"), get_hardware("a100-80g")
    assert h100.attention_kernel and a100.attention_kernel == "FlashAttention-2"
    assert h100.attention_efficiency(backward=False) == 0.60 and h100.attention_efficiency(backward=True) == 0.45
    for hw in GPUS.values():  # backward kernels reach less of peak than forward ones (FA2, FA3 papers)
        assert hw.attention_efficiency(backward=True) <= hw.attention_efficiency(backward=False) <= 1
    bare = h100.model_copy(update={"attention_fwd_efficiency": None, "attention_bwd_efficiency": None})
    assert (
        bare.attention_efficiency(backward=False) == bare.attention_efficiency(backward=True) == h100.matmul_efficiency
    )


def test_another_attention_backend_replaces_only_the_attention_figures() -> None:
    h100 = get_hardware("h100")
    assert h100.attention_backend == "cudnn" and h100.with_attention("cudnn") is h100  # torch 2.11+'s choice
    flash = h100.with_attention(" FLASH ")
    assert flash.name == "h100" and flash.attention_backend == "flash"
    # torch's FlashAttention-2 measured on an H100 (docs/gpu_check.md): about half of cuDNN's speed
    assert (flash.attention_efficiency(backward=False), flash.attention_efficiency(backward=True)) == (0.32, 0.30)
    rest = {"attention_kernel", "attention_backend", "attention_fwd_efficiency", "attention_bwd_efficiency"}
    assert {k: v for k, v in flash.model_dump().items() if k not in rest} == {
        k: v for k, v in h100.model_dump().items() if k not in rest
    }
    with pytest.raises(
        HardwareError, match=r"'cudnn': the table has no figures for it on a100-80g \(it has: flash, unfused\)"
    ):
        get_hardware("a100-80g").with_attention("cudnn")
    # attention before fused kernels needs no figures of its own: every device has it
    for hw in GPUS.values():
        unfused = hw.with_attention("Unfused")
        assert unfused.attention_backend == "unfused" and unfused.attention_kernel.startswith("unfused")
        assert {k: v for k, v in unfused.model_dump().items() if k not in rest} == {
            k: v for k, v in hw.model_dump().items() if k not in rest
        }
    for hw in GPUS.values():
        assert (
            hw.attention_backend in ("flash", "cudnn", "efficient") and hw.attention_backend not in hw.other_attention
        )
        for key, (fwd, bwd) in hw.other_attention.items():
            assert key in ("flash", "cudnn", "efficient") and 0 < bwd <= fwd <= 1


def test_torchtitans_h100_is_the_sxm_with_hbm2e_memory() -> None:
    """torchtitan's H100 figures come from 96 GB HBM2e SXM parts at 2.4 TB/s, 95 GiB as CUDA reports."""
    sxm, hbm2e = get_hardware("h100"), get_hardware("h100-hbm2e")
    assert hbm2e.memory_Bps == 2.4e12 and hbm2e.memory_bytes == 95 * 2**30
    own = {"name", "memory_Bps", "memory_bytes", "source"}
    assert {k: v for k, v in hbm2e.model_dump().items() if k not in own} == {
        k: v for k, v in sxm.model_dump().items() if k not in own
    }


def test_specs_written_before_the_efficiency_table_still_load() -> None:
    # the CPU calibration cache stores HardwareSpec JSON: entries without the new fields must load
    old = {k: v for k, v in get_hardware("h100").model_dump().items() if not k.startswith(("gemm_", "attention_"))}
    hw = HardwareSpec.model_validate(old)
    assert hw.gemm_half_dim == 0.0 and hw.attention_efficiency(backward=True) == hw.matmul_efficiency
