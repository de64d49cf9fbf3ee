"""``planner run``'s options, one decorator per ``--help`` group (cli_groups.py): the run itself, its data
and evaluation, the learning-rate schedule, checkpoints, and the nodes. cli.py holds the commands;
cli_support.py what every command shares; cli_plan_options.py ``planner plan``'s groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from cli_groups import option, option_group

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
        help="Continue from the newest complete checkpoint in the checkpoint folder: weights, optimizer, "
        "learning-rate schedule, data position and RNG; --steps is the run's last step, counted from the start.",
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
        "stops: a hung or stopped rank is named and the run ends instead of waiting forever.",
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


__all__ = ["run_options"]
