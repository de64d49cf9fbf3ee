"""A model's tensor-parallel plan: which ``nn.Linear`` layers split by columns and which by rows.

The plan maps module-name patterns to styles, e.g. ``{"layers.*.attention.wq": "colwise", ...,
"layers.*.attention.wo": "rowwise", "output": "colwise_rep"}``, the names as
``model.named_modules()`` gives them for the module ``build_model`` returns ('*' matches exactly one
dotted name part). Styles are torch's ``ColwiseParallel`` ("colwise": output features split, the
output left split for a following row-wise layer), ``RowwiseParallel`` ("rowwise": input features
split, the output all-reduced) and ``ColwiseParallel(output_layouts=Replicate())`` ("colwise_rep",
Hugging Face's name: output features split, the output all-gathered whole, as for a model's output
head, whose logits the loss reads whole; transformers 5 calls it "colwise_gather_output", read as
the same); every other style is refused. An ``nn.Embedding`` splits only ``colwise_rep``: its width
(``embedding_dim``) split, each rank looking up its slice of every vector, the slices gathered whole
(torch's ``ColwiseParallel(output_layouts=Replicate())`` on an embedding, as transformers 5's
"embedding_colwise"). transformers 5's "embedding_rowwise" (the vocabulary split, the ranks'
lookups summed) is read as the same split: torch 2.13's row-wise embedding on DTensors all-gathers
the weight and still sums the ranks' lookups, so its output comes out ``tp`` times too large, or
fails inside the op, depending on the ids' shape (checked on 2 gloo processes,
``tests/test_run_tp.py``); the width split gives the same numbers and memory per rank, with one
all-gather of the output instead of an all-reduce.

Where it comes from (``resolve_tp_plan``), first found wins:

1. the model file's module-level ``tp_plan``: a dict, or a function ``tp_plan(**config) -> dict``;
2. a Hugging Face model's ``config.base_model_tp_plan`` (transformers 5), its keys prefixed with the
   name of the base model inside the module ``build_model`` returned (``model.`` for a
   ``LlamaForCausalLM``; the base model may sit deeper, inside the user's own wrapper), and the
   model's own ``_tp_plan`` (its output head, gathered) where the head is not tied.

``check_tp_plan`` checks a plan against a built model (every pattern matches, only ``nn.Linear``,
the split sizes and the attention heads divisible by the degree).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from planner.capture.load import ModelFile
from planner.errors import ModelFileError
from planner.schema.counts import divisors

STYLES = ("colwise", "rowwise", "colwise_rep")
COLUMN_STYLES = ("colwise", "colwise_rep")  # the styles that split a layer's output features
# transformers 5's names for the same styles (its embedding styles: see the module docstring)
ALIASES = {
    "colwise_gather_output": "colwise_rep",
    "embedding_colwise": "colwise_rep",
    "embedding_rowwise": "colwise_rep",
}
TP_EXPERTS = "moe_tp_experts"  # transformers 5's style of a mixture-of-experts layer's experts module
EP_EXPERTS = "ep_dispatch_experts"  # its expert-parallel style of the same module
HEAD_ATTRS = ("n_heads", "n_kv_heads", "num_heads", "num_kv_heads", "num_attention_heads", "num_key_value_heads")
CONFIG_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class ResolvedPlan:
    """A model's tensor-parallel plan, or why it has none that the planner can use.

    Attributes:
        plan: pattern -> "colwise" | "rowwise" | "colwise_rep" (empty: none).
        source: where it came from ("model file", "Hugging Face config"), or "".
        reason: why the model is not shardable (an unsupported style, a plan that is no dict); ""
            when there is a plan or simply none declared.
        whole: the patterns of the experts modules a Hugging Face plan styles "moe_tp_experts",
            left whole on every tensor-parallel rank (``_without_experts``).
    """

    plan: dict[str, str]
    source: str = ""
    reason: str = ""
    whole: tuple[str, ...] = ()


def match(pattern: str, name: str) -> bool:
    """Whether module name ``name`` matches ``pattern`` ('*' stands for exactly one name part)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names))


def style_error(tp_plan: Mapping[str, str]) -> str | None:
    """What is wrong with a plan's styles as the runner applies them (None: only ``STYLES``)."""
    bad = sorted({s for s in tp_plan.values() if s not in STYLES})
    return f"tp_plan style {bad[0]!r} is not one of {', '.join(STYLES)}" if bad else None


