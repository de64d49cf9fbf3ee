"""How each block divides under tensor parallelism (``TensorParallelShare``), from the model's plan.

One forward of the traced graph where it lives (on the meta device for estimated costs: no weights,
no data) at the profiled microbatch, watched at the aten level. What is counted, per block:

* split operators: every operator run inside a matched layer (a column-wise, row-wise or
  ``colwise_rep`` ``nn.Linear``, or a ``colwise_rep`` ``nn.Embedding``), and every operator outside them that reads a *split tensor*: one
  produced inside a column-wise layer, or by a split operator outside the layers (attention's SDPA,
  the rotary embedding, SwiGLU's ``silu(w1 x) * w3 x`` between a column-wise and its row-wise
  layer). A row-wise layer's output is whole again (all-reduced), and so is a ``colwise_rep``
  layer's (all-gathered), so the split region ends there.
* ``sharded_compute``: the split operators' share of the block's forward work, an operator's work
  being its FLOPs by ``torch.utils.flop_counter`` (matrix products, attention) or, for any other
  operator that is not a view, one per output element (norms, residual adds, activations: their
  time goes with their elements). The backward follows the forward's split, so the same share is
  used for both.
* ``sharded_activation_bytes`` / ``unsplit_activation_bytes``: the split tensors autograd saves for
  backward (the row-wise layer's split input, SDPA's q, k, v) / the whole ones (a norm's input and
  output, a column-wise layer's input); a view counts as its base; weights, buffers and what is made
  of them alone (a transpose, a narrowed rotary table) take no memory of their own. The split part is
  at most the block's ``activation_bytes`` less the whole ones: on the meta device SDPA runs its math
  form, saving the attention probabilities the estimate's fused kernel does not.
* ``fwd_allreduce_bytes`` / ``fwd_allreduces``: each row-wise layer's output, one all-reduce each
  (torch's ``RowwiseParallel`` turns its Partial output into Replicate).
* ``fwd_allgather_bytes``: each ``colwise_rep`` layer's output (an output head's logits), gathered
  whole in forward (``ColwiseParallel(output_layouts=Replicate())``); its backward slices the
  gradient, no traffic. An ``nn.Linear``'s (an output head's) also as ``head_allgather_bytes``, with
  its rows: loss parallelism leaves them split.
* ``bwd_allreduce_bytes`` / ``bwd_allreduces``: each column-wise (or ``colwise_rep``) layer's input gradient, one
  all-reduce per column-wise layer (none for an embedding: its input is token ids, no gradient): torch's ``ColwiseParallel`` wraps each layer's input with
  ``DTensor.from_local(..., Replicate())`` (torch 2.13 ``distributed/tensor/parallel/style.py``),
  whose backward turns that layer's Partial input gradient into Replicate on its own, so q, k and v,
  though they read one tensor, are three all-reduces (Megatron's fused QKV does one).
* ``sharded_params`` / ``sharded_param_bytes``: the matched layers' weights, and the column-wise
  layers' biases (a row-wise bias is added once, after the all-reduce: whole on every rank).
* ``divisor``: the greatest common divisor of the split features of the block's layers and of the
  head counts of the modules holding them (``planner.capture.tp_plan.split_sizes``); 0 (any degree)
  for a block whose only split layers are ``colwise_rep``: torch shards their rows unevenly where
  the degree does not divide them (an output head of 50,257 logits), and gathers them whole.
* ``slowdown`` (estimated costs only, given the ``HardwareSpec``): every GEMM run inside a matched
  layer is recorded with its ``(m, n, k)``; a column-wise layer splits n, a row-wise one k. At each
  degree t (the divisors of ``divisor`` from 2 to 64) the GEMMs' roofline time at the sharded shapes
  (``HardwareSpec.gemm_efficiency`` of the smaller dimension, the operands' bytes, the per-operator
  overhead) over their time at the whole shapes divided by t is the GEMMs' slowdown ``r(t)``; the
  split part's is ``g r(t) + (1 - g)``, g being the layers' GEMMs' share of the split work (by work,
  FLOPs and elements, as ``sharded_compute`` itself: the watch runs no roofline, so the split
  part's time is not at hand). The forward's GEMMs stand for the backward's: its two GEMMs per
  layer, ``dY W`` and ``dY^T X``, are the forward's ``(m, n, k)`` permuted, so they keep the same
  smallest dimension and the same efficiency. Attention (SDPA, or its matmuls outside the layers)
  split by heads keeps its per-head shapes: no slowdown, it counts in the ``1 - g``.

Blocks of a module-boundary trace (no graph) and blocks that hold no matched layer get no share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import flop_registry

from planner.capture.blocks import GraphTrace, TracedModel, by_block
from planner.capture.graph import _module_path
from planner.capture.meta_cache import meta_op_cache, on_meta
from planner.capture.signature import block_structure, leaves_block, rebuild, signature, spec
from planner.capture.tp_plan import (
    COLUMN_STYLES,
    config_heads,
    matched_modules,
    split_sizes,
)
from planner.core.levers.hardware import HardwareSpec
from planner.costs.roofline import _GEMMS, _gemm_dims, grouped_gemm
from planner.costs.sequence import SeqTally, cut_shares, sequence_only, token_wise
from planner.costs.tp_gemms import MAX_DEGREE, Gemm, gemm_seconds, gemm_slowdown
from planner.schema.shares import TensorParallelShare
from planner.torch_compat import TorchDispatchMode, no_dispatch, view_base


@dataclass
class _Tally:
    """What one block's forward ran."""

    work: float = 0.0
    split_work: float = 0.0
    saved_split: dict[int, int] = field(default_factory=dict)
    saved_whole: dict[int, int] = field(default_factory=dict)  # saved, not split, no parameter
    fwd_bytes: int = 0
    fwd_count: int = 0
    gather_bytes: int = 0
    head: tuple[int, int] = (0, 0)  # of gather_bytes, an output head's (a colwise_rep nn.Linear): bytes, rows
    bwd_bytes: int = 0
    bwd_count: int = 0
    gemm_work: float = 0.0  # of split_work, the GEMMs run inside matched layers
    gemms: list[Gemm] = field(default_factory=list)
    replayed_saved: int = 0  # saved split bytes of a block replayed from its twin (``_ShareRun``)
    replayed_whole: int = 0  # and its saved whole bytes
    seq: SeqTally = field(default_factory=SeqTally)  # what sequence parallelism changes (costs.sequence)

    def replayed(self) -> _Tally:
        """A copy for a twin block: the same counts, its saved tensors as one sum each."""
        return replace(
            self,
            saved_split={},
            saved_whole={},
            gemms=list(self.gemms),
            replayed_saved=self.replayed_saved + sum(self.saved_split.values()),
            replayed_whole=self.replayed_whole + sum(self.saved_whole.values()),
            seq=self.seq.replayed(),
        )


