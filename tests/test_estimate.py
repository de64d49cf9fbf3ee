"""Tier 2 (CPU torch): analytical per-block costs (planner.costs.estimate) and CPU calibration.

FLOPs and times are checked exactly on a Linear block under hand-made hardware where either
compute or memory dominates; the meta path is checked to allocate nothing; the calibrated CPU
model is checked only loosely against measurement (the accurate comparison is
bench/analytical_vs_measured.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.core.levers.hardware import HardwareSpec, get_hardware
from planner.costs.cpu import calibrated_cpu
from planner.costs.estimate import estimate_blocks, optimizer_step_seconds
from planner.costs.measure import profile_model
from planner.costs.settings import ProfileSettings, Sample
from planner.errors import PlannerError
from planner.schema.costs import OptimizerSpec

ROOT = Path(__file__).resolve().parent.parent
B, T, IN, OUT = 8, 128, 1024, 4096
MM = 2 * B * T * IN * OUT  # forward FLOPs of Linear(IN, OUT) on (B, T, IN)


def _spec(kind: str = "gpu", **kw) -> HardwareSpec:
    base = dict(
        name="test",
        kind=kind,
        peak_flops={"fp32": 1e9, "bf16": 1e9},
        memory_Bps=1e20,
        memory_bytes=2**40,
        intra_node_Bps=1e9,
        intra_node_latency_s=0,
        inter_node_Bps=1e9,
        inter_node_latency_s=0,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead_s=0.0,
        dispatch_s=0.0,  # exact roofline times: no host between the kernels either
    )
    base.update(kw)
    return HardwareSpec(**base)


def _linear_model(device: str = "meta"):
    with torch.device(device):
        model = nn.Sequential(nn.Linear(IN, OUT), nn.Linear(OUT, 8))
    x = torch.empty(B, T, IN, device=device)
    target = torch.empty(B, T, 8, device=device)
    return model, (x,), target


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _estimate(hw: HardwareSpec, dtype: str = "fp32", device: str = "meta", **kw):
    model, inputs, target = _linear_model(device)
    traced = trace_model(model, inputs)
    return estimate_blocks(traced, inputs, target, _mse, hw, dtype, progress=False, **kw)


def test_linear_flops_and_compute_bound_time_are_exact() -> None:
    c = _estimate(_spec())[0]
    assert c.name == "0"
    assert c.flops_fwd == MM and c.flops_bwd == 2 * MM  # dX and dW: one GEMM each
    assert c.fwd_s == pytest.approx(MM / 1e9, rel=1e-9)
    assert c.bwd_s == pytest.approx(2 * MM / 1e9, rel=1e-9)
    assert c.bwd_input_s == pytest.approx(MM / 1e9, rel=1e-9)  # dX = dY W
    assert c.bwd_weight_s == pytest.approx(MM / 1e9, rel=1e-9)  # dW = dY^T X (+ bias sum, free here)
    # addmm saves its input and weight, which exist before it runs: torch's early stop ends a
    # checkpoint's recomputation there, before the matmul, so nothing is re-run
    assert c.recompute_s == 0.0
    assert c.params == IN * OUT + OUT and c.param_bytes == 4 * c.params
    assert c.activation_bytes == 4 * B * T * IN  # addmm saves its input; the weight is a parameter
    assert c.cut_bytes == 4 * B * T * OUT and c.cut_tensors == 1 and c.cut_legal


class _TwoLinears(nn.Module):
    """``lin2(relu(lin1(x)))``, or ``relu(lin1(x))`` alone (``half``)."""

    def __init__(self, half: bool = False) -> None:
        super().__init__()
        self.lin1 = nn.Linear(IN, OUT)
        self.lin2 = None if half else nn.Linear(OUT, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin1(x))
        return y if self.lin2 is None else self.lin2(y)


def test_recompute_stops_at_the_last_saved_tensor_and_leaves_out_the_loss() -> None:
    # The last tensor the block saves is relu's output (lin2 saves its input, relu its result): a
    # checkpoint's recomputation runs lin1 and relu and stops before lin2 (torch's early stop), so it
    # costs exactly the forward of relu(lin1(x)). The block is the last: the loss, which saves
    # (out - target) after everything, runs outside the stage's regions and moves nothing.
    def estimate(half: bool):
        with torch.device("meta"):
            model = nn.Sequential(_TwoLinears(half))
        x = torch.empty(B, T, IN, device="meta")
        target = torch.empty(B, T, OUT if half else IN, device="meta")
        traced = trace_model(model, (x,))
        return estimate_blocks(traced, (x,), target, _mse, _spec(), "fp32", progress=False)[0]

    whole, half = estimate(False), estimate(True)
    assert whole.fwd_s == pytest.approx(2 * MM / 1e9, rel=1e-9)  # two matmuls of MM FLOPs
    assert whole.recompute_s == pytest.approx(MM / 1e9, rel=1e-9)
    assert half.recompute_s == pytest.approx(half.fwd_s, rel=1e-9)  # relu(lin1(x)) ends with a saved tensor
    assert whole.recompute_s == pytest.approx(half.fwd_s, rel=1e-9)
    # selective keeps the matmul outputs: lin1's comes from the cache, relu (free here) runs again
    assert whole.selective_recompute_s == pytest.approx(0.0, abs=1e-12)


class _SavedLate(nn.Module):
    """``lin2(h) + (2 h + 1)[:, :IN]`` with ``h = lin1(x)``: lin2 saves ``h`` only after the copy,
    multiply and add that follow lin1 ran (or, ``half``, ``2 h + 1`` alone)."""

    def __init__(self, half: bool = False) -> None:
        super().__init__()
        self.lin1 = nn.Linear(IN, OUT)
        self.lin2 = None if half else nn.Linear(OUT, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        c = h.clone() * 2 + 1
        return c if self.lin2 is None else self.lin2(h) + c[:, :IN]


def test_recompute_runs_to_the_last_save_not_to_the_last_saved_tensors_making() -> None:
    # h is written by lin1, but saved by lin2 after clone, mul and add ran: torch's early stop re-runs
    # those too (it stops at the matching save). Memory-bound hardware, so the element-wise ops cost.
    hw = _spec(memory_Bps=1e12)

    def estimate(half: bool):
        with torch.device("meta"):
            model = nn.Sequential(_SavedLate(half), nn.ReLU())  # block 0 is not the last: no loss in its forward
        x = torch.empty(B * T, IN, device="meta")  # 2-D: no view re-marks h at lin2
        target = torch.empty(B * T, OUT if half else IN, device="meta")
        return estimate_blocks(trace_model(model, (x,)), (x,), target, _mse, hw, "fp32", progress=False)[0]

    whole, half = estimate(False), estimate(True)
    assert whole.recompute_s == pytest.approx(half.fwd_s, rel=1e-9)
    assert 0 < whole.recompute_s < whole.fwd_s


def test_linear_memory_bound_time_is_exact_and_scales_with_dtype() -> None:
    hw = _spec(kind="cpu", peak_flops={"fp32": 1e30, "bf16": 1e30}, memory_Bps=1e9)
    # forward = one addmm: reads bias, input and weight, writes the output (views move nothing)
    elements = OUT + B * T * IN + OUT * IN + B * T * OUT
    c32 = _estimate(hw, "fp32")[0]
    c16 = _estimate(hw, "bf16")[0]
    assert c32.fwd_s == pytest.approx(4 * elements / 1e9, rel=1e-9)
    assert c16.fwd_s == pytest.approx(2 * elements / 1e9, rel=1e-9)
    assert c16.flops_fwd == c32.flops_fwd
    # bf16 runs under autocast over fp32 weights: the weight addmm saves is a bf16 copy, counted (and
    # told apart: a stage may share it)
    assert c16.param_bytes == c32.param_bytes // 2
    assert c16.activation_bytes == c32.activation_bytes // 2 + OUT * IN * 2
    assert (c16.weight_cast_bytes, c32.weight_cast_bytes) == (OUT * IN * 2, 0)
    assert c16.cut_bytes == c32.cut_bytes // 2


def test_operator_overhead_adds_on_cpu_and_hides_on_gpu() -> None:
    gpu = _estimate(_spec(op_overhead_s=100.0))[0]
    cpu = _estimate(_spec(kind="cpu", op_overhead_s=100.0))[0]
    assert gpu.fwd_s == pytest.approx(100.0)  # max(overhead, 8.6 s of GEMM) for the one data-moving op
    assert cpu.fwd_s == pytest.approx(MM / 1e9 + 4 * 100.0)  # view, t, addmm, view: each adds overhead


def test_real_model_gives_the_meta_estimate_and_stays_untouched() -> None:
    torch.manual_seed(0)
    model, inputs, target = _linear_model("cpu")
    before = copy.deepcopy(model.state_dict())
    traced = trace_model(model, inputs)
    real = estimate_blocks(traced, inputs, target, _mse, get_hardware("h100"), "bf16", progress=False)
    meta = _estimate(get_hardware("h100"), "bf16")
    assert real == meta
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 and p.grad is None for p in traced.model.parameters())


def test_fwd_flops_equal_flop_counter_mode_and_split_adds_up() -> None:
    mf = load_model_file(ROOT / "models" / "gpt.py", "tiny")
    with torch.device("meta"):
        model = mf.build()
    inputs, target = mf.batch(2)
    inputs, target = tuple(x.to("meta") for x in inputs), target.to("meta")
    traced = trace_model(model, inputs)
    costs = estimate_blocks(traced, inputs, target, mf.loss_fn, get_hardware("a100-80g"), "bf16", progress=False)
    with FlopCounterMode(display=False) as counter:
        mf.loss_fn(traced.model(*inputs), target)
    assert sum(c.flops_fwd for c in costs) == counter.get_total_flops()
    for c in costs:
        assert c.bwd_input_s + c.bwd_weight_s == pytest.approx(c.bwd_s)
        assert c.bwd_input_s >= 0 and c.bwd_weight_s >= 0
        assert c.flops_bwd >= 2 * c.flops_fwd * 0.99  # attention recomputes scores in backward
    assert costs[0].name == "tok_embeddings" and costs[0].bwd_input_s == 0.0  # token ids need no gradient
    layers = [c for c in costs if c.is_layer]
    assert len(layers) == 4 and all(
        c == layers[0].model_copy(update={"name": c.name, "first_node": c.first_node, "last_node": c.last_node})
        for c in layers
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_meta_estimate_of_a_tutorial_gpt_allocates_nothing() -> None:
    mf = load_model_file(ROOT / "models" / "gpt.py", "tutorial")  # 43.9 M params: 176 MB in fp32
    with torch.device("meta"):
        model = mf.build()
    inputs, target = mf.batch(4)
    inputs, target = tuple(x.to("meta") for x in inputs), target.to("meta")
    traced = trace_model(model, inputs)
    rss = _rss_bytes()
    costs = estimate_blocks(
        traced, inputs, target, mf.loss_fn, get_hardware("h100"), "bf16", OptimizerSpec(), progress=False
    )
    assert _rss_bytes() - rss < 60 * 2**20
    assert all(p.device.type == "meta" for p in traced.model.parameters())
    assert sum(c.params for c in costs) == 43_883_280
    assert sum(c.param_bytes for c in costs) == 2 * 43_883_280
    assert all(c.opt_s > 0 for c in costs if c.params)


def test_errors_name_the_fix() -> None:
    with pytest.raises(PlannerError, match="bf16.*v100"):
        _estimate(get_hardware("v100"), "bf16")
    with pytest.raises(PlannerError, match="--dtype"):
        _estimate(get_hardware("h100"), "fp8")


def test_optimizer_formula() -> None:
    hw = _spec(memory_Bps=1e9)
    adamw, sgd = OptimizerSpec(), OptimizerSpec(name="sgd")
    assert optimizer_step_seconds(1000, 4000, 2, hw, adamw) == pytest.approx(84 * 1000 / 1e9)
    assert optimizer_step_seconds(1000, 4000, 2, hw, sgd) == pytest.approx(12 * 1000 / 1e9)
    # bf16 with an fp32 master copy: the fp32 step plus the two casts (6 B each way)
    assert optimizer_step_seconds(1000, 2000, 2, hw, adamw) == pytest.approx((84 + 12) * 1000 / 1e9)
    assert optimizer_step_seconds(0, 0, 0, hw, adamw) == 0.0


def test_calibration_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cpu.json"
    spec = calibrated_cpu(1, path=path)
    assert spec.kind == "cpu" and spec.name.endswith("-1t") and spec.peak("fp32") > 1e8
    assert spec.memory_Bps > 1e8 and 0 < spec.op_overhead_s < 1e-3

    def boom(threads: int) -> HardwareSpec:
        raise AssertionError("measured again")

    monkeypatch.setattr("planner.costs.cpu.measure_cpu", boom)
    assert calibrated_cpu(1, path=path) == spec
    with pytest.raises(AssertionError):
        calibrated_cpu(1, path=path, refresh=True)


@pytest.mark.slow
@pytest.mark.timing  # a calibration and a profile measured minutes apart: run alone on the cores (Makefile)
def test_calibrated_cpu_estimate_roughly_matches_measurement(tmp_path: Path) -> None:
    hw = calibrated_cpu(1, path=tmp_path / "cpu.json")
    mf = load_model_file(ROOT / "models" / "gpt.py", "tiny")
    torch.manual_seed(0)
    model = mf.build()
    inputs, target = mf.batch(8)
    traced = trace_model(model, inputs)
    sample = Sample(inputs, target, mf.loss_fn)
    measured = profile_model(traced, sample, ProfileSettings(warmup=1, repeats=3, threads=1, progress=False)).costs
    estimated = estimate_blocks(traced, inputs, target, mf.loss_fn, hw, "fp32", progress=False)
    m = sum(c.fwd_s + c.bwd_s for c in measured)
    e = sum(c.fwd_s + c.bwd_s for c in estimated)
    assert m / 3 < e < 3 * m, (m, e)
    assert [c.param_bytes for c in estimated] == [c.param_bytes for c in measured]
    assert [c.cut_bytes for c in estimated] == [c.cut_bytes for c in measured]


# ---------------------------------------------------------------------------------------------
# GPU cost model: causal attention, the attention output layout, GEMM efficiency by shape
# ---------------------------------------------------------------------------------------------

HEADS, HEAD_DIM = 4, 32
HID = HEADS * HEAD_DIM


class _Attention(nn.Module):
    """Self-attention on the input as q, k and v, in the usual (b, s, a, d) -> (b, a, s, d) layout."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = x.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=self.causal)
        return o.transpose(1, 2).reshape(b, s, h)


