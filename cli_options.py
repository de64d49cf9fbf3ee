"""Option groups too long to read inline in cli.py: each a decorator that adds a command's options
of one kind. cli.py holds the commands; cli_support.py what every command shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def training_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``planner run``'s options for data, evaluation, the learning-rate schedule and checkpoints."""
    options = [
        click.option(
            "--data",
            type=click.Path(),
            default=None,
            metavar="PATH",
            help="Train on this text (a .txt file, or a folder of them read in name order) instead of the model "
            "file's own batches; token-id language models only (see docs/data.md). The end is held out (--eval-fraction).",
        ),
        click.option(
            "--tokenizer",
            type=click.Choice(["char", "byte", "word"]),
            default="char",
            show_default=True,
            help="How --data becomes token ids: characters, UTF-8 bytes, or words (vocabulary from the training "
            "split, capped at the model's vocabulary size).",
        ),
        click.option(
            "--eval-every",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            metavar="N",
            help="Evaluate loss and perplexity on the held-out part of --data every N steps (0: after the last step only).",
        ),
        click.option(
            "--eval-fraction",
            type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
            default=0.1,
            show_default=True,
            help="The share of --data held out for evaluation (its last tokens); the rest trains.",
        ),
        click.option(
            "--eval-batches",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            metavar="N",
            help="Held-out batches per evaluation (0: all of them).",
        ),
        click.option(
            "--warmup",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            metavar="STEPS",
            help="Linear learning-rate warm-up from 0 to the plan's rate over the first STEPS steps.",
        ),
        click.option(
            "--lr-decay",
            type=click.Choice(["constant", "linear", "cosine"]),
            default="constant",
            show_default=True,
            help="The learning rate after the warm-up: constant, or decaying to 0 at the last step (--steps).",
        ),
        click.option(
            "--checkpoint-dir",
            type=click.Path(file_okay=False),
            default=None,
            metavar="DIR",
            help="Where checkpoints go, one folder per step (torch.distributed.checkpoint) "
            "[default: PLAN's name with .ckpt]. On several nodes, a folder every node shares.",
        ),
        click.option(
            "--checkpoint-every",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            metavar="N",
            help="Also save a checkpoint every N steps (0: only the final one). A save that crashes never damages "
            "the last complete checkpoint.",
        ),
        click.option(
            "--no-checkpoint",
            "save_checkpoints",
            is_flag=True,
            flag_value=False,
            default=True,
            help="Write no checkpoint, not even the final weights.",
        ),
        click.option(
            "--resume",
            is_flag=True,
            help="Continue from the newest complete checkpoint in the checkpoint folder: weights, optimizer, "
            "learning-rate schedule, data position and RNG; --steps is the run's last step, counted from the start.",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


__all__ = ["training_options"]
