"""Every private torch API the planner touches, in one place.

Checked against torch 2.13.0 (``pyproject.toml`` allows only the versions the suite runs on).
When torch changes one of these, this is the only file to mend; the tests that exercise each
(named below) fail first. Everything else in the planner uses torch's public API.

- ``torch.utils._pytree``: flattening nested outputs (tree_leaves, tree_map_only, tree_unflatten).
- ``torch.utils._python_dispatch.TorchDispatchMode``: the roofline estimator sees every aten op, and so
  does the count of each block's tensor-parallel share (tests/test_tp_plan.py) and of a block's
  backward temporaries (tests/test_backward_temps.py).
- ``torch.distributed.pipelining._backward``: the I/W backward split zero-bubble schedules run
  (tests/test_profile.py).
- ``Tensor._is_view`` and ``UntypedStorage._cdata``: views and storage identity.
- ``GraphModule.graph._codegen`` / ``torch.fx.graph._PyTreeCodeGen``: the output structure of an
  exported graph (tests/test_trace.py), and a graph rebuilt with it (tests/test_graph_file.py).
- ``torch._ops.OpOverload`` / ``HigherOrderOperator``: a graph's operators written by name, the
  launcher's trace handed to the ranks (``operator_name``; tests/test_graph_file.py).
- ``torch.distributed.pipelining.schedules._batch_p2p`` / ``_wait_batch_p2p`` and
  ``PipelineScheduleSingle._maybe_compute_loss``: timers around the schedule's point-to-point
  operations and the loss (tests/test_run.py).
- ``torch.distributed._tools.mem_tracker.MemTracker`` (its ``_update_peak_stats``, ``_curr_mem_snap``,
  ``_peak_mem``, ``_peak_mem_snap``, ``_TOTAL_KEY``): memory by category and the global peak, without
  per-module peaks (tests/test_run.py).
- ``torch.nn.functional.scaled_dot_product_attention`` swapped for the duration of an estimate, to
  charge attention as the fused kernel a GPU runs (tests/test_estimate.py).
- ``torch._functorch.config.donated_buffer`` and ``torch._inductor.config.compile_threads``: how
  compiled code is built, for the profiler and the runner alike (tests/test_speed_levers.py).
- ``torch._utils._flatten_dense_tensors`` / ``_unflatten_dense_tensors``: one all-reduce per dtype
  over the replicas (tests/test_checkpoint.py, the zero-bubble DDP runs).
- ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: a tied parameter that
  another DDP of the same rank already reduces (two stages of one rank reading one weight, under
  DDP and a schedule without a two-part backward; no test runs that layout yet).
- ``LocalElasticAgent._start_workers`` / ``_shutdown``: the launcher learns its workers' pids and
  lets them write their failure records before elastic stops them (tests/test_faults.py).
- ``torch.distributed.pipelining.stage.stage_backward_weight`` (the name ``PipelineStage`` calls):
  wrapped to retain the graph between a stage's parameter groups, and ``stage_backward_input`` to run
  the whole backward of a stage whose inputs need no gradient (``split_backward_patched``;
  tests/test_estimated_runs.py runs T5 under interleaved-zb, tests/test_run.py a frozen embedding).
- ``torch._subclasses.fake_tensor.FakeTensorMode``: the runner's shapes (trace values, stage
  examples, output width) computed without data (tests/test_shapes.py).
- ``torch.fx._lazy_graph_module._LazyGraphModule``: a traced graph whose Python code is generated only
  when it is first called (planning runs the graph in an interpreter; tests/test_trace.py).
- ``torch.fx.proxy._create_arg_bypass``: fx's own table of the argument types it lowers without its
  checks (proxies, numbers, tuples, lists), which the planner's tracer consults first: fx.Tracer
  makes every check before reaching it (tests/test_trace.py, the graph of every shipped model).
- ``torch._C._DisableTorchDispatch``: allocations that no dispatch mode needs to see (the replayed
  values of a meta run, ``planner.capture.graph``; tests/test_meta_runs.py).
- ``torch.fx.Node._update_args_kwargs``: a traced node's arguments set after it is made, which is
  what ``Node.__init__`` and the ``args`` setter do (``set_node_arguments``; tests/test_trace.py).
- ``OpOverload._schema``: whether an operator writes or aliases its arguments, for the meta cache
  (``op_schema``; tests/test_meta_runs.py). This and the four below: tests/test_torch_compat.py too.
- ``Tensor._base``: the tensor a view's memory belongs to, for the saved-activation counts
  (``view_base``; tests/test_tensor_parallel.py, tests/test_weight_casts.py).
- ``DTensor._local_tensor``: a DTensor's local part itself, not ``to_local()``'s fresh alias
  (``local_tensor``; tests/test_run_sp.py).
- ``Module._parameters`` / ``_buffers``: a module's own tensors swapped in place for fake or meta ones
  (``own_tensor_tables``; tests/test_shapes.py).
- torchao's ``Float8TrainingTensor._data`` (torchao 0.18): the float8 payload of a tensor torchao's float8
  linear layers cast, which the roofline charges a byte an element (``float8_payload``;
  tests/test_float8.py).
- The logger ``torch.utils._pytree``, silenced while torchao is imported (it warns of a deprecated
  registration of torchao's; ``float8_import_logger_names``; tests/test_float8.py).
- The loggers ``torch._dynamo`` and ``torch._export``, silenced while the planner tries an export
  (``export_logger_names``; tests/test_trace.py).
- The modules ``torch.export._trace`` and ``torch.distributed._tools.mem_tracker``, imported once by
  the server the ranks fork from (``EXPORT_TRACER_MODULE``, ``MEMORY_TRACKER_MODULE``;
  tests/test_forkserver.py).
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "FLOAT8_DTYPES",
    "FakeTensorMode",
    "split_backward_patched",
    "TorchDispatchMode",
    "ddp_ignore",
    "gather_each_stage_once",
    "EXPORT_TRACER_MODULE",
    "MEMORY_TRACKER_MODULE",
    "export_logger_names",
    "exported_out_spec",
    "flatten_dense",
    "float8_import_logger_names",
    "quiet_loggers",
    "float8_payload",
    "is_view",
    "lazy_graph_module",
    "local_tensor",
    "memory_tracker",
    "no_dispatch",
    "op_schema",
    "own_tensor_tables",
    "pipelining_backward",
    "pytree",
    "retain_graph_compile",
    "set_node_arguments",
    "storage_id",
    "swapped_sdpa",
    "timed_schedule",
    "unflatten_dense",
    "view_base",
    "watched_elastic_agent",
]


def lazy_graph_module(root: torch.nn.Module, graph: fx.Graph, name: str) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, name)`` whose Python code is generated when it is first needed
    (called, printed, pickled): for a 1,000-layer graph that only an interpreter runs, never."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, name)


def fx_arg_bypass() -> dict[type, Callable[[Any, Any], Any]]:
    """fx's table of argument types lowered without checks (exact type -> lowering), empty if gone;
    without tensors, which the table passes on as values (for tracers without a module) and
    ``fx.Tracer`` turns into attribute reads."""
    table = getattr(fx.proxy, "_create_arg_bypass", {})
    return {t: f for t, f in table.items() if not issubclass(t, (torch.Tensor, torch.nn.Module))}


def set_node_arguments(node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Give a node made without arguments its arguments (and its inputs their user), as
    ``Node.__init__`` does with those it is made with."""
    node._update_args_kwargs(args, kwargs)


