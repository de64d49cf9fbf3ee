"""The ``planner`` command: parse options, call the library, print. Nothing else lives here.

planner plan MODEL.py --gpus N     trace, profile, solve; write plan.json; print balance tables
planner run PLAN.json              launch one process per stage and train with the planned schedule
planner report PLAN.json           print the balance tables of a saved plan
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from planner.errors import PlannerError
from planner.schema.costs import OPTIMIZERS
from planner.schema.outputs import check_output
from planner.schema.plan import Plan
from planner.schema.request import DTYPES, METHODS, RECOMPUTE, SCHEDULES, TORCH_NAMES


class _CountOrAuto(click.ParamType):
    """A positive integer, or "auto" (returned as None: the search chooses)."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        try:
            number = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a whole number nor 'auto'", param, ctx)
        if number < 1:
            self.fail(f"{number} is not a positive number; give 1 or more, or 'auto'", param, ctx)
        return number


COUNT_OR_AUTO = _CountOrAuto()


class _Terminated(BaseException):
    """SIGTERM arrived (a scheduler or ``kill`` stopping the command)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr for every way a command can end badly, never a traceback (unless --debug).

    PlannerError (a user mistake): its message, exit 2. Ctrl-C: "interrupted", exit 130. SIGTERM:
    "terminated", exit 143. Anything else is a bug in the planner: one line naming it, exit 1.
    Outputs are written atomically, so none of these leaves a half-written file behind.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return fn(*args, **kwargs)
        except PlannerError as e:
            if debug:
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except _Terminated:
            click.echo("terminated", err=True)
            sys.exit(143)
        except Exception as e:
            if debug:
                raise
            text = " ".join(str(e).split())[:300]
            click.echo(
                f"error: internal error ({type(e).__name__}: {text}); re-run with --debug for the traceback", err=True
            )
            sys.exit(1)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback of an error instead of one line.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Plan and run pipeline-parallel training for a PyTorch model file.

    A model file is plain Python defining build_model(**config) and make_batch(batch_size, **config);
    optionally loss_fn, train_batches and SIZES (see README).
    """
    ctx.obj = {"debug": debug}


def _load_plan(path: str) -> Plan:
    """Load a plan and recompute its figures from its blocks, saying on stderr what a hand edit had changed."""
    from planner.core.predict import refresh

    plan, notes = refresh(Plan.load(path))
    if notes:
        click.echo(
            f"note: {path} was edited by hand or written by another version ({'; '.join(notes)}); "
            "using figures recomputed from its blocks",
            err=True,
        )
    return plan