def _attention_costs(
    hw: HardwareSpec, causal: bool, tracer: str = "fx", compiled: bool = False, attention: nn.Module | None = None
):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(HID, HID), attention or _Attention(causal), nn.Linear(HID, HID))
    x = torch.empty(B, T, HID, device="meta")
    traced = trace_model(model, (x,), methods=(tracer,))
    target = torch.empty(B, T, HID, device="meta")
    return estimate_blocks(traced, (x,), target, _mse, hw, "fp32", progress=False, compiled=compiled)


def test_attention_in_an_exported_graph_is_charged_as_the_fused_kernel() -> None:
    # torch.export records the aten operator, not the Python function fx sees; both are the fused
    # kernel's cost (the unfused math would save S x S scores and probabilities per head)
    hw = get_hardware("h100")
    for causal in (False, True):
        fx_costs, export_costs = _attention_costs(hw, causal, "fx"), _attention_costs(hw, causal, "export")
        assert export_costs[1].activation_bytes == fx_costs[1].activation_bytes
        assert export_costs[1].flops_fwd == fx_costs[1].flops_fwd
        assert export_costs[1].fwd_s == pytest.approx(fx_costs[1].fwd_s, rel=1e-9)
        assert export_costs[1].activation_bytes < B * HEADS * T * T * 4  # no score matrix is kept


