"""Profiling for models traced by module boundaries (no graph to cut blocks out of).

The whole model runs forward and backward; hooks note when each block starts and ends.

- forward time of a block: from its forward pre-hook to its forward hook;
- backward time of block k: from the moment the gradient of its output is ready to the moment the
  gradient of block k-1's output (its input) is ready (``Tensor.register_hook`` on the outputs);
  the first block ends when backward returns, the last block starts when backward starts (its
  backward includes the loss);
- saved activations: ``saved_tensors_hooks`` attribute each saved tensor to the block running;
- backward split (I, W) and recompute: there is no graph to cut a block out of, but each block is a
  module, so its inputs (positional and keyword) are captured with a forward pre-hook during the
  first whole-model run, and afterwards the block is called alone on them and timed with the same
  functions as the graph profiler (``planner.costs.timing.time_input_weight``: torch.distributed
  .pipelining's own ``stage_backward_input`` / ``stage_backward_weight``; and
  ``planner.costs.timing.time_recompute``). Inputs of block 0 need no gradient (a first stage gets the
  user's data), so I = 0 and W = its full backward there, as torch runs a first stage; later
  blocks' float inputs require grad, as a stage receives them; keyword tensors never do (torch
  sends no gradient for them). The last block includes the loss when its output is the model's
  output; when root-level operations follow it, it is timed with a gradient of ones on its own
  output, so those operations and the loss are in its B but not in its I/W. A block the model
  never called, or that cannot run alone on its captured inputs (state passed in keyword
  arguments, such as Hugging Face's DynamicCache, keeps tensors of the whole-model graph), gets
  I = W = recompute = None: unknown, and the solver charges its whole forward for a recompute.

Root-level operations between blocks are not attributed to any block; for models that need this
fallback they are a few element-wise operations.

Speed levers (``planner.costs.levers``): under autocast the whole-model forward and the loss run in a
``torch.autocast`` region, and each block's output bytes (the cut after it) are observed as autocast
makes them. With compile each block module's ``forward`` is replaced by ``torch.compile`` of it for
the duration (the hooks stay eager, around it); a compile failure during a forward names its block,
which runs eagerly from then on; one in backward cannot be told apart, and all blocks run eagerly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from planner.capture.blocks import ModuleTrace
from planner.costs.blocks import Profile, block_cost
from planner.costs.levers import (
    autocast_context,
    compile_module,
    device_type_of,
    failure_reason,
    is_weight_cast,
    tensor_bytes,
)
from planner.costs.settings import ProfileSettings, Sample
from planner.costs.timing import grad_inputs, leaf_safe, time_input_weight, time_recompute
from planner.torch_compat import pytree


class _Observer:
    """Hooks on every block module: forward start/end, when its output gradient is ready, saved bytes."""

    def __init__(self, traced: ModuleTrace) -> None:
        self.names = [b.name for b in traced.blocks]
        self.n = len(self.names)
        self.param_ids = {id(p) for p in traced.model.parameters()}
        self.inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}  # first call's (args, kwargs)
        self.capture = True
        self.last_out: Any = None
        self.out_bytes: dict[int, int] = {}  # first call's output bytes (the cut after the block)
        self.reset()

    def reset(self) -> None:
        """Start a new whole-model run."""
        self.fwd = [0.0] * self.n
        self.start: dict[int, float] = {}
        self.grad_ready: dict[int, float] = {}
        self.hooked: set[int] = set()
        self.saved: list[set[tuple[int, int]]] = [set() for _ in range(self.n)]
        self.casts: list[set[tuple[int, int]]] = [set() for _ in range(self.n)]  # autocast's weight copies
        self.block: int | None = None

    def pre(self, i: int, args: Any, kwargs: Any) -> None:
        if self.capture and i not in self.inputs:  # copies: root ops may change them in place
            self.inputs[i] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        self.block = i
        self.start[i] = time.perf_counter()

    def post(self, i: int, out: Any) -> None:
        self.fwd[i] = time.perf_counter() - self.start[i]
        self.block = None
        if self.capture and i == self.n - 1:
            self.last_out = out
        if self.capture and i not in self.out_bytes:
            self.out_bytes[i] = tensor_bytes(out)
        leaf = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if leaf is not None and i not in self.hooked:
            self.hooked.add(i)
            leaf.register_hook(lambda g, i=i: self.grad_ready.__setitem__(i, time.perf_counter()))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.block is not None and id(t) not in self.param_ids:
            held = self.casts if is_weight_cast(t, self.param_ids) else self.saved
            held[self.block].add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    @contextmanager
    def installed(self, model: torch.nn.Module) -> Iterator[None]:
        """The forward pre- and post-hooks on every block module, removed on exit."""
        handles = []
        for i, name in enumerate(self.names):
            module = model.get_submodule(name)
            handles.append(
                module.register_forward_pre_hook(
                    lambda mod, args, kwargs, i=i: self.pre(i, args, kwargs), with_kwargs=True
                )
            )
            handles.append(module.register_forward_hook(lambda mod, args, out, i=i: self.post(i, out)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def profile_module_blocks(traced: ModuleTrace, sample: Sample, settings: ProfileSettings) -> Profile:
    """Measure each block of a module-boundary trace during whole-model forward/backward runs.

    ``settings.warmup`` counts untimed whole-model runs (``profile_model`` makes it at least 1 with
    ``compile``: the compiling run); under ``settings.autocast`` the forwards and the loss run in a
    ``torch.autocast`` region; with ``settings.compile`` each block module's forward runs as
    ``torch.compile`` of it. ``settings.threads`` is ``profile_model``'s to apply.

    Args:
        traced: a module trace.
        sample: one microbatch, its target and the loss.
        settings: how to time the runs, under which levers.

    Returns:
        The costs (one BlockCost per block, in block order) and what compiling did.
    """
    model = traced.model
    model.train()
    names = [b.name for b in traced.blocks]
    compiled = (
        {i: compile_module(model.get_submodule(name).forward) for i, name in enumerate(names)}
        if settings.compile
        else {}
    )
    failures: list[tuple[str, str]] = []
    while True:
        obs = _Observer(traced)
        try:
            with _forwards(model, names, compiled):
                runs = _observed_runs(model, obs, sample, settings)
                # the isolated runs below run with the timing hooks removed
                bar = tqdm(names, desc="profiling I/W", disable=None if settings.progress else True, leave=False)
                split = [
                    _split_block(
                        model.get_submodule(name),
                        obs.inputs.get(i),
                        i == 0,
                        i == len(names) - 1 and runs.ends_model,
                        sample,
                        settings,
                    )
                    for i, name in enumerate(bar)
                ]
            break
        except Exception as e:  # noqa: BLE001 - torch.compile fails in many ways; eager is the fallback
            if not compiled:
                raise
            # a failure inside a block's forward names it; one in backward could be any block's
            failing = [obs.block] if obs.block in compiled else sorted(compiled)
            failures += [(names[i], failure_reason(e)) for i in failing]
            for i in failing:
                del compiled[i]
        finally:
            model.zero_grad(set_to_none=True)
    owned = traced.owned_parameters()
    n = len(names)
    costs = [
        block_cost(
            traced,
            i,
            owned[i],
            fwd_s=statistics.median(runs.fwd[i]),
            bwd_s=statistics.median(runs.bwd[i]),
            bwd_input_s=split[i][0],
            bwd_weight_s=split[i][1],
            recompute_s=split[i][2],
            activation_bytes=runs.saved[i],
            weight_cast_bytes=runs.casts[i],
            cut_bytes=obs.out_bytes.get(i) if settings.autocast is not None and i < n - 1 else None,
        )
        for i in range(n)
    ]
    if settings.autocast is not None:  # the model's output the last stage keeps, as autocast makes it
        costs[-1] = costs[-1].model_copy(update={"output_bytes": runs.output_bytes})
    return Profile(costs=costs, compile_failures=failures, compile_s=runs.compile_s if compiled else 0.0)


@contextmanager
def _forwards(model: torch.nn.Module, names: list[str], compiled: dict[int, Callable[..., Any]]) -> Iterator[None]:
    """Each block in ``compiled`` runs its compiled forward inside the block, its own afterwards."""
    for i, fn in compiled.items():
        model.get_submodule(names[i]).forward = fn  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for i in compiled:
            del model.get_submodule(names[i]).forward


@dataclass
class _Runs:
    """What the whole-model runs measured, per block: forward and backward times, saved bytes."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    saved: list[int]
    casts: list[int]  # of saved, autocast's copies of the weights
    ends_model: bool = False
    output_bytes: int = 0
    compile_s: float = 0.0


