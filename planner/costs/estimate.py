"""Analytical per-block costs for hardware that is not here: FLOPs and bytes → roofline time.

Costs for hardware that is not here (docs/architecture.md, "Costs"). Each distinct block of a graph-traced
model (``block_key``: the 80 identical layers of a Llama-70B are one) is cut out as its own module
(``planner.capture.stage.stage_graph``, as ``planner.costs.measure`` does) and run forward and backward
on the ``meta`` device, where operators compute shapes but no data, under the roofline
(``planner.costs.roofline.Roofline``: every aten operator charged
``max(flops / (peak * efficiency), bytes / (memory_Bps * memory_efficiency))`` plus a per-operator
overhead, the efficiency by the operation's class: docs/gpu_costs.md). This is the per-operator
roofline of ``torch.distributed._tools.runtime_estimator.RuntimeEstimator``'s
"operator-level-cost-model" mode, with the peak numbers of a ``HardwareSpec`` instead of the
local device's.

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

import copy
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.func import functional_call
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.float8 import convert_stage
from planner.capture.load import move_model
from planner.capture.signature import block_structure, node_target, show
from planner.capture.stage import stage_graph, stage_inputs
from planner.capture.trace import trace_model
from planner.core.levers.hardware import DTYPES, HardwareSpec, dtype_bytes
from planner.costs.backward_temps import BackwardTemps, forward_backward_temps, storage_bytes
from planner.costs.blocks import block_cost
from planner.costs.fusion import Fusion
from planner.costs.roofline import Roofline, Tally, fuse_attention_nodes
from planner.costs.timing import backward_roots, grad_inputs, leaf_safe
from planner.errors import PlannerError, TraceError
from planner.schema.costs import BlockCost, OptimizerSpec
from planner.schema.plan_parts import Float8Linears
from planner.torch_compat import pytree, storage_id

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
aten = torch.ops.aten

TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def costed_trace(
    traced: TracedModel, model: torch.nn.Module, inputs: tuple, dtype: str
) -> tuple[TracedModel, torch.nn.Module]:
    """The trace an estimate costs, and its model: ``traced`` itself, or for a torch.export graph in a
    16-bit dtype a trace of the model cast to it.

    The plan names the graph of the model as built (fp32), as `planner run` traces it: a model whose
    code branches on its weights' dtype (T5's layer norm casts to a 16-bit weight's dtype;
    transformers runs experts as ``torch._grouped_mm`` in bf16, a custom op in fp32) traced cast to
    bf16 into another graph, and its GPU plan was refused at run. But an export graph bakes the dtypes
    of its casts: transformers' RMSNorm upcasts to fp32 and casts back to the input's dtype, fp32 when
    traced so, and the fp32 graph run on bf16 weights stayed in fp32 after the first norm (a Llama-70B
    layer's activations counted 7 GB, not 3). So such a model is costed on its bf16 trace, block by
    block (the same blocks: both traces name them by module). fx graphs keep casts as calls on the
    tensor: one trace serves both.

    Args:
        traced: the model as built, traced on meta inputs.
        model: that model (on the meta device).
        inputs: the meta inputs it was traced on.
        dtype: the planning dtype.

    Returns:
        The trace to cost and its model.
    """
    if traced.method != "export" or dtype in ("fp32", "tf32"):
        return traced, model
    cast = move_model(copy.deepcopy(model), dtype=TORCH_DTYPES[dtype])
    costed = trace_model(cast, inputs, methods=("export",))
    if [b.name for b in costed.blocks] != [b.name for b in traced.blocks]:
        return traced, model  # another chain of blocks in bf16: cost the run's graph as it is
    return costed, cast


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
    model_output_bytes: int = 0  # the last block: the model's output, which the last stage keeps until backward
    loss_bytes: int = 0  # the last block: what its loss saves for backward (its input excluded)
    temp_bytes: int = 0  # the backward's peak temporaries, from the block's output's gradient
    loss_temp_bytes: int = 0  # the last block: the same from its loss on
    kept_out: tuple = ()  # the block's output (the model's, for the last): kept by the next region, not this one
    # (seconds, kept seconds) of the forward when the block (not its loss) saved its last tensor: where a
    # checkpoint's recomputation stops (torch's early stop); a block that saves nothing re-runs nothing
    rerun: tuple[float, float] = (0.0, 0.0)
    # bytes of the parameters its GEMMs and convolutions saved for backward: a run under autocast over
    # fp32 weights saves lower-precision copies of them instead, one set per microbatch in flight
    cast_bytes: int = 0
    # compiled (``Roofline.fuse``): the backward is one autograd node, which the zero-bubble schedules'
    # two-part backward runs whole for I and again for W (planner.costs.levers), so I and W each cost B
    whole_backward: bool = False
    # what the block saves run eagerly (compiled, ``saved_bytes`` is the partitioner's): the forward
    # whose whole and split tensors the tensor-parallel share counts
    eager_saved_bytes: int = 0
    loss_s: float = 0.0  # the last block: its loss's forward, seconds (of fwd's)


def _run_block(
    stage: torch.fx.GraphModule,
    args: tuple,
    last: bool,
    target: torch.Tensor,
    loss_fn: LossFn,
    mode: Roofline,
    tdtype: torch.dtype,
) -> _BlockRun:
    """One roofline run of a block (forward, backward, then I alone unless compiled), charged by ``mode``; the block's
    parameters and buffers cast to ``tdtype``, floating bytes counted at ``mode.float_bytes``."""
    float_bytes = mode.float_bytes
    state = _block_state(stage, tdtype)
    param_storages = {storage_id(t) for t in state.values()}

    model_output = [0]
    loss_fwd = [0.0]  # the last pass's loss forward, seconds (the charged forward's is read after it)
    in_loss: set[int] = set()  # while the loss runs: the storages of the block's own output

    first_out: list[torch.Tensor] = []  # the block's output of the charged forward, held alive

    def run(a: tuple[Any, ...]) -> Any:
        out = functional_call(stage, state, a, tie_weights=True, strict=False)
        if not first_out:
            first_out.extend(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        if not last:
            return out
        in_loss.clear()  # (-1 marks "in the loss" even for an output without tensors)
        in_loss.update([-1, *(storage_id(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))])
        model_output[0] = _output_bytes(out, float_bytes)
        # a compiled stage's loss runs eagerly: the pipeline computes it outside the stage module
        before = mode.tally.seconds
        try:
            with mode.unfused():
                return loss_fn(out, target)
        finally:
            loss_fwd[0] = mode.tally.seconds - before
            in_loss.clear()

    forward = leaf_safe(run, grad_inputs(args))  # a block starting with an in-place op
    first_out.clear()  # the trial forward's: the charged one comes next

    saved: dict[int, int] = {}
    by_loss: dict[int, int] = {}  # of those, what the loss saves (its input, the block's output, excluded)
    saved_params: dict[int, int] = {}  # the parameters saved for backward (their bytes), once each
    loss_saves: set[int] = set()  # every storage the loss saves, the block's output included (eager: kept)
    keep: list[torch.Tensor] = []  # keep saved tensors alive so storage ids stay unique
    rerun = [(0.0, 0.0)]

    def pack(t: torch.Tensor) -> torch.Tensor:
        sid = storage_id(t)
        if not in_loss:
            # torch's early stop ends a checkpoint's recomputation at the save that matches the forward's
            # last one (parameters' saves included): an operator saves its inputs before its kernel runs
            # and its outputs after, and the tally here is the forward's seconds at this very save
            rerun[0] = (mode.tally.seconds, mode.tally.kept_seconds)
        else:
            loss_saves.add(sid)
        if sid in saved or sid in saved_params:
            return t
        nbytes = storage_bytes(t, float_bytes)
        if sid in param_storages:
            saved_params[sid] = nbytes
            return t
        saved[sid] = nbytes
        keep.append(t)
        if in_loss and sid not in in_loss:
            by_loss[sid] = nbytes
        return t

    fwd, bwd, bwd_input, inputs = Tally(), Tally(), Tally(), grad_inputs(args)
    compiled: list[int] = []  # compiled: what the block saves (Fusion.compiled_saves), once its forward ended
    saves = functools.partial(_compiled_saves, saved, first_out, loss_saves | param_storages, compiled)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode.phase(fwd, saves):
        out = forward(inputs)
    loss_s = loss_fwd[0]
    eager = sum(saved.values())  # compiled: what the eager forward saves (tensor parallelism's counts)
    saved_total = compiled[0] if compiled else eager
    roots, grads = backward_roots(out)
    temps = BackwardTemps(float_bytes)
    if roots:
        with mode.phase(bwd), temps:
            _backward(roots, grads, mode, first_out if last else ())
    outputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in _as_flat_outputs(out)) if not last else ()
    del out, roots, grads
    keep.clear()  # release the saved tensors held for their storage ids
    if not mode.fuse:  # (compiled, I runs the whole backward: _BlockRun.whole_backward)
        _input_backward(forward, args, mode, bwd_input)
    own, loss_temps = (_own_temps(stage, state, args, mode), temps.peak()) if last else (temps.peak(), 0)
    found = (saved_total, outputs, model_output[0], sum(by_loss.values()), own, loss_temps, tuple(first_out))
    # the weights its GEMMs saved: under autocast over fp32 weights, lower-precision copies of them
    cast = sum(nbytes for sid, nbytes in saved_params.items() if sid in mode.cast_inputs)
    made = _BlockRun(fwd, bwd, bwd_input, *found, rerun[0], cast, whole_backward=mode.fuse, eager_saved_bytes=eager)
    return replace(made, loss_s=loss_s)


def _output_bytes(out: Any, float_bytes: int | None) -> int:
    """Bytes of the model's output, in the dtype the block computed it in: a model that returns
    ``logits.float()`` keeps fp32 logits under autocast too (the fallback's fp32 run counts floating
    elements at ``float_bytes``)."""
    return sum(
        t.numel() * (float_bytes if float_bytes is not None and t.is_floating_point() else t.element_size())
        for t in pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor)
    )


def _backward(roots: list[torch.Tensor], grads: list[Any], mode: Roofline, model_out: Sequence[torch.Tensor]) -> None:
    """The block's backward; compiled and the last block (``model_out``: its output, which the loss
    read), the loss's part first, eagerly: the pipeline runs the loss outside the compiled stage."""
    wanted = [t for t in model_out if t.requires_grad]
    if mode.fusion is None or not wanted:
        torch.autograd.backward(roots, grads)
        return
    with mode.unfused():
        at_output = torch.autograd.grad(roots, wanted, grads, retain_graph=True, allow_unused=True)
    if all(g is None for g in at_output):
        raise RuntimeError("the loss's gradient does not reach the block's output")
    torch.autograd.backward(wanted, [g if g is not None else torch.zeros_like(t) for g, t in zip(at_output, wanted)])