def _nbytes(t: torch.Tensor, float_bytes: int | None) -> int:
    width = float_bytes if float_bytes is not None and t.is_floating_point() else t.element_size()
    return t.numel() * width


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class _Watch(TorchDispatchMode):
    """Counts every aten operator's work into the current block and follows the split tensors."""

    def __init__(self, float_bytes: int | None = None) -> None:
        super().__init__()
        self.float_bytes = float_bytes
        self.block: _Tally | None = None
        self.style: str | None = None  # of the innermost matched layer running, None outside them
        self.split: set[int] = set()
        self.keep: list[torch.Tensor] = []  # split and state tensors stay alive so their ids stay unique
        self.state: set[int] = set()  # parameters, buffers and what is made of them alone: no activations
        self.seq: set[int] = set()  # sequence shards under sequence parallelism (planner.costs.sequence)
        self.params: set[int] = set()  # trainable parameters: their gradients all-reduced if read on shards

    def is_split(self, t: torch.Tensor) -> bool:
        return id(t) in self.split

    def flag(self, t: torch.Tensor) -> int:
        """1: split, 2: a sequence shard, 0: neither (a twin block's values get the same)."""
        return 1 if id(t) in self.split else 2 if id(t) in self.seq else 0

    def mark(self, tensors: list[torch.Tensor], flag: int) -> None:
        """Note ``tensors`` as split (1) or sequence shards (2), kept alive so their ids stay unique."""
        if flag:
            (self.split if flag == 1 else self.seq).update(id(t) for t in tensors)
            self.keep.extend(tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = _tensors((args, kwargs))
        if read and all(id(t) in self.state for t in read):
            made = _tensors(out)
            self.state.update(id(t) for t in made)
            self.keep.extend(made)
        if self.block is None:
            return out
        reads_split = any(self.is_split(t) for t in read)
        packet = func.overloadpacket
        grouped = grouped_gemm(func, args)  # experts' grouped GEMMs: flop_counter has no formula for them
        if packet in flop_registry:
            work = float(flop_registry[packet](*args, **kwargs, out_val=out))
        elif grouped is not None:
            work = grouped[0]
        elif func.is_view:
            work = 0.0
        else:
            work = float(sum(t.numel() for t in _tensors(out)))
        self.block.work += work
        if self.style is not None or reads_split:
            self.block.split_work += work
        if self.style is not None and packet in _GEMMS and work > 0:
            m, n, k = _gemm_dims(packet, args)
            a = args[1] if packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm) else args[0]
            width = self.float_bytes if self.float_bytes is not None and a.is_floating_point() else a.element_size()
            self.block.gemm_work += work
            self.block.gemms.append(Gemm(self.style, m, n, k, width))
        if self.style == "colwise" or (self.style is None and reads_split):
            self.mark(_tensors(out), 1)
        elif self.style is None and any(id(t) in self.seq for t in read):  # an operator on sequence shards
            self.block.seq.work += work
            if not self.block.seq.mixed and not token_wise(
                func, args, lambda t: id(t) in self.seq, lambda t: id(t) in self.state
            ):
                self.block.seq.mixed = f"runs {packet}, which does not work token by token"
            self.mark(_tensors(out), 2)
            for t in read:
                if id(t) in self.params:
                    self.block.seq.grads.setdefault(id(t), _nbytes(t, self.float_bytes))
        return out