def test_causal_attention_is_charged_half_its_flops_forward_and_backward() -> None:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    shape = (B, HEADS, T, HEAD_DIM)
    full_f, full_b = sdpa_flop_count(shape, shape, shape), sdpa_backward_flop_count(shape, shape, shape, shape)
    hw = _spec(attention_fwd_efficiency=0.5, attention_bwd_efficiency=0.25)
    plain, causal = _attention_costs(hw, False)[1], _attention_costs(hw, True)[1]
    assert plain.flops_fwd == full_f and causal.flops_fwd == full_f / 2
    assert plain.flops_bwd == full_b and causal.flops_bwd == full_b / 2
    # compute-bound (memory is free): the kernel's own efficiency, per direction
    assert causal.fwd_s == pytest.approx(full_f / 2 / (1e9 * 0.5), rel=1e-9)
    assert causal.bwd_s == pytest.approx(full_b / 2 / (1e9 * 0.25), rel=1e-9)


def test_bf16_estimates_count_the_autocast_copies_of_the_weights_gemms_save() -> None:
    """The run computes a bf16 plan under autocast over fp32 weights: a GEMM saves a bf16 copy of
    the weight for backward, per microbatch, which the estimate counts with the activations and
    apart (a stage with many microbatches live may share one set: casts.shared_casts)."""
    fp32, bf16 = _estimate(_spec(), "fp32"), _estimate(_spec(), "bf16")
    # each Linear saves its weight for the input's gradient: a bf16 copy joins the halved activations
    # (the estimate runs every block with inputs that need gradients, the first one's too)
    assert bf16[0].activation_bytes == fp32[0].activation_bytes // 2 + IN * OUT * 2
    assert bf16[1].activation_bytes == fp32[1].activation_bytes // 2 + OUT * 8 * 2
    assert [b.weight_cast_bytes for b in bf16[:2]] == [IN * OUT * 2, OUT * 8 * 2]
    assert all(b.weight_cast_bytes == 0 for b in fp32)
    # selective checkpointing keeps the GEMM outputs, never the copies (its policy recomputes casts)
    assert bf16[1].selective_bytes == fp32[1].selective_bytes // 2