def _compiled_saves(
    saved: dict[int, int], outputs: list[torch.Tensor], fixed: set[int], total: list[int], fusion: Fusion
) -> tuple[set[int], set[int]]:
    """Compiled: what the block saves (into ``total``), and which of the eager block's saves it
    recomputes and which it keeps (``Fusion.compiled_saves``); its outputs and what the eager loss or
    the model keep (``fixed``: the loss's saves, the parameters) are saved as they are."""
    block = {sid: b for sid, b in saved.items() if sid not in fixed}
    kept_whole = {sid: b for sid, b in saved.items() if sid in fixed}
    outs = {storage_id(t) for t in outputs}
    nbytes, recomputed, kept = fusion.compiled_saves(block, outs, fixed)
    total.append(nbytes + sum(kept_whole.values()))
    return recomputed, kept


def _input_backward(forward: Callable[[Any], Any], args: tuple, mode: Roofline, into: Tally) -> None:
    """I of F/I/W into ``into``: a fresh forward (charged to nothing), then gradients w.r.t. the inputs only."""
    inputs = grad_inputs(args)
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    if not wanted:
        return
    with mode.phase(Tally()):
        out = forward(inputs)
    roots, grads = backward_roots(out)
    if roots:
        with mode.phase(into):
            torch.autograd.grad(roots, wanted, grads, allow_unused=True)


