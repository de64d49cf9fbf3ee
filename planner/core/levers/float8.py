"""FP8 training (``--dtype fp8``): which linear layers compute their matrix products in float8, and why
the others stay in bf16.

torchao's float8 training (``torchao.float8.convert_to_float8_training``, which torchtitan's float8
converter applies) swaps ``nn.Linear`` layers for ``Float8Linear``: before each of a layer's three
GEMMs (the output, the input's gradient, the weight's gradient) it scales its two operands and casts
them to float8, and the GEMM runs on the FP8 tensor cores at twice the bf16 peak. Everything else
computes in bf16, as under ``--dtype bf16`` (the weights' master copies stay fp32). A recipe says how
the scales are taken, as torchao names them (``Float8LinearConfig.from_recipe_name``):

* ``tensorwise`` (``--dtype fp8``): one scale per tensor, from its largest magnitude; torchao's
  default, and torchtitan's in its December 2024 H100 benchmarks;
* ``rowwise`` (``--dtype fp8-rowwise``): one scale per row along the reduced dimension, more accurate,
  more casting (each operand is cast again along the other dimension for the backward GEMMs).

Which layers convert (``kept_reason``), as torchao and torchtitan filter them:

* both widths a multiple of 16, which FP8 tensor cores need (torchtitan's ``module_filter_fn``);
* inside the model's repeated layers: the output layer stays in bf16 (torchtitan's ``filter_fqns``
  names it in every preset that converts), as do projections outside the layers;
* not a mixture-of-experts router (a layer whose output picks experts by top-k): its scores choose
  the experts, and a cast would move tokens between them;
* on a GPU estimate, large enough to gain: torchao's auto filter (``_auto_filter_for_recipe`` in
  ``torchao/float8/float8_linear_utils.py``: thresholds from its H100 microbenchmarks) keeps small
  layers in bf16, where the casts cost more than the faster GEMM saves. A CPU plan converts every
  layer the other rules allow: it runs torchao's emulation, whose speed says nothing about a GPU.

Pure module: never imports torch.
"""

from __future__ import annotations

from planner.schema.plan_parts import LinearLayer

RECIPES: dict[str, str] = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}
"""``--dtype`` -> the torchao recipe its linear layers train with."""


def float8_recipe(dtype: str | None) -> str | None:
    """The torchao recipe of ``--dtype`` (None: not an FP8 dtype)."""
    return RECIPES.get(dtype or "")


def float8_dtype(recipe: str) -> str:
    """The ``--dtype`` that trains with torchao's ``recipe`` (``RECIPES`` read backwards)."""
    return next(dtype for dtype, named in RECIPES.items() if named == recipe)


def compute_dtype(dtype: str) -> str:
    """The dtype everything but the converted GEMMs computes in: bf16 for an FP8 dtype, else ``dtype``."""
    return "bf16" if dtype in RECIPES else dtype


def too_small(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether torchao's auto filter keeps a layer of these widths in bf16 for ``recipe``, because on an
    H100 its float8 casts cost more than the faster GEMM saves (``_auto_filter_for_tensorwise`` /
    ``_auto_filter_for_rowwise``, torchao 0.18, with K the input width and N the output width).

    Args:
        in_features: K.
        out_features: N.
        recipe: "tensorwise" or "rowwise".

    Returns:
        True when the layer stays in bf16.
    """
    k, n = in_features, out_features
    if recipe == "rowwise":
        return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
    return k <= 4096 and n <= 1024


def kept_reason(layer: LinearLayer, recipe: str, small_filter: bool) -> str | None:
    """Why ``layer`` stays in bf16 under ``recipe``, or None when it converts to float8.

    Args:
        layer: the linear layer.
        recipe: "tensorwise" or "rowwise".
        small_filter: apply torchao's size thresholds (``too_small``): GPU estimates.

    Returns:
        A short reason for the report ("outside the repeated layers: ..."), or None.
    """
    if layer.in_features % 16 or layer.out_features % 16:
        return f"{layer.in_features} x {layer.out_features}: FP8 tensor cores need widths that are multiples of 16"
    if not layer.in_layer:
        return "outside the repeated layers: the output layer stays in bf16, as torchtitan keeps it"
    if layer.router:
        return "a mixture-of-experts router (its scores pick the experts)"
    if small_filter and too_small(layer.in_features, layer.out_features, recipe):
        return (
            f"{layer.in_features} x {layer.out_features}: too small to gain on an H100, torchao's {recipe} auto filter"
        )
    return None


def kept_layers(layers: list[LinearLayer], recipe: str, small_filter: bool) -> dict[str, str]:
    """The layers that stay in bf16, each with its reason (``kept_reason``); the others convert.

    Args:
        layers: every linear layer of the model.
        recipe: "tensorwise" or "rowwise".
        small_filter: apply torchao's size thresholds (GPU estimates).

    Returns:
        Layer name -> reason, in the layers' order.
    """
    kept = {}
    for layer in layers:
        why = kept_reason(layer, recipe, small_filter)
        if why is not None:
            kept[layer.name] = why
    return kept


def fsdp_float8_gather(recipe: str, dp_mode: str) -> bool:
    """Whether FSDP gathers the float8 layers' weights in float8 (a byte a parameter instead of bf16's two):
    torchao's ``enable_fsdp_float8_all_gather``, which torchtitan's float8 configuration turns on, for the
    tensorwise recipe only (its scale is one number the shards agree on by an all-reduce of their largest
    magnitudes); under FSDP and HSDP. The weights' gradients are reduce-scattered as ever (fp32).

    Args:
        recipe: "tensorwise" or "rowwise".
        dp_mode: the plan's ``--dp-mode``.

    Returns:
        True when the weights are gathered in float8.
    """
    return recipe == "tensorwise" and dp_mode in ("fsdp", "hsdp")
