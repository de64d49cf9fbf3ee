"""The roofline: every aten operator charged by its FLOPs and bytes on a ``HardwareSpec``.

A ``TorchDispatchMode`` (``Roofline``) sees every aten operator a block runs on the ``meta``
device and charges it

    max(flops / (peak[dtype] * efficiency), bytes / (memory_Bps * memory_efficiency))

where the efficiency is the operation class's (docs/gpu_costs.md): a GEMM's follows its shape
(``HardwareSpec.gemm_efficiency``), fused attention's is its kernel's forward or backward figure
(``HardwareSpec.attention_efficiency``; ``fused_attention`` routes ``scaled_dot_product_attention``
through one node charged as the fused kernel a GPU runs), anything else with FLOPs takes
``matmul_efficiency``; plus a fixed per-operator overhead (added on a CPU, which runs kernels
inline; hidden behind longer kernels on a GPU, which queues them). FLOPs come from
``torch.utils.flop_counter``'s formula registry, bytes are every input and output tensor of the
operator with stride-0 (broadcast) dimensions counted once (RuntimeEstimator's ``get_num_bytes``);
operators without a FLOP formula are decomposed first, exactly as ``FlopCounterMode`` does, so the
FLOP totals equal its counts. ``Tally`` keeps the totals.
``planner.costs.estimate`` runs each block under it; ``planner.costs.cpu`` uses it to calibrate
this machine's CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from planner.capture.attention import SDPA_CALLS, sdpa_arguments
from planner.capture.checkpoint import KeepRule
from planner.core.levers.hardware import UNFUSED_ATTENTION, HardwareSpec
from planner.costs.backward_temps import storage_bytes
from planner.costs.fusion import Fusion
from planner.torch_compat import (
    FLOAT8_DTYPES,
    TorchDispatchMode,
    decomposes,
    float8_payload,
    pytree,
    storage_id,
    swapped_sdpa,
)

aten = torch.ops.aten

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
# The aten operators (after decomposition: linear and matmul reach these) that torch.autocast runs in
# its lower precision, casting their fp32 inputs (torch's autocast op reference, "CUDA Ops that can
# autocast to float16").
_AUTOCAST_LOWER = _GEMMS | {aten.convolution}
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
        kept_seconds: of ``seconds``, the operators selective checkpointing keeps the outputs of
            (``planner.capture.checkpoint.KeepRule``: matmuls, convolutions, attention), which a
            selective recomputation does not run again.
        kept: those outputs, storage id -> bytes (what selective checkpointing keeps).
    """

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    ops: int = 0
    kept_seconds: float = 0.0
    kept: dict[int, int] = field(default_factory=dict)
    kv_bytes: int = 0  # keys and values read by fused attention (what context parallelism gathers)
    q_bytes: int = 0  # the queries of masked (causal) attention: what context parallelism's mirrored blocks swap
    attention_s: float = 0.0  # the fused attention kernels' own seconds: what a ring's sends hide behind

    def kept_bytes(self, besides: Sequence[torch.Tensor] = ()) -> int:
        """Bytes of the kept outputs, those sharing storage with ``besides`` left out (a block's own
        output: the next region's input, counted there)."""
        skip = {storage_id(t) for t in besides}
        return sum(v for k, v in self.kept.items() if k not in skip)


def tensor_bytes(t: torch.Tensor, float_bytes: int | None = None) -> int:
    """Bytes an operator touches in ``t``: broadcast (stride-0) dimensions count once.

    Args:
        t: a tensor (meta or real).
        float_bytes: bytes per element to assume for floating tensors (None: their own size).

    Returns:
        Bytes.
    """
    data = float8_payload(t)  # torchao's float8 tensor: its payload, a byte an element (its dtype says bf16)
    if data is not None:
        t, float_bytes = data, None
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    wide = float_bytes is not None and t.is_floating_point() and t.dtype not in FLOAT8_DTYPES
    return n * (float_bytes if wide and float_bytes is not None else t.element_size())