def _observed_runs(model: torch.nn.Module, obs: _Observer, sample: Sample, settings: ProfileSettings) -> _Runs:
    """Whole-model forward/backward runs with ``obs``'s hooks installed; the first ``settings.warmup`` untimed."""
    n = obs.n
    runs = _Runs(fwd=[[] for _ in range(n)], bwd=[[] for _ in range(n)], saved=[0] * n, casts=[0] * n)
    device_type = device_type_of(model, sample.inputs)
    warmup, progress = settings.warmup, settings.progress
    warm_s, round_s = 0.0, []
    with obs.installed(model):
        for r in tqdm(
            range(warmup + settings.repeats), desc="profiling model", disable=None if progress else True, leave=False
        ):
            obs.reset()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(obs.pack, lambda t: t):
                with autocast_context(device_type, settings.autocast):
                    output = model(*sample.inputs)
                    loss = sample.loss_fn(output, sample.target)
            if obs.capture:
                runs.ends_model = obs.last_out is output
                runs.output_bytes = tensor_bytes(output)
                obs.capture, obs.last_out = False, None
            del output
            t_start = time.perf_counter()
            loss.backward()
            t_end = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if r < warmup:
                warm_s += t_end - start
                continue
            round_s.append(t_end - start)
            for i in range(n):
                runs.fwd[i].append(obs.fwd[i])
                begin = obs.grad_ready.get(i, t_start) if i < n - 1 else t_start
                end = obs.grad_ready.get(i - 1, t_end) if i > 0 else t_end
                runs.bwd[i].append(max(0.0, end - begin))
                runs.saved[i] = sum(size for _, size in obs.saved[i] | obs.casts[i])
                runs.casts[i] = sum(size for _, size in obs.casts[i])
    runs.compile_s = max(0.0, warm_s - warmup * statistics.median(round_s))
    return runs