def no_dispatch() -> Any:
    """A context in which torch calls skip every Python dispatch mode (and tensor subclass)."""
    return torch._C._DisableTorchDispatch()


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage."""
    return bool(t._is_view())


def storage_id(t: torch.Tensor) -> int:
    """An id of ``t``'s storage that is the same for every view of it (works on meta tensors)."""
    return int(t.untyped_storage()._cdata)


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 dtypes torchao's training recipes cast to (e4m3 forward, e5m2 for gradients)."""


def float8_payload(t: object) -> torch.Tensor | None:
    """The float8 payload of torchao's float8 training tensor ``t`` (its private ``_data``, what a float8
    GEMM reads; the wrapper reports its high-precision dtype), else None."""
    data = getattr(t, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES else None


def float8_import_logger_names() -> tuple[str, ...]:
    """The loggers that warn while torchao is imported: its own (the CUDA extensions a machine without them
    cannot load) and torch's pytree (a registration torch 2.13 deprecates)."""
    return ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(names: Sequence[str]) -> Iterator[None]:
    """The loggers ``names`` at ERROR inside the block, their levels restored after it (they set their own:
    each is set explicitly).

    Args:
        names: logger names (``float8_import_logger_names``, ``export_logger_names``).
    """
    import logging

    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def quiet_torchao_import() -> contextlib.AbstractContextManager[None]:
    """torchao's first import, wherever it happens inside (float8 training, or transformers importing it
    when a model is built), without the warnings of ``float8_import_logger_names``: neither the CUDA
    extensions a machine lacks nor torch's deprecation concerns the planner's user."""
    return quiet_loggers(float8_import_logger_names())


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor whose memory ``t`` views (torch's private ``Tensor._base``), None if ``t`` is no view.

    The planner counts a saved view as the memory it holds: its base's, once however many views of
    it autograd saves. Torch has no public way to reach a view's base (``_is_view`` says only that
    there is one).

    Args:
        t: any tensor (meta and fake ones too).

    Returns:
        The base tensor, or None.
    """
    return t._base


def op_schema(func: Any) -> Any:
    """An aten operator's ``torch._C.FunctionSchema`` (the ``OpOverload``'s private ``_schema``).

    The meta cache answers an operator's repeated calls only if it neither writes nor aliases its
    arguments, which its schema says (``is_mutable``, each argument's ``alias_info``); torch has no
    public accessor for an overload's parsed schema.

    Args:
        func: an ``OpOverload`` (as a dispatch mode receives it).

    Returns:
        Its schema.
    """
    return func._schema


def local_tensor(dt: Any) -> torch.Tensor:
    """A DTensor's local part: the very tensor it holds (its private ``_local_tensor``).

    ``DTensor.to_local()`` is not the same where autograd records: it returns a fresh alias made by an
    autograd function (``_ToTorchTensor``, a ``view_as``), one per call, with its own node. The
    sequence-parallel runner keys a gathered input by its storage inside autograd's pack hook and
    watches the local part with a weak reference, which must die with the DTensor, not at once.

    Args:
        dt: a ``torch.distributed.tensor.DTensor``.

    Returns:
        Its local tensor (no copy, no alias).
    """
    return dt._local_tensor


def own_tensor_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer tables (``Module._parameters``, ``Module._buffers``),
    the very dicts, name -> tensor or None.

    Writing to them puts a tensor in a parameter's or buffer's place without ``register_parameter``'s
    checks and hooks: the shape runs swap a module's weights for fake or meta tensors (not
    ``nn.Parameter``) and put the originals back, each slot once however many paths reach it.

    Args:
        module: any module; only its own tensors, not its children's.

    Returns:
        (parameters, buffers), the module's own dicts: writes go through.
    """
    return module._parameters, module._buffers


# The module torch.export loads on a process's first export (with aot_autograd, fake-tensor passes
# and inductor's configuration behind it: 85 modules). The rank server imports it once, so that a
# rank tracing a torch.export model does not (0.2 to 0.4 s of every such rank's start).
EXPORT_TRACER_MODULE = "torch.export._trace"

# The module of torch's memory tracker, which every rank's tracked step builds (``memory_tracker``):
# its import registers fake collectives for every c10d operator, 0.25 s of each rank's start here
# when a rank imported it itself. The rank server imports it once, as it does the export tracer.
MEMORY_TRACKER_MODULE = "torch.distributed._tools.mem_tracker"


def export_logger_names() -> tuple[str, ...]:
    """The loggers a failing ``torch.export.export`` warns on, torch's private ``torch._dynamo`` and
    ``torch._export`` among them: the planner silences them while it tries an export and reports the
    reason in one line.

    Returns:
        The logger names, public ones included.
    """
    return ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")


def decomposes(func: Any) -> bool:
    """Whether ``func.decompose`` runs parts (the operator has a CompositeImplicitAutograd kernel)
    instead of returning NotImplemented."""
    return bool(func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd))