def test_attention_kernel_option_costs_the_named_backend() -> None:
    """--attention-kernel: the same attention at another backend's efficiency, nothing else changed."""
    hw = _spec(
        attention_backend="cudnn",
        attention_fwd_efficiency=0.5,
        attention_bwd_efficiency=0.25,
        other_attention={"flash": (0.25, 0.2)},
    )
    own, flash = _attention_costs(hw, True)[1], _attention_costs(hw.with_attention("flash"), True)[1]
    assert flash.flops_fwd == own.flops_fwd and flash.activation_bytes == own.activation_bytes
    assert flash.fwd_s == pytest.approx(2 * own.fwd_s, rel=1e-9)  # compute-bound: 0.5 / 0.25 of peak
    assert flash.bwd_s == pytest.approx(1.25 * own.bwd_s, rel=1e-9)  # 0.25 / 0.2


def test_unfused_attention_runs_every_score_through_two_gemms_and_saves_the_probabilities() -> None:
    """--attention-kernel unfused: attention as code before FlashAttention ran it (Megatron-LM 2021):
    the scores' GEMM, one scale-mask-softmax kernel, the values' GEMM; every score computed (causal
    or not), the S x S probabilities saved for backward, four GEMMs and the softmax's backward."""
    from torch.utils.flop_counter import sdpa_flop_count

    shape = (B, HEADS, T, HEAD_DIM)
    full = sdpa_flop_count(shape, shape, shape)  # the two GEMMs' FLOPs: 4 b a s^2 d
    scores = B * HEADS * T * T * 4  # fp32 bytes of one S x S tensor per head
    qkv = B * T * HID * 4  # the test block reads one tensor as q, k and v
    hw = _spec(attention_fwd_efficiency=0.5, attention_bwd_efficiency=0.25).with_attention("unfused")
    for causal in (False, True):
        c = _attention_costs(hw, causal)[1]
        assert (c.flops_fwd, c.flops_bwd) == (full, 2 * full)  # no causal half; backward: four GEMMs
        assert c.fwd_s == pytest.approx(full / 1e9, rel=1e-9)  # the GEMM figures (1.0 here), not attention's
        assert c.bwd_s == pytest.approx(2 * full / 1e9, rel=1e-9)
        assert c.activation_bytes == qkv + scores  # q (= k = v) and the probabilities
    # memory-bound: forward reads q and k, writes the scores; the softmax reads them and writes the
    # probabilities; the values' GEMM reads those and v and writes o (b, a, s, d), which the
    # transpose + reshape after it then copies
    slow = _spec(peak_flops={"fp32": 1e30, "bf16": 1e30}, memory_Bps=1.0).with_attention("unfused")
    assert _attention_costs(slow, True)[1].fwd_s == pytest.approx(4 * scores + 6 * qkv, rel=1e-9)
    # compiled: the GEMMs and the softmax kernel stay as they are (barriers to inductor's regions)
    compiled = _attention_costs(hw, True, compiled=True)
    assert (compiled[1].flops_fwd, compiled[1].flops_bwd) == (full, 2 * full)
    assert compiled[1].activation_bytes >= scores  # the probabilities, which the GEMMs' backwards read


