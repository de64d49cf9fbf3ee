"""Measured profiling: per-block forward/backward time and memory on this machine's device.

Each block of a graph-traced model is cut out as its own module (the same code that builds
pipeline stages, ``planner.capture.trace.build_stage_module``) and timed on its real inputs, which come
from running the blocks before it. The last block includes the loss, as the last pipeline stage
does. Timing: warm-up runs, then repeats, median (robust to the noise of shared CPUs).

Backward split (zero-bubble schedules run them apart, so the solver needs both): besides the full
backward B (``torch.autograd.backward``, what GPipe/1F1B run) each block's backward is timed as
torch.distributed.pipelining runs it under ``backward_one_chunk(full_backward=False)`` and
``backward_weight_one_chunk``: I = ``stage_backward_input`` (gradients of the block's inputs only;
it keeps the graph alive and notes where the weight paths branch off), then W =
``stage_backward_weight`` (the weight gradients from those saved branch points). Calling torch's
own functions means the measured split includes what torch's split really costs (graph walks,
hooks, the branch nodes run twice), not an idealised one. Special cases, as torch has them:

- block 0 receives the user's data, which needs no gradient (a pipeline's first stage does too):
  torch skips I for the first stage and runs the *full* backward as its W (``stage_backward``,
  ``backward_weight_one_chunk`` with ``stage_index == 0``), so I = 0 and W = that full backward.
  Block 0's B is measured with such inputs too (no gradient of the data is ever computed in a
  pipeline). A later block none of whose inputs needs a gradient (only integer tensors cross into
  it) is timed the same way; torch itself would run I and then a W that finds no weight paths and
  computes no weight gradients for such a stage;
- a block without trainable parameters has W = 0 (nothing to run).

Recompute (activation checkpointing): ``recompute_s`` is *measured*, not copied from the forward:
the block runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and its forward
function is timed the second time it is called, which is the recomputation inside backward. With
torch's default early stop the recomputation ends at the last saved tensor, so ops after it (a
residual add, a trailing sleep in the test fixtures) are not re-run: recompute ≤ forward. The last
block's region holds the block alone and its loss runs after it, as a stage runs them: what the
loss saves (its log-probabilities) would otherwise make the region re-run the whole output layer,
which the runner's never does (on an H100, docs/gpu_recompute.md, a Llama 3 8B output layer's
38 ms forward was charged as its recomputation). Dropout's RNG-state restore is included. Selective checkpointing is timed the same way under the runner's
policy (``planner.capture.checkpoint``: matmul, convolution and attention outputs kept), giving
``selective_recompute_s``: the recomputation plus what the policy adds to the forward itself (its
Python bookkeeping on every operator, which the first call shows against the plain forward); what that policy keeps of one microbatch (``selective_bytes``) is the
bytes of those ops' outputs in one eager forward.

Memory per block: parameter bytes (each parameter counted in the first block that reads it), the
bytes autograd saves for backward during the block's forward, observed with
``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded: they are counted once already),
and the peak temporaries of one eager backward (``planner.costs.backward_temps``), from the block's
output's gradient and, for the last block, also from its loss.

Speed levers (``planner.costs.levers``): under ``autocast`` every forward (and the last block's
loss) runs in a ``torch.autocast`` region, backward outside it; the saved bytes, the bytes crossing
each cut and the model's output are measured as autocast makes them. With ``compile`` each block is
timed as ``torch.compile(block_module)`` (the loss stays eager, as a pipeline computes it outside
the stage module); the first, untimed run compiles, and a block whose compilation fails is timed
eagerly and named in ``Profile.compile_failures``. Blocks identical in operations, shapes and
dtypes (``planner.costs.estimate.structure_key``, the roofline's dedupe) share one compiled
measurement, so the 4 layers of a GPT compile once (compiling costs seconds per block; timing
costs milliseconds, so without compile every block is still measured on its own).

Everything runs on the traced model's private copy, so the caller's model is never changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.checkpoint import kept_bytes
from planner.capture.float8 import convert_stage, emulated
from planner.capture.stage import build_stage_module, stage_inputs
from planner.costs.backward_temps import forward_backward_temps
from planner.costs.blocks import Profile, block_cost
from planner.costs.context import apply_in_context, time_in_context
from planner.costs.levers import (
    autocast_context,
    compile_module,
    compile_settings,
    device_type_of,
    failure_reason,
    is_weight_cast,
    tensor_bytes,
)
from planner.costs.settings import ProfileSettings, Sample
from planner.costs.timing import (
    OptimizerSteps,
    backward_roots,
    grad_inputs,
    leaf_safe,
    sync,
    time_checkpointed,
    time_grad_passes,
    time_input_weight,
    time_optimizer_steps,
)
from planner.schema.costs import BlockCost, OptimizerSpec, StepTempRule
from planner.threads import torch_threads
from planner.torch_compat import pytree


def profile_model(
    traced: TracedModel,
    sample: Sample,
    settings: ProfileSettings | None = None,
    *,
    optimizer: OptimizerSpec | None = None,
    in_context: bool = True,
) -> Profile:
    """Measure every block of a traced model on one microbatch, under the speed levers asked for.

    Args:
        traced: the model, traced on a microbatch of the same shape as ``sample.inputs``.
        sample: the microbatch, its target and the loss.
        settings: warm-up, repeats, threads, progress bar, autocast and compile; None: the defaults.
        optimizer: the run's optimizer; its step over each block's parameters is timed too
            (AdamW over a large output layer is several percent of a CPU step). None leaves
            ``opt_s`` unknown.
        in_context: take each block's forward and backward from the whole model run as one stage
            (``planner.costs.context``), as the plan does; False keeps the isolated timings (the
            bench compares the two).

    Returns:
        The costs (one BlockCost per block, in block order), the blocks compile failed on, and
        the compile time.
    """
    if settings is None:
        settings = ProfileSettings()
    if settings.compile:
        # The first run of a compiled block compiles it and must never be timed: raised here, once,
        # so every profiler and the optimizer timing below see the same untimed runs.
        settings = dataclasses.replace(settings, warmup=max(1, settings.warmup))
    compiling = compile_settings() if settings.compile else contextlib.nullcontext()
    with torch_threads(settings.threads), compiling:
        if isinstance(traced, ModuleTrace):
            from planner.costs.measure_modules import profile_module_blocks

            profile = profile_module_blocks(traced, sample, settings)
        else:
            assert isinstance(traced, GraphTrace)
            profile = _profile_graph(traced, sample, settings)
            if in_context and not settings.compile:  # marks would break a compiled graph: compiled blocks keep theirs
                ctx = time_in_context(traced, sample, settings, device_type_of(traced.model, sample.inputs))
                profile.costs = apply_in_context(profile.costs, ctx)
        if optimizer is not None:
            profile.costs, profile.step_temp_rule = _with_optimizer_shares(traced, profile.costs, optimizer, settings)
        return profile


def _with_optimizer_shares(
    traced: TracedModel, costs: list[BlockCost], optimizer: OptimizerSpec, settings: ProfileSettings
) -> tuple[list[BlockCost], StepTempRule]:
    """Each block's optimizer step, timed on its own parameters, the step's temporaries, and the
    passes over its gradients before the step (``time_grad_passes``).

    The step's cost is not proportional to the parameters: on CPU torch's AdamW runs per tensor and
    a large tensor's temporaries are fresh allocations that page-fault, so each block is timed on
    its own tensors, in a round-robin over all blocks (``time_optimizer_steps``: every block's step
    runs after the others' data went through the caches, as in a stage stepping many parameters;
    timing one block alone would measure cache-resident steps, 2x too fast for the encoder LM's
    12 M-parameter stage here). ``opt_temp_bytes``: the temporaries of the block's step, with the
    copies of the tied parameters it reads; how a stage's combine: the rule returned with them.
    """
    steps = _optimizer_steps(traced, optimizer, settings)
    # and the passes over the same parameters' gradients that come before the step (grad_s)
    clip = optimizer.grad_clip is not None
    grad_s = time_grad_passes(traced.owned_parameters(), clip, max(1, settings.warmup), settings.repeats)
    out = [
        cost.model_copy(update={"opt_s": opt_s, "opt_temp_bytes": temp, "grad_s": g})
        for cost, opt_s, temp, g in zip(costs, steps.seconds, steps.temp_bytes, grad_s)
    ]
    return out, steps.temp_rule


def _optimizer_steps(traced: TracedModel, optimizer: OptimizerSpec, settings: ProfileSettings) -> OptimizerSteps:
    """The blocks' optimizer steps (``time_optimizer_steps``): each block steps the parameters it owns
    (shared parameters step once, in their first block); the temporaries of a block that reads a tied
    parameter an earlier block owns include those of its stage's copy of it."""
    owned = traced.owned_parameters()
    tied = []
    for k, own in enumerate(owned):
        mine = {id(p) for p in own}
        tied.append([p for p in traced.block_parameters(k) if id(p) not in mine])
    return time_optimizer_steps(owned, optimizer, settings.warmup, settings.repeats, tied)


