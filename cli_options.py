"""``planner run``'s options, one decorator per ``--help`` group (cli_groups.py): the run itself, its data
and evaluation, the learning-rate schedule, checkpoints, and the nodes; and ``planner probe``'s, which
launches its ranks as run does (``probe_options``). cli.py holds the commands; cli_support.py what every
command shares; cli_plan_options.py ``planner plan``'s groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from cli_groups import option, option_group
from planner.core.levers.hardware import DTYPES, GPUS

run_settings = option_group(
    "Run",
    option(
        "--steps", type=click.IntRange(min=1), metavar="N", default=20, show_default=True, help="Training steps to run."
    ),
    option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False),
        default=None,
        help="Where to write the run report [default: PLAN's name with .run.json].",
    ),
)

data_options = option_group(
    "Data and evaluation",
    option(
        "--data",
        type=click.Path(),
        default=None,
        metavar="PATH",
        help="Train on this text (a .txt file, or a folder of them read in name order) instead of the model "
        "file's own batches; token-id language models only (see docs/data.md). The end is held out (--eval-fraction).",
    ),
    option(
        "--tokenizer",
        type=click.Choice(["char", "byte", "word"]),
        default="char",
        show_default=True,
        help="How --data becomes token ids: characters, UTF-8 bytes, or words (vocabulary from the training "
        "split, capped at the model's vocabulary size).",
    ),
    option(
        "--eval-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        metavar="N",
        help="Evaluate loss and perplexity on the held-out part of --data every N steps (0: after the last step only).",
    ),
    option(
        "--eval-fraction",
        type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
        metavar="FRACTION",
        default=0.1,
        show_default=True,
        help="The share of --data held out for evaluation (its last tokens); the rest trains.",
    ),
    option(
        "--eval-batches",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        metavar="N",
        help="Held-out batches per evaluation (0: all of them).",
    ),
)

lr_options = option_group(
    "Learning rate",
    option(
        "--warmup",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        metavar="STEPS",
        help="Linear learning-rate warm-up from 0 to the plan's rate over the first STEPS steps.",
    ),
    option(
        "--lr-decay",
        type=click.Choice(["constant", "linear", "cosine"]),
        default="constant",
        show_default=True,
        help="The learning rate after the warm-up: constant, or decaying to 0 at the last step (--steps).",
    ),
)

checkpoint_options = option_group(
    "Checkpoints",
    option(
        "--checkpoint-dir",
        type=click.Path(file_okay=False),
        default=None,
        metavar="DIR",
        help="Where checkpoints go, one folder per step (torch.distributed.checkpoint) "
        "[default: PLAN's name with .ckpt]. On several nodes, a folder every node shares.",
    ),
    option(
        "--checkpoint-every",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        metavar="N",
        help="Also save a checkpoint every N steps (0: only the final one). A save that crashes never damages "
        "the last complete checkpoint.",
    ),
    option(
        "--no-checkpoint",
        "save_checkpoints",
        is_flag=True,
        flag_value=False,
        default=True,
        help="Write no checkpoint, not even the final weights.",
    ),
    option(
        "--resume",
        is_flag=True,
        help="Continue from the checkpoint the checkpoint folder's `latest` names (the last step of the last run "
        "that saved): weights, optimizer, learning-rate schedule, data position and RNG; --steps is the run's "
        "last step, counted from the start.",
    ),
)

node_options = option_group(
    "Nodes",
    option(
        "--nnodes",
        type=click.IntRange(min=1),
        metavar="N",
        default=1,
        show_default=True,
        help="Number of machines (torchrun-style rendezvous).",
    ),
    option(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="Rendezvous address of a multi-node run, the same on every node; the node on that host keeps the "
        "rendezvous store there [default: localhost, on a free port the store picks itself].",
    ),
    option("--rdzv-id", default=None, metavar="ID", help="Rendezvous id shared by all machines of one run."),
    option(
        "--node-rank",
        type=click.IntRange(min=0),
        default=None,
        metavar="K",
        help="This machine's index (0 to --nnodes - 1), as torchrun's --node-rank: a static rendezvous where node 0 "
        "hosts the store at --rdzv-endpoint [default: the c10d rendezvous assigns the nodes' order].",
    ),
    option(
        "--timeout",
        "timeout_s",
        type=click.FloatRange(min=0, min_open=True, max=86400),
        default=300,
        show_default=True,
        metavar="SECONDS",
        help="How long a rank may wait on another (a send, a receive, a collective, the rendezvous) before the run "
        "stops: a hung or stopped rank is named and the run ends instead of waiting forever. At least 5.",
    ),
)


def run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of ``planner run``, group by group (``--debug`` and ``--help`` join the last, "Nodes").

    Args:
        fn: the command function.

    Returns:
        ``fn`` with the options added.
    """
    # click lists a command's options in the order their decorators are written, the last applied first
    for group in reversed([run_settings, data_options, lr_options, checkpoint_options, node_options]):
        fn = group(fn)
    return fn