class _GroupedAttention(nn.Module):
    """Grouped-query attention: two query heads per key and value head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = x.view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        kv = x[..., : h // 2].reshape(b, s, HEADS // 2, HEAD_DIM).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(b, s, h)


def test_unfused_grouped_attention_computes_every_query_head() -> None:
    """Grouped keys and values cost, unfused, what attention with as many key heads as query heads
    costs (torch's math path repeats them): the FLOPs of the whole-head attention."""
    from torch.utils.flop_counter import sdpa_flop_count

    shape = (B, HEADS, T, HEAD_DIM)
    costs = _attention_costs(_spec().with_attention("unfused"), True, attention=_GroupedAttention())
    assert costs[1].flops_fwd == sdpa_flop_count(shape, shape, shape)


def test_attention_output_layout_makes_the_transpose_reshape_a_view(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.costs import roofline
    from planner.costs.roofline import attention_output

    q = torch.empty(B, T, HEADS, HEAD_DIM, device="meta").transpose(1, 2)
    o = attention_output(q, HEAD_DIM)
    assert o.shape == q.shape and o.transpose(1, 2).is_contiguous()  # (b, s, a, d) in memory, as the kernels
    contiguous_q = torch.empty(B, HEADS, T, HEAD_DIM, device="meta")
    assert attention_output(contiguous_q, 16).is_contiguous()  # follows the query's own layout
    # memory-bound: the attention block moves q, k, v (one tensor read three times), o and the fp32
    # log-sum-exp; the transpose + reshape after it is a view and moves nothing
    hw = _spec(peak_flops={"fp32": 1e30, "bf16": 1e30}, memory_Bps=1.0)
    expected = 4 * B * T * HID * 4 + 4 * B * HEADS * T
    assert _attention_costs(hw, True)[1].fwd_s == pytest.approx(expected, rel=1e-9)
    # an output laid out (b, a, s, d), as before, costs one more read and write of it in the reshape
    monkeypatch.setattr(roofline, "attention_output", lambda q, d: q.new_empty((*q.shape[:-1], d)))
    assert _attention_costs(hw, True)[1].fwd_s == pytest.approx(expected + 2 * 4 * B * T * HID, rel=1e-9)


def test_gemm_efficiency_follows_the_smallest_dimension() -> None:
    hw = _spec(matmul_efficiency=0.8, gemm_half_dim=128.0)
    c = _estimate(hw)[0]  # Linear(1024, 4096) on 1024 tokens: (1024 x 1024) @ (1024 x 4096), d = 1024
    assert c.fwd_s == pytest.approx(MM / (1e9 * 0.8 * 1024 / (1024 + 128)), rel=1e-9)
    # dX = dY W: (1024 x 4096) @ (4096 x 1024); dW = dY^T X: (4096 x 1024) @ (1024 x 1024): d = 1024 both
    assert c.bwd_s == pytest.approx(2 * MM / (1e9 * 0.8 * 1024 / (1024 + 128)), rel=1e-9)
    small = _estimate(hw)[1]  # Linear(4096, 8): a skinny GEMM, d = 8
    assert small.fwd_s == pytest.approx(2 * B * T * OUT * 8 / (1e9 * 0.8 * 8 / (8 + 128)), rel=1e-9)


def test_tokens_per_sample_is_the_sequence_length_of_token_ids() -> None:
    from planner.costs.model_costs import tokens_per_sample

    ids = torch.zeros(4, 512, dtype=torch.long, device="meta")
    assert tokens_per_sample((ids,)) == 512
    assert tokens_per_sample({"input_ids": ids, "attention_mask": ids}) == 512  # keyword inputs
    assert tokens_per_sample((torch.empty(4, 512),)) is None  # features, not token ids
    assert tokens_per_sample((torch.zeros(4, 8, 8, dtype=torch.long),)) is None
    assert tokens_per_sample(()) is None


@pytest.mark.slow
def test_identical_layers_are_estimated_once_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.costs.estimate as estimate

    mf = load_model_file(ROOT / "models" / "llama.py", "tiny")
    with torch.device("meta"):
        model = mf.build()
    inputs, target = mf.batch(2)
    inputs = tuple(x.to("meta") for x in inputs)
    traced = trace_model(model, inputs)
    hw = get_hardware("h100")
    runs: list[int] = []
    original = estimate._run_block
    monkeypatch.setattr(estimate, "_run_block", lambda *a, **k: runs.append(1) or original(*a, **k))
    shared = estimate_blocks(traced, inputs, target.to("meta"), mf.loss_fn, hw, "bf16", progress=False)
    layers = sum(b.is_layer for b in traced.blocks)
    assert layers >= 2 and len(runs) == len(traced.blocks) - layers + 1  # the layers ran once between them
    keys = iter(range(10**6))
    monkeypatch.setattr(estimate, "structure_key", lambda *a, **k: str(next(keys)))  # every block on its own
    alone = estimate_blocks(traced, inputs, target.to("meta"), mf.loss_fn, hw, "bf16", progress=False)
    assert shared == alone


@pytest.mark.parametrize(
    ("path", "size", "overrides"),
    [
        ("models/llama.py", "tiny", {"n_layers": 5}),
        ("models/gpt.py", None, {"n_layers": 4}),
        ("models/hf/llama.py", None, {}),
    ],
)
def test_block_keys_read_off_the_graph_group_blocks_as_their_cut_out_stages_do(
    path: str, size: str | None, overrides: dict
) -> None:
    """``block_key`` (read off the traced graph) puts two blocks in one class exactly when
    ``structure_key`` of their cut-out stages does; twin layers share a class."""
    from planner.capture.stage import stage_graph
    from planner.costs.estimate import block_key, structure_key

    mf = load_model_file(ROOT / path, size, overrides)
    with torch.device("meta"):
        model = mf.build()
    inputs, _ = mf.batch(2)
    inputs = tuple(x.to("meta") for x in inputs)
    traced = trace_model(model, inputs)
    n = len(traced.blocks)
    # every block is keyed with the same inputs here: the keys' inputs part is the same for all
    graph_keys = [block_key(traced, k, inputs, k == n - 1) for k in range(n)]
    stage_keys = [
        structure_key(traced.gm, inputs, k == n - 1, graph=stage_graph(traced, k, k + 1, check_cuts=False))
        for k in range(n)
    ]

    def classes(keys: list[str]) -> list[int]:
        first: dict[str, int] = {}
        return [first.setdefault(key, k) for k, key in enumerate(keys)]

    assert classes(graph_keys) == classes(stage_keys)
    assert len(set(graph_keys)) < n  # the layers are twins


# --- eager operators on a GPU: the host issues them, dispatch_s each (Roofline._gpu_seconds) --------
D = 10e-6  # host time per operator in these tests


def _phase_seconds(ops: list[int], memory_Bps: float) -> tuple[float, int]:
    """One GPU phase of eager element-wise operators on tensors of ``ops[i]`` elements: its seconds and
    the operators counted. Compute is free; a kernel takes its bytes over ``memory_Bps``."""
    from planner.costs.roofline import Roofline, Tally

    mode = Roofline(_spec(memory_Bps=memory_Bps, dispatch_s=D), "fp32")
    tensors = [torch.empty(n, device="meta") for n in ops]
    with mode.phase(Tally()) as tally:
        for t in tensors:
            t.neg()  # reads n floats, writes n: 8n bytes
    return tally.seconds, tally.ops


def test_short_eager_operators_on_a_gpu_run_at_the_hosts_pace() -> None:
    # kernels of 8 bytes at 1 TB/s take picoseconds: the phase lasts as long as issuing its operators
    seconds, ops = _phase_seconds([1] * 50, 1e12)
    assert ops == 50
    assert seconds == pytest.approx(50 * D + 8 / 1e12, rel=1e-9)


def test_long_kernels_hide_the_host_but_the_first() -> None:
    # 8 MB at 1 GB/s: 8 ms a kernel; only the first waits for the host, the rest are issued meanwhile
    seconds, _ = _phase_seconds([2**20] * 5, 1e9)
    assert seconds == pytest.approx(D + 5 * 8 * 2**20 / 1e9, rel=1e-9)


def test_short_operators_cost_time_before_a_long_kernel_and_none_after_it() -> None:
    long_kernel = 8 * 2**20 / 1e9
    before, _ = _phase_seconds([1] * 20 + [2**20], 1e9)  # the GPU idles while the host issues 20 operators
    after, _ = _phase_seconds([2**20] + [1] * 20, 1e9)  # issued while the long kernel runs
    assert before == pytest.approx(21 * D + long_kernel, abs=1e-12)  # the short kernels ran in the gaps
    assert after == pytest.approx(D + long_kernel + 20 * 8 / 1e9, rel=1e-6)


def test_the_host_does_not_pace_a_cpu_or_compiled_code() -> None:
    from planner.costs.roofline import Roofline, Tally

    x = torch.empty(1, device="meta")
    for hw, fuse in (
        (_spec(kind="cpu", memory_Bps=1e12, dispatch_s=D), False),
        (_spec(memory_Bps=1e12, dispatch_s=D), True),
    ):
        mode = Roofline(hw, "fp32", fuse=fuse)
        with mode.phase(Tally()) as tally:
            for _ in range(50):
                x.neg()
        assert tally.seconds < D  # a CPU charges op_overhead_s (0 here), compiled code its kernels