@dataclass
class _Timings:
    """The repeats of one block: forward, backward, I, W, recompute, the saved bytes, and the wall
    time of the untimed warm-up runs against the timed ones (what compiling cost)."""

    fwd: list[float] = field(default_factory=list)
    bwd: list[float] = field(default_factory=list)
    bwd_input: list[float] = field(default_factory=list)
    bwd_weight: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    selective: list[float] = field(default_factory=list)  # its recomputation
    selective_fwd: list[float] = field(default_factory=list)  # the forward under its policy
    region_fwd: list[float] = field(default_factory=list)  # the checkpoint region's forward (no loss), in full mode
    saved_bytes: int = 0
    cast_bytes: int = 0  # of saved_bytes, autocast's copies of the weights
    kept_bytes: int | None = None  # what selective checkpointing keeps (None: not measured)
    loss_bytes: int | None = None  # the last block: what its loss saves (None: not measured)
    temp_bytes: int | None = None  # the backward's peak temporaries, from the block's output's gradient
    loss_temp_bytes: int | None = None  # the last block: the same from its loss on
    warm_s: float = 0.0
    rounds_s: list[float] = field(default_factory=list)


def _time_once(
    forward: Callable[[tuple[Any, ...]], Any],
    args: tuple[Any, ...],
    param_storages: set[tuple[int, int]],
    params: set[int],
) -> tuple[float, float, int, int]:
    """One forward and one full backward: (forward s, backward s, bytes saved for backward, of
    those autocast's copies of the weights: ``is_weight_cast`` of the parameters ``params``, ids)."""
    seen: set[tuple[int, int]] = set()
    casts: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in param_storages:  # parameters are counted once, in param_bytes
            return t
        (casts if is_weight_cast(t, params) else seen).add(key)
        return t

    sync(args)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        t0 = time.perf_counter()
        out = forward(args)
        sync(args)
        t1 = time.perf_counter()
    roots, grads = backward_roots(out)
    t2 = time.perf_counter()
    if roots:
        torch.autograd.backward(roots, grads)
    sync(args)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, sum(size for _, size in seen | casts), sum(size for _, size in casts)


