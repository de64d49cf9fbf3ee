"""Analytical per-block costs for hardware that is not here: FLOPs and bytes → roofline time.

Costs for hardware that is not here (docs/architecture.md, "Costs"). Each block of a graph-traced model is cut out as its own module
(``planner.capture.trace.build_stage_module``, as ``planner.costs.measure`` does) and run forward and backward
on the ``meta`` device, where operators compute shapes but no data. A ``TorchDispatchMode``
(``Roofline``) sees every aten operator and charges it

    max(flops / (peak[dtype] * efficiency), bytes / (memory_Bps * memory_efficiency))

where the efficiency is the operation class's (docs/gpu_costs.md): a GEMM's follows its shape
(``HardwareSpec.gemm_efficiency``: small or skinny GEMMs reach less of peak), fused attention's is
its kernel's forward or backward figure (``HardwareSpec.attention_efficiency``), anything else
with FLOPs (convolutions) takes ``matmul_efficiency``. Plus a fixed per-operator overhead (``HardwareSpec.op_overhead_s``: added on a CPU, which runs
kernels inline; hidden behind longer kernels on a GPU, which queues them). This is the
per-operator roofline of ``torch.distributed._tools.runtime_estimator.RuntimeEstimator``'s
"operator-level-cost-model" mode (which itself follows inductor's scheduler): FLOPs from
``torch.utils.flop_counter``'s formula registry, bytes = every input and output tensor of the
operator, stride-0 (broadcast) dimensions counted once (its ``get_num_bytes``). RuntimeEstimator
itself is not reused because it reads the peak numbers of the *local* CUDA device and needs
FakeTensorMode; here the numbers come from a ``HardwareSpec``. Operators without a FLOP formula
are decomposed first, exactly as ``FlopCounterMode`` does, so the FLOP totals equal its counts.

Weights never exist: every parameter and buffer of a block is swapped (``torch.func
.functional_call``) for an empty ``meta`` tensor in the planning dtype, for a model built on meta
and for a real one alike, so planning a 70B model allocates nothing and a real model is untouched.

Backward split (zero-bubble F/I/W, Qi et al. 2023): ``bwd_s`` is one full backward (B). ``I`` is a
backward of a fresh forward with ``torch.autograd.grad`` w.r.t. the block's float inputs only —
the engine then skips every branch that only leads to parameters (the weight-gradient matmuls,
bias sums, accumulation); that is what ``torch.distributed.pipelining._backward
.stage_backward_input`` runs. ``W = B - I``: what the full backward costs beyond the input part,
which ``stage_backward_weight`` runs later from the saved intermediate gradients. A block whose
inputs need no gradient (the embedding) has I = 0 and W = B.

Everything is per microbatch, like ``planner.costs.measure``; the last block includes the loss.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, TracedModel, get_attr
from planner.capture.stage import build_stage_module, stage_inputs
from planner.core.hardware import DTYPES, HardwareSpec, dtype_bytes
from planner.costs.blocks import block_cost
from planner.costs.timing import backward_roots, grad_inputs, leaf_safe
from planner.errors import PlannerError, TraceError
from planner.schema.costs import BlockCost, OptimizerSpec
from planner.torch_compat import TorchDispatchMode, pytree, storage_id, swapped_sdpa

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
aten = torch.ops.aten

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Operators that move no data: views and aliases (RuntimeEstimator's _VIEW_OPS, plus the
# schema-level ``is_view`` test below for the rest).
_NO_BYTES = {
    aten._unsafe_view,
    aten.detach,
    aten.lift_fresh,
    aten.alias,
    aten.view,
    aten.t,
    aten.transpose,
    aten.expand,
    aten.permute,
    aten.select,
    aten.slice,
    aten.squeeze,
    aten.unsqueeze,
    aten.as_strided,
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.chunk,
    aten.diagonal,
    aten.unfold,
}
# Allocations without initialisation write nothing and launch nothing.
_FREE = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided, aten.new_empty_strided}
# Queries of tensor metadata that _FlopCounterMode leaves alone (they matter for subclasses only).
# GEMMs, whose efficiency follows their shape (``_gemm_dims``).
_GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_METADATA_OPS = {
    aten.sym_is_contiguous.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    torch.ops.prim.layout.default,
}


@dataclass
class Tally:
    """What a phase (forward, backward, input-backward) of one block costs on the hardware.

    Attributes:
        flops: floating-point operations (torch.utils.flop_counter formulas).
        bytes: bytes read and written by data-moving operators.
        seconds: roofline time plus per-operator overhead.
        ops: operators dispatched (views included).
    """

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    ops: int = 0


def tensor_bytes(t: torch.Tensor, float_bytes: int | None = None) -> int:
    """Bytes an operator touches in ``t``: broadcast (stride-0) dimensions count once.

    Args:
        t: a tensor (meta or real).
        float_bytes: bytes per element to assume for floating tensors (None: their own size).

    Returns:
        Bytes.
    """
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    size = float_bytes if float_bytes is not None and t.is_floating_point() else t.element_size()
    return n * size


class Roofline(TorchDispatchMode):
    """Charges each aten operator roofline time on a ``HardwareSpec``, into ``self.tally``.

    Args:
        hw: the hardware.
        dtype: the planning dtype ("tf32" makes fp32 operators use the TF32 peak).
        float_bytes: count floating tensors as this many bytes per element (used when a block
            had to run in fp32 although the plan is for a narrower dtype); None: as they are.
    """

    def __init__(self, hw: HardwareSpec, dtype: str, float_bytes: int | None = None) -> None:
        super().__init__()
        self.hw = hw
        self.dtype = dtype
        self.float_bytes = float_bytes
        self.tally = Tally()
        # An operator runs at the peak of its output dtype (an fp32 loss on a bf16 model runs at the
        # fp32 peak); "tf32" plans run fp32 matmuls on the TF32 tensor cores.
        self._peaks: dict[torch.dtype, float] = {}
        for key, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if key in hw.peak_flops:
                self._peaks[tdt] = hw.peak_flops[key]
        if dtype == "tf32":
            self._peaks[torch.float32] = hw.peak("tf32")
        self._default_peak = hw.peak(dtype)

    def _peak(self, dtype: torch.dtype | None) -> float:
        peak = self._peaks.get(dtype) if dtype is not None else None
        return peak or self._default_peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _METADATA_OPS:
            return NotImplemented
        # As _FlopCounterMode: operators without a formula are decomposed when they can be, so the
        # FLOPs equal FlopCounterMode's. But a decomposition of a fused kernel (dropout becomes
        # bernoulli_ + div_ + mul + casts) moves more bytes than the kernel that really runs, so the
        # parts are charged only when they contain FLOPs; otherwise the operator is charged whole.
        if func.overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            outer, self.tally = self.tally, Tally()
            try:
                with self:
                    r = func.decompose(*args, **kwargs)
            finally:
                inner, self.tally = self.tally, outer
            if r is not NotImplemented:
                if inner.flops:
                    self._add(inner)
                else:
                    self._charge(func, args, kwargs, r)
                return r
        out = func(*args, **kwargs)
        self._charge(func, args, kwargs, out)
        return out

    def charge_fused(self, flops: float, tensors: list[torch.Tensor], dtype: torch.dtype, efficiency: float) -> None:
        """Charge one fused kernel (attention) that reads and writes ``tensors`` at ``efficiency`` of peak."""
        nbytes = sum(tensor_bytes(t, self.float_bytes) for t in tensors)
        hw = self.hw
        roof = max(flops / (self._peak(dtype) * efficiency), nbytes / (hw.memory_Bps * hw.memory_efficiency))
        seconds = max(roof, hw.op_overhead_s) if hw.async_launch else roof + hw.op_overhead_s
        self._add(Tally(float(flops), nbytes, seconds, 1))

    @contextlib.contextmanager
    def phase(self, tally: Tally) -> Iterator[Tally]:
        """Charge everything run inside into ``tally`` (attention as one fused kernel where it is)."""
        self.tally = tally
        with _fused_attention(self), self:
            yield tally

    def _add(self, other: Tally) -> None:
        self.tally.flops += other.flops
        self.tally.bytes += other.bytes
        self.tally.seconds += other.seconds
        self.tally.ops += other.ops

    def _charge(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        packet = func.overloadpacket
        if packet in _FREE:
            return
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        moves = not (func.is_view or packet in _NO_BYTES)
        nbytes = 0
        float_dtype = None
        if moves:
            for t in pytree.tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor):
                    nbytes += tensor_bytes(t, self.float_bytes)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                float_dtype = t.dtype
                break
        hw = self.hw
        if flops and packet in _GEMMS:
            efficiency = hw.gemm_efficiency(*_gemm_dims(packet, args))
        else:
            efficiency = hw.matmul_efficiency
        compute = flops / (self._peak(float_dtype) * efficiency) if flops else 0.0
        memory = nbytes / (hw.memory_Bps * hw.memory_efficiency)
        roof = max(compute, memory)
        if hw.async_launch:
            seconds = max(roof, hw.op_overhead_s) if moves or flops else 0.0
        else:
            seconds = roof + hw.op_overhead_s
        self._add(Tally(flops, nbytes, seconds, 1))


def _gemm_dims(packet: Any, args: tuple) -> tuple[int, int, int]:
    """``(m, n, k)`` of a GEMM operator's ``(m x k) @ (k x n)``, batch dimensions folded into m."""
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return batch * int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1])


_SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


class _FusedAttention(torch.autograd.Function):
    """Scaled-dot-product attention charged as the fused kernel that really runs.

    On the meta device ``F.scaled_dot_product_attention`` takes the unfused math path (scores and
    probabilities materialised, S x S each, and saved for backward). A GPU runs FlashAttention /
    memory-efficient attention instead (Dao et al. 2022): it reads Q, K, V, writes O and the
    log-sum-exp, saves only those, and recomputes the scores in backward. Its FLOPs are
    ``torch.utils.flop_counter``'s sdpa formulas (backward includes the recomputation), at the
    kernel's own efficiency (``HardwareSpec.attention_efficiency``).

    Causal attention (``is_causal=True``) is charged half of those FLOPs, forward and backward:
    the flash kernels skip the key blocks above the diagonal (FlashAttention-2 / -3 and cuDNN), and
    their own benchmarks count causal attention as half the FLOPs (``flops(..., causal)`` in
    flash-attn's benchmarks). ``torch.utils.flop_counter`` charges the full count whatever
    ``is_causal`` says. An explicit ``attn_mask`` is charged in full: on the meta device a mask
    has no values, so a causal one cannot be told from any other.

    The output follows the query's layout, as the kernels allocate it (``empty_like`` of the query
    seen as (batch, seq, heads, dim), FlashAttention's ``mha_fwd``): a query that is a transposed
    view of a (batch, seq, heads, dim) projection gets an output whose ``transpose(1, 2)`` is
    contiguous, so the usual ``o.transpose(1, 2).reshape(b, s, h)`` after attention is a view and
    charges no copy, as on a GPU.
    """

    @staticmethod
    def forward(
        ctx: Any,
        roof: Roofline,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        o = _attention_output(q, v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        share = 0.5 if causal else 1.0
        roof.charge_fused(
            share * sdpa_flop_count(q.shape, k.shape, v.shape),
            [q, k, v, o, lse] + ([mask] if mask is not None else []),
            q.dtype,
            roof.hw.attention_efficiency(backward=False),
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.roof = roof
        ctx.share = share
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.roof.charge_fused(
            ctx.share * sdpa_backward_flop_count(do.shape, q.shape, k.shape, v.shape),
            [q, k, v, o, lse, do, dq, dk, dv],
            q.dtype,
            ctx.roof.hw.attention_efficiency(backward=True),
        )
        return None, dq, dk, dv, None, None


def _attention_output(q: torch.Tensor, dim_v: int) -> torch.Tensor:
    """The fused kernel's output for query ``q`` (b, a, s, d): laid out as (b, s, a, d) when the
    query is (a transposed view of a contiguous (b, s, a, d)), else as (b, a, s, d)."""
    b, a, s, _ = q.shape
    if q.transpose(1, 2).is_contiguous():
        return q.new_empty((b, s, a, dim_v)).transpose(1, 2)
    return q.new_empty((b, a, s, dim_v))


_ORIGINAL_SDPA = F.scaled_dot_product_attention
_ACTIVE: list[Roofline] = []  # the Roofline whose phase is running (innermost last)


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    """``F.scaled_dot_product_attention`` as charged: fused where a fused kernel runs (see below)."""
    if _ACTIVE:
        roof = _ACTIVE[-1]
        a = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        q, k, v = a["query"], a["key"], a["value"]
        fused = roof.hw.async_launch or not a.get("dropout_p", 0.0)
        if fused and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[1] % k.shape[1] == 0:
            return _FusedAttention.apply(roof, q, k, v, a.get("attn_mask"), bool(a.get("is_causal", False)))
    return _ORIGINAL_SDPA(*args, **kwargs)


@contextlib.contextmanager
def _fused_attention(roof: Roofline) -> Iterator[None]:
    """Route scaled-dot-product attention to ``_FusedAttention`` where a fused kernel runs.

    GPUs have a fused kernel for every case here (FlashAttention; memory-efficient attention for
    fp32 and masks). PyTorch's CPU flash kernel has no dropout, so on a CPU attention with dropout
    stays unfused, as it runs there. Two routes lead here: fx graphs that call the function
    directly have their nodes retargeted (``_fuse_attention_nodes``), and the module attribute is
    swapped for the duration, for calls nested in leaf modules (``nn.MultiheadAttention`` calls it
    from ``F.multi_head_attention_forward``; a TorchFunctionMode would not see that nested call).
    A name imported before (``from torch.nn.functional import scaled_dot_product_attention``)
    inside a leaf module keeps the unfused estimate, which over-counts bytes only.
    """
    _ACTIVE.append(roof)
    try:
        with swapped_sdpa(_sdpa):
            yield
    finally:
        _ACTIVE.pop()


def _fuse_attention_nodes(stage: torch.fx.GraphModule) -> None:
    """Point the stage's attention calls at ``_sdpa`` (the stage is this module's private copy):
    fx graphs call ``F.scaled_dot_product_attention``, torch.export graphs the aten operator
    (same parameters), which would otherwise decompose into the unfused math on the meta device."""
    changed = False
    for node in stage.graph.nodes:
        if node.op == "call_function" and node.target in (
            _ORIGINAL_SDPA,
            torch.ops.aten.scaled_dot_product_attention.default,
        ):
            node.target = _sdpa
            changed = True
    if changed:
        stage.recompile()


def _meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty meta tensor shaped like ``t``, in ``dtype`` when ``t`` is floating."""
    out = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


def _meta_inputs(values: tuple, dtype: torch.dtype) -> tuple:
    return tuple(_meta_like(v.detach(), dtype) if isinstance(v, torch.Tensor) else v for v in values)


def _block_state(stage: torch.fx.GraphModule, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter, buffer and tensor constant the stage reads."""
    state: dict[str, torch.Tensor] = {}
    for name, p in stage.named_parameters():
        state[name] = _meta_like(p, dtype)
    for name, b in stage.named_buffers():
        state[name] = _meta_like(b, dtype)
    for node in stage.graph.nodes:  # plain tensor attributes (fx's _tensor_constant0, ...)
        if node.op == "get_attr" and node.target not in state:
            value: Any = stage
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                state[str(node.target)] = _meta_like(value, dtype)
    return state


@dataclass
class _BlockRun:
    fwd: Tally
    bwd: Tally
    bwd_input: Tally
    saved_bytes: int
    outputs: tuple


def _run_block(
    stage: torch.fx.GraphModule,
    args: tuple,
    last: bool,
    target: torch.Tensor,
    loss_fn: LossFn,
    hw: HardwareSpec,
    dtype: str,
    tdtype: torch.dtype,
    float_bytes: int | None,
) -> _BlockRun:
    state = _block_state(stage, tdtype)
    param_storages = {storage_id(t) for t in state.values()}

    def run(a: tuple[Any, ...]) -> Any:
        out = functional_call(stage, state, a, tie_weights=True, strict=False)
        return loss_fn(out, target) if last else out

    forward = leaf_safe(run, grad_inputs(args))  # a block starting with an in-place op

    mode = Roofline(hw, dtype, float_bytes)
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keep saved tensors alive so storage ids stay unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        sid = storage_id(t)
        if sid not in param_storages and sid not in saved:
            nbytes = t.untyped_storage().nbytes()
            if float_bytes is not None and t.is_floating_point():
                nbytes = nbytes // t.element_size() * float_bytes
            saved[sid] = nbytes
            keep.append(t)
        return t

    inputs = grad_inputs(args)
    fwd, bwd, bwd_input = Tally(), Tally(), Tally()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode.phase(fwd):
        out = forward(inputs)
    roots, grads = backward_roots(out)
    if roots:
        with mode.phase(bwd):
            torch.autograd.backward(roots, grads)
    outputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in _as_flat_outputs(out)) if not last else ()
    del out, roots, grads
    keep.clear()  # release the saved tensors held for their storage ids

    # I of F/I/W: a fresh forward (charged to nothing), then gradients w.r.t. the inputs only.
    inputs = grad_inputs(args)
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if wanted:
        with mode.phase(Tally()):
            out = forward(inputs)
        roots, grads = backward_roots(out)
        if roots:
            with mode.phase(bwd_input):
                torch.autograd.grad(roots, wanted, grads, allow_unused=True)
    return _BlockRun(fwd, bwd, bwd_input, sum(saved.values()), outputs)


def _as_flat_outputs(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def optimizer_step_seconds(
    params: int, param_bytes: int, n_tensors: int, hw: HardwareSpec, optimizer: OptimizerSpec
) -> float:
    """Optimizer step over ``params`` parameters: memory-bound passes, counted pass by pass.

    ``torch.optim.AdamW``'s default implementation (for-each on a GPU, a per-tensor loop on a
    CPU; both run the same element-wise passes) streams per element, with p = parameter bytes,
    g = gradient bytes (= p) and s = 4 (fp32 state):

    - weight decay ``param.mul_``: 2p; ``exp_avg.lerp_(grad)``: 2s + g;
    - ``exp_avg_sq.mul_(b2)``: 2s; ``.addcmul_(grad, grad)``: 2s + 2g;
    - ``denom = (exp_avg_sq.sqrt() / bc2).add_(eps)``: 6s; ``param.addcdiv_(exp_avg, denom)``: 2p + 2s;

    4p + 3g + 14s in all (84 B per fp32 parameter; a fused kernel would need 28). Under mixed
    precision the step runs on the fp32 master copy (p = g = 4) plus casting the gradient up (2 + 4
    for bf16) and the master down (4 + 2) — the master and moments of ZeRO's 2 + 2 + 12 bytes per
    parameter (Rajbhandari et al. 2020). Plain SGD streams ``param.add_(grad)``: 2p + g. On a CPU
    each parameter tensor also pays the per-operator overhead of its ~9 operators (one for SGD).

    Args:
        params: number of parameters.
        param_bytes: their bytes in the planning dtype (gradients have the same size).
        n_tensors: number of parameter tensors.
        hw: the hardware.
        optimizer: which optimizer.

    Returns:
        Seconds for one step.
    """
    if params == 0:
        return 0.0
    width = param_bytes / params
    narrow = width < 4
    p = g = 4.0 if narrow else width
    per_param = (4 * p + 3 * g + 14 * 4) if optimizer.name == "adamw" else (2 * p + g)
    if narrow:
        per_param += (width + 4) + (4 + width)  # grad up-cast, master down-cast
    ops = 9 if optimizer.name == "adamw" else 1
    overhead = 0.0 if hw.async_launch else n_tensors * ops * hw.op_overhead_s
    return params * per_param / (hw.memory_Bps * hw.memory_efficiency) + overhead


def grad_pass_seconds(params: int, param_bytes: int, n_tensors: int, hw: HardwareSpec, clip: bool) -> float:
    """The runner's passes over a block's gradients before its optimizer step, counted as memory traffic.

    Averaging over the microbatches (``grad.mul_``: read and write, 2g), the clipping norm (read, g)
    and, when clipping, the scale (2g), with g the gradient bytes (= the parameter bytes); on a CPU
    each tensor also pays the per-operator overhead of each pass.

    Args:
        params: number of parameters.
        param_bytes: their bytes (gradients have the same size).
        n_tensors: number of parameter tensors.
        hw: the hardware.
        clip: whether the run clips.

    Returns:
        Seconds per step.
    """
    if params == 0:
        return 0.0
    passes = 5 if clip else 3
    ops = 3 if clip else 2
    overhead = 0.0 if hw.async_launch else n_tensors * ops * hw.op_overhead_s
    return passes * param_bytes / (hw.memory_Bps * hw.memory_efficiency) + overhead


def estimate_blocks(
    traced: TracedModel,
    inputs: tuple,
    target: torch.Tensor,
    loss_fn: LossFn,
    hw: HardwareSpec,
    dtype: str = "bf16",
    optimizer: OptimizerSpec | None = None,
    progress: bool = True,
) -> list[BlockCost]:
    """Estimate every block's costs on ``hw`` from FLOPs and bytes, without running real kernels.

    Works on a model built on the meta device (``with torch.device("meta"): model = build()``,
    traced on meta inputs) and on a real one; either way nothing is computed on real data and no
    weights are allocated. The traced model's parameters are not changed.

    Args:
        traced: the model, traced on a microbatch of the same shape as ``inputs``.
        inputs: positional inputs of one microbatch (meta or real).
        target: the microbatch's target (the last block includes the loss).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        hw: the hardware (``planner.core.hardware.get_hardware`` or ``calibrated_cpu``).
        dtype: planning dtype of parameters and activations: "bf16", "fp16", "fp32", or "tf32"
            (fp32 storage, matmuls at the TF32 peak). Floating parameters, buffers and
            activations crossing blocks are cast to it.
        optimizer: the run's optimizer; its step over each block's parameters is estimated as a
            memory-bound pass (``optimizer_step_seconds``). None leaves ``opt_s`` at 0.
        progress: show a progress bar.

    Returns:
        One BlockCost per block, in block order: fwd_s, bwd_s (= bwd_input_s + bwd_weight_s),
        recompute_s (= fwd_s), flops_fwd/flops_bwd, opt_s, parameter, activation and cut bytes
        in ``dtype``.

    Raises:
        PlannerError: for a dtype the hardware lacks, a model traced by module boundaries (no
            graph to cut), or a block that cannot run on the meta device.
    """
    if dtype not in DTYPES:
        raise PlannerError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    hw.peak(dtype)  # unsupported dtype: one clear error before any work
    if not isinstance(traced, GraphTrace):
        raise TraceError(
            "analytical estimation needs a graph, but this model was traced by module boundaries "
            f"({'; '.join(r for _, r in traced.failures)}); make it traceable by torch.fx or torch.export"
        )
    tdtype = TORCH_DTYPES[dtype]
    width = dtype_bytes(dtype)
    n = len(traced.blocks)
    traced.model.train()
    current = _meta_inputs(stage_inputs(inputs), tdtype)  # the first stage takes the tensors
    target = _meta_like(target.detach(), tdtype)
    owned = traced.owned_parameters()
    costs: list[BlockCost] = []
    # The estimate is a function of the block's operations and shapes only: the 80 identical layers
    # of a Llama-70B are estimated once (the roofline is re-run only for a block not seen before).
    seen: dict[str, _BlockRun] = {}
    bar = tqdm(traced.blocks, desc="estimating blocks", unit="block", disable=None if progress else True, leave=False)
    for k, block in enumerate(bar):
        stage = build_stage_module(traced, k, k + 1, check_cuts=False)
        _fuse_attention_nodes(stage)
        last = k == n - 1
        key = structure_key(stage, current, last)
        if key in seen:
            run = seen[key]
            costs.append(_block_cost(traced, k, owned[k], run, hw, width, optimizer))
            current = tuple(_meta_like(t, tdtype) if isinstance(t, torch.Tensor) else t for t in run.outputs)
            continue
        try:
            run = _run_block(stage, current, last, target, loss_fn, hw, dtype, tdtype, None)
        except RuntimeError as first:
            if tdtype == torch.float32:
                raise _meta_error(block.name, first) from first
            # Model code that makes fp32 tensors of its own (``torch.arange(n).float()``) cannot
            # mix with cast weights; run the block in fp32 and count floating bytes at ``width``.
            try:
                run = _run_block(
                    stage,
                    _meta_inputs(current, torch.float32),
                    last,
                    _meta_like(target, torch.float32),
                    loss_fn,
                    hw,
                    dtype,
                    torch.float32,
                    width,
                )
            except RuntimeError as e:
                raise _meta_error(block.name, e) from e
        seen[key] = run
        costs.append(_block_cost(traced, k, owned[k], run, hw, width, optimizer))
        current = tuple(_meta_like(t, tdtype) if isinstance(t, torch.Tensor) else t for t in run.outputs)
    bar.close()
    return costs


def structure_key(stage: torch.fx.GraphModule, inputs: tuple, last: bool) -> str:
    """What a block's estimate depends on: its operations in order (arguments as positions or
    constants), the shapes and dtypes of its parameters, buffers and inputs, and whether it ends
    the model (the loss). Node and parameter *names* are left out, so identical layers share a key.

    Args:
        stage: the block as a module (``build_stage_module``).
        inputs: its inputs.
        last: whether it is the model's last block.

    Returns:
        The key (text).
    """
    ids: dict[str, int] = {}

    def show(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"T{tuple(value.shape)}{value.dtype}{value.requires_grad}"
        if isinstance(value, torch.nn.Module):
            state = [(tuple(t.shape), t.dtype, t.requires_grad) for t in (*value.parameters(), *value.buffers())]
            return f"M{value!r}{state}"
        return repr(value)

    parts = []
    for i, node in enumerate(stage.graph.nodes):
        ids[node.name] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{ids[a.name]}")  # type: ignore[arg-type,return-value]
        if node.op == "placeholder":
            target = ""  # its name is the value it receives: only its position counts
        elif node.op == "get_attr":
            target = show(get_attr(stage, str(node.target)))
        elif node.op == "call_module":
            target = show(stage.get_submodule(str(node.target)))
        else:
            target = (
                node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
            )
            target = f"{getattr(node.target, '__module__', '')}.{target}"
        parts.append(f"{node.op}|{target}|{args!r}")
    return repr((parts, [show(x) for x in inputs], last))


def _block_cost(
    traced: TracedModel,
    k: int,
    params: list[torch.nn.Parameter],
    run: _BlockRun,
    hw: HardwareSpec,
    width: int,
    optimizer: OptimizerSpec | None,
) -> BlockCost:
    """Block k's record from its roofline run: W = B - I, recompute = the forward, sizes in the planning dtype."""
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * (width if p.is_floating_point() else p.element_size()) for p in params)
    out_bytes = sum(
        t.numel() * (width if t.is_floating_point() else t.element_size())
        for t in run.outputs
        if isinstance(t, torch.Tensor)
    )
    bwd_input_s = min(run.bwd_input.seconds, run.bwd.seconds)
    opt_s = grad_s = None
    if optimizer is not None:
        n_tensors = sum(1 for p in params if p.requires_grad)
        opt_s = optimizer_step_seconds(n_params, param_bytes, n_tensors, hw, optimizer)
        grad_s = grad_pass_seconds(n_params, param_bytes, n_tensors, hw, optimizer.grad_clip is not None)
    return block_cost(
        traced,
        k,
        params,
        fwd_s=run.fwd.seconds,
        bwd_s=run.bwd.seconds,
        bwd_input_s=bwd_input_s,
        bwd_weight_s=run.bwd.seconds - bwd_input_s,
        recompute_s=run.fwd.seconds,
        flops_fwd=run.fwd.flops,
        flops_bwd=run.bwd.flops,
        opt_s=opt_s,
        grad_s=grad_s,
        activation_bytes=run.saved_bytes,
        float_bytes=width,
        cut_bytes=out_bytes,
    )


def _meta_error(block: str, e: Exception) -> PlannerError:
    text = " ".join(str(e).split())
    if len(text) > 200:
        text = text[:200] + "..."
    return PlannerError(
        f"block {block} cannot run on the meta device for estimation ({type(e).__name__}: {text}); "
        "operators that read tensor values (.item(), nonzero, data-dependent shapes) need a measured profile instead"
    )