def _own_temps(stage: torch.fx.GraphModule, state: dict[str, torch.Tensor], args: tuple, mode: Roofline) -> int:
    """The last block's backward temporaries from its output's gradient, without its loss: a fresh
    forward and backward charged to nothing, the parameters' gradients new as in a first backward."""
    forward = leaf_safe(lambda a: functional_call(stage, state, a, tie_weights=True, strict=False), grad_inputs(args))
    with mode.phase(Tally()):
        return forward_backward_temps(forward, grad_inputs(args), state.values(), mode.float_bytes)


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
    compiled: bool = False,
    float8: Float8Linears | None = None,
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
        hw: the hardware (``planner.core.levers.hardware.get_hardware`` or ``calibrated_cpu``).
        dtype: planning dtype of parameters and activations: "bf16", "fp16", "fp32", or "tf32"
            (fp32 storage, matmuls at the TF32 peak). Floating parameters, buffers and
            activations crossing blocks are cast to it.
        optimizer: the run's optimizer; its step over each block's parameters is estimated as a
            memory-bound pass (``optimizer_step_seconds``). None leaves ``opt_s`` at 0.
        progress: show a progress bar.
        compiled: estimate the blocks as ``torch.compile`` runs them (``--compile``): each run of
            memory-bound operators between GEMMs and attention one kernel, saving what AOTAutograd's
            partitioner keeps (``planner.costs.fusion``); the last block's loss stays eager, as the
            pipeline runs it outside the compiled stage.
        float8: ``--dtype fp8``: the linear layers that train in float8; each block's are converted to
            torchao's ``Float8Linear`` before the roofline runs it, which then charges torchao's own casts
            and scales as the memory-bound operators they are and its GEMMs at the FP8 peak.

    Returns:
        One BlockCost per block, in block order: fwd_s, bwd_s (= bwd_input_s + bwd_weight_s; compiled,
        each of those is bwd_s: the two-part backward runs the one compiled node twice),
        recompute_s (the forward up to its last saved tensor), flops_fwd/flops_bwd, opt_s, parameter, activation and cut bytes
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
    autocast = dtype in ("bf16", "fp16")  # how the run computes in it: ``ProfileInfo.run_autocast``
    n = len(traced.blocks)
    traced.model.train()
    current = _meta_inputs(stage_inputs(inputs), tdtype)  # the first stage takes the tensors
    target = _meta_like(target.detach(), tdtype)
    owned = traced.owned_parameters()
    costs: list[BlockCost] = []
    no_formula: set[str] = set()
    # The estimate is a function of the block's operations and shapes only: the 80 identical layers
    # of a Llama-70B are estimated once (the roofline is re-run only for a block not seen before).
    seen: dict[str, _BlockRun] = {}
    bar = tqdm(traced.blocks, desc="estimating blocks", unit="block", disable=None if progress else True, leave=False)
    for k, block in enumerate(bar):
        last = k == n - 1
        key = block_key(traced, k, current, last)
        if key in seen:
            run = seen[key]
            costs.append(_block_cost(traced, k, owned[k], run, hw, width, optimizer, autocast))
            current = tuple(_meta_like(t, tdtype) if isinstance(t, torch.Tensor) else t for t in run.outputs)
            continue
        stage = torch.fx.GraphModule(traced.gm, stage_graph(traced, k, k + 1, check_cuts=False), f"stage_{k}_{k + 1}")
        fuse_attention_nodes(stage)
        if float8 is not None:  # (emulated: the roofline sees torchao's float8 GEMM whole and charges it)
            convert_stage(stage, float8, traced.model, emulate=True)
        mode = Roofline(hw, dtype, fuse=compiled)
        try:
            run = _run_block(stage, current, last, target, loss_fn, mode, tdtype)
        except RuntimeError as first:
            if tdtype == torch.float32:
                raise _meta_error(block.name, first) from first
            # Model code that makes fp32 tensors of its own (``torch.arange(n).float()``) cannot
            # mix with cast weights; run the block in fp32 and count floating bytes at ``width``.
            mode = Roofline(hw, dtype, width, fuse=compiled)
            try:
                run = _run_block(
                    stage,
                    _meta_inputs(current, torch.float32),
                    last,
                    _meta_like(target, torch.float32),
                    loss_fn,
                    mode,
                    torch.float32,
                )
            except RuntimeError as e:
                raise _meta_error(block.name, e) from e
        seen[key] = run
        no_formula.update(mode.no_formula)
        costs.append(_block_cost(traced, k, owned[k], run, hw, width, optimizer, autocast))
        current = tuple(_meta_like(t, tdtype) if isinstance(t, torch.Tensor) else t for t in run.outputs)
    bar.close()
    if no_formula:
        tqdm.write(no_formula_note(no_formula), file=sys.stderr)
    return costs