def _time_block(
    forward: Callable[[tuple[Any, ...]], Any],
    current: tuple[Any, ...],
    grad: bool,
    weights: list[torch.nn.Parameter],
    param_storages: set[tuple[int, int]],
    params: set[int],
    settings: ProfileSettings,
    bar: Any,
    checkpoint: tuple[Callable[[tuple[Any, ...]], Any], Callable[[Any], Any] | None] | None = None,
) -> _Timings:
    """Warm-up and timed repeats of one block: a full F+B, then I/W and the recompute on fresh inputs.

    ``checkpoint``: the checkpoint region's forward and what runs after it outside the region (the
    last block: the block alone, then its loss, as a stage runs them); None: ``forward`` alone.
    """
    region, after = checkpoint if checkpoint is not None else (forward, None)
    t = _Timings()
    warmup = settings.warmup
    for r in range(warmup + settings.repeats):
        start = time.perf_counter()
        fwd, bwd, saved, cast = _time_once(forward, grad_inputs(current, grad), param_storages, params)
        bwd_input, bwd_weight = time_input_weight(forward, grad_inputs(current, grad), weights)
        region_fwd, recompute = time_checkpointed(region, grad_inputs(current, grad), "full", after)
        selective_fwd, selective = time_checkpointed(region, grad_inputs(current, grad), "selective", after)
        if r >= warmup:
            t.fwd.append(fwd)
            t.bwd.append(bwd)
            t.bwd_input.append(bwd_input)
            t.bwd_weight.append(bwd_weight)
            t.recompute.append(recompute)
            t.selective.append(selective)
            t.selective_fwd.append(selective_fwd)
            t.region_fwd.append(region_fwd)
            t.saved_bytes, t.cast_bytes = saved, cast
            t.rounds_s.append(time.perf_counter() - start)
        else:
            t.warm_s += time.perf_counter() - start
        bar.update(1)
    return t