@main.command("plan")
@click.argument("model_file", type=click.Path(dir_okay=False))
@click.option(
    "--gpus",
    "-g",
    type=click.IntRange(min=1),
    required=True,
    help="Number of pipeline ranks (processes, one device each); each runs --stages-per-rank stages.",
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
    help="Samples per training step (global batch).",
)
@click.option(
    "--microbatches",
    "-m",
    type=COUNT_OR_AUTO,
    default="auto",
    show_default=True,
    help="Microbatches per step, or 'auto': the search tries the divisors of the batch up to 8 per rank "
    "(costs are profiled at the smallest divisor >= 2 x gpus and rescaled). A number must divide the batch; "
    "1f1b needs at least one per rank, dualpipev two.",
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
    help="Partition the plan uses: the exact solver, equal layer counts (torchtitan/Megatron), or parameter-balanced (DeepSpeed). The others are shown for comparison.",
)
@click.option(
    "--memory-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="GIB",
    help="Per-rank memory limit in GiB; the solver never exceeds it [default: the GPU's memory when known, else none].",
)
@click.option(
    "--recompute",
    type=click.Choice(list(RECOMPUTE)),
    default="auto",
    show_default=True,
    help="Activation checkpointing per stage: only where a stage would not fit otherwise, never, or everywhere.",
)
@click.option(
    "--gpu-type",
    default=None,
    metavar="NAME",
    help="Plan for hardware that is not here (h100, h200, a100-80g, a100-40g, l4, l40s, a10g, v100, mi300x; "
    "'cpu' = this machine's calibrated CPU): build the model on the meta device and estimate its costs "
    "with the roofline model instead of measuring them.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default=None,
    help="Parameter/activation dtype for --gpu-type estimates [default: bf16 on GPUs, fp32 on cpu].",
)
@click.option(
    "--gpus-per-node",
    type=int,
    default=None,
    metavar="N",
    help="With --gpu-type: GPUs per node. Ranks fill nodes in order (rank r on node r // N), so only "
    "boundaries between stages on different nodes use the inter-node network [default: 8].",
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
    help="CPU threads per rank, for profiling and the run [default: cores // gpus].",
)
@click.option(
    "--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed runs per block (median kept)."
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
@_user_errors
def plan_cmd(
    model_file: str,
    gpus: int,
    size: str | None,
    overrides: tuple[str, ...],
    batch_size: int,
    microbatches: int | None,
    schedule: str,
    stages_per_rank: int | None,
    method: str,
    memory_limit: float | None,
    recompute: str,
    gpu_type: str | None,
    dtype: str | None,
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
    """Trace and profile MODEL_FILE, split it into balanced stages, write the plan and print the balance report."""
    from planner.api import make_plan
    from planner.capture.load import parse_overrides
    from planner.report.tables import render
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=model_file,
        gpus=gpus,
        size=size,
        overrides=parse_overrides(overrides),
        batch_size=batch_size,
        microbatches=microbatches,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        method=method,
        memory_limit_gib=memory_limit,
        recompute=recompute,
        gpu_type=gpu_type,
        dtype=dtype,
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
    plan = make_plan(request)
    plan.save(request.output)
    if not quiet:
        click.echo(render(plan))
    click.echo(f"\nwrote {request.output}")


@main.command("run")
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
    help="Rendezvous address for multi-node runs [default: localhost and a free port].",
)
@click.option("--rdzv-id", default=None, help="Rendezvous id shared by all machines of one run.")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the run report [default: PLAN's name with .run.json].",
)
@_user_errors
def run_cmd(
    plan_file: str, steps: int, nnodes: int, rdzv_endpoint: str | None, rdzv_id: str | None, output: str | None
) -> None:
    """Train with PLAN_FILE: one process per stage, the planned split points and schedule."""
    from planner.run import run_plan
    from planner.schema.request import RunRequest

    request = RunRequest.build(
        plan_file=plan_file, steps=steps, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, output=output
    )
    plan = _load_plan(str(request.plan_file))
    out = check_output(request.result_path, "run result")  # before training, so no run's figures are lost
    result = run_plan(plan, request)
    result.save(out)
    loss = f"; final loss {result.losses[-1]:.4f}" if result.losses else ""  # only the last stage's node has losses
    click.echo(
        f"median step {result.median_step_s * 1e3:.1f} ms measured vs {plan.prediction.step_time_s * 1e3:.1f} ms "
        f"predicted{loss}; wrote {out}"
    )


@main.command("report")
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
@_user_errors
def report_cmd(plan_file: str, run_file: str | None, timeline: str | None, trace: str | None) -> None:
    """Print the balance tables of a saved plan (and, with --measured, how a run of it compared)."""
    from planner.report.tables import render

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
    if outputs:
        _write_pictures(plan, run, timeline, trace)


def _write_pictures(plan: Plan, run: Any, timeline: str | None, trace: str | None) -> None:
    """The predicted (and measured) step as a timeline picture and as trace events."""
    from planner.core.predict import simulate_plan
    from planner.report.compare import measured_events
    from planner.report.timeline import chrome_trace, timeline_figure, write_trace

    predicted = simulate_plan(plan).events
    measured = measured_events(plan, run) if run is not None else None
    if run is not None and not measured:
        click.echo("note: the run recorded no per-action times (run 2 or more steps); only the prediction is drawn")
        measured = None
    title = f"{plan.schedule}, {plan.n_ranks} ranks x {plan.stages_per_rank} stage(s), m={plan.n_microbatches}"
    if timeline:
        timeline_figure(predicted, plan.n_ranks, timeline, measured=measured, title=title)
        click.echo(f"wrote {timeline}")
    if trace:
        write_trace(trace, chrome_trace(predicted, measured=measured, name=title))
        click.echo(f"wrote {trace}")


if __name__ == "__main__":
    main()
