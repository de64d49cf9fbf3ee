"""``planner run``'s options checked in the parent before any rank starts, so that a mistake in
them is one line now instead of a failure on every rank after a minute of set-up.

- ``--resume``: a complete checkpoint exists, was written for this model, and stopped before
  ``--steps``.
- ``--data``: the text can be read and suits the model (``planner.data.TextBatches`` built once
  here: the same checks and the same vocabulary every rank will build).
- the checkpoint folder can be written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from planner.capture.blocks import TracedModel
from planner.capture.load import ModelFile
from planner.errors import DataError, PlannerError
from planner.run.checkpoint import checkpoint_step, kept_vocab, latest_checkpoint
from planner.run.streams import vocab_size_of
from planner.schema.plan import Plan
from planner.schema.request import RunRequest


def check_resume(plan: Plan, request: RunRequest) -> int:
    """The step a ``--resume`` run continues after (0: not resuming).

    Raises:
        PlannerError: no complete checkpoint, one written for another model, or one at or past
            ``--steps``.
    """
    if not request.resume:
        return 0
    root = request.checkpoint_root
    found = latest_checkpoint(root)
    if found is None:
        raise PlannerError(
            f"--resume: no complete checkpoint in {root}; give the --checkpoint-dir of the run to continue "
            "(a save that crashed leaves only a .partial folder, which is never resumed from)"
        )
    step = checkpoint_step(found, plan.model.fingerprint, "resume with the plan of that run")
    if step >= request.steps:
        raise PlannerError(
            f"--resume: {found} is already at step {step}, and --steps {request.steps} is the run's last step "
            f"(counted from the start); give --steps above {step} to train on"
        )
    return step


def check_checkpoint_dir(request: RunRequest) -> None:
    """The checkpoint folder can be created and written (checked before training, so no run's weights are lost).

    The folders the check creates are removed again: a command that fails later leaves nothing
    behind, and the first save creates the folder for good.

    Args:
        request: ``planner run``'s options (the checkpoint folder, whether to save).

    Raises:
        PlannerError: it is a file, or cannot be created or written.
    """
    if not request.save_checkpoints:
        return
    root = request.checkpoint_root
    if root.exists() and not root.is_dir():
        raise PlannerError(f"checkpoint folder {root} is a file; give --checkpoint-dir a folder")
    created = _missing_folders(root)
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PlannerError(
                f"cannot create checkpoint folder {root}: {e.strerror or e}; pick another --checkpoint-dir"
            ) from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise PlannerError(f"checkpoint folder {root} is not writable; pick another --checkpoint-dir")
    finally:
        for folder in created:  # deepest first; a folder something else filled meanwhile stays
            with contextlib.suppress(OSError):
                folder.rmdir()


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and each of its parents that does not exist (not even as a link), deepest first."""
    missing: list[Path] = []
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def check_data(
    plan: Plan, request: RunRequest, mf: ModelFile, traced: TracedModel, print_fn: Callable[[str], None]
) -> None:
    """Read ``--data`` once as the ranks will, so a bad file or an unsuitable model is one line now.

    Prints the stream's one-line description (corpus, tokenizer, vocabulary, tokens, steps per epoch).
    Nothing is written: a vocabulary kept beside the checkpoints is read, none is kept here.

    Args:
        plan: the plan (microbatch and batch size, seed, replicas).
        request: ``planner run``'s options (``--data``, ``--tokenizer``, the checkpoint folder).
        mf: the plan's model file.
        traced: the model traced for the plan (its output width is the vocabulary).
        print_fn: where the description goes.

    Raises:
        DataError: the text cannot be read, is too short, or the model takes no token ids.
    """
    if request.data is None:
        return
    if not request.data.exists():  # before the model is asked anything: the likelier mistake
        raise DataError(f"--data {request.data}: no such file or folder; give a .txt file or a folder of them")
    from planner.data import TextBatches

    # Read a kept vocabulary, never write one: a check leaves nothing behind (the ranks keep the
    # vocabulary with their first checkpoint).
    vocab_file = kept_vocab(request.checkpoint_root) if request.save_checkpoints else None
    stream = TextBatches(
        request.data,
        example=mf.batch(plan.microbatch_size, seed=plan.model.seed),
        vocab_size=vocab_size_of(traced, mf.batch(plan.microbatch_size, seed=plan.model.seed)[0]),
        global_rows=plan.batch_size,
        replicas=plan.dp,
        tokenizer=request.tokenizer,
        eval_fraction=request.eval_fraction,
        vocab_file=vocab_file,
    )
    if request.echo:
        print_fn(stream.describe())
