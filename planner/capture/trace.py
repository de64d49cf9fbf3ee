"""The tracer fallback chain: torch.fx, then torch.export (non-strict), then module boundaries.

fx comes first (about 90x faster than export here, and it keeps ``torch.nn`` modules as single
nodes so dropout and batch norm behave as in training); export handles control flow on shapes and
config flags; module boundaries need no graph at all but give plans that can be costed, not cut.
When a tracer fails, its reason is kept in one line naming the model-code line that stopped it.
"""

from __future__ import annotations

import copy
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.expert_calls import calls_of, tag_calls
from planner.capture.graph import (
    analyse_graph,
    group_blocks,
    record_values,
    recorded_run,
    trace_export,
    trace_fx,
    with_values,
)
from planner.capture.modules import trace_module_boundaries
from planner.errors import TraceError

TRACERS: dict[str, Callable[..., fx.GraphModule]] = {"fx": trace_fx, "export": trace_export}
"""Each tracer: ``(model, inputs, experts)`` -> the graph module (``experts``: the experts modules
whose calls it records, ``planner.capture.expert_calls``)."""

_NOT_USER_CODE = tuple(
    str(Path(p).resolve())
    for p in (Path(torch.__file__).parent, Path(__file__).parents[1], sysconfig.get_paths()["stdlib"])
)


def short_reason(e: BaseException) -> str:
    """One line: the exception's message (its first 500 characters, cut between sentences or words and
    never inside a link) and the last line of the user's code it passed through (generated code, such
    as an fx graph's ``<string>``, is skipped: its line says nothing)."""
    text = " ".join(str(e).split())
    if len(text) > 500:
        cut = text[:500]
        end = cut.rfind(". ")
        cut = cut[: end + 1] if end > 200 else cut.rsplit(" ", 1)[0]
        words = cut.split(" ")
        while words and words[-1].startswith(("http://", "https://", "(http")):
            words.pop()
        text = " ".join(words) + " ..."
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith("<") and not str(Path(f.filename).resolve()).startswith(_NOT_USER_CODE)
    ]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return f"{type(e).__name__}: {text}{where}"


# what tracers say when the model's Python branches on tensor data (the one cause the generic advice
# about data-dependent control flow is for)
_CONTROL_FLOW = (
    "data-dependent",
    "data dependent",
    "guardondatadependent",
    "control flow",
    "could not guard",
    "dynamic control",
)


def trace_advice(failures: list[tuple[str, str]]) -> str:
    """What to change, from why the tracers failed: the control-flow advice only where the cause is
    control flow, else a pointer to the reasons given (a model that returns a cache object, calls an
    operator torch.export does not know, ... needs its own fix, which the reason names).

    Args:
        failures: (tracer, reason) pairs.

    Returns:
        One clause of advice.
    """
    if any(word in reason.lower() for _, reason in failures for word in _CONTROL_FLOW):
        return "make forward free of data-dependent control flow, or put the repeated layers in an nn.ModuleList"
    return "each tracer's reason above says what stopped it (run with --debug for the whole traceback)"


