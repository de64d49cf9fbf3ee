"""A model's experts: which modules hold a mixture-of-experts layer's experts, and how many.

A mixture-of-experts layer routes each token to ``top_k`` of its ``E`` experts. The planner needs
to know which module holds the experts (expert parallelism shards exactly those modules' weights,
by expert, and dispatches the tokens routed to them; tensor parallelism keeps them whole), so a
model says so in an expert plan: module-name patterns, as ``model.named_modules()`` names the
module ``build_model`` returns ('*' for exactly one name part), to a style:

* ``"experts"`` (transformers 5's ``"ep_dispatch_experts"`` is read as the same): the module holding
  a layer's experts. Each of its parameters has the expert index as its leading dimension (``E``
  rows: transformers' grouped expert weights, ``gate_up_proj`` of shape ``(E, 2 f, d)``; a bias
  ``(E, f)``), before at least one dimension of each expert's own, and it is
  called as ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``, the
  router's choice of global expert ids and their weights, as transformers 5's ``MixtralExperts``,
  ``Qwen2MoeExperts`` and ``DeepseekV3NaiveMoe`` are. The router and any shared expert lie outside it.
* ``"grouped_gemm"``: one of those parameters (transformers 5 names each); checked to belong to an
  experts module and to have ``E`` leading rows, and otherwise implied by its module.

Where the plan comes from (``resolve_experts``), first found wins:

1. the model file's module-level ``ep_plan``: a dict, or a function ``ep_plan(**config) -> dict``;
2. a Hugging Face model's ``config.base_model_ep_plan`` (transformers 5 declares it for 70-odd
   mixture-of-experts families), its keys prefixed with the base model's name inside the module
   ``build_model`` returned (``planner.capture.tp_plan.base_model_prefix``: ``model.`` for a
   ``MixtralForCausalLM``, deeper inside a user's wrapper);
3. the modules its ``config.base_model_tp_plan`` styles ``"moe_tp_experts"``.

A model without any of these has no experts (a dense model). A model file's pattern that matches no
module, or an experts module whose parameters do not share one leading expert dimension, is one
line (``ModelFileError``); a Hugging Face plan's patterns are the family's, so those matching
nothing in a smaller configuration are passed over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from planner.capture.load import ModelFile
from planner.capture.tp_plan import EP_EXPERTS, TP_EXPERTS, base_model_prefix, file_plan, match, matched_modules
from planner.errors import ModelFileError

EXPERTS = "experts"
WEIGHTS = "grouped_gemm"
ALIASES = {EP_EXPERTS: EXPERTS}


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer's experts module.

    Attributes:
        name: the module's FQN in the model ``build_model`` returned.
        n_experts: its experts (the leading dimension of each of its parameters).
        params: the elements of its parameters, all experts together.
        param_bytes: their bytes, as built.
        matrices: each expert's weight matrices, ``(rows, columns)`` of every parameter with two
            dimensions besides the expert index (each routed row is multiplied by each once: the
            grouped GEMMs ``planner.costs.experts`` costs); biases are not among them.
    """

    name: str
    n_experts: int
    params: int
    param_bytes: int
    matrices: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Experts:
    """A model's experts, as its expert plan names them.

    Attributes:
        layers: every experts module, in module order (empty: a dense model).
        patterns: the plan's experts patterns, as given (prefixed where a Hugging Face config's).
        source: where the plan came from ("model file", "Hugging Face config"), or "".
    """

    layers: tuple[ExpertLayer, ...] = ()
    patterns: tuple[str, ...] = ()
    source: str = ""

    @property
    def counts(self) -> dict[str, int]:
        """Each experts module's FQN -> its expert count (``Plan.experts``)."""
        return {layer.name: layer.n_experts for layer in self.layers}


def resolve_experts(mf: ModelFile, model: nn.Module) -> Experts:
    """The model's experts (see the module docstring for where the plan comes from).

    Args:
        mf: the loaded model file (its module's ``ep_plan``).
        model: the model ``build_model`` returned (any device, meta included).

    Returns:
        The experts modules the plan names (none for a dense model).

    Raises:
        ModelFileError: the model file's ``ep_plan`` is not a dict of patterns to "experts" /
            "grouped_gemm", its function raises, a pattern matches no module, or an experts
            module's parameters have no common leading expert dimension.
    """
    declared = file_plan(mf, "ep_plan")
    if declared is not None:
        where = f"{mf.path.name}: ep_plan"
        return _experts(model, _checked(declared, where), where, strict=True, source="model file")
    found = base_model_prefix(model)
    config: Any = getattr(found[1], "config", None) if found else getattr(model, "config", None)
    if config is None:
        return Experts()
    prefix = found[0] if found else ""
    declared_ep = getattr(config, "base_model_ep_plan", None) or {}
    declared_tp = getattr(config, "base_model_tp_plan", None) or {}
    plan = {k: v for k, v in dict(declared_ep).items() if isinstance(k, str) and isinstance(v, str)}
    plan |= {k: EXPERTS for k, v in dict(declared_tp).items() if v == TP_EXPERTS and k not in plan}
    if not plan:
        return Experts()
    where = f"{type(config).__name__}.base_model_ep_plan"
    prefixed = {(f"{prefix}.{k}" if prefix else k): v for k, v in _checked(plan, where).items()}
    return _experts(model, prefixed, where, strict=False, source="Hugging Face config")