def _plain_name(block: str) -> str:
    """A block's name without the call index of a layer called again (``layer#2``)."""
    return block.partition("#")[0]


class _ShareRun(fx.Interpreter):
    """One forward of the traced graph, each node's operators counted into its block's tally.

    Matched layers that are modules of the graph (torch.fx keeps ``nn.Linear`` as leaves) are seen
    by hooks (their input and output); layers inlined into the graph (torch.export) by their nodes'
    module paths and graph edges.
    """

    def __init__(self, traced: GraphTrace, matched: dict[str, Any], watch: _Watch, float_bytes: int | None) -> None:
        super().__init__(traced.gm)
        self.matched = matched
        self.watch = watch
        self.float_bytes = float_bytes
        self.block_of = {n: k for k, b in enumerate(traced.blocks) for n in b.nodes}
        self.tallies = [_Tally() for _ in traced.blocks]
        self.seen: set[tuple[str, str]] = set()  # (layer, what) already counted: each layer once
        self.seen_layers: set[str] = set()  # the layers in ``seen``
        self.layer_stack: list[str | None] = []
        self.module_names = {id(m): n for n, (_, m, _) in matched.items()}
        # Twin blocks (planner.capture.signature) on the meta device: a block identical to one run
        # before, whose layers split alike, gets a copy of that block's tally and fresh values.
        self.blocks = traced.blocks
        self.first = {b.nodes[0]: k for k, b in enumerate(traced.blocks) if b.nodes}
        self.nodes = traced.nodes_by_name()
        # key -> the first block's tally, its nodes' value specs, which of each value's tensors are split,
        # and whether each value leaves the block (only those are made again for a twin: no other is read)
        self.known: dict[Any, tuple[_Tally, list[Any], list[tuple[int, ...]], list[bool]]] = {}
        self.replay: list[Any] | None = None  # the current block's fresh values, when replayed
        # a new block: its key, its nodes' value specs and each value's tensors' ``_Watch.flag``
        self.recording: tuple[Any, list[Any], list[tuple[int, ...]]] | None = None
        self.counted: set[str] = set()  # layers of replayed blocks: counted with their tally
        self.position = 0
        self.on_meta = on_meta(traced.gm)
        self.seq_nodes: set[str] = set()  # values that are sequence shards (the cuts' share)
        self.sequence: tuple[int, ...] = ()  # the input tokens' [batch, seq], when the input is token ids

    def styled(self, path: list[str]) -> tuple[str, str] | None:
        """The innermost matched layer of a node's module path, with its style."""
        for p in reversed(path):
            if p in self.matched:
                return p, self.matched[p][0]
        return None

    def _count(self, name: str, what: str) -> bool:
        if (name, what) in self.seen or name in self.counted:
            return False
        self.seen.add((name, what))
        self.seen_layers.add(name)
        return True

    def _add(self, what: str, tensors: list[torch.Tensor], count: bool) -> None:
        """Count a layer's all-reduce: "bwd" a column-wise input's gradient, "fwd" a row-wise output."""
        block = self.watch.block
        assert block is not None
        nbytes = sum(_nbytes(t, self.float_bytes) for t in tensors)
        if what == "bwd":
            block.bwd_bytes += nbytes
            block.bwd_count += int(count)
        else:
            block.fwd_bytes += nbytes
            block.fwd_count += int(count)

    def _gather(self, tensors: list[torch.Tensor], head: bool) -> None:
        """A colwise_rep layer's output, all-gathered whole; an output head's (``head``: an nn.Linear's,
        not an embedding's) noted apart, with its rows, for loss parallelism to leave split."""
        block = self.watch.block
        assert block is not None
        nbytes = sum(_nbytes(t, self.float_bytes) for t in tensors)
        block.gather_bytes += nbytes
        if head:
            rows = sum(t.numel() // max(1, t.shape[-1]) for t in tensors if t.dim())
            block.head = (block.head[0] + nbytes, block.head[1] + rows)

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.layer_stack.append(self.watch.style)
        self.watch.style = self.matched[self.module_names[id(module)]][0]

    def post_hook(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.watch.style = self.layer_stack.pop()
        name = self.module_names[id(module)]
        style = self.matched[name][0]
        if style == "rowwise":  # under sequence parallelism, reduce-scattered along the sequence
            self._row_output(_tensors(out))
        if self.watch.block is not None and self._count(name, "io"):
            floats = [t for t in _tensors(args)[:1] if t.is_floating_point()]  # an embedding's ids: no gradient
            if style in COLUMN_STYLES and floats:  # its input's gradient is all-reduced in backward
                self._add("bwd", floats, True)
                self._column_input(floats)
            if style == "rowwise":  # its output is all-reduced in forward
                self._add("fwd", _tensors(out), True)
            if style == "colwise_rep":  # its output is all-gathered whole in forward
                self._gather(_tensors(out), isinstance(module, nn.Linear))

    def _row_output(self, tensors: list[torch.Tensor]) -> None:
        """A row-wise layer's output: a sequence shard, if it is laid out [batch, seq, features] (the
        runner splits dimension 1; ``sequence``: the tokens' [batch, seq], when the input is tokens)."""
        self.watch.mark(tensors, 2)
        block = self.watch.block
        bad = [t for t in tensors if t.dim() < 3 or (self.sequence and tuple(t.shape[:2]) != self.sequence)]
        if bad and block is not None and not block.seq.mixed:
            block.seq.mixed = f"gives a row-wise output of shape {tuple(bad[0].shape)}, not [batch, seq, features]"

    def _column_input(self, tensors: list[torch.Tensor]) -> None:
        """A column-wise layer's input, as sequence parallelism gathers (or wraps) it once per value."""
        block = self.watch.block
        assert block is not None
        for t in tensors:
            block.seq.column_input(id(t), _nbytes(t, self.float_bytes), id(t) in self.watch.seq)

    def hooks(self, stack: ExitStack) -> None:
        """Hook every matched layer the graph calls as a module."""
        gm_modules = dict(self.module.named_modules())
        for name in self.matched:
            if name not in gm_modules:
                continue
            target = gm_modules[name]
            self.module_names[id(target)] = name
            stack.enter_context(target.register_forward_pre_hook(self.pre_hook))
            stack.enter_context(target.register_forward_hook(self.post_hook))

    def _layers(self, k: int) -> list[tuple[str, str] | None]:
        """Each node of block k's matched layer and style (None: in none)."""
        out: list[tuple[str, str] | None] = []
        for name in self.blocks[k].nodes:
            n = self.nodes[name]
            if n.op == "call_module" and str(n.target) in self.matched:
                out.append((str(n.target), self.matched[str(n.target)][0]))
            else:
                out.append(self.styled(_module_path(n)))
        return out

    def _begin(self, k: int) -> None:
        """At block k's first node: replay it from a twin, or note what it produces to replay later."""
        self.replay = self.recording = None
        found = self._layers(k)
        names = {x[0] for x in found if x is not None}
        if names & self.counted or names & self.seen_layers:
            return  # a layer another block ran too (ALBERT): counted once, so never replayed
        prefix = _plain_name(self.blocks[k].name) + "."
        layers = tuple((x[0].removeprefix(prefix), x[1]) if x else None for x in found)  # names inside the block
        shape = block_structure(self.module, self.blocks[k].nodes, self.nodes)
        key = signature(shape, self.module, lambda a: self.env[a])
        if key is None:
            return
        split_in = tuple(
            tuple(self.watch.flag(t) for t in _tensors(self.env[a])) for a in shape[1] if a.op != "get_attr"
        )
        key = (key, layers, split_in)
        if key not in self.known:
            self.recording = (key, [], [])
            return
        tally, specs, split, leaves = self.known[key]
        self.tallies[k] = tally.replayed()
        self.counted.update(names)
        with no_dispatch():
            self.replay = [rebuild(x) if out else None for x, out in zip(specs, leaves)]
        for value, flags, name in zip(self.replay, split, self.blocks[k].nodes):
            for t, flag in zip(_tensors(value), flags):
                self.watch.mark([t], flag)
            if 2 in flags:
                self.seq_nodes.add(name)

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.first and self.on_meta:
            self._begin(self.first[n.name])
            self.position = 0
        k = self.block_of.get(n.name)
        if k is not None and self.replay is not None:
            out = self.replay[self.position]
            self.position += 1
            if self.position == len(self.replay):
                self.replay = None
            return out
        out = self._run_counted(n, k)
        if any(id(t) in self.watch.seq for t in _tensors(out)):
            self.seq_nodes.add(n.name)
        if k is not None and self.recording is not None:
            recorded = spec(out)
            if recorded is None:
                self.recording = None
            else:
                self.recording[1].append(recorded)
                self.recording[2].append(tuple(self.watch.flag(t) for t in _tensors(out)))
                if n.name == self.blocks[k].nodes[-1]:
                    key, specs, split = self.recording
                    leaves = leaves_block(self.blocks[k].nodes, self.nodes)
                    self.known[key] = (self.tallies[k].replayed(), specs, split, leaves)
                    self.recording = None
        return out

    def _run_counted(self, n: fx.Node, k: int | None) -> Any:
        self.watch.block = self.tallies[k] if k is not None else None
        inner = self.styled(_module_path(n)) if n.op != "call_module" else None
        self.watch.style = inner[1] if inner else None
        out = super().run_node(n)
        if inner is not None and self.watch.block is not None:  # an inlined layer (export): its graph edges
            self._inlined(n, inner, out)
        self.watch.style = None
        return out

    def _inlined(self, n: fx.Node, inner: tuple[str, str], out: Any) -> None:
        name, style = inner

        def layer_of(a: fx.Node) -> str:
            return (self.styled(_module_path(a)) or ("", ""))[0]

        if style in COLUMN_STYLES:
            inputs = False
            for a in n.all_input_nodes:
                floats = [t for t in _tensors(self.env[a]) if t.is_floating_point()]  # not an embedding's ids
                if a.op != "get_attr" and layer_of(a) != name and floats and self._count(name, a.name):
                    self._add("bwd", floats, False)
                    self._column_input(floats)
                    inputs = True
            if inputs and self._count(name, "count"):
                self._add("bwd", [], True)
        if style == "rowwise" and any(layer_of(u) != name for u in n.users):
            self._row_output(_tensors(out))
            self._add("fwd", _tensors(out), self._count(name, "count"))
        if style == "colwise_rep" and any(layer_of(u) != name for u in n.users):
            self._gather(_tensors(out), isinstance(self.matched[name][1], nn.Linear))


def tensor_parallel_shares(
    traced: TracedModel,
    inputs: tuple[Any, ...],
    plan: Mapping[str, str],
    *,
    float_bytes: int | None = None,
    param_bytes: int | None = None,
    hardware: HardwareSpec | None = None,
    dtype: str | None = None,
) -> dict[str, TensorParallelShare]:
    """Each split block's ``TensorParallelShare`` (see the module docstring for what is counted).

    Args:
        traced: the traced model (a graph; a module-boundary trace gives no shares).
        inputs: one microbatch of the model's positional inputs, at the profiled size (any device).
        plan: pattern -> "colwise" | "rowwise" | "colwise_rep", the FQNs of the traced model's modules.
        float_bytes: bytes of a floating element in the planning dtype (None: as the tensors have).
        param_bytes: bytes of a parameter element as the blocks count them (None: as they have).
        hardware: the hardware of estimated costs: the shares then carry the GEMMs' ``slowdown``
            (None: measured costs, no slowdown).
        dtype: the planning dtype, whose peak the GEMMs run at (with ``hardware``).

    Returns:
        block name -> share, for the blocks that hold a matched layer.
    """
    if not isinstance(traced, GraphTrace) or not plan:
        return {}
    matched = matched_modules(traced.model, plan)
    if not matched:
        return {}
    watch = _Watch(float_bytes)
    watch.state.update(id(t) for t in (*traced.gm.parameters(), *traced.gm.buffers()))
    watch.params.update(id(p) for p in traced.gm.parameters() if p.requires_grad)
    run = _ShareRun(traced, matched, watch, float_bytes)
    first = inputs[0] if inputs else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        run.sequence = tuple(first.shape)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if watch.block is None or id(t) in watch.state:
            return t
        # a view holds its base's memory, split or whole as its base is (not as the view: a column-wise
        base = view_base(t)
        base = t if base is None else base  # layer's x.view(-1, d) of its whole input is made inside it)
        saved = watch.block.saved_split if watch.is_split(base) else watch.block.saved_whole
        saved.setdefault(id(base), _nbytes(base, float_bytes))
        # whole without sequence parallelism, split with it (a column-wise layer's input too: the
        # runner keeps the shard and gathers it again for the backward)
        if id(base) in watch.seq:
            watch.block.seq.saved.setdefault(id(base), _nbytes(base, float_bytes))
            if watch.style in COLUMN_STYLES:
                watch.block.seq.column.setdefault(id(base), _nbytes(base, float_bytes))
        return t

    device = next((p.device for p in traced.gm.parameters()), torch.device("meta"))
    moved = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    with ExitStack() as stack:
        run.hooks(stack)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(meta_op_cache(on_meta(traced.gm, moved)))  # below the tally: it sees every call
        stack.enter_context(watch)
        run.run(*moved)
    watch.keep.clear()
    heads = config_heads(traced.model)
    inside = by_block([b.name for b in traced.blocks], matched)
    cuts = cut_shares([c.tensors for c in traced.cuts], run.seq_nodes, lambda n: _value_bytes(traced, n)) + [0.0]
    shares: dict[str, TensorParallelShare] = {}
    for block, tally, cut in zip(traced.blocks, run.tallies, cuts):
        seq = tally.seq.share(tally.work, cut)
        if inside.get(block.name) and tally.work > 0:
            share = _share(traced.model, inside[block.name], tally, param_bytes, hardware, dtype, heads)
            shares[block.name] = share.model_copy(update={"sequence": seq})
        elif seq is not None:  # no split layer, but sequence shards (a final norm): split only with them
            shares[block.name] = sequence_only(seq)
    return shares


def _value_bytes(traced: GraphTrace, name: str) -> int:
    info = traced.values.get(name)
    return info.nbytes if info is not None and info.kind == "tensor" else 0


def _share(
    model: nn.Module,
    inside: dict[str, Any],
    tally: _Tally,
    param_bytes: int | None,
    hardware: HardwareSpec | None,
    dtype: str | None,
    heads: list[tuple[str, int]],
) -> TensorParallelShare:
    """One block's share from what its forward ran (``inside``: its matched layers; ``heads``: the
    model config's head counts, ``config_heads``)."""
    params = [p for _, (style, m, _) in inside.items() for p in _split_params(m, style)]
    sizes = [n for _, _, n in split_sizes(model, {}, matched=inside, heads=heads)]
    divisor = math.gcd(*sizes) if sizes else 0  # 0: any degree (colwise_rep layers only: torch shards them unevenly)
    slowdown: dict[int, float] = {}
    if hardware is not None and tally.gemms and tally.split_work > 0:
        g = min(1.0, tally.gemm_work / tally.split_work)
        peak = hardware.peak(dtype or "bf16")
        slowdown = {
            t: g * gemm_slowdown(tally.gemms, t, hardware, peak) + (1.0 - g)
            for t in range(2, (min(divisor, MAX_DEGREE) if divisor else MAX_DEGREE) + 1)
            if divisor % t == 0
        }
    return TensorParallelShare(
        sharded_params=sum(p.numel() for p in params),
        sharded_param_bytes=sum(
            p.numel() * (param_bytes if param_bytes is not None else p.element_size()) for p in params
        ),
        sharded_compute=min(1.0, tally.split_work / tally.work),
        sharded_activation_bytes=sum(tally.saved_split.values()) + tally.replayed_saved,
        unsplit_activation_bytes=sum(tally.saved_whole.values()) + tally.replayed_whole,
        fwd_allreduce_bytes=tally.fwd_bytes,
        fwd_allgather_bytes=tally.gather_bytes,
        head_allgather_bytes=tally.head[0],
        head_rows=tally.head[1],
        bwd_allreduce_bytes=tally.bwd_bytes,
        fwd_allreduces=tally.fwd_count,
        bwd_allreduces=tally.bwd_count,
        divisor=divisor,
        slowdown=slowdown,
    )


def _split_params(module: nn.Module, style: str) -> list[torch.Tensor]:
    """The parameters a layer splits: its weight, and its bias when column-wise (or colwise_rep)."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    out = [weight] if isinstance(weight, torch.Tensor) else []
    if style in COLUMN_STYLES and isinstance(bias, torch.Tensor):
        out.append(bias)
    return out


__all__ = ["gemm_seconds", "gemm_slowdown", "tensor_parallel_shares"]
