"""``planner report PLAN --config``: the TOML job file that makes PLAN again (``planner plan --config``).

A plan records its layout and settings, not the command line that made it, so the job file gives
the plan's own values: the ranks from its world size, the schedule, microbatches, stages per rank,
replicas and tensor parallelism it chose, each stage's recomputation where all stages agree, and
its split as ``method = "given"`` with DeepSpeed-style ``parts`` (block indices), so profiling noise
cannot move a cut. The keys are ``planner plan``'s options (cli_config.py reads them back).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from planner.core.levers.float8 import float8_dtype
from planner.schema.plan import Plan

PLAIN_RECOMPUTE = ("never", "selective", "full", "stage")
"""Recompute modes ``--recompute`` applies to every stage alike (``full:k`` is one ``auto`` chooses)."""


def toml_value(value: Any) -> str:
    """``value`` as a TOML value: a string, number, boolean, array or inline table.

    Args:
        value: str, bool, int, float, list / tuple or dict of those (no None: TOML has no null).

    Returns:
        The TOML text, e.g. ``"gpipe"``, ``8``, ``true``, ``[1, 2]``, ``{ n_layers = 2 }``.

    Raises:
        TypeError: None or another type TOML cannot hold.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        # a JSON string is a TOML basic string, but for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"TOML has no value for {type(value).__name__}")


def toml_key(key: str) -> str:
    """A TOML key: bare when it is letters, digits, ``_`` and ``-`` only, else quoted."""
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else toml_value(key)


def _holds_none(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_holds_none(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_none(v) for v in value)
    return value is None


def _model_path(plan: Plan, plan_path: str) -> str:
    """The model file as a path from the working directory (absolute when it lies above it)."""
    path = Path(plan.model.path)
    if not path.is_absolute():
        path = Path(plan_path).parent / path  # plans store it relative to their own folder
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else str(path.resolve())


def _model(plan: Plan, plan_path: str) -> dict[str, Any]:
    """The "Model" group: the file, its size, its config as planned (size entries and --set), the seed."""
    values: dict[str, Any] = {"model-file": _model_path(plan, plan_path)}
    if plan.model.size is not None:
        values["size"] = plan.model.size
    # a Hugging Face config.json is served with its own path under this key (planner.capture.load)
    config = {k: v for k, v in plan.model.config.items() if k != "hf_config"}
    if config:
        # TOML has no null: a config holding None goes as --set's KEY=JSON strings
        values["set"] = [f"{k}={json.dumps(v)}" for k, v in config.items()] if _holds_none(config) else config
    values["seed"] = plan.model.seed
    return values


def _cluster_and_costs(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    """The "Cluster" and "Costs" groups: ranks, hardware and how the costs were found."""
    profile = plan.profile
    cluster: dict[str, Any] = {"gpus": plan.world_size}
    costs: dict[str, Any] = {}
    if profile.source == "estimated":
        cluster["gpu-type"] = profile.hardware
        if plan.gpus_per_node is not None:
            cluster["gpus-per-node"] = plan.gpus_per_node
        costs["dtype"] = profile.dtype
        if profile.attention_kernel is not None:
            costs["attention-kernel"] = profile.attention_kernel
    else:
        cluster["threads"] = profile.threads
        if profile.autocast is not None:
            costs["dtype"] = profile.autocast
    if profile.float8 is not None:  # bf16 around the float8 layers: the dtype that asked for them
        costs["dtype"] = float8_dtype(profile.float8.recipe)
    costs["compile"] = plan.compile
    if (
        profile.source != "estimated"
    ):  # an estimate times nothing (its profile records 0 repeats, which --repeats refuses)
        costs.update(repeats=profile.repeats, warmup=profile.warmup)
    if plan.moe_imbalance is not None:
        costs["moe-imbalance"] = plan.moe_imbalance
    return {k: v for k, v in cluster.items() if v is not None}, costs


def _layout(plan: Plan) -> dict[str, Any]:
    """The "Layout" group: everything the search chose, fixed, and the split as given block indices."""
    values: dict[str, Any] = {"dp": plan.dp, "tp": plan.tp}
    if plan.experts:
        values["ep"] = plan.ep
    if plan.cp > 1:
        values.update({"cp": plan.cp, "cp-attention": plan.cp_attention})
    if plan.tp > 1:
        values["sequence-parallel"] = plan.sequence_parallel
        values["loss-parallel"] = plan.loss_parallel
    values["schedule"] = plan.schedule
    values["stages-per-rank"] = plan.n_stages // plan.n_ranks
    values["microbatches"] = plan.n_microbatches
    values["accumulation"] = plan.accumulation
    if plan.dp > 1:
        values["dp-mode"] = plan.dp_mode
        if plan.dp_mode == "hsdp" and plan.dp_shard is not None:
            values["dp-shard"] = plan.dp_shard
        if plan.sharded:
            values["fsdp-units"] = plan.fsdp_units
    if plan.method in ("uniform", "params"):
        values["method"] = plan.method  # equal layers or parameters: the same split from the same model
    else:
        values["method"] = "given"
        values["compare"] = "parts:" + ",".join(str(s.start) for s in plan.stages) + f",{len(plan.blocks)}"
    return values


def _memory(plan: Plan) -> dict[str, Any]:
    """The "Memory" group: the limit planned for and the stages' recomputation."""
    values: dict[str, Any] = {}
    if plan.memory_limit_bytes is not None:
        values["memory-limit"] = plan.memory_limit_bytes / 2**30  # exact: a byte count over a power of two
    modes = {s.recompute for s in plan.stages}
    only = next(iter(modes)) if len(modes) == 1 else None
    values["recompute"] = only if only in PLAIN_RECOMPUTE else "auto"
    return values


def job_file(plan: Plan, plan_path: str) -> str:
    """The TOML job file that makes ``plan`` again: ``planner plan --config FILE``.

    Args:
        plan: a loaded plan.
        plan_path: where it was read from, as the user gave it (the model path is relative to its folder).

    Returns:
        The job file's text, its keys in ``planner plan --help``'s groups.
    """
    cluster, costs = _cluster_and_costs(plan)
    training = {
        "batch-size": plan.batch_size,
        "optimizer": plan.optimizer.name,
        "lr": plan.optimizer.lr,
        "grad-clip": plan.optimizer.grad_clip or 0.0,
    }
    groups = [
        ("Model", _model(plan, plan_path)),
        ("Cluster", cluster),
        ("Training", training),
        ("Layout", _layout(plan)),
        ("Memory", _memory(plan)),
        ("Costs", costs),
        ("Output", {"output": plan_path}),
    ]
    lines = [
        f"# planner plan --config FILE: the job that makes {plan_path} again (planner report --config).",
        '# The layout is the plan\'s, fixed: set a Layout key or recompute to "auto" for the search to choose',
        '# it again, and method to "optimal" without compare for the solver to split the model again.',
    ]
    if plan.calibration:
        lines.append('# The costs were calibrated by a run: add calibrate = "RUN.json" with that run\'s file.')
    for title, values in groups:
        lines.append(f"\n# {title}")
        lines.extend(f"{toml_key(key)} = {toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


__all__ = ["job_file", "toml_key", "toml_value"]