def _checked(plan: object, where: str) -> tuple[dict[str, str], str]:
    """The plan as a str -> str dict, or the reason it cannot be used."""
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        return (
            {},
            f"{where} is {type(plan).__name__}, not a dict of module-name patterns to {' / '.join(map(repr, STYLES))}",
        )
    plan = {k: ALIASES.get(v, v) for k, v in plan.items()}
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        key, style = next(iter(bad.items()))
        return {}, (
            f"{where} uses style {style!r} (for {key!r}); the planner splits only 'colwise', 'rowwise' and "
            "'colwise_rep' layers (torch's ColwiseParallel / RowwiseParallel)"
        )
    return dict(plan), ""


def base_model_prefix(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The FQN of the Hugging Face base model inside ``model`` ('' when ``model`` is it) and the
    module whose ``config`` declares ``base_model_tp_plan``; None when there is none.

    A ``...ForCausalLM`` holds its base model under ``base_model_prefix`` ("model"); a user's wrapper
    may hold the ``...ForCausalLM`` anywhere: the first module (in ``named_modules`` order) with a
    config that declares a plan is taken, and its base model found under it.
    """
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or not getattr(config, "base_model_tp_plan", None):
            continue
        inner = getattr(module, "base_model_prefix", "")
        base = getattr(module, inner, None) if inner else None
        if isinstance(base, nn.Module):
            return (f"{name}.{inner}" if name else inner), module
        return name, module
    return None


def file_plan(mf: ModelFile, name: str) -> object | None:
    """A model file's module-level plan ``name`` (``tp_plan``, ``ep_plan``): the dict, or what its
    function returns for the file's config; None where the file declares none.

    Raises:
        ModelFileError: the function raises (named, with the error).
    """
    declared = getattr(mf.module, name, None)
    if callable(declared):
        try:
            return declared(**mf.config)
        except Exception as e:
            raise ModelFileError(f"{mf.path.name}: {name}(**config) raised {type(e).__name__}: {e}") from e
    return declared


def resolve_tp_plan(mf: ModelFile, model: nn.Module) -> ResolvedPlan:
    """The model's tensor-parallel plan (see the module docstring for where it comes from).

    Args:
        mf: the loaded model file (its module's ``tp_plan``, its config).
        model: the model ``build_model`` returned (any device, meta included).

    Returns:
        The plan; an empty one with a reason when the declared plan cannot be used, an empty one
        without a reason when the model declares none.

    Raises:
        ModelFileError: the model file's ``tp_plan`` function raises.
    """
    declared = file_plan(mf, "tp_plan")
    if declared is not None:
        plan, reason = _checked(declared, f"{mf.path.name}: tp_plan")
        return ResolvedPlan(plan, "model file" if plan else "", reason)
    found = base_model_prefix(model)
    if found is None:
        return ResolvedPlan({})
    prefix, owner = found
    config: Any = owner.config
    declared, whole = _without_experts(config)
    plan, reason = _checked(declared, f"{type(config).__name__}.base_model_tp_plan")
    if reason:
        return ResolvedPlan({}, "", reason)
    out = {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}
    # a family's plan names layers some of its configurations lack (Qwen2-MoE's dense MLPs, in
    # models whose every layer routes to experts): those patterns are passed over, not refused
    used = {pattern for _, _, pattern in matched_modules(model, out).values()}
    out = {k: v for k, v in out.items() if k in used}
    kept = tuple(f"{prefix}.{k}" if prefix else k for k in whole)
    return ResolvedPlan(_untied(model, out) | _head_entries(model, owner), "Hugging Face config", whole=kept)


def _without_experts(config: Any) -> tuple[dict[str, str], list[str]]:
    """A Hugging Face config's ``base_model_tp_plan`` without its mixture-of-experts entries, and the
    experts modules' patterns.

    transformers 5 splits an experts module's grouped weights (``"packed_colwise"`` /
    ``"rowwise"`` on 3-D parameters, the module ``"moe_tp_experts"``), which torch's
    ``parallelize_module`` has no style for. The planner keeps those modules whole on every
    tensor-parallel rank (the attention and any dense or shared-expert MLP still split), the layout
    Megatron-Core runs with an expert tensor-parallel size of 1: the entries naming an experts module
    (styled so in either plan) or anything inside it are dropped.
    """
    plan = dict(config.base_model_tp_plan)
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    experts = [k for k, v in plan.items() if v == TP_EXPERTS]
    experts += [k for k, v in dict(ep_plan).items() if v == EP_EXPERTS and k not in experts]
    kept = {k: v for k, v in plan.items() if not any(k == e or k.startswith(f"{e}.") for e in experts)}
    return kept, [e for e in experts if any(k == e or k.startswith(f"{e}.") for k in plan)]


def _untied(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A Hugging Face plan without the entries whose layers hold a tied weight (an input embedding
    shared with the output head): those stay whole, as the head tied to them does, instead of the
    tie refusing the whole plan (``_check_ties``)."""
    holders = _holders(model)
    out: dict[str, str] = {}
    for key, style in plan.items():
        weights = [getattr(m, "weight", None) for _, m, _ in matched_modules(model, {key: style}).values()]
        if not any(isinstance(w, nn.Parameter) and len(holders.get(id(w), [])) > 1 for w in weights):
            out[key] = style
    return out


def _head_entries(model: nn.Module, owner: nn.Module) -> dict[str, str]:
    """A transformers model's own ``_tp_plan`` beside its config's (the output head: ``{"lm_head":
    "colwise_gather_output"}`` for Llama, Qwen2, Mistral), prefixed with the model's name inside
    ``model``: the entries whose style the planner runs and whose layer's weight is not tied (a head
    tied to the input embedding stays whole: splitting it would need the embedding split alike)."""
    declared = getattr(owner, "_tp_plan", None)
    if not isinstance(declared, Mapping):
        return {}
    name = next((n for n, m in model.named_modules() if m is owner), "")
    holders = _holders(model)
    out: dict[str, str] = {}
    for key, style in declared.items():
        style = ALIASES.get(style, style) if isinstance(style, str) else style
        full = f"{name}.{key}" if name else str(key)
        found = matched_modules(model, {full: style}) if style in STYLES else {}
        weights = [getattr(m, "weight", None) for _, m, _ in found.values()]
        if found and all(isinstance(w, nn.Parameter) and len(holders.get(id(w), [])) == 1 for w in weights):
            out[full] = style
    return out


def _holders(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id -> the names of the modules holding it (more than one: a tie)."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):  # None slots skipped
            holders.setdefault(id(p), []).append(name)
    return holders


def matched_modules(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[str, nn.Module, str]]:
    """Every module a pattern of ``plan`` matches: FQN -> (style, module, pattern), in module order
    (``match``; the first pattern that matches a module names it)."""
    patterns = [(pattern.split("."), style, pattern) for pattern, style in plan.items()]
    out: dict[str, tuple[str, nn.Module, str]] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        names = name.split(".")  # split once per module, not once per pattern (a 1,000-layer model has 12,000)
        for parts, style, pattern in patterns:
            if len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names)):
                out[name] = (style, module, pattern)
                break
    return out


