"""``planner plan``'s options, one decorator per ``--help`` group, and the request they make.

Each help text is a sentence or two; docs/options.md holds every option's full meaning, in the same
groups (``PLAN_GROUPS``, in ``--help`` order, which tests/test_cli_config.py checks --help against):
move an option here and there together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from cli_config import config_option, merge_file_overrides
from cli_groups import option, option_group
from cli_support import COUNT_OR_AUTO, FACTOR_OR_AUTO, REPLICAS_OR_AUTO, split_option
from planner.core.levers.hardware import GPUS
from planner.schema.costs import OPTIMIZERS
from planner.schema.names import CP_ATTENTION, DP_MODES, DTYPES, METHODS, RECOMPUTE, SCHEDULES
from planner.schema.request import PlanRequest

PLAN_GROUPS = ("Model", "Cluster", "Training", "Layout", "Memory", "Costs", "Job file and output")
"""The ``--help`` sections of ``planner plan``, in order (``--debug`` and ``--help`` join the last)."""

model_options = option_group(
    "Model",
    option(
        "--size",
        "-s",
        default=None,
        metavar="NAME",
        help="A config from the model file's SIZES [default: its defaults].",
    ),
    option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        callback=merge_file_overrides,
        help="Override one config entry (repeatable); VALUE is JSON or a string.",
    ),
    option(
        "--seed", type=int, metavar="N", default=0, show_default=True, help="Seed of the weights and the example batch."
    ),
)

cluster_options = option_group(
    "Cluster",
    option(
        "--gpus",
        "-g",
        type=click.IntRange(min=1),
        required=True,
        help="Total number of ranks (processes, one device each) = dp x cp x pp x tp.",
    ),
    option(
        "--gpu-type",
        default=None,
        metavar="NAME|FILE",
        help=f"Estimate costs for this GPU ({', '.join(GPUS)}, cpu) or a planner probe file.",
    ),
    option("--gpus-per-node", type=int, default=None, metavar="N", help="With --gpu-type: GPUs per node [default: 8]."),
    option("--multi-node", is_flag=True, help="With --gpu-type: every boundary crosses nodes (--gpus-per-node 1)."),
    option(
        "--threads",
        type=click.IntRange(min=1),
        metavar="N",
        default=None,
        help="CPU threads per rank, profiling and run [default: cores // gpus].",
    ),
)

training_options = option_group(
    "Training",
    option(
        "--batch-size",
        "-b",
        type=click.IntRange(min=1),
        metavar="N",
        default=32,
        show_default=True,
        help="Samples per training step, over all replicas.",
    ),
    option(
        "--optimizer",
        type=click.Choice(list(OPTIMIZERS)),
        default="adamw",
        show_default=True,
        help="The run's optimizer (its state counts in memory).",
    ),
    option(
        "--lr",
        type=click.FloatRange(min=0, min_open=True),
        metavar="RATE",
        default=1e-3,
        show_default=True,
        help="The run's learning rate.",
    ),
    option(
        "--grad-clip",
        type=click.FloatRange(min=0),
        metavar="NORM",
        default=1.0,
        show_default=True,
        help="Max gradient norm (0: none).",
    ),
)


# the searched options: "auto" unless given
_AUTO: dict[str, Any] = {"default": "auto", "show_default": True}

layout_options = option_group(
    "Layout",
    option("--dp", type=REPLICAS_OR_AUTO, default="1", help="Data-parallel replicas, or auto."),
    option("--tp", type=REPLICAS_OR_AUTO, **_AUTO, help="Tensor-parallel ranks per pipeline rank, or auto."),
    option("--ep", type=REPLICAS_OR_AUTO, default=1, help="Ranks MoE experts shard over, or auto."),
    option("--cp", type=REPLICAS_OR_AUTO, default=1, help="Ranks each sequence is split over, or auto."),
    option(
        "--cp-attention",
        type=click.Choice(["auto", *CP_ATTENTION], case_sensitive=False),
        metavar="NAME",
        default="auto",
        help="With --cp: all-gather, ring, auto (default).",
    ),
    option(
        "--sequence-parallel/--no-sequence-parallel",
        default=None,
        help="With tp > 1, also split activations along the sequence [default: auto].",
    ),
    option(
        "--loss-parallel/--no-loss-parallel",
        default=False,
        help="With tp > 1, the loss on the split logits [default: off].",
    ),
    option("--schedule", metavar="NAME", **_AUTO, help=f"{', '.join(SCHEDULES)}, or auto."),
    option("--stages-per-rank", "-v", type=COUNT_OR_AUTO, **_AUTO, help="Pipeline stages on every rank, or auto."),
    option("--microbatches", "-m", type=COUNT_OR_AUTO, **_AUTO, help="Microbatches per pass of a replica, or auto."),
    option("--accumulation", type=REPLICAS_OR_AUTO, **_AUTO, help="Pipeline passes per step (gradient accumulation)."),
    option(
        "--dp-mode",
        type=click.Choice(["auto", *DP_MODES], case_sensitive=False),
        **_AUTO,
        help="How the replicas reduce gradients: ddp, fsdp, hsdp (fully_shard on a 2-D mesh) or auto.",
    ),
    option(
        "--dp-shard", type=REPLICAS_OR_AUTO, **_AUTO, help="Under --dp-mode hsdp, the replicas of each shard group."
    ),
    option(
        "--fsdp-units",
        type=click.Choice(["auto", "stage", "block"], case_sensitive=False),
        **_AUTO,
        help="Under fsdp/hsdp, what is gathered at a time.",
    ),
    option(
        "--method",
        type=click.Choice(list(METHODS)),
        default="optimal",
        show_default=True,
        help="The split the plan uses (the others are compared).",
    ),
    option(
        "--compare",
        default=None,
        metavar="SPLIT",
        callback=lambda _ctx, _param, value: split_option(value),
        help="A split you use now, costed beside the plan (3,4 or Et*3|t*4L or parts:0,3,7 or a file).",
    ),
    option(
        "--jobs",
        "-j",
        type=click.IntRange(min=1, max=1024),
        metavar="N",
        default=None,
        help="Processes the search runs in (same plan) [default: cores].",
    ),
)


memory_options = option_group(
    "Memory",
    option(
        "--memory-limit",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="GIB",
        help="Per-rank memory limit [default: the GPU's memory, else none].",
    ),
    option(
        "--recompute",
        type=click.Choice(list(RECOMPUTE)),
        default="auto",
        show_default=True,
        metavar="MODE",
        help=f"Activation checkpointing: {', '.join(RECOMPUTE)}.",
    ),
)

cost_options = option_group(
    "Costs",
    option(
        "--dtype",
        type=click.Choice(list(DTYPES)),
        default=None,
        metavar="DTYPE",
        help="bf16, fp16, fp32: autocast (--gpu-type: estimate in it); fp8, fp8-rowwise: linears in float8.",
    ),
    option("--compile", "compile_", is_flag=True, help="Profile and train with torch.compile."),
    option(
        "--attention-kernel",
        default=None,
        metavar="BACKEND",
        help="With --gpu-type: the attention kernel to cost (flash, cudnn, efficient, unfused).",
    ),
    option(
        "--calibrate",
        "calibrate_run",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="RUN.json",
        help="Correct the costs with an earlier run's timings.",
    ),
    option(
        "--moe-imbalance",
        type=FACTOR_OR_AUTO,
        default="auto",
        show_default=True,
        help="MoE: busiest expert's routed rows / mean.",
    ),
    option(
        "--repeats",
        type=click.IntRange(min=1),
        metavar="N",
        default=5,
        show_default=True,
        help="Timed runs per block (20 or more on a busy machine).",
    ),
    option(
        "--warmup",
        type=click.IntRange(min=0),
        metavar="N",
        default=2,
        show_default=True,
        help="Untimed runs per block.",
    ),
)

output_options = option_group(
    "Job file and output",
    config_option,
    option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False),
        default="plan.json",
        show_default=True,
        help="Where to write the plan.",
    ),
    option("--quiet", "-q", is_flag=True, help="No progress bars and no tables."),
)


def plan_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of ``planner plan``, group by group in ``PLAN_GROUPS`` order.

    Args:
        fn: the command function.

    Returns:
        ``fn`` with the options added.
    """
    # click lists a command's options in the order their decorators are written, the last applied first
    groups = [model_options, cluster_options, training_options, layout_options, memory_options, cost_options]
    for group in reversed([*groups, output_options]):
        fn = group(fn)
    return fn


def plan_request(model_file: str, options: dict[str, Any]) -> PlanRequest:
    """The request ``planner plan``'s options make (the library takes nothing else).

    Args:
        model_file: the MODEL_FILE argument.
        options: every other parameter of ``planner plan``, by its click name.

    Returns:
        The validated request.

    Raises:
        PlannerError: a value out of range or of the wrong kind, naming its option.
    """
    from planner.capture.load import parse_overrides

    o = dict(options)
    sequence_parallel = o.pop("sequence_parallel")
    return PlanRequest.build(
        model_file=model_file,
        fsdp_units=o.pop("fsdp_units").lower(),
        sequence_parallel="auto" if sequence_parallel is None else sequence_parallel,
        overrides=parse_overrides(o.pop("overrides")),
        memory_limit_gib=o.pop("memory_limit"),
        compile=o.pop("compile_"),
        optimizer={"name": o.pop("optimizer"), "lr": o.pop("lr"), "grad_clip": o.pop("grad_clip") or None},
        progress=not o.pop("quiet"),
        **o,
    )


__all__ = ["PLAN_GROUPS", "plan_options", "plan_request"]