def _split_block(
    module: torch.nn.Module,
    captured: tuple[tuple[Any, ...], dict[str, Any]] | None,
    first: bool,
    with_loss: bool,
    sample: Sample,
    settings: ProfileSettings,
) -> tuple[float | None, float | None, float | None]:
    """Median (I, W, recompute) seconds of one block called alone on its captured inputs (None: unknown).

    ``first``: the model's first block (its inputs need no gradient); ``with_loss``: the block's output
    is the model's, so ``sample``'s loss follows it."""
    if captured is None:  # the model never called this block
        return None, None, None
    args, kwargs = captured
    kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), kwargs)
    device_type = device_type_of(module, (args, kwargs))

    def block(a: tuple[Any, ...]) -> Any:
        with autocast_context(device_type, settings.autocast):
            return module(*a, **kwargs)

    def loss(out: Any) -> Any:
        with autocast_context(device_type, settings.autocast):
            return sample.loss_fn(out, sample.target)

    def run(a: tuple[Any, ...]) -> Any:
        return loss(block(a)) if with_loss else block(a)

    weights = list(module.parameters())
    runs = []
    try:
        forward = leaf_safe(run, grad_inputs(args, not first))
        region = leaf_safe(block, grad_inputs(args, not first))
        for r in range(settings.warmup + settings.repeats):
            i_s, w_s = time_input_weight(forward, grad_inputs(args, not first), weights)
            # the loss runs after the stage's checkpoint regions, as the runner runs it
            rec = time_recompute(region, grad_inputs(args, not first), "full", loss if with_loss else None)
            if r >= settings.warmup:
                runs.append((i_s, w_s, rec))
    except RuntimeError:
        # The block cannot run alone on its captured inputs (keyword state of the whole-model graph):
        # its I/W split and recompute time stay unknown; forward and backward are still measured.
        return None, None, None
    return (
        statistics.median(x[0] for x in runs),
        statistics.median(x[1] for x in runs),
        statistics.median(x[2] for x in runs),
    )