class Roofline(TorchDispatchMode):
    """Charges each aten operator roofline time on a ``HardwareSpec``, into ``self.tally``.

    Args:
        hw: the hardware.
        dtype: the planning dtype ("tf32" makes fp32 operators use the TF32 peak).
        float_bytes: count floating tensors as this many bytes per element, and fp32 operators at
            the planning dtype's peak (used when a block had to run in fp32 although the plan is for
            a narrower dtype: its fp32 tensors stand for the planning dtype's); None: as they are.
        fuse: charge the block as ``torch.compile`` runs it: each run of memory-bound operators between
            GEMMs, attention and collectives as one kernel (``planner.costs.fusion``); views free.
    """

    def __init__(self, hw: HardwareSpec, dtype: str, float_bytes: int | None = None, fuse: bool = False) -> None:
        super().__init__()
        self.hw = hw
        self.dtype = dtype
        self.float_bytes = float_bytes
        self.fuse = fuse
        self.fusion: Fusion | None = None  # the running phase's regions, under ``fuse``
        # operators outside aten that no FLOP formula covers and no decomposition reaches (a library's
        # custom op): charged their bytes only, which is right for a copy and far too little for a
        # matrix product (transformers' MoE experts were such an op): said to the user, not hidden
        self.no_formula: set[str] = set()
        self.tally = Tally()
        # Eager operators on a GPU: when the host has issued the phase's operators so far, and when the
        # GPU finishes their kernels (``_gpu_seconds``)
        self._host = 0.0
        self._device = 0.0
        # the kept outputs (Tally.kept), held so that no later tensor reuses their storage ids
        self.alive: list[torch.Tensor] = []
        self.keep = KeepRule()  # which outputs selective checkpointing keeps (the charged forward runs first)
        # storages read by the operators autocast runs in the lower precision (GEMMs, convolutions):
        # where the run autocasts over fp32 weights, the ones among them that are parameters are cast
        # copies there, saved for backward per microbatch (``planner.costs.estimate``)
        self.cast_inputs: set[int] = set()
        # An operator runs at the peak of its output dtype (an fp32 loss on a bf16 model runs at the
        # fp32 peak); "tf32" plans run fp32 matmuls on the TF32 tensor cores.
        self._peaks: dict[torch.dtype, float] = {}
        for key, tdt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if key in hw.peak_flops:
                self._peaks[tdt] = hw.peak_flops[key]
        if dtype == "tf32":
            self._peaks[torch.float32] = hw.peak("tf32")
        self._default_peak = hw.peak(dtype)
        if float_bytes is not None:
            # a block run in fp32 for a bf16 plan (model code mixing its own fp32 tensors with cast
            # weights, e.g. a router's fp32 weights into a bf16 index_add): charged at the fp32
            # peak, a Mixtral layer's experts took 11x their bf16 time
            self._peaks[torch.float32] = self._default_peak

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
            # the regions as they were, should the parts be charged as one operator after all
            before = self.fusion.snapshot() if self.fusion is not None and decomposes(func) else None
            clocks = self._host, self._device
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
                    if self.fusion is not None and before is not None:
                        self.fusion.restore(before)
                    self._host, self._device = clocks  # the parts were not issued: the whole operator is
                    self._charge(func, args, kwargs, r)
                return r
            self._host, self._device = clocks
        out = func(*args, **kwargs)
        self._charge(func, args, kwargs, out)
        return out

    def charge_fused(
        self,
        flops: float,
        tensors: list[torch.Tensor],
        dtype: torch.dtype,
        efficiency: float,
        kept: Sequence[torch.Tensor] = (),
    ) -> None:
        """Charge one fused kernel (attention) that reads and writes ``tensors`` at ``efficiency`` of
        peak; ``kept``: its outputs, which selective checkpointing keeps (empty: the kernel is not kept)."""
        if self.fusion is not None:
            self.fusion.barrier(tensors)
        nbytes = sum(tensor_bytes(t, self.float_bytes) for t in tensors)
        hw = self.hw
        roof = max(flops / (self._peak(dtype) * efficiency), nbytes / (hw.memory_Bps * hw.memory_efficiency))
        seconds = self._gpu_seconds(max(roof, hw.op_overhead_s)) if hw.async_launch else roof + hw.op_overhead_s
        held = {storage_id(t): tensor_bytes(t, self.float_bytes) for t in kept}
        self.alive.extend(kept)
        self._add(Tally(float(flops), nbytes, seconds, 1, seconds if kept else 0.0, held, attention_s=roof))

    @contextlib.contextmanager
    def phase(
        self, tally: Tally, saves: Callable[[Fusion], tuple[set[int], set[int]]] | None = None
    ) -> Iterator[Tally]:
        """Charge everything run inside into ``tally`` (attention as one fused kernel where it is;
        under ``fuse``, memory-bound operators as the kernels ``torch.compile`` fuses them into).

        Args:
            tally: where the phase's costs go.
            saves: under ``fuse``, asked of the phase's regions at its end: the storages the compiled
                backward recomputes and those the compiled block keeps (``Fusion.compiled_saves``),
                which decide what the forward writes (``Fusion.settle``).
        """
        self.tally = tally
        self.fusion = Fusion() if self.fuse else None
        self._host = self._device = 0.0  # a phase starts with the GPU idle and nothing issued
        try:
            with fused_attention(self), self:
                yield tally
        finally:
            if self.fusion is not None:
                recomputed, kept = saves(self.fusion) if saves is not None else (set(), set())
                self._settle(self.fusion.settle(recomputed, kept), tally)
            elif self.hw.async_launch:  # the host still issuing (views) after the GPU's last kernel
                tally.seconds += max(0.0, self._host - self._device)
            self.fusion = None

    @contextlib.contextmanager
    def unfused(self) -> Iterator[None]:
        """Operators run inside are charged as eager ones (a compiled stage's loss, which the pipeline
        runs outside the stage module), and take no part in the phase's regions."""
        paused, self.fusion = self.fusion, None
        try:
            yield
        finally:
            self.fusion = paused

    def _settle(self, regions: dict[int, tuple[int, int]], tally: Tally) -> None:
        """Replace the regions' provisional charges by their kernels' (``Fusion.settle``'s bytes)."""
        hw = self.hw
        bandwidth = hw.memory_Bps * hw.memory_efficiency
        for charged, moved in regions.values():
            before = charged / bandwidth + hw.op_overhead_s
            after = (
                max(moved / bandwidth, hw.op_overhead_s) if hw.async_launch else moved / bandwidth + hw.op_overhead_s
            )
            tally.seconds += after - before
            tally.bytes += moved - charged

    def _gpu_seconds(self, kernel_s: float) -> float:
        """Seconds one operator adds to a GPU phase whose kernel takes ``kernel_s`` (0: a view).

        Compiled code (under ``fuse``) issues its kernels from a tight wrapper: the kernel alone. Eager
        code issues operators one after another from the host, ``dispatch_s`` each; the GPU starts a
        kernel once it is issued and the kernel before it is done. The operator is charged what it moves
        the end of the GPU's work by: its kernel, plus any wait for the host. Long kernels let the host
        run ahead and hide its dispatch; a run of short operators waits on the host (docs/gpu_costs.md:
        a small GPT on an H200 ran at the host's pace, 4x its kernels' time).
        """
        if self.fusion is not None:
            return kernel_s
        self._host += self.hw.dispatch_s
        if kernel_s <= 0.0:
            return 0.0
        start = max(self._device, self._host)
        charged = start + kernel_s - self._device
        self._device = start + kernel_s
        return charged

    def _add(self, other: Tally) -> None:
        self.tally.flops += other.flops
        self.tally.bytes += other.bytes
        self.tally.seconds += other.seconds
        self.tally.ops += other.ops
        self.tally.kept_seconds += other.kept_seconds
        self.tally.kept.update(other.kept)
        self.tally.kv_bytes += other.kv_bytes
        self.tally.q_bytes += other.q_bytes
        self.tally.attention_s += other.attention_s

    def _charge(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        packet = func.overloadpacket
        if packet in _FREE:
            return
        grouped = None  # looked up only for operators flop_counter has no formula for (every op passes here)
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        else:
            grouped = grouped_gemm(func, args)
            flops = grouped[0] if grouped is not None else 0.0
            if grouped is None and getattr(func, "namespace", "aten") not in _CORE_NAMESPACES:
                self.no_formula.add(func.name())
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
        if packet in _AUTOCAST_LOWER:
            self.cast_inputs.update(
                storage_id(_payload(t)) for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)
            )
        if self.fusion is not None and self._fused(func, flops, moves, args, kwargs, out):
            return
        hw = self.hw
        peak = self._peak(float_dtype)
        relaid = 0
        if flops and packet in _GEMMS:
            relaid = _float8_relayout_bytes(args)
            efficiency = hw.gemm_efficiency(*_gemm_dims(packet, args), fp8=relaid >= 0)
            if relaid >= 0:  # float8 operands (torchao): the FP8 tensor cores' peak
                peak = hw.peak("fp8")
        elif flops and grouped is not None:
            efficiency = hw.gemm_efficiency(*grouped[1])
        else:
            efficiency = hw.matmul_efficiency
        compute = flops / (peak * efficiency) if flops else 0.0
        # the FP8 GEMM takes its first operand row-major and its second column-major: torchao copies an operand
        # laid out otherwise first (eager: read and write a byte an element; compiled, the cast writes the
        # second layout itself, a byte an element more: torchao's roofline, testing/training/roofline_utils.py)
        nbytes += max(relaid, 0) // (2 if self.fuse else 1)
        memory = nbytes / (hw.memory_Bps * hw.memory_efficiency)
        roof = max(compute, memory)
        if hw.async_launch:
            seconds = self._gpu_seconds(max(roof, hw.op_overhead_s) if moves or flops else 0.0)
        else:
            seconds = roof + hw.op_overhead_s
        if self.keep.keeps(func):
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            held = {storage_id(t): tensor_bytes(t, self.float_bytes) for t in outs}
            self.alive.extend(outs)
            self._add(Tally(flops, nbytes, seconds, 1, seconds, held))
        else:
            self._add(Tally(flops, nbytes, seconds, 1))

    def _fused(self, func: Any, flops: float, moves: bool, args: tuple, kwargs: dict, out: Any) -> bool:
        """Under ``fuse``: charge a memory-bound operator into its region (True), or end the region
        at a barrier, which is then charged as ever (False). Views are free in a compiled graph."""
        assert self.fusion is not None
        read = [_payload(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        made = [_payload(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if flops or getattr(func, "namespace", "aten") not in _FUSED_NAMESPACES:
            self.fusion.barrier(read, made)
            return False
        if not moves:
            return True
        # what AOTAutograd's partitioner recomputes in backward rather than save: no reduction's result
        # (ban_recompute_reductions: an output smaller than the operator's largest input), nothing random
        widest = max((t.numel() for t in read), default=0)
        random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        nbytes, opened = self.fusion.operator(
            [(t, tensor_bytes(t, self.float_bytes)) for t in read],
            [(t, tensor_bytes(t, self.float_bytes), not random and t.numel() >= widest) for t in made],
            {storage_id(t): storage_bytes(t, self.float_bytes) for t in read},
        )
        hw = self.hw
        seconds = nbytes / (hw.memory_Bps * hw.memory_efficiency) + (hw.op_overhead_s if opened else 0.0)
        self._add(Tally(0.0, nbytes, seconds, 1 if opened else 0))
        return True


_CORE_NAMESPACES = {"aten", "prim", "prims", "_c10d_functional", "c10d_functional", "c10d"}
# Operators inductor generates code for and fuses; collectives and libraries' custom operators run as
# their own kernels (barriers).
_FUSED_NAMESPACES = {"aten", "prim", "prims"}

# Grouped GEMMs (mixture-of-experts layers: every token's rows times its experts' weights), which
# torch.utils.flop_counter has no formula for: charged zero FLOPs, a Mixtral layer's experts cost
# nothing. torch's own kernel, and transformers' fallback (a custom op, fp32 on CPUs and older torch)
# with its backward, which computes the input and the weight gradients.
_GROUPED_GEMMS = {
    "aten::_grouped_mm": 1,
    "transformers::grouped_mm_fallback": 1,
    "transformers::grouped_mm_fallback_backward": 2,
}


def _payload(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory an operator reads: a float8 training tensor's payload (which the cast before
    it wrote), else ``t``."""
    data = float8_payload(t)
    return t if data is None else data


def _float8_relayout_bytes(args: tuple) -> int:
    """-1 for a GEMM of plain tensors; for one of torchao's float8 GEMMs (``aten.mm`` on float8 training
    tensors), the bytes copying its operands into the layout ``torch._scaled_mm`` takes costs: the first
    row-major, the second column-major (torchao's ``preprocess_addmm``), read and written once each."""
    a, b = (float8_payload(x) for x in args[-2:])
    if a is None or b is None:
        return -1
    copied = 0 if a.stride()[-1] == 1 else 2 * a.numel()
    return copied + (0 if b.stride()[0] == 1 and b.dim() == 2 else 2 * b.numel())


def grouped_gemm(func: Any, args: tuple) -> tuple[float, tuple[int, int, int]] | None:
    """FLOPs of a grouped GEMM and one group's average ``(m, n, k)``; None for any other operator.

    ``_grouped_mm(a, b, offs)``: a (T, K) x b (G, K, N) → (T, N), the T rows split into G groups by
    ``offs``; a (M, K) x b (K, N) with K split → (G, M, N) (a weight gradient); a (G, M, K) x b (K, N)
    with N split → (M, N); a (G, M, K) x b (G, K, N) → (G, M, N). Each multiplies every row once, so the
    FLOPs are those of the ungrouped product, whatever the routing put in each group.
    """
    name = func.name() if callable(getattr(func, "name", None)) else ""  # an OpOverload: "aten::_grouped_mm"
    times = _GROUPED_GEMMS.get(name)
    if times is None or len(args) < 2:
        return None
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    if a.dim() == 2 and b.dim() == 3:
        groups, (m, k), n = b.shape[0], a.shape, b.shape[-1]
        flops, dims = 2.0 * m * k * n, (max(1, m // groups), n, k)
    elif a.dim() == 2 and b.dim() == 2:
        (m, k), n = a.shape, b.shape[-1]
        groups = int(args[2].shape[0]) if len(args) > 2 and isinstance(args[2], torch.Tensor) else 1
        flops, dims = 2.0 * m * k * n, (m, n, max(1, k // groups))
    elif a.dim() == 3 and b.dim() == 2:
        groups, m, k = a.shape
        n = b.shape[-1]
        flops, dims = 2.0 * m * k * n, (m, max(1, n // groups), k)
    elif a.dim() == 3 and b.dim() == 3:
        groups, m, k = a.shape
        n = b.shape[-1]
        flops, dims = 2.0 * groups * m * k * n, (m, n, k)
    else:
        return None
    return times * flops, (int(dims[0]), int(dims[1]), int(dims[2]))


def _gemm_dims(packet: Any, args: tuple) -> tuple[int, int, int]:
    """``(m, n, k)`` of a GEMM operator's ``(m x k) @ (k x n)``, batch dimensions folded into m."""
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return batch * int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1])


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
        o = attention_output(q, v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        share = 0.5 if causal else 1.0
        roof.charge_fused(
            share * sdpa_flop_count(q.shape, _as_query_heads(q, k), _as_query_heads(q, v)),
            [q, k, v, o, lse] + ([mask] if mask is not None else []),
            q.dtype,
            roof.hw.attention_efficiency(backward=False),
            kept=[o, lse],
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
            ctx.share * sdpa_backward_flop_count(do.shape, q.shape, _as_query_heads(q, k), _as_query_heads(q, v)),
            [q, k, v, o, lse, do, dq, dk, dv],
            q.dtype,
            ctx.roof.hw.attention_efficiency(backward=True),
        )
        return None, dq, dk, dv, None, None


def _as_query_heads(q: torch.Tensor, kv: torch.Tensor) -> torch.Size:
    """``kv``'s shape with the query's head count: grouped-query attention computes every query head
    against its group's keys, so it costs what attention with as many key heads as query heads costs
    (torch 2.11's ``sdpa_flop_count`` refuses shapes with fewer key heads; 2.13 counts the same)."""
    return torch.Size((*kv.shape[:-3], q.shape[-3], *kv.shape[-2:]))


def attention_output(q: torch.Tensor, dim_v: int) -> torch.Tensor:
    """The fused kernel's output for query ``q`` (b, a, s, d): laid out as (b, s, a, d) when the
    query is (a transposed view of a contiguous (b, s, a, d)), else as (b, a, s, d)."""
    b, a, s, _ = q.shape
    if q.transpose(1, 2).is_contiguous():
        return q.new_empty((b, s, a, dim_v)).transpose(1, 2)
    return q.new_empty((b, a, s, dim_v))


_ORIGINAL_SDPA = SDPA_CALLS[0]
_ACTIVE: list[Roofline] = []  # the Roofline whose phase is running (innermost last)


def _sdpa(*args: Any, **kwargs: Any) -> Any:
    """``F.scaled_dot_product_attention`` as charged: fused where a fused kernel runs (see below)."""
    if _ACTIVE:
        roof = _ACTIVE[-1]
        a = sdpa_arguments(args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        fused = roof.hw.async_launch or not a.get("dropout_p", 0.0)
        if fused and q.dim() == 4 and k.dim() == 4 and v.dim() == 4 and q.shape[1] % k.shape[1] == 0:
            mask, causal = a.get("attn_mask"), bool(a.get("is_causal", False))
            # what context parallelism exchanges, whichever kernel runs (planner.core.levers.context_parallel)
            roof.tally.kv_bytes += tensor_bytes(k, roof.float_bytes) + tensor_bytes(v, roof.float_bytes)
            roof.tally.q_bytes += tensor_bytes(q, roof.float_bytes) if causal or mask is not None else 0
            if roof.hw.attention_backend == UNFUSED_ATTENTION:
                return _UnfusedAttention.apply(roof, q, k, v, mask)
            return _FusedAttention.apply(roof, q, k, v, mask, causal)
    return _ORIGINAL_SDPA(*args, **kwargs)


class _UnfusedAttention(torch.autograd.Function):
    """Attention as code before fused kernels ran it (``--attention-kernel unfused``; Megatron-LM
    2021's ``ParallelAttention``): a batched GEMM for the scores, one kernel that scales, masks and
    softmaxes them (``FusedScaleMaskSoftmax``: the scale folded into the GEMM, a causal mask computed
    in the kernel, no mask tensor made), and a batched GEMM with the values; backward, the two GEMMs'
    four and the softmax's own kernel. The GEMMs run every score, the masked ones too (no causal
    half), charged as any batched GEMM (strided: no copies of the heads); the scores and
    probabilities, S x S per head, pass through memory, and the probabilities stay saved for
    backward beside the queries, keys and values. Grouped keys and values are charged at the query's
    heads, as torch's math path repeats them. Attention dropout is left out (the fused kernels above
    charge none either).
    """

    @staticmethod
    def forward(
        ctx: Any, roof: Roofline, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, a, s, d = q.shape
        n, t, dv = b * a, k.shape[-2], v.shape[-1]
        scores = torch.bmm(q.new_empty((n, s, d)), k.new_empty((n, d, t)))
        probs = torch.empty_like(scores)
        roof.charge_fused(0.0, [scores, probs] + ([mask] if mask is not None else []), scores.dtype, 1.0)
        out = torch.bmm(probs, v.new_empty((n, t, dv)))
        ctx.save_for_backward(q, k, v, probs)
        ctx.roof = roof
        return out.view(b, a, s, dv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, probs = ctx.saved_tensors
        n, s, t = probs.shape
        d, dv = q.shape[-1], v.shape[-1]
        g = grad.new_empty((n, s, dv))
        grad_probs = torch.bmm(g, v.new_empty((n, dv, t)))
        torch.bmm(probs.transpose(1, 2), g)  # the values' gradient
        grad_scores = torch.empty_like(probs)
        ctx.roof.charge_fused(0.0, [probs, grad_probs, grad_scores], probs.dtype, 1.0)
        torch.bmm(grad_scores, k.new_empty((n, t, d)))  # the queries'
        torch.bmm(grad_scores.transpose(1, 2), q.new_empty((n, s, d)))  # the keys'
        return None, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@contextlib.contextmanager
def fused_attention(roof: Roofline) -> Iterator[None]:
    """Route scaled-dot-product attention to ``_FusedAttention`` where a fused kernel runs.

    GPUs have a fused kernel for every case here (FlashAttention; memory-efficient attention for
    fp32 and masks). PyTorch's CPU flash kernel has no dropout, so on a CPU attention with dropout
    stays unfused, as it runs there. Two routes lead here: fx graphs that call the function
    directly have their nodes retargeted (``fuse_attention_nodes``), and the module attribute is
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


def fuse_attention_nodes(stage: torch.fx.GraphModule) -> None:
    """Point the stage's attention calls at ``_sdpa`` (the stage is this module's private copy):
    fx graphs call ``F.scaled_dot_product_attention``, torch.export graphs the aten operator
    (same parameters), which would otherwise decompose into the unfused math on the meta device."""
    changed = False
    for node in stage.graph.nodes:
        if node.op == "call_function" and node.target in SDPA_CALLS:
            node.target = _sdpa
            changed = True
    if changed:
        stage.recompile()