def no_formula_note(ops: set[str]) -> str:
    """The line that says which operators the estimate could charge no FLOPs to.

    Args:
        ops: their names.

    Returns:
        e.g. "note: the estimate charges mylib::fused_mlp its bytes only: no FLOP formula ...".
    """
    shown = ", ".join(sorted(ops))
    return (
        f"note: the estimate charges {shown} its bytes only: torch.utils.flop_counter has no formula for "
        "these custom operators and they do not decompose into aten ones; if they multiply matrices, their "
        "blocks are estimated too fast (plan with measured costs on the hardware, or without --gpu-type here)"
    )


def structure_key(stage: torch.nn.Module, inputs: tuple, last: bool, graph: torch.fx.Graph | None = None) -> str:
    """What a block's estimate depends on: its operations in order (arguments as positions or
    constants), the shapes and dtypes of its parameters, buffers and inputs, and whether it ends
    the model (the loss). Node and parameter *names* are left out, so identical layers share a key.

    Args:
        stage: the block as a module (``build_stage_module``), or with ``graph`` the module whose
            attributes the graph's get_attr and call_module nodes name.
        inputs: its inputs.
        last: whether it is the model's last block.
        graph: the block's graph (None: ``stage.graph``).

    Returns:
        The key (text).
    """
    ids: dict[str, int] = {}
    parts = []
    own: torch.fx.Graph = graph if graph is not None else stage.graph  # type: ignore[assignment]
    for i, node in enumerate(own.nodes):
        ids[node.name] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{ids[a.name]}")  # type: ignore[arg-type,return-value]
        parts.append(f"{node.op}|{node_target(node, stage)}|{args!r}")
    return repr((parts, [show(x) for x in inputs], last))


