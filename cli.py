"""The ``planner`` command: parse options, call the library, print. Nothing else lives here.

planner plan MODEL.py --gpus N     trace, profile, solve; write plan.json; print balance tables
planner run PLAN.json              launch one process per rank and train with the planned schedule
planner report PLAN.json           print the balance tables of a saved plan (--config: its job file)
planner export PLAN.json --to T    the plan in torchtitan's, Megatron's, DeepSpeed's or torch's CSV terms
planner probe --gpus N -o HW.json  measure this machine or cluster into a hardware file (--gpu-type HW.json)

The options live beside it, one decorator per --help group (cli_groups.py): cli_plan_options.py for
plan, cli_options.py for run; cli_config.py reads plan's TOML job files, cli_jobfile.py writes a
plan's; cli_support.py holds what every command shares.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import click

from cli_groups import GroupedCommand
from cli_options import probe_options, run_options
from cli_plan_options import plan_options, plan_request
from cli_support import PlannerGroup, debug_option, stopped_line, user_errors
from planner.core.levers.hardware import GPUS
from planner.errors import PlannerError, listed
from planner.report.export import EXPORT_FORMATS
from planner.schema.outputs import check_output
from planner.schema.plan import Plan

# Set by ``console`` (the ``planner`` script): the process ends with the command, so ``plan`` can
# leave what it built to the exit instead of collecting it (planner.core.heap.kept_until_exit). A
# caller of ``main`` in its own process (a test's CliRunner, a script) keeps collection as usual.
_ENDS_WITH_COMMAND = False


def console() -> None:
    """The ``planner`` console script: ``main`` in a process that ends when the command does."""
    global _ENDS_WITH_COMMAND
    _ENDS_WITH_COMMAND = True
    main()


@click.group(cls=PlannerGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


@main.command("plan", cls=GroupedCommand)
@debug_option
@click.argument("model_file", type=click.Path())
@plan_options
@user_errors
def plan_cmd(model_file: str, quiet: bool, **options: Any) -> None:
    """Trace and profile MODEL_FILE, split it into balanced stages, write the plan and print the balance report.

    MODEL_FILE is a Python model file (build_model, make_batch; see README), or a Hugging Face
    config.json or the folder holding it. Every option in full: docs/options.md.
    """
    from planner.api import make_plan
    from planner.core.heap import kept_until_exit
    from planner.report.tables import batch_norm_line, render

    request = plan_request(model_file, {**options, "quiet": quiet})
    check_output(request.output, "plan")  # before profiling: a model file or a link is never overwritten
    cores = os.cpu_count() or 1
    if request.gpu_type is None and request.threads is not None and request.threads * request.gpus > cores:
        # the profile would time kernels fighting over the cores, slower than a run that fits them
        click.echo(
            f"warning: --threads {request.threads} x --gpus {request.gpus} ranks is more than this machine's "
            f"{cores} cores: the profile and the run oversubscribe them (default: {max(1, cores // request.gpus)})",
            err=True,
        )
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
        else:  # the cautions about what the run computes, without the tables
            for note in [*notes, batch_norm_line(plan)]:
                if note:
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


@main.command("run", cls=GroupedCommand)
@debug_option
@click.argument("plan_file", type=click.Path(dir_okay=False))
@run_options
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
    """Train with PLAN_FILE: one process per rank, the planned split points and schedule.

    The final weights are saved as a checkpoint (PLAN's name with .ckpt, or --checkpoint-dir);
    `planner export-weights PLAN_FILE -o model.pt` turns one into the unsplit model's state dict.
    """
    from planner.errors import RunFailed
    from planner.run import RunResult, run_plan
    from planner.schema.run_request import RunRequest

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
        click.echo(stopped_line(e), err=True)
        click.echo(f"wrote {out} ({e.result.steps} step(s) completed)", err=True)
        sys.exit(e.exit_code)
    result.save(out)
    loss = f"; final loss {result.losses[-1]:.4f}" if result.losses else ""  # only the last stage's node has losses
    # a run of 1 or 2 steps times none (run.json's timed_steps): it says so rather than show their times
    measured = (
        f"median step {result.median_step_s * 1e3:.1f} ms measured vs {plan.prediction.step_time_s * 1e3:.1f} ms "
        "predicted"
        if result.median_step_s is not None
        else f"no timed step: run --steps {result.first_step + 2} or more to measure the step time (step "
        f"{result.first_step} sets the schedule up, the last runs under the memory tracker)"
    )
    click.echo(f"{measured}{loss}; wrote {out}")
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
    path, step, untrained = save_weights(Path(plan_file), Path(checkpoint) if checkpoint else None, Path(out))
    click.echo(f"wrote {out}: the weights after step {step} ({path})")
    if untrained:
        click.echo(
            f"{len(untrained)} tensor(s) no stage of the plan uses (forward never reaches them) were never trained "
            f"and keep their initial values (the plan's seed): {listed(untrained, 6)}"
        )


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
    from planner.report.export import export_plan
    from planner.report.renames import parse_renames
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
@click.option(
    "--config",
    "job",
    is_flag=True,
    help="Print the TOML job file that makes this plan again (planner plan --config FILE) instead of the tables.",
)
@user_errors
def report_cmd(
    plan_file: str, run_file: str | None, timeline: str | None, trace: str | None, blocks: bool, job: bool
) -> None:
    """Print the balance tables of a saved plan (and, with --measured, how a run of it compared)."""
    from planner.report.tables import render

    if blocks and not run_file:
        raise PlannerError("--blocks compares with a run: give it one with --measured RUN.json")
    if job and (run_file or timeline or trace):
        raise PlannerError("--config prints the job file only: leave out --measured, --timeline and --trace")
    plan = _load_plan(plan_file)
    if job:
        from cli_jobfile import job_file

        click.echo(job_file(plan, plan_file), nl=False)
        return
    outputs = []
    if timeline:
        from planner.report.timeline import check_timeline_path

        outputs.append(check_output(timeline, "timeline", "--timeline"))
        check_timeline_path(timeline)  # a .jpg is refused before the report prints, not after
    if trace:
        outputs.append(check_output(trace, "trace", "--trace"))
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise PlannerError(
            f"--timeline and --trace both name {trace}: the trace would replace the picture; give two files"
        )
    run = None
    if run_file:
        from planner.schema.result import RunResult

        run = RunResult.load(run_file)
    # the comparisons made before anything prints: a run of another plan is one line (compare_table checks)
    compared = []
    if run is not None:
        from planner.report.compare import compare_blocks_table, compare_table

        compared.append("\npredicted vs measured (err = (plan - run) / run)\n" + compare_table(plan, run))
        if blocks:
            compared.append("\nevery block, profiled vs inside the pipeline\n" + compare_blocks_table(plan, run))
    click.echo(render(plan))
    for table in compared:
        click.echo(table)
    if run is not None and (run.status != "completed" or run.median_step_s is None):
        why = (
            f"{run.status}: {run.stopped}"
            if run.status != "completed"
            else "timed no step (--steps 3 or more times some)"
        )
        click.echo(f"note: the run {why}; its columns show what it measured before, '-' where nothing")
    if outputs:
        _write_pictures(plan, run, timeline, trace)


def picture_title(plan: Plan, pipeline_s: float) -> str:
    """The title of a plan's timeline picture and trace: the layout, and the predicted step where it
    is longer than the pipeline drawn (the optimizer step and gradient reductions follow it; the
    picture once said 55.9 ms where the plan said 62).

    Args:
        plan: the plan.
        pipeline_s: the end of the last predicted pipeline action.

    Returns:
        The title.
    """
    title = f"{plan.schedule}, {plan.n_ranks} ranks x {plan.stages_per_rank} stage(s), m={plan.n_microbatches}"
    title += f", {plan.accumulation} passes" if plan.accumulation > 1 else ""
    step_s = plan.prediction.step_time_s
    if step_s - pipeline_s > 0.0005 * step_s:
        title += (
            f"; predicted step {step_s * 1e3:.1f} ms: the pipeline below, then "
            f"{(step_s - pipeline_s) * 1e3:.1f} ms after it (optimizer step, gradient reductions)"
        )
    return title


def _write_pictures(plan: Plan, run: Any, timeline: str | None, trace: str | None) -> None:
    """The predicted (and measured) step as a timeline picture and as trace events."""
    from planner.core.step.predict import simulate_plan
    from planner.report.compare import measured_events
    from planner.report.timeline import chrome_trace, timeline_figure, write_trace

    predicted = simulate_plan(plan).events
    measured = measured_events(plan, run) if run is not None else None
    if run is not None and not measured:
        click.echo("note: the run recorded no per-action times (run 3 or more steps); only the prediction is drawn")
        measured = None
    title = picture_title(plan, max((e.end_s for e in predicted), default=0.0))
    if timeline:
        timeline_figure(predicted, plan.n_ranks, timeline, measured=measured, title=title)
        click.echo(f"wrote {timeline}")
    if trace:
        write_trace(trace, chrome_trace(predicted, measured=measured, name=title))
        click.echo(f"wrote {trace}")


@main.command("probe", cls=GroupedCommand)
@debug_option
@click.argument("model_file", required=False, type=click.Path())
@probe_options
@user_errors
def probe_cmd(model_file: str | None, **o: Any) -> None:
    """Measure this machine's (or cluster's) GEMMs, memory, attention and collectives into a hardware file.

    Launched like `planner run` (one process per GPU: nccl on GPUs, gloo on a CPU). Rank 0 times
    GEMMs (MODEL_FILE's linear layers when given, else square and skinny shapes), a large copy,
    attention and a tiny model's operators; all ranks time all-reduce, all-gather, reduce-scatter,
    all-to-all and send/recv over a sweep of sizes. The fitted constants and the raw points go to
    FILE.json: `planner plan MODEL --gpus N --gpu-type FILE.json` then estimates for this hardware.
    docs/probe.md says what each constant is fitted from.
    """
    if o["write_shipped"]:
        given = [
            name for name, value in (("MODEL_FILE", model_file), ("-o", o["output"]), ("--gpus", o["gpus"])) if value
        ]
        if given:
            raise PlannerError(
                f"--write-shipped measures nothing (it writes the shipped GPUs' files): give it without {', '.join(given)}, "
                "or measure without it"
            )
        _write_shipped(Path(o["write_shipped"]))
        return
    if o["gpus"] is None or o["output"] is None:
        raise PlannerError("give --gpus N and -o FILE.json (or --write-shipped DIR to write the shipped GPUs)")
    from planner.core.levers.hardware_file import write_hardware_file
    from planner.core.levers.probe_fit import hardware_file_of
    from planner.schema.outputs import check_output

    out = check_output(o["output"], "hardware file")
    measured = _measure(model_file, o)
    if measured is None:  # another node's share of a multi-node probe: node 0 writes the file
        click.echo(f"this node's ranks are done; the node of rank 0 writes {out}")
        return
    doc = hardware_file_of(measured, o["name"] or out.stem)
    write_hardware_file(out, doc)
    click.echo(_summary(doc.spec))
    click.echo(f"wrote {out}; plan for it with `planner plan MODEL --gpus N --gpu-type {out}`")


def _measure(model_file: str | None, o: dict[str, Any]) -> Any:
    """Launch the ranks (or measure here, for one) and return rank 0's ``Measured`` (None on another node)."""
    import torch

    from planner.api import default_threads
    from planner.core.levers.hardware_file import Measured
    from planner.core.levers.probe_fit import default_task
    from planner.costs.probe import probe_here, probe_rank
    from planner.run.spawn import launch_function

    gpus = o["gpus"]
    per_node = o["gpus_per_node"] or gpus
    if gpus % per_node:
        raise PlannerError(f"--gpus-per-node {per_node} does not divide --gpus {gpus}; give a divisor of it")
    cuda = o["device"] == "cuda" or (o["device"] == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() < per_node:
        have = torch.cuda.device_count()
        if not have:
            raise PlannerError("--device cuda: this node shows no CUDA GPU; use --device cpu (or auto)")
        asked = f"--gpus-per-node {per_node}" if o["gpus_per_node"] else f"--gpus {gpus} (on one node)"
        raise PlannerError(
            f"{asked} needs {per_node} GPUs a node; this node shows {have} (give --gpus-per-node {have} to spread "
            "the ranks over nodes, or --device cpu)"
        )
    task = default_task(
        "cuda" if cuda else "cpu",
        o["dtype"] or ("bf16" if cuda else "fp32"),
        o["quick"],
        per_node,
        o["threads"] or (1 if cuda else default_threads(per_node)),
        _model_gemms(model_file, o),
    ).model_copy(update={"progress": o["progress"], "timeout_s": o["timeout_s"]})
    if gpus == 1:
        return probe_here(task)
    values = launch_function(
        probe_rank,
        (task.model_dump_json(),),
        nproc=per_node,
        nnodes=gpus // per_node,
        threads=task.threads,
        rdzv_endpoint=o["rdzv_endpoint"],
        timeout_s=o["timeout_s"],
        preload=("planner.costs.probe",),
    )
    return Measured.model_validate_json(values[0]) if values.get(0) else None


def _model_gemms(model_file: str | None, o: dict[str, Any]) -> list[tuple[int, int, int]]:
    """The GEMM shapes of MODEL_FILE's linear layers (none without a model file)."""
    if model_file is None:
        given = [
            name
            for name, key in (("--size", "size"), ("--set", "overrides"), ("--microbatch-size", "microbatch_size"))
            if o[key]
        ]
        if given:
            raise PlannerError(
                f"{' and '.join(given)} describe{'s' if len(given) == 1 else ''} the model's GEMMs: give its MODEL_FILE too"
            )
        return []
    from planner.capture.load import load_model_file, parse_overrides
    from planner.costs.probe import model_gemms

    mf = load_model_file(model_file, o["size"], parse_overrides(o["overrides"]))
    shapes = model_gemms(mf, o["microbatch_size"] or 1)
    if not shapes:
        raise PlannerError(f"{model_file} has no nn.Linear layer to take GEMM shapes from; probe without it")
    return shapes


def _summary(spec: Any) -> str:
    """The fitted constants, one line each."""
    peak = ", ".join(f"{d} {v / 1e12:.3f} TFLOP/s" for d, v in spec.peak_flops.items())
    half = f" (half speed at {spec.gemm_half_dim:.0f}-wide GEMMs)" if spec.gemm_half_dim else ""
    attn = (
        f"; attention {spec.attention_fwd_efficiency:.0%} / {spec.attention_bwd_efficiency:.0%} of it fwd / bwd"
        if spec.attention_fwd_efficiency is not None
        else ""
    )
    return "\n".join(
        [
            f"{spec.name}: GEMMs {peak}{half}{attn}",
            f"memory {spec.memory_Bps / 1e9:.1f} GB/s; {spec.op_overhead_s * 1e6:.1f} us per operator",
            f"inside a node {spec.intra_node_latency_s * 1e6:.0f} us + {spec.intra_node_Bps / 1e9:.2f} GB/s; "
            f"across nodes {spec.inter_node_latency_s * 1e6:.0f} us + {spec.inter_node_Bps / 1e9:.2f} GB/s",
        ]
    )


def _write_shipped(folder: Path) -> None:
    """Every shipped GPU as DIR/NAME.json."""
    from planner.core.levers.hardware_file import shipped_file, write_hardware_file
    from planner.schema.outputs import check_output

    # every file checked before any is written (a refused command changes no file); a missing folder
    # is made, under a parent that exists, as `mkdir` would
    if folder.is_dir():
        for name in GPUS:
            try:
                check_output(folder / f"{name}.json", "hardware file", "--write-shipped")
            except PlannerError as e:
                reason = str(e).split("; ", 1)[0]  # its remedy names a file: this option takes a folder
                there = (folder / f"{name}.json").exists() or (folder / f"{name}.json").is_symlink()
                raise PlannerError(
                    f"{reason}; {'move that file away, or ' if there else ''}choose another folder"
                ) from None
    else:
        check_output(folder, "hardware file", "--write-shipped")  # a folder to make it in, writable
        try:
            folder.mkdir()
        except OSError as e:
            raise PlannerError(f"--write-shipped {folder}: cannot make the folder ({e.strerror})") from None
    for name in GPUS:
        write_hardware_file(folder / f"{name}.json", shipped_file(name))
    click.echo(f"wrote {len(GPUS)} hardware files to {folder}: {', '.join(f'{n}.json' for n in GPUS)}")


if __name__ == "__main__":
    console()
