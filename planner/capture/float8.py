"""Float8 linear layers in a traced model (``--dtype fp8``): the layers the model has, and a stage's
layers converted to torchao's ``Float8Linear``.

The planner traces the model as written (torch.export cannot trace torchao's float8 tensors) and
converts each stage after cutting it: the estimate's blocks (``planner.costs.estimate``), the measured
profile's and the runner's stages, before tensor parallelism and FSDP wrap them (torchtitan's order).
A torch.fx stage calls its linear layers as modules, which ``convert_to_float8_training`` swaps; a
torch.export stage calls ``aten.linear`` on the weights, so each such call becomes a call of an
``nn.Linear`` holding the stage's own parameters first, and is then swapped alike.

torchao is imported here only, when a plan trains in float8 (the fp8 extra: ``pip install -e '.[fp8]'``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any, cast

import torch
from torch import fx, nn

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.tp_graph import call_as_module
from planner.errors import PlannerError, TraceError
from planner.schema.plan_parts import Float8Linears, LinearLayer
from planner.torch_compat import quiet_torchao_import

_LINEAR = torch.ops.aten.linear.default
# how far from a linear layer's output a top-k may read it for the layer to be a router (softmax,
# a cast, a view in between)
_ROUTER_HOPS = 4


def require_torchao() -> Any:
    """torchao's float8 training module.

    Returns:
        ``torchao.float8``.

    Raises:
        PlannerError: torchao is not installed.
    """
    try:
        with quiet_torchao_import():
            import torchao.float8 as float8
    except ImportError as e:
        raise PlannerError(
            f"--dtype fp8 trains the linear layers with torchao's float8, which is not installed ({e}); "
            "install it with pip install 'torchao>=0.18,<0.19' (the planner's fp8 extra)"
        ) from e
    return float8


def linear_layers(traced: TracedModel) -> list[LinearLayer]:
    """Every linear layer the traced model calls, once each, in graph order.

    Args:
        traced: the trace (a graph: module-boundary traces are refused).

    Returns:
        The layers with their widths, whether a repeated layer holds them and whether they route.

    Raises:
        TraceError: the model was traced by module boundaries.
    """
    if not isinstance(traced, GraphTrace):
        raise TraceError(
            "--dtype fp8 converts the linear layers of a traced graph, but this model was traced by module "
            f"boundaries ({'; '.join(r for _, r in traced.failures)}); make it traceable by torch.fx or torch.export"
        )
    found: dict[str, LinearLayer] = {}
    for node in traced.gm.graph.nodes:
        name = linear_name(traced.gm, node, traced.model)
        if name is None or name in found:
            continue
        weight = traced.gm.get_parameter(f"{name}.weight")
        block = traced.blocks[traced.block_of[node.name]]
        found[name] = LinearLayer(
            name, int(weight.shape[1]), int(weight.shape[0]), block.is_layer, router=_feeds_topk(node)
        )
    return list(found.values())


def linear_name(gm: fx.GraphModule, node: fx.Node, model: nn.Module) -> str | None:
    """The qualified name of the linear layer ``node`` calls, or None when it calls none: an ``nn.Linear``
    module (torch.fx), or ``aten.linear`` on the weight and bias of a module that is an ``nn.Linear`` in
    ``model`` (torch.export, whose graph holds the weights in plain modules)."""
    if node.op == "call_module":
        return str(node.target) if type(gm.get_submodule(str(node.target))) is nn.Linear else None
    if node.op != "call_function" or node.target is not _LINEAR or len(node.args) < 2 or node.kwargs:
        return None
    weight = node.args[1]
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and str(weight.target).endswith(".weight")):
        return None
    name = str(weight.target)[: -len(".weight")]
    bias = node.args[2] if len(node.args) > 2 else None
    if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr" and bias.target == f"{name}.bias"):
        return None
    # an nn.Linear's call, as torchao swaps only those (a router module of its own calling F.linear stays)
    try:
        held = model.get_submodule(name)
    except AttributeError:
        return None
    return name if type(held) is nn.Linear else None


def _feeds_topk(node: fx.Node) -> bool:
    """Whether a top-k reads ``node``'s output within a few operators (a router's scores)."""
    frontier, seen = [node], {node}
    for _ in range(_ROUTER_HOPS):
        nxt = []
        for n in frontier:
            for user in n.users:
                if "topk" in str(getattr(user.target, "__name__", user.target)):
                    return True
                if user not in seen:
                    seen.add(user)
                    nxt.append(user)
        frontier = nxt
    return False


def convert_stage(
    stage: fx.GraphModule, float8: Float8Linears, model: nn.Module, emulate: bool, fsdp_gather: bool = False
) -> int:
    """Convert the stage's linear layers, but those the plan keeps in bf16, to torchao's ``Float8Linear``
    in place.

    Args:
        stage: a stage (or block) module cut from a graph trace; its parameters are shared, not copied.
        float8: the plan's float8 record (the recipe, the layers kept in bf16).
        model: the traced model, whose modules say which of a torch.export graph's calls are linear layers.
        emulate: torchao's emulation (the float8 casts and scales, the GEMM in high precision): for a
            device without FP8 tensor cores (the CPU) and for the meta device, whose roofline charges
            the GEMMs itself.
        fsdp_gather: FSDP gathers the layers' weights in float8 (``fsdp_float8_gather``).

    Returns:
        How many layers were converted.
    """
    require_torchao()  # before the graph changes
    graph = stage.graph
    calls = [(n, linear_name(stage, n, model)) for n in graph.nodes if n.op == "call_function"]
    made = [call_as_module(stage, graph, name, n) for n, name in calls if name and name not in float8.kept]
    if made:
        graph.lint()
        stage.recompile()
    return convert_stage_modules(stage, float8.recipe, float8.kept, emulate, fsdp_gather)


def convert_stage_modules(
    module: nn.Module, recipe: str, kept: Collection[str], emulate: bool, fsdp_gather: bool = False
) -> int:
    """Swap ``module``'s ``nn.Linear`` modules, but those named in ``kept``, for torchao's ``Float8Linear``
    (sharing their parameters); ``fsdp_gather``: FSDP gathers their weights in float8 (torchao's
    ``enable_fsdp_float8_all_gather``, tensorwise only). Returns how many."""
    float8 = require_torchao()
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, enable_fsdp_float8_all_gather=fsdp_gather
    )
    converted: list[str] = []

    def chosen(module: nn.Module, fqn: str) -> bool:
        take = type(module) is nn.Linear and fqn not in kept
        if take:
            converted.append(fqn)
        return take

    with quiet_torchao_import():
        float8.convert_to_float8_training(module, module_filter_fn=chosen, config=config)
    return len(converted)


def float8_modules(module: nn.Module) -> list[nn.Module]:
    """The float8 linear layers (torchao's ``Float8Linear``) inside ``module``, in module order.

    Args:
        module: a converted stage or unit.

    Returns:
        Its converted layers (none where torchao is not installed: nothing can have converted).
    """
    try:
        with quiet_torchao_import():
            from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, Float8Linear)]


def precompute_scales(modules: Sequence[nn.Module]) -> None:
    """Every float8 weight's scale for the next FSDP gather, in one all-reduce: torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` over a rank's stage modules, as torchtitan calls it
    after each optimizer step (its float8 setting ``precompute_float8_dynamic_scale_for_fsdp``).
    Without it each weight's gather all-reduces that weight's largest magnitude on its own; the scale
    is the same either way (the largest magnitude of the whole weight). A rank whose stages gather no
    weight in float8 does nothing (torchao returns before any collective: every rank holding the
    same stages agrees).

    Args:
        modules: the rank's stage modules, wrapped by FSDP (every rank of their shard groups calls this).
    """
    float8 = require_torchao()
    float8.precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(modules))


def emulated(device: torch.device) -> bool:
    """Whether float8 runs emulated on ``device``: a CPU, or the meta device.

    Raises:
        PlannerError: a CUDA GPU without FP8 tensor cores (compute capability below 8.9).
    """
    if device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise PlannerError(
            f"--dtype fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, Blackwell); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}; re-plan with --dtype bf16"
        )
    return False


def check_float8(device: torch.device, compiled: bool) -> None:
    """Refuse, in one line, what float8 training cannot do on ``device``: a GPU without FP8 tensor cores
    (``emulated``), and ``--compile`` where float8 runs emulated (torchao's emulation does not compile,
    as torchtitan's float8 converter says).

    Raises:
        PlannerError: either.
    """
    if emulated(device) and compiled:
        raise PlannerError(
            f"--dtype fp8 with --compile: on {device.type} float8 runs in torchao's emulation, which does not "
            "compile; plan it without --compile here, or estimate the GPU run with --gpu-type"
        )


def convert_model(model: nn.Module, float8: Float8Linears, emulate: bool) -> int:
    """Convert an eager model's linear layers, but those the plan keeps in bf16, to ``Float8Linear`` in
    place: the model a float8 plan's stages are cut from, trained whole (the unsplit reference, a
    one-stage plan). Every ``nn.Linear`` converts that the plan does not keep: the layers a traced
    graph calls (``linear_name``) are the model's ``nn.Linear`` modules, under the same names.

    Args:
        model: the model.
        float8: the plan's float8 record.
        emulate: torchao's emulation (``emulated``).

    Returns:
        How many layers were converted.
    """
    return convert_stage_modules(model, float8.recipe, float8.kept, emulate)


def float8_shares(traced: TracedModel, float8: Float8Linears) -> list[float]:
    """Per block, the share of the parameters it owns that are weights of layers that train in float8
    (``BlockCost.float8_share``: what FSDP gathers in float8 under the tensorwise recipe).

    Args:
        traced: the trace the blocks were costed on.
        float8: the plan's float8 record.

    Returns:
        One share in [0, 1] per block.
    """
    converted = {x.name for x in linear_layers(traced) if x.name not in float8.kept}  # (a graph trace)
    gm = cast(GraphTrace, traced).gm
    weights = {id(gm.get_parameter(f"{name}.weight")) for name in converted}
    shares = []
    for params in traced.owned_parameters():
        total = sum(p.numel() for p in params)
        shares.append(sum(p.numel() for p in params if id(p) in weights) / total if total else 0.0)
    return shares