def exported_out_spec(gm: fx.GraphModule) -> Any:
    """The pytree spec of an exported graph's output (torch.export flattens outputs), or None."""
    info = exported_pytree_info(gm)
    return info.out_spec if info is not None else None


def exported_pytree_info(gm: fx.GraphModule) -> Any:
    """An exported graph's input and output structures (its code generator's pytree info), or None."""
    codegen = gm.graph._codegen
    return codegen.pytree_info if isinstance(codegen, fx.graph._PyTreeCodeGen) else None


def with_pytree_codegen(graph: fx.Graph, info: Any) -> None:
    """Give ``graph`` the code generator of an exported graph with these structures (None: leave it)."""
    if info is not None:
        graph._codegen = fx.graph._PyTreeCodeGen(info)


def operator_name(target: Any) -> tuple[str, str] | None:
    """An aten-style operator overload as (namespace, "packet.overload"), None for any other target.

    Raises:
        TypeError: a higher-order operator (its subgraphs are modules of their own).
    """
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise TypeError(f"the higher-order operator {target.name()}")
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target.__name__
    return None


def graph_copy(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph``, node names and metadata kept, with its code generator: an exported graph's
    takes and returns the model's own input and output structures (pytree specs), not flat tuples."""
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    out._codegen = graph._codegen  # read only (its specs); a deep copy warns about pytree's LeafSpec
    return out


def pipelining_backward() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch.distributed.pipelining's ``stage_backward``, ``stage_backward_input``, ``stage_backward_weight``.

    Imported on call: torch.distributed.pipelining takes ~1 s to import and most commands never
    need it.
    """
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    return stage_backward, _whole_without_input_grads(stage_backward_input), _retaining(stage_backward_weight)


def _whole_without_input_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """``stage_backward_input`` running the whole backward where no input of the stage needs a gradient
    (``split_backward_patched`` says why); the profiler and the runner share it."""
    if getattr(original, "_planner_whole", False):
        return original
    from torch.distributed.pipelining._backward import stage_backward

    def input_half(outputs: Any, output_grads: Any, input_values: list[Any], weights: Any) -> Any:
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in input_values):
            return original(outputs, output_grads, input_values, weights)
        # no parameter group left for the weight half: it computes nothing
        return stage_backward(outputs, output_grads, input_values), []

    input_half._planner_whole = True  # type: ignore[attr-defined]
    return input_half


def _retaining(original: Callable[..., Any]) -> Callable[..., Any]:
    """``stage_backward_weight`` keeping the graph between parameter groups when there are several
    (``split_backward_patched`` says why); the profiler and the runner share it."""
    if getattr(original, "_planner_retaining", False):
        return original

    def retaining(weights: Any, param_groups: list[dict[str, Any]], retain_graph: bool = False) -> Any:
        return original(weights, param_groups, retain_graph=retain_graph or len(param_groups) > 1)

    retaining._planner_retaining = True  # type: ignore[attr-defined]
    return retaining


def split_backward_patched() -> None:
    """Mend two gaps of torch's two-part backward (zero-bubble schedules); idempotent, for the process.

    - The weight half keeps the autograd graph between a stage's parameter groups.
      ``stage_backward_weight`` runs one ``autograd.grad`` per parameter group with
      ``retain_graph=False``, so where two groups reach shared nodes (T5's relative position bias,
      computed in a stage's first layer and read by every other, ALBERT's one layer applied N times)
      the first group frees what the second needs: "Trying to backward through the graph a second
      time". Retaining it is what the groups' overlap needs; the graph is freed as soon as the step's
      intermediates are dropped, after the last group.
    - The input half of a stage none of whose inputs needs a gradient runs the whole backward.
      ``stage_backward_input`` finds the parameter groups the weight half computes through the
      inputs' gradient functions; where every input is without one (all before the stage frozen: a
      fine-tuned model's embedding) it finds none, and the stage's weights silently got no gradient.
      torch spares its first stage the same way (``PipelineStage.backward_weight_one_chunk`` runs a
      full backward there); a later stage after a frozen prefix is this case.
    """
    import torch.distributed.pipelining.stage as stage_module

    stage_module.stage_backward_weight = _retaining(stage_module.stage_backward_weight)
    stage_module.stage_backward_input = _whole_without_input_grads(stage_module.stage_backward_input)


@functools.cache
def _global_peak_tracker() -> type:
    """``MemTracker`` keeping only the rank's peak, not every module's.

    After each operator MemTracker walks every module it has seen, to raise the peaks of those still
    running (``_update_peak_stats``); that walk was a third of a small pipeline rank's time in its
    memory-tracked step (1.1 of 3.1 s for tiny GPT). The planner reads only the global categories and
    the global peak, which this override keeps exactly as torch computes them (the second half of
    torch's method, unchanged); the module hooks stay, since they decide what is an activation, a
    temporary or a gradient.
    """
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class GlobalPeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(dev_snap)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            # torch registers a gradient hook on every parameter of a module it sees called, and a
            # frozen one (requires_grad False: a fine-tuned model's embedding) refuses it ("cannot
            # register a hook on a tensor that doesn't require gradient"). A frozen parameter never
            # gets a gradient, so it needs none: entered as hooked already, with handles that remove
            # nothing, it is still counted as a parameter.
            for param in module.parameters():
                if not param.requires_grad and param not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return GlobalPeakTracker


class _NoHook:
    """A hook handle with nothing to remove (``_global_peak_tracker``'s frozen parameters)."""

    def remove(self) -> None:
        """Nothing was registered."""


_NO_HOOK = _NoHook()


def memory_tracker() -> Any:
    """A new ``torch.distributed._tools.mem_tracker.MemTracker`` that keeps the global peak only
    (``_global_peak_tracker``: per-module peaks are not kept)."""
    return _global_peak_tracker()()


def forget_root_module(tracker: Any, *modules: Any) -> None:
    """Let ``MemTracker`` see ``module`` called at the top level once more in the same context.

    MemTracker refuses a second root-level forward of a module it already tracks ("multiple
    iterative calls"); pipeline microbatches are exactly that. ``reset_mod_stats`` clears every
    module's statistics, which breaks the backward hooks of *other* stages of the same rank whose
    microbatches are still in flight (their modules are looked up in backward); so only this root
    module's entry is dropped (its private ``memory_tracking`` table). Only the global categories
    are read from the tracker, never the per-module statistics.
    """
    for module in modules:
        if module is not None:
            tracker.memory_tracking.pop(module, None)


@contextlib.contextmanager
def swapped_sdpa(replacement: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """Replace ``F.scaled_dot_product_attention`` process-wide inside the block.

    Yields:
        The original function (the replacement calls it where it does not apply).
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = replacement
    try:
        yield original
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def timed_schedule(
    schedule: Any, on_loss: Callable[[Any, int, float], None], on_p2p: Callable[[float], None]
) -> Iterator[None]:
    """Time the schedule's loss per microbatch and its point-to-point posting and waiting.

    Wraps ``schedule._maybe_compute_loss`` (an instance attribute, so only this schedule) and the
    module functions ``_batch_p2p`` / ``_wait_batch_p2p`` of ``torch.distributed.pipelining.schedules``
    (process-wide, which is why only a worker process or a test uses this), restoring all on exit.

    Args:
        schedule: a ``torch.distributed.pipelining`` schedule instance.
        on_loss: called with (stage, microbatch index, seconds) after each loss computation.
        on_p2p: called with seconds after each post or wait.
    """
    import time

    from torch.distributed.pipelining import schedules as sched_mod

    loss = schedule._maybe_compute_loss
    batch_p2p, wait_p2p = sched_mod._batch_p2p, sched_mod._wait_batch_p2p

    def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        on_loss(stage, mb_index, time.perf_counter() - t0)
        return out

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                on_p2p(time.perf_counter() - t0)

        return wrapper

    schedule._maybe_compute_loss = maybe_compute_loss
    sched_mod._batch_p2p, sched_mod._wait_batch_p2p = timed(batch_p2p), timed(wait_p2p)
    try:
        yield
    finally:
        schedule.__dict__.pop("_maybe_compute_loss", None)
        sched_mod._batch_p2p, sched_mod._wait_batch_p2p = batch_p2p, wait_p2p


def gather_each_stage_once(schedule: Any) -> None:
    """Lower a multi-stage torch schedule again so that FSDP gathers each of a rank's stages once a
    step, all of them prefetched at its start, instead of keeping at most three gathered.

    torch's ``_PipelineScheduleRuntime`` inserts ``UNSHARD`` / ``RESHARD`` actions keeping the next
    three stages a rank computes unsharded (``_add_unshard_reshard(max_active_stages=3)``): with four
    or more stages per rank the interleaved schedules then reshard and gather a stage again every
    few microbatches (23 gathers instead of 4 on rank 0 of 16 ranks x 4 stages at m 128). The
    planner's plans keep every stage of a rank gathered for the whole step (its memory model counts
    it so, ``planner.core.split.stage_model.unsharded_bytes``) and predict one gather per stage
    (``planner.core.step.simulate.Traffic``), so the lowering runs again (torch's own, which also adds
    the reductions and messages) with the window widened to the rank's stage count. The module
    function is swapped for that call alone, as ``timed_schedule`` swaps its own.

    Args:
        schedule: a ``torch.distributed.pipelining`` multi-stage schedule (``pipeline_order`` set).
    """
    from torch.distributed.pipelining import schedules as sched_mod

    order = schedule.pipeline_order

    def stages(actions: list[Any]) -> set[int]:  # DualPipeV's overlapped F&B by its two parts
        return {x.stage_index for a in actions if a is not None for x in (a.sub_actions or (a,))}

    window = max(len(stages(actions)) for actions in order.values())
    original = sched_mod._add_unshard_reshard

    def widened(actions: Any, max_active_stages: int = 3) -> Any:
        return original(actions, max(window, max_active_stages))

    sched_mod._add_unshard_reshard = widened  # type: ignore[assignment]  # the same signature, Any-typed
    try:
        schedule._prepare_schedule_with_comms(order)
    finally:
        sched_mod._add_unshard_reshard = original


@contextlib.contextmanager
def retain_graph_compile(*, compile_threads: int | None = None) -> Iterator[None]:
    """Inside the block, ``torch.compile`` builds code whose backward may retain its graph.

    torch.distributed.pipelining's two-part backward (``stage_backward_input``, the zero-bubble
    schedules) retains the graph and runs a compiled backward twice, which a backward compiled with
    donated buffers refuses ("This backward function was compiled with non-empty donated
    buffers"): ``torch._functorch.config.donated_buffer`` is False inside. Compilation is lazy (the
    first call), so the block must hold the compiled module's first forward and backward.

    Args:
        compile_threads: inductor's compile workers inside (``torch._inductor.config``; None: torch's
            default, a pool of worker processes).
    """
    import torch._functorch.config as functorch_config  # torch 2.13's knobs; no public equivalents

    with contextlib.ExitStack() as patches:
        patches.enter_context(functorch_config.patch(donated_buffer=False))
        if compile_threads is not None:
            import torch._inductor.config as inductor_config

            patches.enter_context(inductor_config.patch(compile_threads=compile_threads))
        yield


def flatten_dense(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` copied into one flat tensor of their dtype (``torch._utils._flatten_dense_tensors``,
    what DDP's buckets use), so one collective covers all of them."""
    from torch._utils import _flatten_dense_tensors

    return _flatten_dense_tensors(list(tensors))


def unflatten_dense(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` shaped as ``like`` (``torch._utils._unflatten_dense_tensors``): the inverse of
    ``flatten_dense``."""
    from torch._utils import _unflatten_dense_tensors

    return tuple(_unflatten_dense_tensors(flat, list(like)))


def ddp_ignore(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Have the ``DistributedDataParallel`` about to wrap ``module`` leave these of its parameters
    alone (names within ``module``): neither broadcast nor all-reduced by it.

    Torch's private ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``; call it
    before wrapping.
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))


def watched_elastic_agent(
    on_start: Callable[[dict[int, int]], None], before_shutdown: Callable[[], None], **kwargs: Any
) -> Any:
    """torch elastic's ``LocalElasticAgent`` that reports the workers it starts and lets the caller
    act before it stops them (it overrides the agent's private ``_start_workers`` and ``_shutdown``).
    When it stops them, it keeps what those that had already returned gave back (its ``returned``,
    global rank -> value): a Ctrl-C between the last worker's return and the agent noticing it would
    otherwise lose a finished run's results (elastic reads them only after every worker has returned,
    and stops the waiting workers with the signal).

    Args:
        on_start: called with {global rank: pid} of this node's workers, right after they start
            (in the agent's thread).
        before_shutdown: called each time the agent is about to stop its workers (a failed rank,
            Ctrl-C, SIGTERM), before it signals them.
        kwargs: ``LocalElasticAgent``'s own arguments (spec, logs_specs, start_method, ...).

    Returns:
        The agent (a ``LocalElasticAgent``); ``run()`` it.
    """
    from torch.distributed.elastic.agent.server.api import WorkerGroup
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class WatchedAgent(LocalElasticAgent):
        def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
            pids = super()._start_workers(worker_group)  # local rank -> pid
            on_start({w.global_rank: pids[w.local_rank] for w in worker_group.workers})
            return pids

        returned: dict[int, Any] = {}

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            before_shutdown()
            self.returned = _returned(self._pcontext, self._worker_group.workers)
            super()._shutdown(death_sig, timeout)

    return WatchedAgent(**kwargs)


def _returned(context: Any, workers: Sequence[Any]) -> dict[int, Any]:
    """What the workers of an elastic ``MultiprocessContext`` have returned so far, by global rank:
    the values it read, and those still in its return queues (each worker puts its value there, then
    waits for the agent to read them all)."""
    values = dict(getattr(context, "_return_values", None) or {})
    for local_rank, queue in (getattr(context, "_ret_vals", None) or {}).items():
        with contextlib.suppress(OSError, EOFError, ValueError):
            if local_rank not in values and not queue.empty():
                values[local_rank] = queue.get()
    return {w.global_rank: values[w.local_rank] for w in workers if w.local_rank in values}
