"""Sequence parallelism inside a tensor-parallel stage: the activations between a row-wise and the
next column-wise layer (residual adds, norms) split along the sequence over the tensor-parallel ranks.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), as
Megatron-LM's ``--sequence-parallel`` and torchtitan's tensor parallelism run it, here with torch's
DTensors so that it works on any traced stage without knowing its code:

* a row-wise layer returns its output reduce-scattered along dimension 1 (``RowwiseParallel(
  output_layouts=Shard(1), use_local_output=False)``): a DTensor whose local part is this rank's
  slice of the sequence;
* every operator that reads such a DTensor gives one (DTensor's own rules, exact for residual adds
  and per-token norms); ``Replicated`` wraps the operator's plain tensors (a norm's weight, the
  residual coming from the model's first layers) as replicated DTensors with ``DTensor.from_local``,
  whose backward all-reduces their partial gradients (a norm weight's gradient sums over the
  sequence slices), so every tensor-parallel rank ends with the same whole gradient;
* a column-wise layer's input is all-gathered once per value (q, k and v read one gathered tensor,
  kept as a replicated DTensor, so their three partial input gradients add up first and are
  reduce-scattered once in backward, as Megatron's fused QKV does), cast first to autocast's dtype
  (what the layer would cast it to: half the bytes to gather); what the layers save of it for
  their weight gradients is the shard, gathered again when the backward needs it (a saved-tensor
  hook: Megatron-LM saves and re-gathers the same way), so a layer holds 1/tp of its input; the
  layers that read one gathered value share one such gather in backward too (q, k and v: one
  all-gather, not three);
* a stage's inputs that are sequence shards in the whole graph (``planner.capture.tp_sequence``)
  are cut to this rank's slice on arrival (no traffic; their gradient is all-gathered in
  backward), its DTensor outputs gathered whole before they leave (the boundary then scatters them
  as any other: ``planner.run.boundary``).

The stage's units (and the checkpoint regions a recomputation re-runs in backward) run their
forward under ``Replicated``; outside it nothing changes, so FSDP's and the pipeline's own code never
sees a DTensor it did not make. ``planner.core.levers.tensor_parallel`` charges the same collectives.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.capture.contract import SEQUENCE_DIM
from planner.torch_compat import local_tensor, pytree


class Replicated(TorchFunctionMode):
    """Wraps the plain tensors of any torch call that also reads a DTensor as replicated DTensors.

    Exact where it is used: outside the split layers a plain tensor is the same on every
    tensor-parallel rank (a weight, a buffer, an activation not yet scattered).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        mesh = next((a.device_mesh for a in leaves if isinstance(a, DTensor)), None)
        if mesh is not None and any(type(a) is torch.Tensor or type(a) is nn.Parameter for a in leaves):

            def wrap(a: Any) -> Any:
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                    return DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                return a

            args, kwargs = pytree.tree_map(wrap, (args, kwargs))
        return func(*args, **kwargs)


