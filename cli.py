"""The ``planner`` command: parse options, call the library, print. Nothing else lives here.

planner plan MODEL.py --gpus N     trace, profile, solve; write plan.json; print balance tables
planner run PLAN.json              launch one process per stage and train with the planned schedule
planner report PLAN.json           print the balance tables of a saved plan
planner export PLAN.json --to T    the plan in torchtitan's, Megatron's, DeepSpeed's or torch's CSV terms
"""

from __future__ import annotations

import atexit
import gc
import sys
from contextlib import nullcontext
from typing import Any

import click

from cli_options import training_options
from cli_support import COUNT_OR_AUTO, REPLICAS_OR_AUTO, debug_option, split_option, user_errors
from planner.core.levers.hardware import GPUS
from planner.errors import PlannerError
from planner.report.export import EXPORT_FORMATS
from planner.schema.costs import OPTIMIZERS
from planner.schema.outputs import check_output
from planner.schema.plan import Plan
from planner.schema.request import DP_MODES, DTYPES, METHODS, RECOMPUTE, SCHEDULES, TORCH_NAMES

# Set by ``console`` (the ``planner`` script): the process ends with the command, so ``plan`` can
# leave what it built to the exit instead of collecting it (planner.core.heap.kept_until_exit). A
# caller of ``main`` in its own process (a test's CliRunner, a script) keeps collection as usual.
_ENDS_WITH_COMMAND = False