def _heads(model: nn.Module, name: str) -> list[tuple[str, int]]:
    """The head counts the parent of module ``name`` declares (attributes), as (what, count)."""
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return [(a, v) for a in HEAD_ATTRS if isinstance(v := getattr(parent, a, None), int) and v > 0]


def config_heads(model: nn.Module) -> list[tuple[str, int]]:
    """A Hugging Face config's head counts, as ("config.<attribute>", count) (none for other models)."""
    found = base_model_prefix(model)
    config = getattr(found[1], "config", None) if found else getattr(model, "config", None)
    return [(f"config.{a}", v) for a in CONFIG_HEAD_ATTRS if isinstance(v := getattr(config, a, None), int) and v > 0]


def split_sizes(
    model: nn.Module,
    plan: Mapping[str, str],
    matched: Mapping[str, tuple[str, nn.Module, str]] | None = None,
    heads: list[tuple[str, int]] | None = None,
) -> list[tuple[str, str, int]]:
    """Every size the degree must divide, as (pattern or module, what, size): the split features of
    each matched Linear (not a colwise_rep one's: torch shards its rows unevenly where the degree does
    not divide them, and gathers its output whole), each split embedding's width, the heads of the
    attention modules holding a split layer, and a Hugging Face config's head counts when a plan
    splits anything.

    Args:
        model: the model ``build_model`` returned.
        plan: pattern -> style.
        matched: ``matched_modules(model, plan)`` where the caller has it (or a part of it: one
            block's layers); None matches here. Matching walks every module of the model, so a
            caller asking block by block passes its share instead of walking the model per block.
        heads: ``config_heads(model)`` where the caller has it (None: found here, another walk).

    Returns:
        The sizes, in module order.
    """
    sizes: list[tuple[str, str, int]] = []
    parents: set[str] = set()
    for name, (style, module, pattern) in (matched_modules(model, plan) if matched is None else matched).items():
        if isinstance(module, nn.Linear) and style != "colwise_rep":  # torch shards a colwise_rep unevenly
            what = "out_features" if style == "colwise" else "in_features"
            sizes.append((f"{pattern} ({name})", what, getattr(module, what)))
        elif isinstance(module, nn.Embedding):  # split by its width, which the ranks' slices must divide
            sizes.append((f"{pattern} ({name})", "embedding_dim", module.embedding_dim))
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent not in parents:
            parents.add(parent)
            sizes.extend((parent or "<root>", what, n) for what, n in _heads(model, name))
    if sizes:
        sizes.extend(("the model", what, n) for what, n in (config_heads(model) if heads is None else heads))
    return sizes