class SequenceSplit:
    """One stage's sequence parallelism: installed by ``install``, the hooks share this state.

    Args:
        tp_mesh: the rank's 1-D tensor-parallel mesh.
        seq_inputs: for each positional input of the stage, whether it is a sequence shard.
    """

    def __init__(self, tp_mesh: Any, seq_inputs: Sequence[bool]) -> None:
        self.mesh = tp_mesh
        self.seq_inputs = list(seq_inputs)
        self.depth = 0  # units nest (a chain of units, a checkpoint region): one mode at a time
        self.mode: Replicated | None = None
        self.saved = SavedShards()

    def enter(self, *_: Any) -> None:
        if self.depth == 0:
            self.mode = Replicated()
            self.mode.__enter__()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        if self.depth == 0:  # a hook before ``enter`` raised (FSDP's gather): nothing was entered
            return
        self.depth -= 1
        if self.depth == 0:
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.mode = None
            # a recomputation (in backward) gathers too: hold nothing past it
            self.saved.forget()

    def close(self) -> None:
        """Leave the mode and the saved-tensor hooks, hold nothing: the stage's forward is over."""
        self.saved.stop()
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        self.depth = 0

    def stage_in(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The stage's inputs, the sequence shards cut to this rank's slice (the mode entered)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.close()  # whatever an earlier failed forward left
        self.enter()
        self.saved.start()
        out = list(args)
        for i, flag in enumerate(self.seq_inputs[: len(out)]):
            x = out[i]
            if flag and isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
                out[i] = whole.redistribute(self.mesh, [Shard(SEQUENCE_DIM)])
        return tuple(out)

    def stage_out(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The stage's output with every DTensor gathered whole (a plain tensor again)."""
        from torch.distributed.tensor import DTensor, Replicate

        self.close()

        def whole(t: Any) -> Any:
            return t.redistribute(t.device_mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t

        return pytree.tree_map(whole, output)

    def column_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A column-wise layer's input as a replicated DTensor, gathered (or wrapped) once for the
        layers that read it one after another."""
        from torch.distributed.tensor import DTensor, Replicate

        x = args[0]
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or isinstance(x, DTensor)):
            return None  # an embedding's token ids: torch's style wraps them, no gradient to reduce
        whole = self.saved.recent(x)
        if whole is None:
            if isinstance(x, DTensor):
                shard = autocast_cast(x)
                whole = shard.redistribute(self.mesh, [Replicate()])
                self.saved.gathered(whole, shard)
            else:
                whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            self.saved.remember(x, whole)
        return (whole, *args[1:])


def autocast_cast(x: Any) -> Any:
    """``x`` cast to autocast's dtype where autocast is on (what a linear layer would cast its input
    to): a layer's input gathered after the cast moves half the bytes of a float32 one."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class SavedShards:
    """What a split that gathers sequence shards for column-wise layers keeps for their backward: a
    gathered input saved by the layers is kept as its shard and gathered again when the backward needs
    it (``pack`` / ``unpack``, saved-tensor hooks entered by ``start``), and the last input gathered is
    remembered (``recent``), so that consecutive layers reading one value (q, k, v) share one gather
    even though their saved copies are shards.
    """

    def __init__(self) -> None:
        # the last input gathered and its whole, held until the next one
        self.last: tuple[Any, Any] | None = None
        # storage of a gathered whole -> (weakref to the whole's local tensor, its shard, shape -> the
        # one packed value every layer saving the whole in that shape keeps: q, k and v read one
        # gathered input, so backward gathers it once for the three, as Megatron's fused QKV): an
        # entry counts only while that whole lives (a freed storage's address is reused)
        self.shard_of: dict[int, tuple[Any, Any, dict[tuple[int, ...], _Regather]]] = {}
        self.saving: Any = None  # the saved-tensor hooks during the stage's forward

    def start(self) -> None:
        """Enter the saved-tensor hooks for a stage's forward: innermost while no checkpoint region
        runs (a region's own hooks keep nothing, and a recomputation, in backward, outside this
        forward, saves the whole for its region's backward)."""
        self.stop()
        self.saving = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.saving.__enter__()

    def stop(self) -> None:
        """Leave the hooks and hold nothing: the stage's forward is over."""
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        self.forget()

    def forget(self) -> None:
        """Hold no gathered input (a recomputation, in backward, gathers its own)."""
        self.last = None
        self.shard_of.clear()

    def recent(self, x: Any) -> Any:
        """The whole gathered for ``x`` by the last gather, if ``x`` is what it gathered (else None)."""
        return self.last[1] if self.last is not None and self.last[0]() is x else None

    def remember(self, x: Any, whole: Any) -> None:
        """``whole`` is what layers reading ``x`` get, until another input is gathered."""
        self.last = (weakref.ref(x), whole)

    def gathered(self, whole: Any, shard: Any) -> None:
        """``whole`` (a DTensor) was gathered from ``shard``, a DTensor whose ``redistribute`` to
        ``Replicate()`` on its mesh gathers it again."""
        self.shard_of[_storage(whole)] = (weakref.ref(local_tensor(whole)), shard, {})

    def pack(self, t: torch.Tensor) -> Any:
        """What autograd keeps of a saved tensor: for a gathered whole (or a view of it) its shard."""
        found = self.shard_of.get(_storage(t)) if self.shard_of else None
        if found is None or found[0]() is None:
            return t
        shard, packs = found[1], found[2]
        # only a reshape of the whole (a linear's flattened input): gathered again it reads the same
        if not t.is_contiguous() or t.numel() != shard.numel():
            return t
        shape = tuple(t.shape)
        packed = packs.get(shape)
        if packed is None:
            packed = packs[shape] = _Regather(shard, shape)
        packed.keeps += 1
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        """A saved tensor again: a kept shard gathered whole (in the shape it was saved in)."""
        return packed.gathered() if isinstance(packed, _Regather) else packed


class _Regather:
    """A saved gathered input, kept as its shard (``SequenceSplit.pack``) by ``keeps`` saved tensors
    (the layers that read the one gathered whole): backward gathers it for the first of them and
    hands the same whole to the others, then lets it go.

    A two-part backward (zero-bubble) unpacks the saved tensors in its input pass and again in its
    weight pass: counting unpacks per ``keeps`` gathers once per pass. Should a pass unpack only some
    of them, the whole is held until the rest do (the same values: only memory is held longer).
    """

    __slots__ = ("keeps", "served", "shape", "shard", "whole")

    def __init__(self, shard: Any, shape: tuple[int, ...]) -> None:
        self.shard = shard
        self.shape = shape
        self.keeps = 0  # saved tensors that hold this
        self.served = 0  # unpacks since the last gather
        self.whole: torch.Tensor | None = None

    def gathered(self) -> torch.Tensor:
        """The whole, gathered for the first unpack and shared until every keeper had it."""
        whole = self.whole
        if whole is None:
            from torch.distributed.tensor import Replicate

            with torch.no_grad():
                whole = self.shard.redistribute(self.shard.device_mesh, [Replicate()]).reshape(self.shape)
        self.served += 1
        if self.served >= self.keeps:  # the last keeper: hold nothing for the next pass
            self.served, self.whole = 0, None
        else:
            self.whole = whole
        return whole


def _storage(t: torch.Tensor) -> int:
    """The storage a tensor's data lives in (a DTensor's local part), 0 for a tensor without one."""
    from torch.distributed.tensor import DTensor

    local = local_tensor(t) if isinstance(t, DTensor) else t
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def hook_units(stage: nn.Module, units: Sequence[nn.Module], split: Any) -> None:
    """Hook a stage's split (``SequenceSplit``, ``planner.run.context_shard.ContextSplit``) on the
    stage and its units: ``stage_in`` / ``stage_out`` around the stage's forward, ``enter`` / ``leave``
    around each unit's (a recomputation re-runs a unit's forward in backward, outside the stage's).

    Args:
        stage: the stage module.
        units: the modules it runs one after another (``stage_units``).
        split: the shared state, with those four methods.
    """
    stage.register_forward_pre_hook(split.stage_in)
    stage.register_forward_hook(split.stage_out, always_call=True)
    for unit in units:
        if unit is not stage:
            unit.register_forward_pre_hook(split.enter)
            unit.register_forward_hook(split.leave, always_call=True)


def row_style() -> Any:
    """torch's style of a row-wise layer under sequence parallelism: its output reduce-scattered
    along the sequence, left a DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)


def install(
    stage: nn.Module,
    units: Sequence[nn.Module],
    column_layers: Sequence[nn.Module],
    tp_mesh: Any,
    seq_inputs: Sequence[bool],
) -> SequenceSplit:
    """Install sequence parallelism on a stage whose layers ``shard_stage`` is about to split.

    Call before the layers are parallelized and before FSDP wraps anything: the column-wise layers'
    gathering hooks must run before torch's own input hooks, and FSDP's forward hooks (registered
    later, its pre-forward hooks prepended) outside the mode.

    Args:
        stage: the stage module (its inputs and outputs cross pipeline boundaries).
        units: the modules it runs one after another (``stage_units``): each runs under the mode,
            also when a recomputation re-runs it in backward.
        column_layers: the stage's column-wise (and ``colwise_rep``) layers.
        tp_mesh: the rank's tensor-parallel mesh.
        seq_inputs: which of the stage's positional inputs are sequence shards.

    Returns:
        The shared state (held by the hooks).
    """
    split = SequenceSplit(tp_mesh, seq_inputs)
    hook_units(stage, units, split)
    for layer in column_layers:
        layer.register_forward_pre_hook(split.column_input)
    return split


__all__ = ["Replicated", "SavedShards", "SequenceSplit", "autocast_cast", "hook_units", "install", "row_style"]
