"""Where a traced graph calls a mixture-of-experts layer's experts, and that call made one module call.

Expert parallelism runs an experts module (``planner.capture.ep_plan``) on other ranks' tokens, so a
stage cut from a graph must call it as one step it can replace (``planner.run.experts``). Both
tracers inline the module's operators into the graph; this module records, while tracing, which
graph values the module takes as its three inputs (``hidden``, ``top_k_index``, ``top_k_weights``)
and which it returns, without changing the graph's operators:

* under ``torch.fx`` (``recording``) the module's ``forward`` is wrapped for the trace, and the
  proxies it receives and returns name the nodes;
* under ``torch.export`` the module's call signature is preserved
  (``preserve_module_call_signature``) and read back from the program's module call graph
  (``exported_calls``): the operators are the same, some ``getitem`` nodes are named otherwise.

The calls travel with the graph module (``gm.meta``, also in ``planner.capture.graph_file``) and are
marked on their nodes (``tag_calls``), whose copies in a stage keep the mark whatever they are named.
``replace_calls`` then swaps, in a stage's graph, each call's operators for one ``call_module`` node.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from planner.errors import TraceError

META_KEY = "planner_expert_calls"
"""The ``GraphModule.meta`` entry that holds the calls: experts module name -> ``ExpertCall``."""


@dataclass(frozen=True)
class ExpertCall:
    """One call of an experts module in a traced graph.

    Attributes:
        name: the experts module's name in the model.
        inputs: the graph nodes it takes, in order: the hidden states, the router's expert ids, their weights.
        output: the graph node it returns.
    """

    name: str
    inputs: tuple[str, str, str]
    output: str


def _call(name: str, inputs: Sequence[str], outputs: Sequence[str]) -> ExpertCall:
    """An ``ExpertCall``, or a ``TraceError`` where the module is not called as the contract says."""
    if len(inputs) != 3 or len(outputs) != 1:
        raise TraceError(
            f"the experts module {name} is called with {len(inputs)} tensor(s), returning {len(outputs)}: expert "
            "parallelism dispatches experts(hidden, top_k_index, top_k_weights) -> one tensor"
        )
    return ExpertCall(name, (inputs[0], inputs[1], inputs[2]), outputs[0])


@contextlib.contextmanager
def recording(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, ExpertCall]]:
    """While a ``torch.fx`` trace of ``model`` runs inside it, record each named experts module's
    call (filled in as the trace goes; every module must be called exactly once).

    Args:
        model: the model being traced.
        names: its experts modules' names.

    Yields:
        Experts module name -> its call.

    Raises:
        TraceError: a module called twice, or not as ``experts(hidden, top_k_index, top_k_weights)``.
    """
    calls: dict[str, ExpertCall] = {}
    patched: list[nn.Module] = []

    def wrapped(name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            bound = inspect.signature(forward).bind(*args, **kwargs)
            values = [v for v in bound.arguments.values() if isinstance(v, fx.Proxy)]
            if name in calls:
                raise TraceError(f"the experts module {name} is called twice; expert parallelism dispatches one call")
            outs = [out] if isinstance(out, fx.Proxy) else []
            calls[name] = _call(name, [v.node.name for v in values], [o.node.name for o in outs])
            return out

        return record

    try:
        for name in names:
            module = model.get_submodule(name)
            module.forward = wrapped(name, module.forward)  # type: ignore[method-assign]
            patched.append(module)
        yield calls
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def exported_calls(program: Any, names: Sequence[str]) -> dict[str, ExpertCall]:
    """The calls of the named experts modules in a ``torch.export`` program exported with their call
    signatures preserved (``preserve_module_call_signature=names``).

    Args:
        program: the ``ExportedProgram``.
        names: the experts modules' names.

    Returns:
        Experts module name -> its call (nodes named as in ``program.module()``'s graph).

    Raises:
        TraceError: a module not called as ``experts(hidden, top_k_index, top_k_weights)``.
    """
    wanted = set(names)
    calls: dict[str, ExpertCall] = {}
    for entry in program.module_call_graph:
        if entry.fqn in wanted and entry.signature is not None:
            sig = entry.signature
            ins = [a.name for a in sig.inputs if hasattr(a, "name") and type(a).__name__ == "TensorArgument"]
            outs = [a.name for a in sig.outputs if hasattr(a, "name") and type(a).__name__ == "TensorArgument"]
            calls[entry.fqn] = _call(entry.fqn, ins, outs)
    return calls


def calls_of(gm: fx.GraphModule) -> dict[str, ExpertCall]:
    """The experts calls a traced graph module carries (none: traced without experts named)."""
    return dict(gm.meta.get(META_KEY, {}))


TAG = "planner_expert_io"
"""The node meta entry marking a call's inputs and output: (experts module name, position), the
position 0-2 for the inputs and 3 for the output. Copies of a node (a stage's graph) keep it."""


def tag_calls(gm: fx.GraphModule) -> None:
    """Mark on their nodes the inputs and output of each call ``gm`` records (``TAG``), so that a
    stage cut from it finds them whatever its nodes are named (a stage's marks rename copies).

    Args:
        gm: a traced graph module (its calls in ``meta``; none: nothing is marked).
    """
    calls = calls_of(gm)
    if not calls:  # every trace passes here: a graph of 50,000 nodes is not walked for nothing
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    for call in calls.values():
        for k, name in enumerate((*call.inputs, call.output)):
            nodes[name].meta[TAG] = (call.name, k)


def replace_calls(gm: fx.GraphModule, names: Sequence[str], target: Callable[[str], str]) -> list[str]:
    """In ``gm`` (a stage cut from a traced graph whose calls were marked, ``tag_calls``), replace the
    call of each experts module of ``names`` whose output the stage computes by one ``call_module``
    node of ``target(name)`` (a module the caller registers on ``gm``) taking the call's three
    inputs: the operators between them and the output are removed, with the parameter reads only
    they used.

    Args:
        gm: the stage's graph module.
        names: the experts modules to replace.
        target: the attribute path of the module replacing an experts module's call, by its name.

    Returns:
        The names of the experts modules replaced, in graph order.

    Raises:
        TraceError: a call's inputs are not in the stage (a cut inside the experts' call), or the
            call reads a value neither given to it nor made inside it.
    """
    marked: dict[str, dict[int, fx.Node]] = {}
    for node in gm.graph.nodes:
        tag = node.meta.get(TAG)
        if tag is not None and tag[0] in names:
            marked.setdefault(tag[0], {})[tag[1]] = node
    done: list[str] = []
    for name, io in marked.items():
        out = io.get(3)
        if out is None:
            continue
        if any(k not in io for k in range(3)):
            raise TraceError(f"the stage computes the experts of {name} without all three of their inputs")
        inputs = [io[0], io[1], io[2]]
        inside = _between(name, inputs, out)
        with gm.graph.inserting_after(out):
            new = gm.graph.call_module(target(name), tuple(inputs))
        new.meta = {k: v for k, v in out.meta.items() if k != TAG}
        out.replace_all_uses_with(new)
        for node in reversed([n for n in gm.graph.nodes if n in inside]):
            gm.graph.erase_node(node)
        done.append(name)
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return done


def _in_module(node: fx.Node, name: str) -> bool:
    """Whether ``node`` was traced inside module ``name`` (its module stack holds it), or reads a
    parameter or buffer (the call's weights: the only reads without a stack)."""
    if node.op == "get_attr":
        return True
    stack = node.meta.get("nn_module_stack") or {}
    return any((value[0] if isinstance(value, tuple) else key) == name for key, value in stack.items())


def _between(name: str, inputs: Sequence[fx.Node], out: fx.Node) -> set[fx.Node]:
    """The call's own operators: what ``out`` depends on short of ``inputs`` (``out`` included), and
    the operators inside module ``name`` that only those feed (an in-place write nothing reads on).

    Raises:
        TraceError: the call reads a value neither given to it nor made inside it.
    """
    stop = set(inputs)
    inside: set[fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in inside or node in stop:
            continue
        if not _in_module(node, name):
            raise TraceError(
                f"the experts module {name} reads {node.name}, which is neither one of its three inputs nor made "
                "inside it: expert parallelism cannot dispatch that call"
            )
        inside.add(node)
        stack.extend(node.all_input_nodes)
    grew = True
    while grew:
        grew = False
        for node in list(inside):
            for user in node.users:
                fed = all(a in inside or a in stop for a in user.all_input_nodes)
                if user not in inside and user.op != "output" and _in_module(user, name) and fed:
                    inside.add(user)
                    grew = True
    return inside


__all__ = ["META_KEY", "TAG", "ExpertCall", "calls_of", "exported_calls", "recording", "replace_calls", "tag_calls"]