class _BlockTimer:
    """Times the blocks of one graph profile under its levers: autocast around every forward; with
    compile, each block compiled (identical blocks sharing one measurement), eager where that fails."""

    def __init__(
        self, traced: GraphTrace, sample: Sample, settings: ProfileSettings, device_type: str, bar: Any
    ) -> None:
        self.sample, self.settings, self.device_type, self.bar = sample, settings, device_type, bar
        self.param_storages = {_storage_key(p) for p in traced.model.parameters()}
        self.params = {id(p) for p in traced.model.parameters()}
        self.profile = Profile(costs=[])
        self.shared: dict[str, _Timings] = {}  # structure key -> the compiled measurement identical blocks share
        self.failed: dict[str, str] = {}  # structure key -> why torch.compile failed on such a block

    def forward_of(self, call: Callable[..., Any], last: bool) -> Callable[[tuple[Any, ...]], Any]:
        """``call`` as a block's forward: under autocast, with the loss after it for the last block."""

        def run(args: tuple[Any, ...]) -> Any:
            with autocast_context(self.device_type, self.settings.autocast):
                out = call(*args)
            return self._loss_of(out) if last else out

        return run

    def time(
        self, name: str, module: torch.fx.GraphModule, current: tuple[Any, ...], last: bool, grad: bool
    ) -> _Timings:
        """Block ``name`` timed on its inputs ``current`` (``grad``: they require grad, as a later
        stage's do): compiled when asked and possible, else eagerly."""
        from planner.costs.estimate import structure_key

        compile, warmup = self.settings.compile, self.settings.warmup
        key = structure_key(module, grad_inputs(current, grad), last) if compile else ""
        if key in self.shared:
            self.profile.shared += 1
            self.bar.update(warmup + self.settings.repeats)
            return self.shared[key]
        if compile and key not in self.failed:
            done = self.bar.n
            try:
                t = self.shared[key] = self._timed(module, compile_module(module), current, last, grad)
                # what the untimed runs took beyond ordinary runs: compiling (and recompiling for I/W)
                self.profile.compile_s += max(0.0, t.warm_s - warmup * statistics.median(t.rounds_s))
                return t
            except Exception as e:  # noqa: BLE001 - torch.compile fails in many ways; eager is the fallback
                self.failed[key] = failure_reason(e)
                self.bar.n = done  # the eager runs below count again
        if compile:
            self.profile.compile_failures.append((name, self.failed[key]))
        return self._timed(module, module, current, last, grad)

    def _timed(
        self, module: torch.nn.Module, call: Callable[..., Any], current: tuple[Any, ...], last: bool, grad: bool
    ) -> _Timings:
        start = time.perf_counter()
        forward = leaf_safe(self.forward_of(call, last), grad_inputs(current, grad))
        trial_s = time.perf_counter() - start  # a first call: it compiles the forward of a compiled block
        weights = list(module.parameters())
        checkpoint = None
        if last:  # the stage's loss runs after its checkpoint regions, not inside the last one
            checkpoint = (leaf_safe(self.forward_of(call, False), grad_inputs(current, grad)), self._loss_of)
        args = (self.param_storages, self.params, self.settings, self.bar, checkpoint)
        t = _time_block(forward, current, grad, weights, *args)
        t.warm_s += trial_s

        # counted on the eager module (a dispatch mode around a compiled one would recompile it),
        # without the loss (it runs outside the stage's regions) and without the block's output,
        # which the next region keeps as its input (or the last stage as its output)
        def plain(a: tuple[Any, ...]) -> Any:  # the block alone, under the profile's autocast
            with autocast_context(self.device_type, self.settings.autocast):
                return module(*a)

        block = leaf_safe(plain, grad_inputs(current, grad))  # a block starting in place gets a clone
        with torch.enable_grad(), kept_bytes() as kept:
            out = block(grad_inputs(current, grad))
        t.kept_bytes = kept.total(out)
        if last:
            t.loss_bytes = self._loss_bytes(block, current, grad)
        t.temp_bytes = self._temp_bytes(module, current, False, grad)
        if last:
            t.loss_temp_bytes = self._temp_bytes(module, current, True, grad)
        return t

    def _temp_bytes(self, module: torch.nn.Module, current: tuple[Any, ...], loss: bool, grad: bool) -> int:
        """The peak temporaries of one eager backward of the block, from its output's gradient (or with
        ``loss`` from its loss)."""
        forward = leaf_safe(self.forward_of(module, loss), grad_inputs(current, grad))
        return forward_backward_temps(forward, grad_inputs(current, grad), module.parameters())

    def _loss_of(self, out: Any) -> Any:
        """The model's loss on the last block's output ``out``, under the profile's autocast."""
        with autocast_context(self.device_type, self.settings.autocast):
            return self.sample.loss_fn(out, self.sample.target)

    def _loss_bytes(self, block: Callable[[tuple[Any, ...]], Any], current: tuple[Any, ...], grad: bool) -> int:
        """Bytes the loss saves for backward on the last block's output (its own output excluded:
        the stage keeps that anyway)."""
        with torch.enable_grad(), autocast_context(self.device_type, self.settings.autocast):
            out = block(grad_inputs(current, grad))
            own = {_storage_key(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
            seen: dict[tuple[int, int], int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = _storage_key(t)
                if key not in own and key not in self.param_storages:
                    seen[key] = key[1]
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                self.sample.loss_fn(out, self.sample.target)
        return sum(seen.values())


def _profile_graph(traced: GraphTrace, sample: Sample, settings: ProfileSettings) -> Profile:
    """Cut every block out on its own and time it on the real outputs of the blocks before it."""
    n = len(traced.blocks)
    traced.model.train()
    device_type = device_type_of(traced.model, sample.inputs)
    autocast = settings.autocast
    owned = traced.owned_parameters()
    current = stage_inputs(sample.inputs)  # what the first stage takes: the tensors
    bar = tqdm(
        total=n * (settings.warmup + settings.repeats),
        desc="profiling blocks" + (" (compiling)" if settings.compile else ""),
        unit="run",
        disable=None if settings.progress else True,
        leave=False,
    )
    timer = _BlockTimer(traced, sample, settings, device_type, bar)
    for k in range(n):
        module = build_stage_module(traced, k, k + 1, check_cuts=False)
        if settings.float8 is not None and isinstance(module, torch.fx.GraphModule):
            convert_stage(module, settings.float8, traced.model, emulated(torch.device(device_type)))
        last = k == n - 1
        # the first block gets the user's data, which needs no gradient
        t = timer.time(traced.blocks[k].name, module, current, last, grad=k > 0)
        # what the next block receives: the outputs as the forward (under autocast) makes them
        out_bytes = None
        if not last or autocast is not None:
            with torch.no_grad(), autocast_context(device_type, autocast):
                out = module(*current)
            if autocast is not None:
                out_bytes = tensor_bytes(out)
            if not last:
                current = out if isinstance(out, tuple) else (out,)
        costs = block_cost(
            traced,
            k,
            owned[k],
            fwd_s=statistics.median(t.fwd),
            bwd_s=statistics.median(t.bwd),
            bwd_input_s=statistics.median(t.bwd_input),
            bwd_weight_s=statistics.median(t.bwd_weight),
            recompute_s=statistics.median(t.recompute),
            # the recomputation, and what the policy's bookkeeping adds to the forward (every operator
            # passes it: on a CPU a large share of a small block's forward); that difference of two
            # timings is taken between their fastest runs, which a loaded machine disturbs least; the last
            # block's region holds no loss, so its forward is compared with the region's under full mode
            selective_recompute_s=statistics.median(t.selective)
            + max(0.0, min(t.selective_fwd) - (min(t.region_fwd) if last else min(t.fwd))),
            selective_bytes=t.kept_bytes,
            activation_bytes=t.saved_bytes,
            weight_cast_bytes=t.cast_bytes,
            loss_bytes=t.loss_bytes,
            bwd_temp_bytes=t.temp_bytes,
            loss_temp_bytes=t.loss_temp_bytes,
            cut_bytes=None if last else out_bytes,
        )
        if last and out_bytes is not None:  # the model's output the last stage keeps until backward
            costs = costs.model_copy(update={"output_bytes": out_bytes})
        timer.profile.costs.append(costs)
    bar.close()
    traced.model.zero_grad(set_to_none=True)
    return timer.profile


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())