def _checked(plan: object, where: str) -> dict[str, str]:
    """The plan as a str -> style dict (aliases read), or a ``ModelFileError`` naming what is wrong."""
    styles = f"{EXPERTS!r} (the module holding a layer's experts) or {WEIGHTS!r} (one of its parameters)"
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise ModelFileError(f"{where} is {type(plan).__name__}, not a dict of module-name patterns to {styles}")
    out = {str(k): ALIASES.get(str(v), str(v)) for k, v in plan.items()}
    for key, style in out.items():
        if style not in (EXPERTS, WEIGHTS):
            raise ModelFileError(f"{where} gives {key!r} the style {style!r}; the styles are {styles}")
    return out


def _experts(model: nn.Module, plan: Mapping[str, str], where: str, *, strict: bool, source: str) -> Experts:
    """The experts modules ``plan`` names in ``model``, checked (``resolve_experts``)."""
    modules = {p: s for p, s in plan.items() if s == EXPERTS}
    found = matched_modules(model, modules)
    if strict:
        for pattern in modules:
            if not any(p == pattern for _, _, p in found.values()):
                raise ModelFileError(f"{where}: {pattern!r} matches no module of the model{_names_like(model)}")
    layers = tuple(_layer(name, module, where) for name, (_, module, _) in found.items())
    _check_weights(model, plan, found, where, strict)
    used = tuple(p for p in modules if any(p == q for _, _, q in found.values()))
    return Experts(layers, used, source if layers else "")


def _layer(name: str, module: nn.Module, where: str) -> ExpertLayer:
    """``module`` (an experts module) as an ``ExpertLayer``, its expert count checked."""
    params = list(module.named_parameters())
    if not params:
        raise ModelFileError(f"{where}: the experts module {name!r} holds no parameters")
    # an expert's own weights have at least one dimension besides the expert index (a bias: its width)
    lead = {p.shape[0] if p.dim() > 1 else 0 for _, p in params}
    declared = getattr(module, "num_experts", None)
    if len(lead) != 1 or (isinstance(declared, int) and lead != {declared}) or 0 in lead:
        shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in params[:4])
        count = f" ({declared} experts)" if isinstance(declared, int) else ""
        raise ModelFileError(
            f"{where}: the experts module {name!r} needs every parameter to lead with the expert index{count}, "
            f"then dimensions of each expert's own; it holds {shapes}"
        )
    matrices = tuple((int(p.shape[-2]), int(p.shape[-1])) for _, p in params if p.dim() == 3)
    return ExpertLayer(name, lead.pop(), sum(p.numel() for _, p in params), sum(p.nbytes for _, p in params), matrices)


def _check_weights(
    model: nn.Module, plan: Mapping[str, str], found: Mapping[str, Any], where: str, strict: bool
) -> None:
    """Every ``grouped_gemm`` pattern names a parameter of an experts module (strict: and matches one)."""
    for pattern, style in plan.items():
        if style != WEIGHTS:
            continue
        hits = [n for n, _ in model.named_parameters() if match(pattern, n)]
        if strict and not hits:
            raise ModelFileError(f"{where}: {pattern!r} matches no parameter of the model{_names_like(model)}")
        for name in hits:
            owner = name.rsplit(".", 1)[0]
            if owner not in found:
                raise ModelFileError(
                    f"{where}: the {WEIGHTS!r} weight {name!r} is not a parameter of a module styled {EXPERTS!r}"
                )


def _names_like(model: nn.Module) -> str:
    """ ", whose modules are named like 'layers.0.mlp'" from the model's deepest module name, or ""."""
    names = [n for n, _ in model.named_modules() if n]
    return f" (its modules are named like {max(names, key=lambda n: n.count('.'))!r})" if names else ""


__all__ = ["EXPERTS", "ExpertLayer", "Experts", "WEIGHTS", "resolve_experts"]
