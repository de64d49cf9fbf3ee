"""Balance report: the tables ``planner plan`` and ``planner report`` print.

Pure module (tabulate, no torch). Everything shown is read from the plan; nothing is recomputed,
except the link a data-parallel group reduces over (``planner.core.levers.data_parallel``). Tables are
per pipeline (one replica's); a plan of several replicas adds a layout line.
"""

from __future__ import annotations

from tabulate import tabulate

from planner.core.layout.robust import chosen_row
from planner.core.levers.data_parallel import dp_group_links
from planner.core.levers.hsdp import hsdp_links
from planner.core.levers.recompute import recomputed_prefix
from planner.core.step.predict import plan_links, slots_of
from planner.report.robustness import HEADER, has_column, robust_line, slowed_cell, what_if
from planner.report.throughput import throughput_line
from planner.schema.costs import GLOO_CPU_LINK
from planner.schema.plan import Plan, Tie

METHOD_TITLES = {
    "optimal": "planner (searched)",
    "uniform": "uniform layers (torchtitan/Megatron)",
    "params": "parameter-balanced (DeepSpeed)",
    "given": "your split (--compare)",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def _over(need: int, limit: int) -> str:
    """The fits column of a layout over the limit: how many times the limit it needs (a hand-edited
    plan may hold a 0-byte limit, which has no multiple)."""
    return f"NO: needs {need / limit:.2f}x the limit" if limit > 0 else "NO: the limit is 0 bytes"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _count_of(n: int | None, noun: str) -> str:
    """``n`` and the noun, plural unless one: "1 core", "2 cores"."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def stage_table(plan: Plan) -> str:
    """One row per stage: its blocks, parameters, times, activations, memory, share of the bottleneck.

    "act MB/mb" is what the stage saves per microbatch under its recompute mode (``kept_bytes``; a plan
    written before that field: all its blocks' saved activations). "hidden ms/step" and "exposed
    ms/step" are the stage's communication over a step: what ran beside its compute, and what its
    rank waited for (its pipeline messages and the data-parallel collectives it does not hide;
    ``planner.core.levers.overlap``); absent for a plan written before those fields.

    Args:
        plan: the plan.

    Returns:
        The table as text.
    """
    bottleneck = plan.prediction.bottleneck_s
    rows = []
    several = plan.stages_per_rank > 1
    overlap = any(s.comm_hidden_s is not None for s in plan.stages)
    for s in plan.stages:
        blocks = s.first_block if s.end - s.start == 1 else f"{s.first_block} .. {s.last_block}"
        if s.recompute != "never":
            mode, upto = recomputed_prefix(plan.blocks[s.start : s.end], s.recompute)
            some = f", first {upto} blocks" if upto < s.end - s.start else ""
            blocks += f" [{mode} recompute{some}]"
        rows.append(
            [
                f"{s.index} (rank {s.rank})" if several else str(s.index),
                f"{blocks} ({s.end - s.start})",
                _count(s.params),
                _ms(s.fwd_s),
                _ms(s.bwd_s),
                _ms(s.comm_s),
                _ms(s.time_s),
                _mb(s.activation_bytes if s.kept_bytes is None else s.kept_bytes),
                s.in_flight,
                _mb(s.memory_bytes),
                f"{100 * s.time_s / bottleneck:.0f}%" if bottleneck > 0 else "-",
            ]
            + ([_ms(s.comm_hidden_s or 0.0), _ms(s.comm_exposed_s or 0.0)] if overlap else [])
        )
    headers = [
        "stage",
        "blocks (n)",
        "params",
        "fwd ms",
        "bwd ms",
        "comm ms",
        "total ms",
        "act MB/mb",
        "in flight",
        "memory MB",
        "of slowest",
    ] + (["hidden ms/step", "exposed ms/step"] if overlap else [])
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True, colalign=("right", "left"))


def summary_table(plan: Plan) -> str:
    """The plan's predicted figures beside the baselines' on the same costs.

    Args:
        plan: the plan.

    Returns:
        The table as text: one row per partition method.
    """
    rows = []
    chosen = plan.prediction
    limit = plan.memory_limit_bytes
    entries = [(plan.method, chosen)] + [(k, v) for k, v in plan.baselines.items() if k != plan.method]
    for method, pred in entries:
        marker = " *" if method == plan.method else ""
        fits = limit is None or pred.max_memory_bytes <= limit
        rows.append(
            [
                METHOD_TITLES.get(method, method) + marker,
                _split_text(pred.starts, len(plan.blocks)),
                _ms(pred.bottleneck_s),
                _ms(pred.step_time_s),
                f"{100 * pred.bubble_fraction:.1f}%",
                f"{pred.imbalance:.3f}",
                _mb(pred.max_memory_bytes),
                "yes" if fits or limit is None else _over(pred.max_memory_bytes, limit),
                f"{pred.step_time_s / chosen.step_time_s:.3f}x" if fits else "(cannot run)",
            ]
        )
    headers = [
        "partition",
        "blocks per stage",
        "slowest ms/mb",
        "step ms",
        "bubble",
        "imbalance",
        "max mem MB",
        "fits" if limit is None else f"fits {_mb(limit)} MB",
        "step vs plan",
    ]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def search_table(plan: Plan) -> str:
    """The best candidates of the joint search (schedule, microbatches, stages per rank, split),
    with a column of data-parallel replicas when the search tried several counts, of the
    tensor-parallel degree ("8 sp": with sequence parallelism) when it tried several or chose one, and
    of the context-parallel degree ("4 ring": by ring attention) when any row splits the sequence.

    Args:
        plan: the plan.

    Returns:
        The table as text (empty when no search ran).
    """
    if not plan.search:
        return ""
    with_dp = len({c.dp for c in plan.search}) > 1
    with_tp = len({c.tp for c in plan.search}) > 1 or plan.tp > 1
    with_k = any(c.accumulation > 1 for c in plan.search) or plan.accumulation > 1
    with_cp = any(c.cp > 1 for c in plan.search) or plan.cp > 1
    slowed = has_column(plan)  # the step on slower hardware (planner.report.robustness)
    rows = []
    chosen_index = chosen_row(plan)
    for i, c in enumerate(plan.search):
        chosen = i == chosen_index
        row: list[object] = [c.schedule + (" *" if chosen else "")]
        if with_tp:  # "8 sp": split over 8 ranks with sequence parallelism
            row += [f"{c.tp} sp" if c.sequence_parallel else c.tp, len(c.starts) // c.stages_per_rank]
        if with_dp:
            units = " per block" if c.fsdp_units == "block" else ""
            mode = f"hsdp in groups of {c.dp_shard}" if c.dp_mode == "hsdp" else c.dp_mode
            row.append(f"{c.dp} ({mode}{units})" if c.dp > 1 else "1")
        if with_cp:  # "4 ring": each sequence over 4 ranks, by ring attention
            row.append(f"{c.cp} ring" if c.cp > 1 and c.cp_attention == "ring" else c.cp)
        row += [c.accumulation] if with_k else []
        row += [
            c.n_microbatches,
            c.stages_per_rank,
            _split_text(c.starts, len(plan.blocks)),
            _ms(c.step_time_s),
            f"{100 * c.bubble_fraction:.1f}%",
            _mb(c.max_memory_bytes),
            "yes" if c.fits else "no",
        ]
        row += [slowed_cell(c)] if slowed else []
        rows.append(row)
    headers = [
        "schedule",
        *(["tp", "pp"] if with_tp else []),
        *(["dp"] if with_dp else []),
        *(["cp"] if with_cp else []),
        *(["passes"] if with_k else []),
        "m",
        "stages/rank",
        "blocks per stage",
        "step ms",
    ]
    headers += ["bubble", "max mem MB", "fits"] + ([HEADER] if slowed else [])
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _split_text(starts: tuple[int, ...], n_blocks: int) -> str:
    """Blocks per stage, e.g. "4+3"."""
    ends = list(starts[1:]) + [n_blocks]
    return "+".join(str(b - a) for a, b in zip(starts, ends))


def tie_line(plan: Plan, tie: Tie) -> str:
    """One line on a tied parameter: its names, size and the stages holding a copy.

    Args:
        plan: the plan.
        tie: one of ``plan.ties``.

    Returns:
        e.g. ``  tied: transformer.wte.weight = lm_head.weight (32.77k params), a copy on stages 0 and 1
        (ranks 0, 1: gradients summed)``.
    """
    return f"  tied: {' = '.join(tie.names)} ({_count(tie.params)} params), {_held(plan, tie)}"


def tie_lines(plan: Plan) -> list[str]:
    """The plan's ties, a line each, except that the parameters of one module that the same blocks
    read share a line (ALBERT's one layer, applied by every block: 16 tensors).

    Args:
        plan: the plan.

    Returns:
        e.g. ``  tied: 16 parameters of albert.encoder.albert_layer_groups.0 (45.7k params), a copy on
        stages 0 and 1 (ranks 0, 1: gradients summed)``.
    """
    groups: dict[tuple[str, ...], list[Tie]] = {}
    for tie in plan.ties:
        groups.setdefault(tie.blocks, []).append(tie)
    lines = []
    for ties in groups.values():
        if len(ties) == 1:
            lines.append(tie_line(plan, ties[0]))
            continue
        parts = [t.names[0].split(".")[:-1] for t in ties]  # the modules holding them
        common = next((i for i, col in enumerate(zip(*parts)) if len(set(col)) > 1), min(map(len, parts)))
        owner = ".".join(parts[0][:common])
        label = f"{len(ties)} parameters of {owner}" if owner else f"{len(ties)} parameters"
        lines.append(f"  tied: {label} ({_count(sum(t.params for t in ties))} params), {_held(plan, ties[0])}")
    return lines


def _held(plan: Plan, tie: Tie) -> str:
    """Where a tie's copies are and how they stay equal."""
    stages = plan.tie_stages(tie)
    ranks = sorted({plan.stages[i].rank for i in stages})
    where = " and ".join(", ".join(str(i) for i in stages).rsplit(", ", 1))
    if len(ranks) > 1:
        sync = f"ranks {', '.join(map(str, ranks))}: gradients summed"
    else:
        sync = f"one parameter on rank {ranks[0]}"
    return f"a copy on stages {where} ({sync})" if len(stages) > 1 else f"held by stage {stages[0]}"


def _ranks_text(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _placement(plan: Plan) -> list[str]:
    """Which global ranks each replica holds (replicas outermost), or each pipeline rank's replicas
    (pipeline-outermost, ``Plan.pp_outer``), the first two and the last where there are more than 4."""
    p, dp, tp = plan.n_ranks, plan.replicas, plan.tp
    count = p if plan.pp_outer else dp
    shown = list(range(count)) if count <= 4 else [0, 1, count - 1]
    if plan.pp_outer:
        out = [f"pipeline rank {r}'s replicas = {_ranks_text(r * dp * tp, (r + 1) * dp * tp - 1)}" for r in shown]
    else:
        out = [
            f"replica {k} = {_ranks_text(plan.global_rank(k, 0), plan.global_rank(k, p - 1, tp - 1))}" for k in shown
        ]
    if count > 4:
        out.insert(2, "...")
    return out


def layout_line(plan: Plan) -> str:
    """One line on the (dp, pp, tp) mesh of a plan with data-parallel replicas or tensor parallelism:
    which global ranks each replica holds, how each pipeline rank is split and how gradients are reduced.

    Args:
        plan: the plan.

    Returns:
        e.g. ``layout: 2 replicas x 2 stages (dp x pp) on 4 ranks; replica 0 = ranks 0-1, replica 1
        = ranks 2-3; gradients reduced by DDP (all-reduce 0.84 ms/step)``; with tensor parallelism
        ``layout: 2 replicas x 2 stages x tp 2 (dp x pp x tp) on 8 ranks; ...; each pipeline rank split
        over 2 consecutive ranks of one node by the model's tp plan (4 colwise, 3 rowwise patterns); ...``;
        empty with one replica and tp 1.
    """
    if plan.replicas == 1 and plan.tp == 1:
        return ""
    if plan.replicas == 1:
        return (
            f"layout: {plan.n_ranks} pipeline rank{'s' if plan.n_ranks > 1 else ''} x tp {plan.tp} (pp x tp) on "
            f"{plan.world_size} ranks; {tp_text(plan)}"
        )
    p = plan.n_ranks
    if plan.stages_per_rank == 1:
        pipeline = f"{p} stage{'s' if p > 1 else ''}"
    else:
        pipeline = f"{p} rank{'s' if p > 1 else ''} of {plan.stages_per_rank} stages"
    replicas = _placement(plan)
    reduce_ms = f"{plan.prediction.dp_reduce_s * 1e3:.2f} ms/step"
    name, ways = plan.dp_mode.upper(), plan.shard_size
    groups = (
        f" inside {plan.replicas // ways} groups of {ways} consecutive replicas, each shard's gradients then all-reduced "
        "over the groups"
        if plan.dp_mode == "hsdp"
        else ""
    )
    if plan.sharded and plan.fsdp_units == "block":
        how = (
            f"{name} block by block (parameters, gradients and optimizer state sharded {ways} ways{groups}; each "
            f"block gathered for every microbatch's forward and backward, its gradients reduce-scattered then: "
            f"{reduce_ms} not hidden by compute, or lost to the slowdown of the compute beside it)"
        )
    elif plan.sharded and slots_of(plan.profile) is None:
        how = (
            f"{name} (parameters, gradients and optimizer state sharded {ways} ways{groups}; each stage gathered "
            f"when a pass starts and reduce-scattered{' + all-reduced' if groups else ''} after its last backward: "
            f"{reduce_ms} not hidden by the pipeline, or lost to the slowdown of the compute beside it)"
        )
    elif plan.sharded:
        how = (
            f"{name} (parameters, gradients and optimizer state sharded {ways} ways{groups}; all-gather + "
            f"reduce-scatter{' + all-reduce' if groups else ''} {reduce_ms})"
        )
    else:
        how = f"DDP (all-reduce {reduce_ms})"
    if plan.dp_mode == "hsdp":
        inner, copies = hsdp_links(plan_links(plan), p, plan.dp, ways)
        links = sorted({x.name for x in inner + copies})
    else:
        links = sorted({x.name for x in dp_group_links(plan_links(plan), p, plan.replicas)})
    over = f" over {', '.join(links)}" if links and links != [plan.link.name] else ""
    if plan.tp == 1:
        order = (
            "(dp x pp, pipeline-outermost as Megatron-LM and torchtitan order ranks)" if plan.pp_outer else "(dp x pp)"
        )
        return (
            f"layout: {plan.replicas} replicas x {pipeline} {order} on {plan.world_size} ranks; {', '.join(replicas)}; "
            f"gradients reduced by {how}{over}"
        )
    return (
        f"layout: {plan.replicas} replicas x {pipeline} x tp {plan.tp} (dp x pp x tp) on {plan.world_size} ranks; "
        f"{', '.join(replicas)}; {tp_text(plan)}; gradients reduced by {how}{over}"
    )


def tp_text(plan: Plan) -> str:
    """How a plan's pipeline ranks are split over tensor-parallel ranks, e.g. "each pipeline rank split over
    8 consecutive ranks of one node by the model's tp plan (3 colwise, 2 rowwise patterns)"."""
    styles = list(plan.tp_plan.values())
    counts = ", ".join(f"{styles.count(style)} {style}" for style in sorted(set(styles)))
    return (
        f"each pipeline rank split over {plan.tp} consecutive ranks of one node by the model's tp plan "
        f"({counts} pattern{'s' if len(styles) > 1 else ''})"
        + (
            ", with sequence parallelism (norms and residuals split along the sequence)"
            if plan.sequence_parallel
            else ""
        )
        + (", the loss on the output head's split logits (loss parallelism)" if plan.loss_parallel else "")
    )


def context_line(plan: Plan) -> str:
    """One line on a context-parallel plan's sequences: how they split, how attention reaches the keys
    and values (``Plan.cp_attention``).

    Args:
        plan: the plan.

    Returns:
        e.g. ``context parallelism: each sequence split into 2 chunks over 2 consecutive replicas (dp 1 x
        cp 2: ...), each rank's queries attending to every position's keys and values, all-gathered over the
        group (reduce-scattered in backward)``; empty with cp 1.
    """
    if plan.cp == 1:
        return ""
    how = (
        "passed around the group's ring a chunk at a time, each step's send overlapped with the attention on the "
        "chunk held (ring attention; in backward the chunks go round again with their gradients)"
        if plan.cp_attention == "ring"
        else "all-gathered over the group (reduce-scattered in backward)"
    )
    return (
        f"context parallelism: each sequence split into {plan.cp} chunks over {plan.cp} consecutive replicas "
        f"(dp {plan.dp} x cp {plan.cp}: every rank holds its stages whole and reads its replica's rows), each rank's "
        f"queries attending to every position's keys and values, {how}"
    )


def float8_line(plan: Plan) -> str:
    """One line on an FP8 plan's linear layers: how many train in float8, which stay in bf16 and why.

    Args:
        plan: the plan (``profile.float8``).

    Returns:
        e.g. ``float8 (torchao, tensorwise scaling): 224 of 225 linear layers compute their GEMMs in float8;
        in bf16: output (outside the repeated layers ...)``; empty without float8.
    """
    f8 = plan.profile.float8
    if f8 is None:
        return ""
    line = (
        f"float8 (torchao, {f8.recipe} scaling): {f8.converted} of {f8.layers} linear layers compute "
        "their GEMMs in float8, everything else in bf16"
    )
    by_reason: dict[str, list[str]] = {}
    for name, why in f8.kept.items():
        by_reason.setdefault(why, []).append(name)
    kept = [
        (", ".join(names) if len(names) <= 3 else f"{len(names)} layers: {names[0]} ... {names[-1]}") + f" ({why})"
        for why, names in by_reason.items()
    ]
    line += "; in bf16: " + "; ".join(kept) if kept else ""
    if f8.bf16_step_s is not None:
        gain = f8.bf16_step_s / plan.prediction.step_time_s
        bf16 = f"the same layout with every layer in bf16 ({_ms(f8.bf16_step_s)} ms a step)"
        if gain > 1:
            line += f"\nfloat8 pays here: {gain:.2f}x as fast as {bf16}"
        else:
            line += f"\nfloat8 does not pay here: {1 / gain:.2f}x as slow as {bf16}"
            line += "" if plan.compile else "; eager, torchao's casts run unfused: plan with --compile"
    return line


def experts_line(plan: Plan) -> str:
    """One line on a mixture-of-experts model's experts, e.g. "experts: 32 mixture-of-experts layers of 8
    experts (model.layers.0.mlp.experts ... model.layers.31.mlp.experts); every rank holds all the experts
    of its stages' layers, tensor parallelism leaves them whole", or how ``ep`` shards them; "" for a
    dense model.

    Args:
        plan: the plan (its ``experts``).

    Returns:
        The line.
    """
    if not plan.experts:
        return ""
    names = list(plan.experts)
    counts = " / ".join(str(c) for c in sorted(set(plan.experts.values())))
    where = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
    n = len(names)
    whole = ", tensor parallelism leaves them whole" if plan.tp > 1 and plan.ep == 1 else ""
    shares = [b.experts for b in plan.blocks if b.experts is not None]
    busiest = max((s.imbalance_at(plan.ep) for s in shares), default=1.0)
    uneven = f" (the busiest rank {busiest:.2f}x the mean rows, charged)" if busiest > 1.0 else ""
    if plan.ep == 1:
        held = "every rank holds all the experts of its stages' layers"
    elif plan.tp == 1:
        held = (
            f"each layer's experts sharded over {plan.ep} consecutive replicas (ep {plan.ep}), every token sent to "
            f"its experts' rank and back by all-to-all{uneven}"
        )
    else:
        held = (
            f"each layer's experts sharded over {plan.ep} consecutive ranks (ep {plan.ep}: {plan.ep_replicas} "
            f"replica(s) x {plan.tp} tensor-parallel ranks, each expert whole), each rank sending its 1/{plan.tp} of "
            f"its replica's tokens to their experts' ranks and back by all-to-all{uneven}, then gathering the rest"
        )
    return f"experts: {n} mixture-of-experts layer{'s' if n > 1 else ''} of {counts} experts ({where}); {held}{whole}"


def small_stages_line(plan: Plan) -> str | None:
    """A caution for stages that compute less per action than one message's fixed cost on the
    uncalibrated CPU link, or None.

    ``GLOO_CPU_LINK``'s latency was fitted to runs of stages computing milliseconds per action; it
    carries costs that shrink with the stage (cold starts, the runtime's work around an action), so
    smaller stages are predicted too slow: the encoder LM at 4 ranks (about 1 ms per action) by about
    10 %, the repository's toy model (0.2 ms) by 70-300 % (docs/prediction_accuracy.md). A calibrated
    plan's link is fitted to its own run and gets no caution.

    Args:
        plan: the plan.

    Returns:
        The line, or None when the stages are large enough or the link is not the CPU default.
    """
    if plan.link.name != GLOO_CPU_LINK.name or plan.n_stages < 2:
        return None
    per_action = sum(s.fwd_s + s.bwd_s for s in plan.stages) / (2 * plan.n_stages)
    if per_action >= plan.link.latency_s:
        return None
    return (
        f"note: the stages compute {_ms(per_action)} ms per forward or backward on average, less than the "
        f"{_ms(plan.link.latency_s)} ms each message is charged; that cost was fitted to CPU runs of stages "
        "computing milliseconds, and steps of smaller stages are predicted too long (about +10 % at 1 ms per "
        "action, 2x and more at 0.2 ms). Run the plan, then re-plan with --calibrate RUN.json to fit it to "
        "this model."
    )


def batch_norm_line(plan: Plan) -> str | None:
    """A caution for a model with batch norm whose batch the plan splits, or None.

    Batch norm normalizes by the statistics of the batch it is given: each microbatch (and each
    replica's share) on its own, so the run trains as the unsplit model on the whole batch only with
    one microbatch and one replica (``planner.capture.contract.batch_norms``; GPipe's caveat).

    Args:
        plan: the plan.

    Returns:
        The line, or None when the model has no batch norm or the plan normalizes the whole batch.
    """
    norms = plan.model.batch_norms
    passes = plan.n_microbatches * plan.accumulation
    split = [f"{passes} microbatches of {plan.microbatch_size}"] if passes > 1 else []
    split += [f"{plan.replicas} replicas"] if plan.replicas > 1 else []
    if not norms or not split:
        return None
    return (
        f"note: {_count_of(len(norms), 'batch-norm layer')} ({norms[0]}{', ...' if len(norms) > 1 else ''}) "
        f"normalize{'s' if len(norms) == 1 else ''} each microbatch by its own statistics: with {' and '.join(split)} this does not train as the "
        f"unsplit model on the batch of {plan.batch_size} (as in GPipe); GroupNorm or LayerNorm normalize each "
        "sample alone, and -m 1 with no replicas keeps the whole batch"
    )


def render(plan: Plan) -> str:
    """The full report: a header, the stage table and the summary table.

    Args:
        plan: the plan.

    Returns:
        The report text.
    """
    m = plan.model
    replicas = f"{plan.dp} replicas x " if plan.dp > 1 else ""
    replicas += f"{plan.accumulation} passes x " if plan.accumulation > 1 else ""
    p = plan.profile
    estimate = ""  # which GPU and attention kernel an estimate is for
    if p.source == "estimated" and p.hardware is not None and p.device == "cuda":
        estimate = f" (costs estimated for {p.hardware}" + (
            f", {p.attention_kernel} attention)" if p.attention_kernel else ")"
        )
    head = (
        f"{m.path} (size {m.size or 'default'}; traced by {m.trace_method}) on {plan.world_size} x "
        f"{p.device}/{p.backend}{estimate}, {p.threads} thread(s) per rank\n"
        f"schedule {plan.schedule}"
        + (f" with {plan.stages_per_rank} stages per rank ({plan.n_stages} stages)" if plan.stages_per_rank > 1 else "")
        + f", batch {plan.batch_size} = {replicas}{plan.n_microbatches} microbatches of "
        f"{plan.microbatch_size}; {len(plan.blocks)} blocks; link {plan.link.name} "
        f"({plan.link.latency_s * 1e3:.2f} ms + bytes / {plan.link.bandwidth_Bps / 1e9:.1f} GB/s)"
    )
    slots = slots_of(plan.profile)
    if slots is not None and slots < plan.world_size and plan.n_ranks > 1:
        head += (
            f"; ranks share {_count_of(plan.profile.cores, 'core')}: compute and {plan.link.cpu_share:.0%} of each message's "
            "time take turns on them"
        )
    inter = plan.inter_node_link
    if inter is not None and plan.gpus_per_node is not None and plan.world_size > plan.gpus_per_node:
        head += (
            f"; {plan.gpus_per_node} GPUs per node: boundaries between nodes use {inter.name} "
            f"({inter.latency_s * 1e3:.3f} ms + bytes / {inter.bandwidth_Bps / 1e9:.1f} GB/s)"
        )
    if plan.replicas > 1 or plan.tp > 1:
        head += "\n" + layout_line(plan)
    if plan.cp > 1:
        head += "\n" + context_line(plan)
    if m.trace_failures:
        head += "\n" + "\n".join(f"  {method} could not trace it: {reason}" for method, reason in m.trace_failures)
    for line in tie_lines(plan):
        head += "\n" + line
    if plan.experts:
        head += "\n" + experts_line(plan)
    if plan.profile.float8 is not None:
        head += "\n" + float8_line(plan)
    reduction = (
        f" ({_ms(plan.prediction.dp_reduce_s)} ms of it reducing gradients over {plan.replicas} replicas)"
        if plan.replicas > 1
        else ""
    )
    summary = (
        f"predicted step {_ms(plan.prediction.step_time_s)} ms{reduction}, bubble "
        f"{100 * plan.prediction.bubble_fraction:.1f}%, imbalance {plan.prediction.imbalance:.3f} (slowest / mean "
        f"stage)\n{throughput_line(plan)}"
    )
    if plan.choice:
        summary += f"\nchosen: {plan.choice}"
        robust = robust_line(plan)  # where slower hardware changes the winner (planner.report.robustness)
        if robust:
            summary += "\n" + robust
    if plan.calibration:
        summary += "\ncalibrated: " + "\n  ".join(plan.calibration)
    for caution in (small_stages_line(plan), batch_norm_line(plan)):
        if caution:
            summary += "\n" + caution
    parts = [head, stage_table(plan), summary_table(plan)]
    search = search_table(plan)
    if search:
        slowed = f"; {HEADER}: the step with {what_if()}" if has_column(plan) else ""
        parts.append(f"joint search (best candidates; * = the plan{slowed}):\n" + search)
    return "\n\n".join([*parts, summary])