def block_key(traced: GraphTrace, k: int, inputs: tuple, last: bool) -> str:
    """``structure_key`` of block k read off the traced graph, without cutting the block out
    (``stage_graph`` copies every node: at 1,000 layers that was most of the estimate's time).

    The block's ``block_structure`` (each node's operation, its arguments as positions among the
    block's nodes or among the outside values it reads, computed once per graph and shared with the
    meta runs that replay twin blocks); where each outside value comes from: a position among the
    block's inputs (the cut before it, in the order the stage takes them), a baked constant or an
    attribute's shapes; then what it passes on (the cut after it, or the model's output). Nodes the
    cut-out stage would drop as dead are kept here, so two blocks with one key also have one stage.

    Args:
        traced: the graph trace.
        k: the block.
        inputs: the inputs the block's stage takes.
        last: whether it is the model's last block.

    Returns:
        The key (text).

    Raises:
        TraceError: the block reads a value that is neither its input nor an attribute.
    """
    nodes = traced.nodes_by_name()
    names = tuple(traced.blocks[k].nodes)
    parts, outside = block_structure(traced.gm, names, nodes)
    sources: dict[str, str] = {}
    if k == 0:
        for i, node in enumerate(n for n in traced.gm.graph.nodes if n.op == "placeholder"):
            info = traced.values.get(node.name)
            sources[node.name] = f"C{info.const!r}" if info is not None and info.kind == "const" else f"%in{i}"
    else:
        cut = traced.cuts[k - 1]
        sources.update({name: f"%in{i}" for i, name in enumerate(cut.tensors)})
        sources.update({name: f"C{traced.values[name].const!r}" for name in cut.consts})

    def source(a: torch.fx.Node) -> str:
        if a.name in sources:
            return sources[a.name]
        if a.op != "get_attr":  # an attribute read outside the block is copied into its stage
            raise TraceError(f"value {a.name} is needed in blocks [{k}, {k + 1}) but not available there")
        return f"A{node_target(a, traced.gm)}"

    read = [source(a) for a in outside]
    inside = {name: i for i, name in enumerate(names)}

    def ref(a: torch.fx.Node) -> str:
        return f"%{inside[a.name]}" if a.name in inside else source(a)

    if last:
        out = next(node for node in traced.gm.graph.nodes if node.op == "output")
        passed = repr(torch.fx.node.map_arg(out.args[0], ref))
    else:
        passed = repr([ref(nodes[name]) for name in traced.cuts[k].tensors])
    return repr((parts, read, passed, [show(x) for x in inputs], last))