def _from_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face transformers model (its class comes from the package)."""
    return any(c.__module__.split(".", 1)[0] == "transformers" for c in type(model).__mro__)


def trace_model(
    model: nn.Module,
    inputs: tuple[Any, ...],
    methods: tuple[str, ...] = ("fx", "export", "modules"),
    *,
    shapes_only: bool = False,
    copied: bool = True,
    exported: Callable[[nn.Module], fx.GraphModule] | None = None,
    experts: Sequence[str] = (),
) -> TracedModel:
    """Trace ``model`` on an example microbatch, group nodes into blocks and find legal cuts.

    The model is deep-copied first (unless ``copied`` is False), so tracing and everything done
    later with the result (profiling runs forward and backward) never changes the caller's model.

    Args:
        model: the model to trace.
        inputs: positional inputs of one microbatch (shapes are baked into constants; use the
            microbatch size the pipeline will run with).
        methods: tracers to try, in order (a subset of "fx", "export", "modules").
        shapes_only: record what each node produces on fake tensors where they can run the graph
            (``record_values``): the runner needs shapes only, and a real forward of a model at
            full width takes minutes on a CPU.
        copied: False: trace ``model`` itself, which the caller built for this trace and hands over
            (a model on the meta device, whose copy took seconds at 1,000 layers and held nothing).
        exported: for "export", the graph made some other way from the model's private copy than by
            exporting it (``planner run``'s ranks rebuild the launcher's, ``planner.capture.graph_file``);
            grouped, recorded and fingerprinted as an export is. None: export.
        experts: the experts modules whose calls a graph records (expert parallelism's stages
            replace them: ``planner.capture.expert_calls``); empty for every other plan.

    Returns:
        A ``GraphTrace`` (fx, export) or a ``ModuleTrace`` (module boundaries).

    Raises:
        TraceError: when every tracer failed; the message names what stopped each one.
    """
    private = copy.deepcopy(model) if copied else model
    failures: list[tuple[str, str]] = []
    for method in methods:
        if method == "fx" and len(methods) > 1 and _from_transformers(model):
            # fx cannot follow a transformers model's forward (it fails with "co_varnames is too
            # small", which tells a user nothing); say why in words and go on to torch.export
            failures.append(
                (
                    "fx",
                    f"{type(model).__name__} is a transformers model, whose forward fx does not follow; torch.export does",
                )
            )
            continue
        if method == "modules":
            try:
                return trace_module_boundaries(private, inputs, failures)
            except TraceError as e:
                failures.append(("modules", str(e)))
                continue
        try:
            gm = (
                exported(private)
                if exported is not None and method == "export"
                else TRACERS[method](private, inputs, experts)
            )
            tag_calls(gm)  # the experts' calls, where recorded, marked on their nodes
            blocks = group_blocks(gm, private)  # first: twin layers' values are replayed, not run again
            values, output = recorded_run(gm, inputs, shapes_only=shapes_only, blocks=blocks)
        except Exception as e:  # any tracer failure means: try the next one
            failures.append((method, short_reason(e)))
            continue
        traced = analyse_graph(gm, private, method, failures, values, blocks)
        traced.example_output = output
        return traced
    detail = "; ".join(f"{m}: {r}" for m, r in failures)
    raise TraceError(
        f"could not trace {type(model).__name__} with any of {', '.join(methods)} ({detail}); {trace_advice(failures)}"
    )


def retrace(
    traced: TracedModel,
    model: nn.Module,
    inputs: tuple[Any, ...],
    methods: tuple[str, ...] = ("fx", "export", "modules"),
) -> TracedModel:
    """``trace_model(model, inputs, methods)`` for a model ``traced`` holds a trace of on inputs of
    another size (the microbatch-scaling fit, the plan's microbatch size), without tracing it again
    where that is certain to give the same graph.

    ``torch.fx`` traces without the inputs (``trace_fx`` never reads them), so an fx trace of the
    same model is the same graph at any size; only the values recorded on the example differ. When
    ``traced`` is an fx trace and fx is the first tracer asked for, its graph is reused and the
    values recorded again at ``inputs``; if that run fails, fx fails for this size as it would in a
    fresh trace, and ``trace_model`` is called to go on to the next tracer as it would. Tracing a
    1,000-layer model costs as much as recording its values, so this halves the second trace.

    Args:
        traced: a trace of ``model`` (or of a copy of it) by ``trace_model``.
        model: the model.
        inputs: positional inputs of one microbatch of the new size.
        methods: tracers to try, in order (as ``trace_model``).

    Returns:
        The trace at ``inputs``; when the graph is reused it shares ``traced``'s model copy.
    """
    fx_first = methods[:1] == ("fx",) and not (len(methods) > 1 and _from_transformers(model))
    if fx_first and traced.method == "fx" and isinstance(traced, GraphTrace):
        try:
            values = record_values(traced.gm, inputs, blocks=traced.blocks)
        except Exception:  # noqa: BLE001, S110 - fx fails at this size: trace_model says so and tries the next tracer
            pass
        else:
            return with_values(traced, values)
    # the experts' calls recorded where the first trace recorded them (expert parallelism's plans)
    experts = tuple(calls_of(traced.gm)) if isinstance(traced, GraphTrace) else ()
    return trace_model(model, inputs, methods, experts=experts)