def console() -> None:
    """The ``planner`` console script: ``main`` in a process that ends when the command does."""
    global _ENDS_WITH_COMMAND
    _ENDS_WITH_COMMAND = True
    main()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback of an error instead of one line.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Plan and run pipeline-parallel training for a PyTorch model file.

    A model file is plain Python defining build_model(**config) and make_batch(batch_size, **config);
    optionally loss_fn, train_batches and SIZES (see README). A Hugging Face config.json works too.
    """
    ctx.obj = {"debug": debug}


def _load_plan(path: str) -> Plan:
    """Load a plan and recompute its figures from its blocks, saying on stderr what a hand edit had changed."""
    from planner.core.step.predict import refresh

    plan, notes = refresh(Plan.load(path))
    if notes:
        click.echo(
            f"note: {path} was edited by hand or written by another version ({'; '.join(notes)}); "
            "using figures recomputed from its blocks",
            err=True,
        )
    return plan


@main.command("plan")
@debug_option
@click.argument("model_file", type=click.Path())
@click.option(
    "--gpus",
    "-g",
    type=click.IntRange(min=1),
    required=True,
    help="Total number of ranks (processes, one device each) = dp x pp x tp: --dp replicas of a pipeline of "
    "--gpus / (--dp x --tp) ranks, each pipeline rank split over --tp ranks of one node (all of them one "
    "pipeline with --dp 1 --tp 1); each pipeline rank runs --stages-per-rank stages.",
)
@click.option(
    "--dp",
    type=REPLICAS_OR_AUTO,
    default="1",
    show_default=True,
    help="Data-parallel replicas of the pipeline: K divides --gpus into K pipelines of --gpus / K ranks "
    "(global rank = replica x pp + pipeline rank), each reading --batch-size / K samples per step, their "
    "gradients reduced once per step (--dp-mode). 'auto': the search tries every divisor of --gpus that "
    "splits the batch and keeps the fastest plan that fits (ties: less memory, then fewer replicas).",
)
@click.option(
    "--dp-mode",
    type=click.Choice(["auto", *DP_MODES], case_sensitive=False),
    default="auto",
    show_default=True,
    help="How the replicas reduce gradients: ddp (DistributedDataParallel: an all-reduce; every replica holds "
    "its stages whole), fsdp (fully_shard: parameters, gradients and optimizer state sharded over the "
    "replicas, gathered by --fsdp-units), hsdp (fully_shard on a 2-D mesh, as multi-node FSDP runs do: "
    "sharded inside groups of --dp-shard replicas, replicated across the groups, whose gradients are "
    "all-reduced once per pass with stage units, every microbatch with block units), or 'auto': ddp where it fits the memory limit, else fsdp, or hsdp in groups "
    "of one node's replicas where the replicas span nodes and that fits and is faster. "
    "Ignored with one replica.",
)
@click.option(
    "--dp-shard",
    type=REPLICAS_OR_AUTO,
    default="auto",
    show_default=True,
    help="Under --dp-mode hsdp, the replicas of each shard group, a divisor of the replicas (replicas k x N .. "
    "k x N + N - 1 shard their state among them). 'auto': the largest groups whose replicas, with their "
    "pipeline and tensor-parallel ranks, each lie on one node (--gpus-per-node; every replica on a machine for "
    "measured plans), so the gathers stay inside a node and only the groups' all-reduce crosses nodes; where "
    "one replica fills a node, groups of the fewest replicas.",
)
@click.option(
    "--fsdp-units",
    type=click.Choice(["auto", "stage", "block"], case_sensitive=False),
    default="auto",
    show_default=True,
    help="Under fsdp or hsdp, what is gathered at a time: stage (each stage one unit, gathered from its first forward to "
    "its last backward, gradients reduce-scattered once per pass), block (each block its own unit, as torchtitan "
    "shards layers: gathered for every microbatch's forward and again for its backward, resharded after each, "
    "gradients reduce-scattered every microbatch; a few blocks unsharded at a time, the traffic overlapped with "
    "compute), or 'auto': the faster of the two that fits.",
)
@click.option(
    "--tp",
    type=REPLICAS_OR_AUTO,
    default="auto",
    show_default=True,
    help="Tensor-parallel ranks each pipeline rank is split over (Megatron's layout: the layers the model's "
    "tp_plan names are split by columns or rows, the rest held whole; global rank = (replica x pp + pipeline "
    "rank) x tp + tensor-parallel rank, so a group stays inside one node). 'auto': the search tries every "
    "degree that divides a node's ranks, --gpus and the model's split sizes, and keeps the fastest that fits; "
    "1 when the model declares no tp_plan (a module-level dict in the model file, or a Hugging Face "
    "config's base_model_tp_plan).",
)
@click.option(
    "--sequence-parallel/--no-sequence-parallel",
    default=None,
    help="With tensor parallelism (tp > 1), also split the activations between the split layers (residual adds, "
    "norms) along the sequence over the tp ranks: each saves 1/tp of them, the row-wise outputs are "
    "reduce-scattered and the column-wise inputs all-gathered instead of all-reduced (Megatron-LM's "
    "--sequence-parallel; torchtitan runs it with every tp plan). Needs a model traced as a graph, with "
    "activations laid out [batch, seq, features]. [default: auto: the search tries each tensor-parallel "
    "layout with and without it, where the model allows it, and keeps the faster that fits]",
)
@click.option(
    "--size", "-s", default=None, help="Named config from the model file's SIZES (default: the file's own defaults)."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override one config entry (repeatable); VALUE is JSON or a string.",
)
@click.option(
    "--batch-size",
    "-b",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Samples per training step (global batch; each of the --dp replicas reads an equal share).",
)
@click.option(
    "--microbatches",
    "-m",
    type=COUNT_OR_AUTO,
    default="auto",
    show_default=True,
    help="Microbatches per step of each replica's pipeline, or 'auto': the search tries every divisor of the "
    "replica's batch, down to microbatches of one sample (costs are profiled at the smallest divisor >= 2 x "
    "pipeline ranks and rescaled; layouts whose lower bound cannot beat the best found are skipped). A number "
    "must divide the replica's batch; 1f1b needs at least one per rank, dualpipev two.",
)
@click.option(
    "--accumulation",
    type=REPLICAS_OR_AUTO,
    default="auto",
    show_default=True,
    help="Pipeline passes per step (gradient accumulation, as torchtitan runs schedule.step several times per "
    "optimizer step): each replica runs the schedule N times on --batch-size / (--dp x N) samples, "
    "--microbatches microbatches each, gradients accumulated, then reduces, clips and steps once. torch's "
    "PipelineStage allocates a receive buffer per microbatch of a pass, up front, so N passes of m "
    "microbatches hold m buffers where one pass of N x m holds N x m; each pass pays the pipeline's warm-up "
    "and drain. 'auto': one pass, and more (at least one microbatch per pipeline rank each) only for the "
    "layouts whose one pass does not fit the memory. A number must divide the replica's batch with the "
    "microbatches.",
)
@click.option(
    "--schedule",
    default="auto",
    show_default=True,
    metavar="NAME",
    help=f"Pipeline schedule of torch.distributed.pipelining: {', '.join(SCHEDULES)}, or 'auto' (the search "
    f"picks the fastest that fits). torch's class names work too ({', '.join(TORCH_NAMES.values())}).",
)
@click.option(
    "--stages-per-rank",
    "-v",
    type=COUNT_OR_AUTO,
    default="auto",
    show_default=True,
    help="Pipeline stages on every rank, or 'auto'. gpipe and 1f1b run 1; zbv and dualpipev 2 (V-shaped: "
    "rank r holds stages r and 2p-1-r); interleaved-1f1b, looped-bfs and interleaved-zb any (looped: "
    "stage s on rank s mod p; auto tries 1 to 4).",
)
@click.option(
    "--method",
    type=click.Choice(list(METHODS)),
    default="optimal",
    show_default=True,
    help="Partition the plan uses: the exact solver, equal layer counts (torchtitan/Megatron), parameter-balanced "
    "(DeepSpeed), or 'given': the split of --compare. The others are shown for comparison.",
)
@click.option(
    "--compare",
    default=None,
    metavar="SPLIT",
    callback=lambda _ctx, _param, value: split_option(value),
    help="A split you use now, costed beside the plan and the baselines (its step, memory and whether it fits): "
    "layer counts per stage (3,4), a Megatron --pipeline-model-parallel-layout (Et*3|t*4L), DeepSpeed parts "
    "(parts:0,3,7: block indices), or a file holding torchtitan's module_fqns_per_model_part (JSON list, "
    "TOML or Python config, or a `planner export --to torchtitan` output). A split of another stage count is "
    "costed under the best schedule for that count. --method given makes it the plan's split.",
)
@click.option(
    "--memory-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="GIB",
    help="Per-rank (per process, every replica alike) memory limit in GiB; the solver never exceeds it "
    "[default: the GPU's memory when known, else none].",
)
@click.option(
    "--recompute",
    type=click.Choice(list(RECOMPUTE)),
    default="auto",
    show_default=True,
    help="Activation checkpointing: auto (per stage, only where it would not fit otherwise: the first that fits of "
    "selective, full, stage; then only the stage's first k blocks, as many as it must, where that recomputes less: "
    "full:k / selective:k in plan.json, as Megatron's --recompute-num-layers), or on every stage never, selective (each block its own region, keeping its matmul "
    "and attention outputs and recomputing the rest, as torchtitan's op mode), full (each block its own region, "
    "keeping only its input) or stage (the whole stage one region: least kept per microbatch, most rebuilt at "
    "once); always is full.",
)
@click.option(
    "--gpu-type",
    default=None,
    metavar="NAME",
    help=f"Plan for hardware that is not here ({', '.join(GPUS)}; "
    "'cpu' = this machine's calibrated CPU): build the model on the meta device and estimate its costs "
    "with the roofline model instead of measuring them.",
)
@click.option(
    "--attention-kernel",
    default=None,
    metavar="BACKEND",
    help="With --gpu-type: the scaled_dot_product_attention backend the estimate costs: flash (torch's "
    "FlashAttention-2, what torch 2.5.1-2.10 run on H100/H200), cudnn or efficient, where the GPU table has "
    "figures for it [default: the backend current torch picks on that GPU: cudnn on H100/H200, flash on A100, "
    "L4, L40S, A10G, MI300X, efficient on V100]. It changes the estimate, not what planner run executes.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default=None,
    help="Measured costs: profile every block under torch.autocast in bf16 or fp16 (parameters, gradients and "
    "optimizer state stay fp32; the run trains the same way) [default: fp32, no autocast]. With --gpu-type: the "
    "parameter/activation dtype of the estimate [default: bf16 on GPUs, fp32 on cpu].",
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="Train with torch.compile: profile each block as torch.compile(block) (the first, untimed run compiles: "
    "seconds per distinct block; identical layers share one) and have the run compile each stage. With --gpu-type "
    "the estimate charges each run of memory-bound operators between matrix products and attention as one fused "
    "kernel, as inductor generates, and saves for backward what AOTAutograd's partitioner keeps (matrix products' "
    "outputs, not the element-wise ones it recomputes).",
)
@click.option(
    "--gpus-per-node",
    type=int,
    default=None,
    metavar="N",
    help="With --gpu-type: GPUs per node. Ranks fill nodes in order (global rank g on node g // N, replica "
    "by replica), so only boundaries between stages on different nodes, and replica groups spanning nodes, "
    "use the inter-node network [default: 8].",
)
@click.option(
    "--multi-node",
    is_flag=True,
    help="With --gpu-type: every boundary crosses nodes (the same as --gpus-per-node 1).",
)
@click.option(
    "--calibrate",
    "calibrate_run",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="RUN.json",
    help="Correct the costs with the measurements of an earlier `planner run` of this model (its plan is found next to the run).",
)
@click.option(
    "--optimizer",
    type=click.Choice(list(OPTIMIZERS)),
    default="adamw",
    show_default=True,
    help="Optimizer of the run (its state counts in memory).",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-3,
    show_default=True,
    help="Learning rate of the run.",
)
@click.option(
    "--grad-clip",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Max global gradient norm (0 disables).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="CPU threads per rank, for profiling and the run [default: cores // gpus, all replicas' ranks].",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Timed runs per block (median kept); the whole model also runs this many times warm and as many cold "
    "(a wait before every block, for the cold starts after a message). On a busy or noisy machine use 20 or more: "
    "the default times a small model for a fraction of a second (docs/prediction_accuracy.md).",
)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed runs per block before timing."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for the model's weights and the example batch."
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    default="plan.json",
    show_default=True,
    help="Where to write the plan.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no tables.")
@user_errors
def plan_cmd(
    model_file: str,
    gpus: int,
    dp: int | str,
    dp_mode: str,
    dp_shard: int | str,
    fsdp_units: str,
    tp: int | str,
    sequence_parallel: bool | None,
    size: str | None,
    overrides: tuple[str, ...],
    batch_size: int,
    microbatches: int | None,
    accumulation: int | str,
    schedule: str,
    stages_per_rank: int | None,
    method: str,
    compare: str | None,
    memory_limit: float | None,
    recompute: str,
    gpu_type: str | None,
    attention_kernel: str | None,
    dtype: str | None,
    compile_: bool,
    gpus_per_node: int | None,
    multi_node: bool,
    calibrate_run: str | None,
    optimizer: str,
    lr: float,
    grad_clip: float,
    threads: int | None,
    repeats: int,
    warmup: int,
    seed: int,
    output: str,
    quiet: bool,
) -> None:
    """Trace and profile MODEL_FILE, split it into balanced stages, write the plan and print the balance report.

    MODEL_FILE is a Python model file (build_model, make_batch; see README), or a Hugging Face
    config.json or the folder holding it: the class its "architectures" names is built with fresh
    weights (nothing is downloaded) and fed random tokens of its vocabulary; --set seq_len=N sets
    the tokens per sample (default: max_position_embeddings, at most 512) and --set FIELD=VALUE any
    config field.
    """
    from planner.api import make_plan
    from planner.capture.load import parse_overrides
    from planner.core.heap import kept_until_exit
    from planner.report.tables import render
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=model_file,
        gpus=gpus,
        dp=dp,
        dp_mode=dp_mode,
        dp_shard=dp_shard,
        fsdp_units=fsdp_units.lower(),
        tp=tp,
        sequence_parallel="auto" if sequence_parallel is None else sequence_parallel,
        size=size,
        overrides=parse_overrides(overrides),
        batch_size=batch_size,
        microbatches=microbatches,
        accumulation=accumulation,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        method=method,
        compare=compare,
        memory_limit_gib=memory_limit,
        recompute=recompute,
        gpu_type=gpu_type,
        attention_kernel=attention_kernel,
        dtype=dtype,
        compile=compile_,
        multi_node=multi_node,
        gpus_per_node=gpus_per_node,
        calibrate_run=calibrate_run,
        optimizer={"name": optimizer, "lr": lr, "grad_clip": grad_clip or None},
        threads=threads,
        repeats=repeats,
        warmup=warmup,
        seed=seed,
        output=output,
        progress=not quiet,
    )
    check_output(request.output, "plan")  # before profiling: a model file or a link is never overwritten
    # an estimate holds meta tensors, graphs and numbers only: in the console script nothing of it is
    # collected before the process ends (planner.core.heap.kept_until_exit); a measured profile, or a
    # process that goes on after the command, collects as usual
    keep = _ENDS_WITH_COMMAND and request.gpu_type is not None
    with kept_until_exit() if keep else nullcontext():
        plan = make_plan(request)
        plan.save(request.output)
        header, notes = _lever_lines(plan)
        if not quiet:
            first, _, rest = render(plan).partition("\n")
            click.echo("\n".join([first + header, *notes, rest]))
        else:
            for note in notes:
                click.echo(note)
        click.echo(f"\nwrote {request.output}")
    if not keep:  # kept_until_exit has frozen the estimate already
        # The plan is written: the collection CPython makes as the process ends would walk the
        # model's graph once more (~1 s at 1,000 layers) to free what the exit frees anyway.
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)


def _lever_lines(plan: Plan) -> tuple[str, list[str]]:
    """The speed levers of a plan for its report: what the first line gains (", autocast bf16,
    compiled") and the notes under it (compile time, blocks compile failed on, what a compiled
    estimate leaves out)."""
    header = (f", autocast {plan.profile.autocast}" if plan.profile.autocast else "") + (
        ", compiled" if plan.compile else ""
    )
    notes = []
    if plan.compile and plan.profile.source == "estimated":
        notes.append(
            "note: --compile estimated, not measured: element-wise operators fused into one kernel per run, "
            "their outputs recomputed in backward rather than saved (docs/gpu_costs.md); the run compiles each stage"
        )
    elif plan.compile and plan.profile.compile_s is not None:
        notes.append(f"compiling the blocks took {plan.profile.compile_s:.1f} s (the untimed first runs)")
    failures = plan.profile.compile_failures
    if failures:
        names = ", ".join(name for name, _ in failures)
        notes.append(f"torch.compile failed on {names}: profiled eagerly ({failures[0][1]})")
    return header, notes


@main.command("run")
@debug_option
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Training steps to run.")
@click.option(
    "--nnodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Number of machines (torchrun-style rendezvous).",
)
@click.option(
    "--rdzv-endpoint",
    default=None,
    metavar="HOST:PORT",
    help="Rendezvous address of a multi-node run, the same on every node; the node on that host keeps the "
    "rendezvous store there [default: localhost, on a free port the store picks itself].",
)
@click.option("--rdzv-id", default=None, help="Rendezvous id shared by all machines of one run.")
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=None,
    metavar="K",
    help="This machine's index (0 to --nnodes - 1), as torchrun's --node-rank: a static rendezvous where node 0 "
    "hosts the store at --rdzv-endpoint [default: the c10d rendezvous assigns the nodes' order].",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=300,
    show_default=True,
    metavar="SECONDS",
    help="How long a rank may wait on another (a send, a receive, a collective, the rendezvous) before the run "
    "stops: a hung or stopped rank is named and the run ends instead of waiting forever.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the run report [default: PLAN's name with .run.json].",
)
@training_options
@user_errors
def run_cmd(
    plan_file: str,
    steps: int,
    nnodes: int,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    node_rank: int | None,
    timeout_s: float,
    output: str | None,
    **training: Any,
) -> None:
    """Train with PLAN_FILE: one process per stage, the planned split points and schedule.

    The final weights are saved as a checkpoint (PLAN's name with .ckpt, or --checkpoint-dir);
    `planner export-weights PLAN_FILE -o model.pt` turns one into the unsplit model's state dict.
    """
    from planner.errors import RunFailed
    from planner.run import RunResult, run_plan
    from planner.schema.request import RunRequest

    request = RunRequest.build(
        plan_file=plan_file,
        steps=steps,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        node_rank=node_rank,
        timeout_s=timeout_s,
        output=output,
        **training,
    )
    plan = _load_plan(str(request.plan_file))
    out = check_output(request.result_path, "run result")  # before training, so no run's figures are lost
    try:
        result = run_plan(plan, request)
    except RunFailed as e:
        # The steps completed are kept: run.json is written with the status and the cause.
        if not isinstance(e.result, RunResult):
            raise
        e.result.save(out)
        if (click.get_current_context().find_root().obj or {}).get("debug"):
            raise
        click.echo(f"{'error: ' if e.exit_code == 1 else ''}{e}", err=True)
        click.echo(f"wrote {out} ({e.result.steps} step(s) completed)", err=True)
        sys.exit(e.exit_code)
    result.save(out)
    loss = f"; final loss {result.losses[-1]:.4f}" if result.losses else ""  # only the last stage's node has losses
    click.echo(
        f"median step {result.median_step_s * 1e3:.1f} ms measured vs {plan.prediction.step_time_s * 1e3:.1f} ms "
        f"predicted{loss}; wrote {out}"
    )
    click.echo(_run_figures(result))


def _run_figures(result: Any) -> str:
    """One line of a finished run's throughput and peak memory per rank (the figures run.json holds)."""
    parts = []
    if result.samples_per_s:
        tokens = f", {result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else ""
        parts.append(f"throughput {result.samples_per_s:,.1f} samples/s{tokens}")
    peaks = result.peak_device_bytes or result.peak_rss_bytes
    what = "device memory" if result.peak_device_bytes else "resident memory"
    if peaks:
        parts.append(f"peak {what} per rank: {', '.join(f'{b / 2**20:,.0f} MiB' for b in peaks)}")
    if result.evals:
        last = result.evals[-1]
        parts.append(f"held-out loss {last.loss:.4f}, perplexity {last.perplexity:.2f} (step {last.step})")
    return "; ".join(parts)


@main.command("export-weights")
@debug_option
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option(
    "--checkpoint",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="A checkpoint folder (step_NNNNNNNN) or a run's checkpoint folder, whose newest is used "
    "[default: PLAN's name with .ckpt].",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    required=True,
    help="Where to write the state dict (load it with model.load_state_dict(torch.load(PATH))).",
)
@user_errors
def export_weights_cmd(plan_file: str, checkpoint: str | None, output: str) -> None:
    """Write the unsplit model's weights from a checkpoint of PLAN_FILE's run.

    The result is the state dict of the model that the model file's build_model gives (every
    parameter and persistent buffer, under the model's own names), saved with torch.save.
    """
    from pathlib import Path

    from planner.run.checkpoint import save_weights

    out = check_output(output, "weights")
    path, step = save_weights(Path(plan_file), Path(checkpoint) if checkpoint else None, Path(out))
    click.echo(f"wrote {out}: the weights after step {step} ({path})")


@main.command("export")
@debug_option
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option(
    "--to",
    "fmt",
    type=click.Choice(list(EXPORT_FORMATS), case_sensitive=False),
    required=True,
    help="torchtitan: ParallelismConfig fields as Python (torchtitan >= 0.3), module_fqns_per_model_part per "
    "stage; torchtitan-toml: the [parallelism] and [training] tables of torchtitan <= 0.2.2; megatron: "
    "--pipeline-model-parallel-layout and the other pipeline arguments; deepspeed: the parts and a "
    "PipelineModule subclass that uses them; csv: every rank's actions of the planned schedule, as torch's "
    "_PipelineScheduleRuntime loads them (torchtitan's pipeline_parallel_schedule_csv).",
)
@click.option(
    "--rename",
    multiple=True,
    metavar="OLD=NEW",
    help="Rename blocks whose name starts with the module path OLD (repeatable), for targets that name modules: "
    "--rename model.layers=layers turns model.layers.3 into layers.3.",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the export to this file [default: print it].",
)
@user_errors
def export_cmd(plan_file: str, fmt: str, rename: tuple[str, ...], output: str | None) -> None:
    """Write PLAN_FILE's split for another trainer: torchtitan, Megatron, DeepSpeed or torch's CSV.

    docs/interop.md shows where each goes and how it was verified against the trainer's own code.
    """
    from planner.report.export import export_plan, parse_renames
    from planner.schema.jsonfile import write_atomic

    out = check_output(output, "export") if output else None
    text = export_plan(_load_plan(plan_file), fmt.lower(), parse_renames(rename))
    if out is None:
        click.echo(text, nl=False)
        return
    write_atomic(out, text.encode())
    click.echo(f"wrote {out} ({fmt.lower()})")


@main.command("report")
@debug_option
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option(
    "--measured",
    "run_file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="RUN.json",
    help="A run.json of this plan (`planner run`): add predicted-vs-measured tables with the error in %, "
    "and the measured step under the predicted one in --timeline / --trace.",
)
@click.option(
    "--timeline",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="IMAGE",
    help="Draw one step as a picture (.png, .svg or .pdf): a row per rank, forward / backward / input- and "
    "weight-gradient actions coloured and numbered by microbatch, idle time (the bubble) left blank.",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="TRACE.json",
    help="Write one step as Chrome / Perfetto trace events (open in chrome://tracing or ui.perfetto.dev).",
)
@click.option(
    "--blocks",
    is_flag=True,
    help="With --measured: also compare every block's profiled forward and backward with its time inside the "
    "running stage (run.json's per-block times), and each stage's time outside its blocks.",
)
@user_errors
def report_cmd(plan_file: str, run_file: str | None, timeline: str | None, trace: str | None, blocks: bool) -> None:
    """Print the balance tables of a saved plan (and, with --measured, how a run of it compared)."""
    from planner.report.tables import render

    if blocks and not run_file:
        raise PlannerError("--blocks compares with a run: give it one with --measured RUN.json")
    plan = _load_plan(plan_file)
    outputs = []
    if timeline:
        outputs.append(check_output(timeline, "timeline", "--timeline"))
    if trace:
        outputs.append(check_output(trace, "trace", "--trace"))
    run = None
    if run_file:
        from planner.schema.result import RunResult

        run = RunResult.load(run_file)
    click.echo(render(plan))
    if run is not None:
        from planner.report.compare import compare_table

        click.echo("\npredicted vs measured (err = (plan - run) / run)\n" + compare_table(plan, run))
        if blocks:
            from planner.report.compare import compare_blocks_table

            click.echo("\nevery block, profiled vs inside the pipeline\n" + compare_blocks_table(plan, run))
    if outputs:
        _write_pictures(plan, run, timeline, trace)


def _write_pictures(plan: Plan, run: Any, timeline: str | None, trace: str | None) -> None:
    """The predicted (and measured) step as a timeline picture and as trace events."""
    from planner.core.step.predict import simulate_plan
    from planner.report.compare import measured_events
    from planner.report.timeline import chrome_trace, timeline_figure, write_trace

    predicted = simulate_plan(plan).events
    measured = measured_events(plan, run) if run is not None else None
    if run is not None and not measured:
        click.echo("note: the run recorded no per-action times (run 2 or more steps); only the prediction is drawn")
        measured = None
    title = f"{plan.schedule}, {plan.n_ranks} ranks x {plan.stages_per_rank} stage(s), m={plan.n_microbatches}"
    title += f", {plan.accumulation} passes" if plan.accumulation > 1 else ""
    if timeline:
        timeline_figure(predicted, plan.n_ranks, timeline, measured=measured, title=title)
        click.echo(f"wrote {timeline}")
    if trace:
        write_trace(trace, chrome_trace(predicted, measured=measured, name=title))
        click.echo(f"wrote {trace}")


if __name__ == "__main__":
    console()