def check_tp_plan(model: nn.Module, plan: Mapping[str, str], tp: int = 1) -> None:
    """Check a plan against a built model: every pattern matches a module, every matched module is an
    ``nn.Linear`` (or an ``nn.Embedding`` split ``colwise_rep``), and ``tp`` divides every split size
    (features, an embedding's width, heads).

    Args:
        model: the model ``build_model`` returned.
        plan: pattern -> style.
        tp: the degree asked for (1: structure only).

    Raises:
        ModelFileError: one line naming the pattern, the module and the numbers.
    """
    matched = matched_modules(model, plan)
    for pattern in plan:
        if not any(p == pattern for _, _, p in matched.values()):
            raise ModelFileError(
                f"tp_plan: {pattern!r} matches no module of the model ('*' stands for one name part, names as "
                "model.named_modules() gives them); fix the pattern or drop it"
            )
    for name, (style, module, pattern) in matched.items():
        if isinstance(module, nn.Embedding) and style != "colwise_rep":
            raise ModelFileError(
                f"tp_plan: {pattern!r} splits the embedding {name} {style}; an nn.Embedding splits only 'colwise_rep' "
                "(its width split, the lookups gathered whole)"
            )
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ModelFileError(
                f"tp_plan: {pattern!r} matches {name}, a {type(module).__name__}; only nn.Linear layers (and "
                f"nn.Embedding, colwise_rep) can be split {style}"
            )
    _check_ties(model, matched)
    reason = indivisible_split(model, plan, tp)
    if reason:
        raise ModelFileError(f"--tp {tp}: {reason}")


def indivisible_split(model: nn.Module, plan: Mapping[str, str], tp: int) -> str | None:
    """Why ``tp`` cannot split ``model`` by ``plan``: the first split size (features, an embedding's
    width, a head count) it does not divide, and the degrees that would do (``_degrees``). ``planner
    plan`` checks its degree with it, ``planner run`` a plan's (a hand edit included).

    Args:
        model: the unsplit model.
        plan: pattern -> style.
        tp: the degree.

    Returns:
        The reason, or None when ``tp`` divides every split size (or is 1).
    """
    if tp <= 1:
        return None
    sizes = split_sizes(model, plan)
    for where, what, n in sizes:
        if n % tp:
            return f"tp_plan splits {where}, whose {what} is {n}, not a multiple of {tp}; {_degrees(sizes)}"
    return None


def _degrees(sizes: list[tuple[str, str, int]]) -> str:
    """The degrees every split size allows, and which size limits them most (the smallest): "give a
    degree that divides 2" once followed a width of 64, where 2 key-value heads were the limit."""
    divisor = math.gcd(*(n for _, _, n in sizes))
    where, what, n = min(sizes, key=lambda s: s[2])
    limit = f"{where}'s {what} is {n}" if n == divisor else f"the gcd of every split size is {divisor}"
    if divisor == 1:
        return f"no degree above 1 divides every split size ({limit}): give --tp 1, or --tp auto"
    degrees = divisors(divisor)[1:]  # above 1
    shown = ", ".join(map(str, degrees[:6])) + (", ..." if len(degrees) > 6 else "")
    return f"the degrees that divide every split size: {shown} ({limit}); give one of them, or --tp auto"


def _check_ties(model: nn.Module, matched: Mapping[str, tuple[str, nn.Module, str]]) -> None:
    """A split layer's weight must not be held by another module too (a tie, e.g. an output head
    sharing the input embedding): torch's styles give each split module a new sharded parameter of
    its own, so the holders would train apart."""
    holders = _holders(model)
    for name, (style, module, pattern) in matched.items():
        other = next((o for o in holders.get(id(module.weight), []) if o != name), None)
        if other is not None:
            raise ModelFileError(
                f"tp_plan splits {name} {style} ({pattern!r}), whose weight is tied to {other}: torch gives a split "
                f"layer a sharded weight of its own, so the tie would not hold; drop {pattern!r} or untie the weights"
            )


__all__ = [
    "EP_EXPERTS",
    "STYLES",
    "TP_EXPERTS",
    "COLUMN_STYLES",
    "style_error",
    "ResolvedPlan",
    "base_model_prefix",
    "check_tp_plan",
    "config_heads",
    "file_plan",
    "match",
    "matched_modules",
    "indivisible_split",
    "resolve_tp_plan",
    "split_sizes",
]