def _block_cost(
    traced: TracedModel,
    k: int,
    params: list[torch.nn.Parameter],
    run: _BlockRun,
    hw: HardwareSpec,
    width: int,
    optimizer: OptimizerSpec | None,
    autocast: bool,
) -> BlockCost:
    """Block k's record from its roofline run: W = B - I, recompute = the forward up to the last tensor
    the block saves (selectively: less its kept operators, whose outputs it keeps), sizes in the
    planning dtype. ``autocast``: the run computes in the planning dtype under torch.autocast over
    fp32 weights (``ProfileInfo.run_autocast``), so the weights its GEMMs save are lower-precision
    copies it holds per microbatch, counted with the activations and apart (``weight_cast_bytes``: a
    stage may share them, ``planner.core.levers.casts.shared_casts``; selective checkpointing never
    keeps them, its policy recomputes the casts)."""
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * (width if p.is_floating_point() else p.element_size()) for p in params)
    out_bytes = sum(
        t.numel() * (width if t.is_floating_point() else t.element_size())
        for t in run.outputs
        if isinstance(t, torch.Tensor)
    )
    bwd_input_s = run.bwd.seconds if run.whole_backward else min(run.bwd_input.seconds, run.bwd.seconds)
    # an eager block's operators, each issued by the host on a GPU (Roofline._gpu_seconds); compiled code
    # (whole_backward) launches its kernels from a wrapper
    dispatch = hw.dispatch_s if hw.async_launch and not run.whole_backward else 0.0
    opt_s = grad_s = None
    if optimizer is not None:
        n_tensors = sum(1 for p in params if p.requires_grad)
        opt_s = optimizer_step_seconds(n_params, param_bytes, n_tensors, hw, optimizer)
        grad_s = grad_pass_seconds(n_params, param_bytes, n_tensors, hw, optimizer.grad_clip is not None)
    cost = block_cost(
        traced,
        k,
        params,
        fwd_s=run.fwd.seconds,
        bwd_s=run.bwd.seconds,
        bwd_input_s=bwd_input_s,
        bwd_weight_s=run.bwd.seconds if run.whole_backward else run.bwd.seconds - bwd_input_s,
        # (compiled, the running forward at a save held writes its end took back: at most the forward)
        recompute_s=min(run.rerun[0], run.fwd.seconds),
        selective_recompute_s=max(min(run.rerun[0], run.fwd.seconds) - run.rerun[1], 0.0),
        selective_bytes=run.fwd.kept_bytes(run.kept_out),
        loss_bytes=run.loss_bytes if k == len(traced.blocks) - 1 else None,
        bwd_temp_bytes=run.temp_bytes,
        loss_temp_bytes=run.loss_temp_bytes if k == len(traced.blocks) - 1 else None,
        flops_fwd=run.fwd.flops,
        flops_bwd=run.bwd.flops,
        opt_s=opt_s,
        grad_s=grad_s,
        activation_bytes=run.saved_bytes + (run.cast_bytes if autocast else 0),
        weight_cast_bytes=run.cast_bytes if autocast else 0,
        float_bytes=width,
        cut_bytes=out_bytes,
        output_bytes=run.model_output_bytes,
        kv_bytes=run.fwd.kv_bytes,
        q_bytes=run.fwd.q_bytes,
    )
    if k == len(traced.blocks) - 1:  # its loss's forward apart (loss parallelism divides it)
        cost = cost.model_copy(update={"loss_s": min(run.loss_s, run.fwd.seconds)})
    if run.whole_backward:  # compiled: what the eager forward saves (tensor parallelism's counts)
        eager = run.eager_saved_bytes + (run.cast_bytes if autocast else 0)
        cost = cost.model_copy(update={"eager_activation_bytes": eager})
    if run.fwd.attention_s:  # what a ring's sends hide behind (planner.core.levers.context_parallel)
        cost = cost.model_copy(update={"attention_s": (run.fwd.attention_s, run.bwd.attention_s)})
    host = {
        "host_fwd_s": min(run.fwd.ops * dispatch, run.fwd.seconds),
        "host_bwd_s": min(run.bwd.ops * dispatch, run.bwd.seconds),
    }
    return cost.model_copy(update=host) if dispatch else cost


def _meta_error(block: str, e: Exception) -> PlannerError:
    text = " ".join(str(e).split())
    if len(text) > 200:
        text = text[:200] + "..."
    return PlannerError(
        f"block {block} cannot run on the meta device for estimation ({type(e).__name__}: {text}); "
        "operators that read tensor values (.item(), nonzero, data-dependent shapes) need a measured profile instead"
    )
