"""Compiled blocks' estimates: runs of memory-bound operators charged as the kernels inductor fuses
them into (planner/costs/fusion.py), exact byte counts on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_estimate import _spec as estimate_spec

from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.core.levers.hardware import HardwareSpec, get_hardware
from planner.costs.estimate import estimate_blocks
from planner.costs.roofline import Roofline, Tally

ROOT = Path(__file__).resolve().parent.parent
ROWS, COLS = 512, 1024
N = ROWS * COLS * 4  # bytes of one fp32 (ROWS, COLS) tensor


def _spec(kind: str = "gpu", overhead: float = 0.0) -> HardwareSpec:
    """1 byte per second of memory, compute free: seconds are bytes (plus the kernels' overhead)."""
    return estimate_spec(kind, peak_flops={"fp32": 1e30, "bf16": 1e30}, memory_Bps=1.0, op_overhead_s=overhead)


def _llama_eager_and_compiled(overrides: dict | None = None) -> tuple[list, list, list]:
    """The tiny Llama's blocks (as traced), estimated on an H100 eagerly and compiled."""
    mf = load_model_file(ROOT / "models" / "llama.py", "tiny", overrides)
    with torch.device("meta"):
        model = mf.build()
    inputs, target = mf.batch(2)
    inputs = tuple(x.to("meta") for x in inputs)
    traced = trace_model(model, inputs)
    # kernels only: the host's pace (dispatch_s) is the eager side's alone, and would hide what compiling
    # does to the kernels these tests compare (tests/test_estimate.py checks the host's pace)
    hw = get_hardware("h100").model_copy(update={"dispatch_s": 0.0})
    eager = estimate_blocks(traced, inputs, target.to("meta"), mf.loss_fn, hw, "bf16", progress=False)
    fused = estimate_blocks(traced, inputs, target.to("meta"), mf.loss_fn, hw, "bf16", progress=False, compiled=True)
    return traced.blocks, eager, fused


def _phase(fn: Callable[[], object], fuse: bool, hw: HardwareSpec | None = None) -> tuple[Tally, object]:
    """Run ``fn`` as one phase; returns its tally and its result (held: alive when the phase ends)."""
    mode = Roofline(hw or _spec(), "fp32", fuse=fuse)
    tally = Tally()
    with mode.phase(tally):
        out = fn()
    return tally, out


def _x(grad: bool = False) -> torch.Tensor:
    return torch.empty(ROWS, COLS, device="meta", requires_grad=grad)


def test_a_chain_of_elementwise_operators_reads_its_input_once_and_writes_its_result_once() -> None:
    x = _x()

    def chain() -> torch.Tensor:
        return ((x * 2.0 + 1.0).rsqrt() * x).to(torch.bfloat16)

    eager, _ = _phase(chain, fuse=False)
    fused, _ = _phase(chain, fuse=True)
    # eagerly: mul (r x, w), add (r, w), rsqrt (r, w), mul (r, r x, w), cast (r fp32, w bf16)
    assert eager.bytes == 2 * N + 2 * N + 2 * N + 3 * N + N + N // 2
    assert fused.bytes == N + N // 2  # x once (read twice inside the kernel), the bf16 result
    assert fused.seconds == pytest.approx(fused.bytes) and fused.ops == 1


def test_what_a_matrix_product_reads_is_written_and_a_temporary_nothing_reads_is_not() -> None:
    x, w = _x(), torch.empty(COLS, COLS, device="meta")

    def layer() -> torch.Tensor:
        a = x * 2.0  # read by the GEMM and by the second region: written
        b = a @ w
        return (b + a) * 3.0  # b + a: a temporary inside the region, never written

    fused, _ = _phase(layer, fuse=True)
    gemm = N + COLS * COLS * 4 + N  # a, w, b
    assert fused.bytes == (N + N) + gemm + (2 * N + N)
    assert fused.ops == 3  # two kernels and the GEMM


def test_a_tensor_saved_for_backward_is_written_even_where_its_region_reads_it() -> None:
    x = _x(grad=True)

    def forward() -> torch.Tensor:
        return (x * 2.0).sin()  # sin saves its input for backward

    saved, _ = _phase(forward, fuse=True)
    with torch.no_grad():
        unsaved, _ = _phase(forward, fuse=True)
    assert saved.bytes == 3 * N  # x, the saved x * 2, the result
    assert unsaved.bytes == 2 * N


def test_an_operator_charged_whole_after_its_parts_is_one_kernel_of_its_inputs_and_output() -> None:
    # silu's backward reaches the roofline as silu_backward, which decomposes into parts with no
    # FLOPs and is then charged whole: its parts must not stay in the region
    x = _x(grad=True)
    y = F.silu(x)
    g = torch.empty_like(y)
    fused, _ = _phase(lambda: y.backward(g), fuse=True)
    assert fused.bytes == 3 * N  # reads the gradient and x, writes x.grad
    assert x.grad is not None


def test_kernel_overhead_is_a_floor_on_a_gpu_and_added_on_a_cpu() -> None:
    x = _x()

    def two_kernels() -> torch.Tensor:
        a = (x + 1.0).exp()
        return a @ torch.empty(COLS, 4, device="meta") + a.sum()

    big = 1e12
    gpu, _ = _phase(two_kernels, fuse=True, hw=_spec("gpu", big))
    cpu, _ = _phase(two_kernels, fuse=True, hw=_spec("cpu", big))
    # exp's region, the GEMM, then a.sum() and the add, which run after the GEMM: one region
    assert gpu.ops == 3
    assert gpu.seconds == pytest.approx(3 * big)  # each kernel's floor, far above its bytes
    assert cpu.seconds == pytest.approx(3 * big + cpu.bytes)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.layer_norm(x, (COLS,)).relu() * 2.0,
        lambda x: torch.softmax(x, dim=-1) @ x.T,
        lambda x: F.gelu(x @ torch.ones(COLS, COLS, device="meta")) + x,
        lambda x: torch.cat([x, x * 2.0], dim=0).sum(0),
    ],
)
def test_fused_never_charges_more_than_eager_and_counts_the_same_flops(fn: Callable[[torch.Tensor], object]) -> None:
    x = _x(grad=True)
    eager, out = _phase(lambda: fn(x), fuse=False, hw=get_hardware("h100"))
    fused, out2 = _phase(lambda: fn(x), fuse=True, hw=get_hardware("h100"))
    assert fused.flops == eager.flops
    assert 0 < fused.bytes <= eager.bytes and 0 < fused.seconds <= eager.seconds * (1 + 1e-12)