probe_cluster = option_group(
    "Cluster",
    option(
        "--gpus",
        "-g",
        type=click.IntRange(min=1),
        default=None,
        help="Ranks to launch, one per GPU (on a CPU machine: processes talking over gloo). With 2 or more the "
        "collectives are measured too.",
    ),
    option(
        "--gpus-per-node",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Ranks per node [default: --gpus, one node]. Several nodes: run the same command on each, with the "
        "same --rdzv-endpoint; collectives are then measured inside a node and across nodes.",
    ),
    option(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="The rendezvous store every node reaches (several nodes only), as `planner run --rdzv-endpoint`.",
    ),
    option(
        "--threads",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="Intra-op threads per rank [default: cores // ranks per node, as `planner plan` profiles].",
    ),
    option(
        "--device",
        type=click.Choice(["auto", "cpu", "cuda"]),
        default="auto",
        show_default=True,
        help="What to measure: the GPUs (nccl) when CUDA is available, else this CPU (gloo).",
    ),
    option(
        "--timeout",
        "timeout_s",
        type=click.FloatRange(min=1),
        default=300.0,
        show_default=True,
        metavar="SECONDS",
        help="How long a rank or node may wait for the others.",
    ),
)

probe_sweep = option_group(
    "Sweep",
    option(
        "--quick",
        is_flag=True,
        help="A shorter sweep: collectives up to 4 MiB on a CPU (256 MiB on a GPU; else 64 MiB / 1 GiB), fewer "
        "GEMMs, 1 warm-up and 3 timed repeats per point (else 2 and 5).",
    ),
    option(
        "--dtype",
        type=click.Choice(DTYPES),
        default=None,
        help="The dtype of the GEMMs and attention; the file has a peak for it only [default: bf16 on GPUs, fp32 "
        "on a CPU].",
    ),
    option(
        "--size",
        "-s",
        default=None,
        metavar="NAME",
        help="With MODEL_FILE: a named config from its SIZES.",
    ),
    option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="With MODEL_FILE: override one config entry (repeatable), as `planner plan --set`.",
    ),
    option(
        "--microbatch-size",
        type=click.IntRange(min=1),
        default=None,
        metavar="N",
        help="With MODEL_FILE: the samples per microbatch its linear layers' GEMMs are measured at [default: 1].",
    ),
)

probe_output = option_group(
    "Output",
    option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE.json",
        help="The hardware file to write (plan with `planner plan --gpu-type FILE.json`).",
    ),
    option("--name", default=None, help="The hardware's name in the file and in plans [default: FILE's stem]."),
    option(
        "--write-shipped",
        type=click.Path(file_okay=False),
        default=None,
        metavar="DIR",
        help=f"Measure nothing: write the shipped GPUs ({', '.join(GPUS)}) as hardware files DIR/NAME.json, "
        "in the format probe writes, to read or edit and give to --gpu-type.",
    ),
    option("--progress/--no-progress", default=True, show_default=True, help="A progress bar over the sweep."),
)


def probe_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of ``planner probe``: the cluster, the sweep, the output.

    Args:
        fn: the command function.

    Returns:
        ``fn`` with the options added.
    """
    for group in reversed([probe_cluster, probe_sweep, probe_output]):
        fn = group(fn)
    return fn


__all__ = ["probe_options", "run_options"]
