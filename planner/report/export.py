"""A plan in another trainer's terms: torchtitan's ``ParallelismConfig`` (Python, or the TOML of
torchtitan <= 0.2.2), Megatron's ``--pipeline-model-parallel-layout``, DeepSpeed's partition
(``parts``), and torch's pipeline-order CSV (what ``_PipelineScheduleRuntime._load_csv`` reads).

Pure: it reads the plan only. A split a target cannot express is one line saying why and what to
change (``ExportError``). docs/interop.md says how each was verified against the target's own code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from planner.core.levers.float8 import fsdp_float8_gather
from planner.core.levers.recompute import recomputed_prefix
from planner.core.step.schedules import action_order, placement
from planner.report.renames import ExportError, check_renames, renamed
from planner.schema.costs import split_recompute
from planner.schema.names import TORCH_NAMES
from planner.schema.outputs import EXPORT_HEADER
from planner.schema.plan import Plan

EXPORT_FORMATS = ("torchtitan", "torchtitan-toml", "megatron", "deepspeed", "csv")
"""What ``planner export --to`` writes."""

HEADER = EXPORT_HEADER.decode()
"""The first words of every export but the CSV (``check_output`` replaces only such a file)."""

# torchtitan's _split_module keeps top-level children by name and entries of a top-level
# ModuleList / ModuleDict as "<list>.<index>"; nothing deeper.
_TITAN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[0-9]+)?$")


def export_plan(plan: Plan, fmt: str, renames: Mapping[str, str] | None = None) -> str:
    """The plan written for another trainer.

    Args:
        plan: the plan.
        fmt: one of ``EXPORT_FORMATS``.
        renames: block-name prefixes to replace (``--rename``), for the formats that name modules.

    Returns:
        The text to write (ends with a newline).

    Raises:
        ExportError: an unknown format, or a split the format cannot express.
    """
    writers = {
        "torchtitan": _torchtitan_python,
        "torchtitan-toml": _torchtitan_toml,
        "megatron": _megatron,
        "deepspeed": _deepspeed,
        "csv": _csv,
    }
    if fmt not in writers:
        raise ExportError(f"--to {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    renames = dict(renames or {})
    check_renames(plan, renames, fmt)
    return writers[fmt](plan, renames)


def stage_blocks(plan: Plan) -> list[list[str]]:
    """The block names of every stage, in global stage order (the model's order)."""
    return [[b.name for b in plan.blocks[s.start : s.end]] for s in sorted(plan.stages, key=lambda s: s.index)]


def torchtitan_fqns(plan: Plan, renames: Mapping[str, str]) -> list[list[str]]:
    """``module_fqns_per_model_part``: each stage's module names, renamed, in global stage order.

    Raises:
        ExportError: a block whose name torchtitan's split cannot keep (named, with a rename that
            would do where one exists).
    """
    parts = [[renamed(n, renames) for n in names] for names in stage_blocks(plan)]
    for stage, names in enumerate(parts):
        for name in names:
            if not _TITAN_NAME.match(name):
                raise ExportError(
                    f"block {name!r} (stage {stage}) is not a module torchtitan's split keeps (a top-level module, "
                    f"or one entry of a top-level ModuleList / ModuleDict such as 'layers.3'){_rename_hint(name)}"
                )
    return parts


def _rename_hint(name: str) -> str:
    """``; rename it: --rename OLD=NEW`` where dropping leading module names gives a name torchtitan keeps."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        rest = ".".join(parts[k:])
        if _TITAN_NAME.match(rest) and "#" not in name and "@" not in name:
            tail = 1 if parts[-1].isdigit() else 0  # rename the list, not one entry of it
            old = ".".join(parts[: len(parts) - tail])
            new = ".".join(parts[k : len(parts) - tail])
            return f"; rename it: --rename {old}={new}"
    return "; torchtitan cannot keep it as a module of its own"


def _batch_lines(plan: Plan) -> dict[str, int]:
    """Batch sizes as torchtitan's TrainingConfig takes them: samples per data-parallel rank per
    optimizer step in one pass (local) and over every replica and pass (global)."""
    return {
        "local_batch_size": plan.batch_size // (plan.dp * plan.accumulation),
        "global_batch_size": plan.batch_size,
    }


def _titan_fields(plan: Plan, renames: Mapping[str, str]) -> dict[str, object]:
    """The ``ParallelismConfig`` fields that carry the plan.

    Raises:
        ExportError: expert parallelism over DDP replicas, which torchtitan cannot say (it borrows
            its expert-parallel ranks from FSDP's shard degree and tensor parallelism).
    """
    if plan.ep > 1 and plan.shard_size * plan.tp % plan.ep:
        raise ExportError(
            f"--to torchtitan: the plan shards its experts over {_expert_ranks(plan)} under {plan.dp_mode}, but torchtitan "
            f"takes its expert_parallel_degree out of data_parallel_shard_degree x tensor_parallel_degree "
            f"({plan.shard_size} x {plan.tp}), which ep must divide; export --to megatron, or plan with --ep 1"
        )
    fields: dict[str, object] = {
        "pipeline_parallel_degree": plan.n_ranks,
        "pipeline_parallel_schedule": TORCH_NAMES[plan.schedule],
        "pipeline_parallel_microbatch_size": plan.microbatch_size,
        "module_fqns_per_model_part": torchtitan_fqns(plan, renames),
        "tensor_parallel_degree": plan.tp,
    }
    if plan.ep > 1:
        fields["expert_parallel_degree"] = plan.ep
    if plan.cp > 1:  # torchtitan shards over its dp_shard x cp ranks, as the plan's fsdp over dp x cp replicas
        fields["context_parallel_degree"] = plan.cp
    # ddp replicas replicate the weights; fsdp shards them (torchtitan shards per block, not per
    # stage); hsdp shards inside groups and replicates the groups, torchtitan's two degrees both > 1;
    # torchtitan's shard degree leaves out the cp ranks it shards over besides (its dp_shard x cp)
    if plan.cp > 1 and plan.dp_mode == "hsdp" and plan.shard_size % plan.cp:
        raise ExportError(
            f"--to torchtitan: the plan's HSDP shard groups of {plan.shard_size} replicas split context-parallel "
            f"groups of {plan.cp}, but torchtitan shards over whole ones (data_parallel_shard_degree x "
            f"context_parallel_degree); plan with a --dp-shard that {plan.cp} divides"
        )
    shard = plan.shard_size // plan.cp if plan.sharded else plan.shard_size
    fields["data_parallel_shard_degree"] = shard
    fields["data_parallel_replicate_degree"] = plan.dp // shard
    if plan.sharded:
        # block units reshard after every forward ("always"); a stage kept gathered through the
        # pipeline is torchtitan's "never" (its "default" under pipelining)
        fields["fsdp_reshard_after_forward"] = "always" if plan.fsdp_units == "block" else "never"
    return fields


_STRENGTH = {"never": 0, "selective": 1, "full": 2, "stage": 2}


def titan_checkpointing(plan: Plan) -> str:
    """The one activation checkpointing mode torchtitan applies to every block of the model: the
    plan's, or where its stages differ the strongest of them (so every stage fits); a stage
    checkpointed as one region becomes torchtitan's per-block "full"."""
    strongest = max((split_recompute(s.recompute)[0] for s in plan.stages), key=lambda m: _STRENGTH[m])
    return "full" if strongest == "stage" else strongest


def _checkpointing_note(plan: Plan) -> list[str]:
    modes = {s.recompute for s in plan.stages}
    notes = []
    partial = sorted(m for m in modes if split_recompute(m)[1] is not None)
    if partial:
        notes.append(
            f"torchtitan checkpoints all of a stage's blocks or none: this plan's stages recompute only their first "
            f"blocks ({', '.join(partial)}), so every block is set (more recomputation than the plan predicts)"
        )
        modes = {split_recompute(m)[0] for m in modes}
    if len(modes) > 1:
        notes.append(
            f"torchtitan checkpoints every block alike: this plan's stages differ ({', '.join(sorted(modes))}), "
            f"so the strongest, {titan_checkpointing(plan)}, is set (more recomputation than the plan predicts)"
        )
    if "stage" in modes:
        notes.append(
            "torchtitan checkpoints block by block: the stages this plan checkpoints as one region get full "
            "checkpointing of each block (the same recomputation, more kept per microbatch than the plan predicts)"
        )
    return notes


def _expert_ranks(plan: Plan) -> str:
    """The ranks an expert-parallel group spans, in words."""
    if plan.tp == 1:
        return f"{plan.ep} replicas"
    return f"{plan.ep} ranks ({plan.ep_replicas} replica(s) x {plan.tp} tensor-parallel ranks, each expert whole)"


def _notes(plan: Plan) -> list[str]:
    """What the target does differently from ``planner run``, as comment lines."""
    notes = [
        f"{plan.n_stages} stage(s) on {plan.n_ranks} pipeline rank(s), {plan.n_microbatches} microbatch(es) of "
        f"{plan.microbatch_size} sample(s), {plan.dp} {plan.dp_mode} replica(s)"
        + (f" in shard groups of {plan.dp_shard}" if plan.dp_shard else "")
        + (" (of their dp x cp ranks)" if plan.dp_shard and plan.cp > 1 else "")
        + (" sharded block by block" if plan.fsdp_units == "block" else "")
        + f", tensor parallel {plan.tp}"
        + (" with sequence parallelism" if plan.sequence_parallel else "")
        + (f", experts sharded over {_expert_ranks(plan)} (expert parallel {plan.ep})" if plan.ep > 1 else "")
        + (f", each sequence split over {plan.cp} context-parallel ranks ({_cp_how(plan)})" if plan.cp > 1 else ""),
        f"predicted step {plan.prediction.step_time_s * 1e3:.2f} ms on {plan.profile.hardware or plan.profile.device}",
    ]
    if plan.accumulation > 1:
        notes.append(f"each step runs the schedule {plan.accumulation} times (gradient accumulation)")
    recomputing = [s for s in plan.stages if s.recompute != "never"]
    if recomputing:
        notes.append(
            "the plan checkpoints activations per block on stages "
            + ", ".join(f"{s.index} ({s.recompute})" for s in recomputing)
        )
    if plan.ties:
        notes.append("tied weights: " + "; ".join(" = ".join(t.names) for t in plan.ties))
    if plan.cp > 1 and plan.dp_mode == "ddp":
        notes.append(
            "the plan keeps the weights whole on its context-parallel ranks (DDP); torchtitan shards them over "
            "data_parallel_shard_degree x context_parallel_degree ranks (FSDP), Megatron as its optimizer says"
        )
    f8 = plan.profile.float8
    if f8 is not None:
        notes.append(
            f"float8 linear layers ({f8.recipe} scaling, torchao): {f8.converted} of {f8.layers}; "
            f"kept in bf16: {_names(list(f8.kept))}"
        )
    if plan.tp > 1 and not plan.sequence_parallel:
        notes.append(
            "planned without sequence parallelism, which torchtitan always runs with tensor parallelism "
            "(Megatron with --sequence-parallel): plan with --sequence-parallel to predict it"
        )
    if plan.tp > 1 and not plan.loss_parallel:  # (torchtitan and Megatron compute it on the split logits)
        notes.append("planned with the logits gathered whole for the loss: plan with --loss-parallel to predict theirs")
    return notes


def _cp_how(plan: Plan) -> str:
    """How the plan's context-parallel ranks attend, in a note."""
    if plan.cp_attention == "ring":
        return "ring attention: the keys and values passed around the group, torch's alltoall rotation"
    return "keys and values all-gathered"


def _names(names: list[str], most: int = 4) -> str:
    """Names for a comment line: all of a few, else the first ones and how many in all."""
    if not names:
        return "none"
    return ", ".join(names) if len(names) <= most else f"{', '.join(names[:most])}, ... ({len(names)} in all)"


def _torchtitan_python(plan: Plan, renames: Mapping[str, str]) -> str:
    fields = _titan_fields(plan, renames)
    body = ",\n".join(f"    {k}={_py(v)}" for k, v in fields.items())
    batch = _batch_lines(plan)
    mode = titan_checkpointing(plan)
    checkpointing = {"never": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[mode]
    float8 = _titan_float8(plan, renames)
    lines = [
        f"{HEADER} --to torchtitan (torchtitan >= 0.3, whose configs are Python)",
        *(f"# {n}" for n in _notes(plan) + _checkpointing_note(plan)),
        "# Give these fields to your trainer config's ParallelismConfig, the batch sizes to its",
        "# TrainingConfig and the checkpointing to its activation_checkpoint. The model's forward must",
        "# skip the modules a stage does not hold (None), as torchtitan's own models do.",
        "from torchtitan.config import ParallelismConfig",
        *(["from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC"] if mode != "never" else []),
        "",
        f"parallelism = ParallelismConfig(\n{body},\n)",
        f"local_batch_size = {batch['local_batch_size']}  # TrainingConfig.local_batch_size",
        f"global_batch_size = {batch['global_batch_size']}  # TrainingConfig.global_batch_size",
        f"activation_checkpoint = {checkpointing}  # Trainer.Config.activation_checkpoint",
        *float8,
    ]
    return "\n".join(lines) + "\n"


def _titan_float8(plan: Plan, renames: Mapping[str, str]) -> list[str]:
    """A float8 plan's converter for torchtitan >= 0.3 (Python lines; none without float8).

    Raises:
        ExportError: a tensorwise plan: torchtitan 0.3's float8 converter has the rowwise recipes only.
    """
    f8 = plan.profile.float8
    if f8 is None:
        return []
    if f8.recipe != "rowwise":
        raise ExportError(
            "--to torchtitan: torchtitan 0.3's Float8LinearConverter runs the rowwise recipes only, and this plan "
            "is tensorwise (--dtype fp8); re-plan with --dtype fp8-rowwise, or export --to torchtitan-toml "
            "(torchtitan <= 0.2.2, whose [float8] section runs tensorwise)"
        )
    kept = [renamed(name, renames) for name in f8.kept]
    return [
        "# the linear layers in float8 (torchao's Float8Linear), those the plan keeps in bf16 filtered out:",
        "# give this converter to your model spec's converters",
        "from torchtitan.components.quantization.float8 import Float8LinearConverter",
        f'float8 = Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns={json.dumps(kept)})',
    ]


def _torchtitan_toml(plan: Plan, renames: Mapping[str, str]) -> str:
    fields = _titan_fields(plan, renames)
    if plan.cp > 1:  # torch's context_parallel: "alltoall" passes the key and value shards around, a ring
        fields["context_parallel_rotate_method"] = "alltoall" if plan.cp_attention == "ring" else "allgather"
    batch = _batch_lines(plan)
    mode = titan_checkpointing(plan)
    mode = "none" if mode == "never" else mode  # torchtitan's name
    lines = [
        f"{HEADER} --to torchtitan-toml (torchtitan <= 0.2.2: --job.config_file)",
        *(f"# {n}" for n in _notes(plan) + _checkpointing_note(plan)),
        "[parallelism]",
        *(f"{k} = {json.dumps(v)}" for k, v in fields.items()),
        "",
        "[training]",
        *(f"{k} = {v}" for k, v in batch.items()),
        "",
        "[activation_checkpoint]",
        f'mode = "{mode}"',
        *(['selective_ac_option = "op"  # the policy planner run uses'] if mode == "selective" else []),
        *_titan_toml_float8(plan, renames),
    ]
    return "\n".join(lines) + "\n"


def _titan_toml_float8(plan: Plan, renames: Mapping[str, str]) -> list[str]:
    """A float8 plan's sections for torchtitan <= 0.2.2 (none without float8): its float8 converter with the
    plan's recipe, the layers it keeps in bf16 and, under FSDP with tensorwise scaling, the float8 all-gather."""
    f8 = plan.profile.float8
    if f8 is None:
        return []
    gather = json.dumps(fsdp_float8_gather(f8.recipe, plan.dp_mode) and plan.sharded)
    return [
        "",
        "[model]",
        'converters = ["float8"]',
        "",
        "[float8]",
        f'recipe_name = "{f8.recipe}"',
        f"filter_fqns = {json.dumps([renamed(name, renames) for name in f8.kept])}",
        f"enable_fsdp_float8_all_gather = {gather}",
        f"precompute_float8_dynamic_scale_for_fsdp = {gather}",
    ]


def _py(value: object) -> str:
    """A field value as Python source (lists of names one stage per line)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "[\n" + "".join(f"        {json.dumps(v)},\n" for v in value) + "    ]"
    return json.dumps(value)


def _megatron_cp(plan: Plan) -> str:
    """Megatron-Core's ``--cp-comm-type`` for the plan's context-parallel attention."""
    return "p2p" if plan.cp_attention == "ring" else "allgather"


def megatron_layout(plan: Plan) -> str:
    """``--pipeline-model-parallel-layout``: per stage in global order (Megatron's vpp x pp order),
    ``E`` for the embedding (the blocks before the first layer), ``t`` per layer, ``L`` for the
    final norm, output layer and loss (the blocks after the last layer); ``|`` between stages.

    Raises:
        ExportError: a V-shaped placement, a block between layers that is no layer, or the blocks
            before the first (after the last) layer split over stages.
    """
    if placement(plan.schedule) == "v":
        raise ExportError(
            f"Megatron places stage s on pipeline rank s mod {plan.n_ranks}; this {plan.schedule} plan's V shape "
            "is not expressible: re-plan with --schedule interleaved-1f1b (or 1f1b) for Megatron"
        )
    kinds = _megatron_kinds(plan)
    out = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        tokens = [k for k in kinds[s.start : s.end] if k is not None]
        out.append(_compress("".join(tokens)))
    return "|".join(out)


def _megatron_kinds(plan: Plan) -> list[str | None]:
    """Each block's Megatron token: E on the first block of the embedding group, L on the last of
    the head group, t per layer, None for the rest of a group (it travels with its token).

    Raises:
        ExportError: as ``megatron_layout``.
    """
    layers = [k for k, b in enumerate(plan.blocks) if b.is_layer]
    if not layers:
        raise ExportError(
            "the plan's model has no repeated layers (blocks marked as layers); Megatron counts decoder layers"
        )
    first, last = layers[0], layers[-1]
    stray = next((b.name for b in plan.blocks[first : last + 1] if not b.is_layer), None)
    if stray is not None:
        raise ExportError(
            f"block {stray!r} sits between the transformer layers; Megatron's layout has only the embedding (E), "
            "decoder layers (t) and the loss (L)"
        )
    stage_of = {k: s.index for s in plan.stages for k in range(s.start, s.end)}
    for group, what in ((range(0, first), "embedding (E)"), (range(last + 1, len(plan.blocks)), "loss (L)")):
        stages = sorted({stage_of[k] for k in group})
        if len(stages) > 1:
            names = ", ".join(plan.blocks[k].name for k in group)
            raise ExportError(
                f"blocks {names} are Megatron's {what}, one unit, but the plan puts them on stages {stages}: "
                "re-plan so they share a stage (e.g. planner plan ... --method given with a split that keeps them together)"
            )
    kinds: list[str | None] = [None] * len(plan.blocks)
    kinds[0] = "E"
    for k in layers:
        kinds[k] = "t"
    kinds[-1] = "L"
    if first == 0:  # no embedding block: the layer's stage holds E too
        kinds[0] = "Et"
    if last == len(plan.blocks) - 1:
        kinds[-1] = "tL"
    return kinds


def _compress(tokens: str) -> str:
    """Runs of ``t`` written ``t*N`` (Megatron's parser unrolls them)."""
    return re.sub(r"t{3,}", lambda m: f"t*{len(m.group(0))}", tokens)


def megatron_layer_counts(plan: Plan) -> list[int]:
    """Decoder layers per stage, in global stage order."""
    return [
        sum(1 for b in plan.blocks[s.start : s.end] if b.is_layer) for s in sorted(plan.stages, key=lambda s: s.index)
    ]


def _megatron_uneven_flags(plan: Plan) -> tuple[list[str], str | None]:
    """``--decoder-first/last-pipeline-num-layers`` for the split, where they express it (one stage
    per rank, every middle stage the same layer count); else why not."""
    counts = megatron_layer_counts(plan)
    if plan.stages_per_rank > 1:
        return [], "with virtual stages only the layout string gives each stage its layers"
    if len(counts) < 2:
        return [], "one stage needs no split flags"
    middle = set(counts[1:-1])
    if len(middle) > 1:
        return [], f"the middle stages hold {', '.join(map(str, counts[1:-1]))} layers, not one count"
    return [
        f"--decoder-first-pipeline-num-layers {counts[0]}",
        f"--decoder-last-pipeline-num-layers {counts[-1]}",
    ], None


def megatron_recompute(plan: Plan) -> tuple[list[str], list[str]]:
    """Megatron's activation checkpointing arguments for the plan, and what they do differently.

    Megatron applies one setting to every pipeline stage (each model chunk): full recomputation of
    its first N decoder layers (``--recompute-method block --recompute-num-layers N``, which the
    plan's "full:k" is), or selective recomputation of every layer's attention core. N is the most
    layers any stage of the plan recomputes, so every stage fits.

    Returns:
        The arguments (none when no stage recomputes) and notes for the comment lines.
    """
    values = [(s, *recomputed_prefix(plan.blocks[s.start : s.end], s.recompute)) for s in plan.stages]
    # decoder layers each stage recomputes in full (a selective stage's count as none: Megatron's full is more)
    layers = [
        sum(b.is_layer for b in plan.blocks[s.start : s.start + upto]) if mode in ("full", "stage") else 0
        for s, mode, upto in values
    ]
    modes = {mode for _, mode, _ in values}
    if modes <= {"never"}:
        return [], []
    if modes <= {"never", "selective"}:
        notes = [
            "Megatron's selective recomputation (--recompute-granularity selective) re-runs each layer's attention "
            "core only, on every layer; the plan's selective keeps matmul and attention outputs and recomputes the "
            "rest (torchtitan's op policy): Megatron keeps more than the plan predicts"
        ]
        return ["--recompute-granularity selective"], notes
    most = max(layers)
    if most == 0:
        return [], ["the plan recomputes only blocks that are no decoder layers, which Megatron does not checkpoint"]
    args = ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {most}"]
    counts = megatron_layer_counts(plan)
    fewer = [s.index for (s, _, _), n in zip(values, layers, strict=True) if n < min(most, counts[s.index])]
    notes = [
        f"Megatron recomputes the first {most} decoder layers of every stage in full (the most any stage of the plan does)"
    ]
    if fewer:
        notes.append(
            f"stage(s) {', '.join(map(str, fewer))} recompute fewer (or selectively) in the plan: more recomputation "
            "than the plan predicts"
        )
    if "stage" in modes:
        notes.append("the stages the plan checkpoints as one region are checkpointed layer by layer (more kept)")
    return args, notes


def _megatron_fp8(plan: Plan) -> list[str]:
    """A float8 plan's Transformer Engine arguments: e4m3 forward, e5m2 gradients ("hybrid", as torchao's
    recipes cast them); tensorwise is TE's "tensorwise" (current scaling); TE has no per-row recipe, and
    its 1 x 128 blocks ("blockwise") are the nearest to rowwise."""
    f8 = plan.profile.float8
    if f8 is None:
        return []
    return ["--fp8-format hybrid", f"--fp8-recipe {'tensorwise' if f8.recipe == 'tensorwise' else 'blockwise'}"]


def _megatron(plan: Plan, _renames: Mapping[str, str]) -> str:
    layout = megatron_layout(plan)
    counts = megatron_layer_counts(plan)
    recompute, recompute_notes = megatron_recompute(plan)
    common = [
        f"--pipeline-model-parallel-size {plan.n_ranks}",
        f"--tensor-model-parallel-size {plan.tp}",
        *(["--sequence-parallel"] if plan.sequence_parallel else []),
        *([f"--expert-model-parallel-size {plan.ep}"] if plan.ep > 1 else []),
        # the expert group spans the tensor-parallel ranks, each expert whole (Megatron's default is tp)
        *(["--expert-tensor-parallel-size 1"] if plan.ep > 1 and plan.tp > 1 else []),
        # the ring is Megatron-Core's p2p (its default), the gather its allgather
        *([f"--context-parallel-size {plan.cp}", f"--cp-comm-type {_megatron_cp(plan)}"] if plan.cp > 1 else []),
        *_megatron_fp8(plan),
        f"--num-layers {sum(counts)}",
        f"--micro-batch-size {plan.microbatch_size}",
        f"--global-batch-size {plan.batch_size}",
    ]
    flags, why_not = _megatron_uneven_flags(plan)
    schedule = "interleaved 1F1B" if plan.stages_per_rank > 1 else "1F1B"
    lines = [
        f"{HEADER} --to megatron (pretrain_gpt.py arguments)",
        *(f"# {n}" for n in _notes(plan)),
        f"# Megatron runs its own {schedule} schedule; the planned one is {plan.schedule}.",
        f"# decoder layers per stage: {counts}",
        *(f"# {n}" for n in recompute_notes),
        "MEGATRON_PIPELINE_ARGS=(",
        *(f"    {a}" for a in common),
        f'    --pipeline-model-parallel-layout "{layout}"',
        *(f"    {a}" for a in recompute),
        ")",
    ]
    if flags:
        lines += ["# or, equivalently, without a layout:", "# " + " ".join(common[:1] + flags)]
    else:
        lines.append(f"# not expressible with --decoder-first/last-pipeline-num-layers: {why_not}")
    return "\n".join(lines) + "\n"


def deepspeed_parts(plan: Plan) -> list[int]:
    """DeepSpeed's ``parts``: the first block of every stage, then the block count (its layers
    list holds the plan's blocks in order).

    Raises:
        ExportError: several stages per rank (DeepSpeed runs one stage per rank).
    """
    if plan.stages_per_rank > 1:
        raise ExportError(
            f"DeepSpeed's PipelineModule runs one stage per rank; this {plan.schedule} plan runs "
            f"{plan.stages_per_rank}: re-plan with --schedule 1f1b (or gpipe) for DeepSpeed"
        )
    return [s.start for s in sorted(plan.stages, key=lambda s: s.index)] + [len(plan.blocks)]


def _deepspeed(plan: Plan, renames: Mapping[str, str]) -> str:
    if plan.cp > 1:
        raise ExportError(
            f"DeepSpeed's PipelineModule splits no sequence over ranks; this plan splits each over {plan.cp} "
            "context-parallel ranks: export --to torchtitan or --to megatron, or re-plan with --cp 1"
        )
    parts = deepspeed_parts(plan)
    names = [renamed(b.name, renames) for b in plan.blocks]
    micro_per_step = plan.n_microbatches * plan.accumulation
    config = {
        "train_batch_size": plan.batch_size,
        "train_micro_batch_size_per_gpu": plan.microbatch_size,
        "gradient_accumulation_steps": micro_per_step,
    }
    lines = [
        f"{HEADER} --to deepspeed",
        *(f"# {n}" for n in _notes(plan)),
        "# Build PlannedPipelineModule as DeepSpeed's PipelineModule, with one entry of `layers` per block of",
        "# the plan, in this order (DeepSpeed has no field for explicit parts, so the subclass sets them):",
        *(f"#   {k:3d}  {n}" for k, n in enumerate(names)),
        f"# DeepSpeed runs its own 1F1B-like schedule; the planned one is {plan.schedule}.",
        *(
            [
                "# float8: convert the layers with torchao's convert_to_float8_training before building the module,",
                "# its module_filter_fn leaving out the layers the plan keeps in bf16 (above)",
            ]
            if plan.profile.float8 is not None
            else []
        ),
        "from deepspeed.pipe import PipelineModule",
        "",
        f"PARTS = {parts}",
        f"DS_CONFIG = {json.dumps(config)}  # merge into your DeepSpeed config",
        "",
        "",
        "class PlannedPipelineModule(PipelineModule):",
        '    """PipelineModule whose stages are the plan\'s (parts from planner export)."""',
        "",
        '    def _partition_layers(self, method="uniform"):',
        "        if len(self._layer_specs) != PARTS[-1] or self.num_stages != len(PARTS) - 1:",
        "            raise ValueError(",
        '                f"the plan splits {PARTS[-1]} layers over {len(PARTS) - 1} stages; this PipelineModule has "',
        '                f"{len(self._layer_specs)} layers and {self.num_stages} stages"',
        "            )",
        "        self.parts = list(PARTS)",
        "        stage_id = self._topo.get_coord(self.global_rank).pipe",
        "        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])",
    ]
    return "\n".join(lines) + "\n"


def csv_rows(plan: Plan) -> list[list[str]]:
    """Every pipeline rank's compute actions of one pass of the schedule, as torch writes them
    (``2F0``: stage 2's forward of microbatch 0; ``B`` full backward, ``I`` / ``W`` its input and
    weight halves), one row per rank."""
    orders = action_order(plan.schedule, plan.n_ranks, plan.n_microbatches, plan.stages_per_rank)
    return [[f"{a.stage}{a.kind}{a.microbatch}" for a in order] for order in orders]


def _csv(plan: Plan, _renames: Mapping[str, str]) -> str:
    return csv_text(plan)


def csv_text(plan: Plan) -> str:
    """``csv_rows`` as the CSV text ``_PipelineScheduleRuntime._load_csv`` reads."""
    return "".join(",".join(row) + "\n" for row in csv_rows(plan))