def test_a_compiled_llama_estimate_is_faster_with_the_same_flops_and_saves_less() -> None:
    blocks, eager, fused = _llama_eager_and_compiled({"dim": 256, "seq_len": 256})
    for e, f in zip(eager, fused):
        assert (f.flops_fwd, f.flops_bwd, f.param_bytes, f.selective_bytes) == (
            e.flops_fwd,
            e.flops_bwd,
            e.param_bytes,
            e.selective_bytes,
        )
        assert f.fwd_s <= e.fwd_s and f.bwd_s <= e.bwd_s and f.recompute_s <= e.recompute_s
        assert f.activation_bytes <= e.activation_bytes  # the partitioner recomputes element-wise outputs
        # the zero-bubble split runs a compiled block's one backward node whole for I and for W
        assert f.bwd_input_s == f.bwd_weight_s == f.bwd_s
    layer = next(i for i, b in enumerate(blocks) if b.is_layer)
    # a layer's norms, rotary embedding, SwiGLU and residual adds fuse: well under its eager time
    assert fused[layer].fwd_s + fused[layer].bwd_s < 0.9 * (eager[layer].fwd_s + eager[layer].bwd_s)


class _SwiGLU(torch.nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def test_a_compiled_block_saves_the_matrix_products_outputs_and_recomputes_the_element_wise_ones() -> None:
    eagers, fuseds = _first_block(_SwiGLU, torch.empty(8, 32, 64, device="meta"), get_hardware("h100"))
    eager, fused = eagers[0], fuseds[0]
    inp, wide = 8 * 32 * 64 * 4, 8 * 32 * 256 * 4
    # eagerly: x (for w1's and w3's weight gradients), w1 x (silu's), silu(w1 x) and w3 x (the
    # product's), the product (w2's); compiled: x, w1 x and w3 x, the rest recomputed from them
    assert eager.activation_bytes == inp + 4 * wide
    assert fused.activation_bytes == inp + 2 * wide
    # and the forward no longer writes silu(w1 x), which nothing reads after its region
    assert fused.fwd_s < eager.fwd_s


def _first_block(make: Callable[[], torch.nn.Module], x: torch.Tensor, hw: HardwareSpec, dtype: str = "fp32") -> tuple:
    """Block 0, ``make()`` followed by a small head (so that it is not the last block), eager and compiled."""
    with torch.device("meta"):
        model = torch.nn.Sequential(make(), torch.nn.Linear(x.shape[-1], 8))
    target = torch.empty(*x.shape[:-1], 8, device="meta")
    traced = trace_model(model, (x,))

    def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    eager = estimate_blocks(traced, (x,), target, mse, hw, dtype, progress=False)
    fused = estimate_blocks(traced, (x,), target, mse, hw, dtype, progress=False, compiled=True)
    return eager, fused


def test_a_compiled_rms_norm_saves_its_input_and_the_mean_and_writes_the_mean_it_keeps() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "models"))
    from llama import RMSNorm

    b, t, d = 4, 64, 256
    x = torch.empty(b, t, d, device="meta")
    eager, fused = _first_block(lambda: RMSNorm(d), x, _spec())
    n = b * t * d * 4
    # eagerly it saves x, rsqrt's output and the normalised tensor; compiled, x and the mean of squares
    # (a reduction's result), from which the rest is recomputed
    assert eager[0].activation_bytes == n + b * t * 4 + n
    assert fused[0].activation_bytes == n + b * t * 4
    # one kernel: reads x and the weight, writes the mean (kept, though nothing in the forward holds
    # it after rsqrt) and the output; seconds are bytes on this spec
    assert fused[0].fwd_s == pytest.approx(n + d * 4 + b * t * 4 + n)


def test_a_compiled_block_never_saves_more_than_the_eager_one() -> None:
    class TwoProducts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 64, bias=False)
            self.b = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.a(x) + self.b(x)).sin()  # sin saves its input, made of two products

    eager, fused = _first_block(TwoProducts, torch.empty(8, 32, 64, device="meta"), _spec())
    # the sum's frontier (both products) holds twice its bytes: the sum stays saved
    assert fused[0].activation_bytes == eager[0].activation_bytes


def test_the_compiled_last_block_charges_its_eager_loss_forward_and_backward() -> None:
    _, eagers, fuseds = _llama_eager_and_compiled()
    eager, fused = eagers[-1], fuseds[-1]
    # the loss's own temporaries and saves are the eager ones; the block's backward still runs
    assert (fused.loss_temp_bytes, fused.loss_bytes) == (eager.loss_temp_bytes, eager.loss_bytes)
    assert 0.5 * eager.bwd_s < fused.bwd_s <= eager.bwd_s
    assert fused.recompute_s <= fused.fwd_s
