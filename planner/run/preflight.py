"""``planner run``'s options checked in the parent before any rank starts, so that a mistake in
them is one line now instead of a failure on every rank after a minute of set-up.

- ``--resume``: a complete checkpoint exists, was written for this model, and stopped before
  ``--steps``.
- ``--data``: the text can be read and suits the model (``planner.data.TextBatches`` built once
  here: the same checks and the same vocabulary every rank will build).
- the checkpoint folder can be written, and belongs to this plan's model: another model's
  checkpoints, or a ``latest`` or step folder ``planner run`` did not write, are refused (nothing
  of theirs is replaced); an earlier run of this model's checkpoints are announced (this run's
  first save replaces them).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.capture.blocks import TracedModel
from planner.capture.graph_file import RankGraphs
from planner.capture.load import ModelFile
from planner.capture.stage import stage_module
from planner.errors import DataError, PlannerError
from planner.run.checkpoint import (
    check_latest_replaceable,
    checkpoint_step,
    earlier_checkpoints,
    kept_vocab,
    latest_checkpoint,
    owned_by_planner,
    step_of,
)
from planner.run.model import StageSource, check_ties
from planner.run.streams import vocab_size_of
from planner.run.tensor_shard import check_tp_degree, check_tp_split, shardable_trace
from planner.schema.plan import Plan
from planner.schema.run_request import RunRequest


def check_resume(plan: Plan, request: RunRequest) -> int:
    """The step a ``--resume`` run continues after (0: not resuming).

    Raises:
        PlannerError: no complete checkpoint, one written for another model, one at or past
            ``--steps``, or one of a run on another data stream (the model file's where ``--data``
            is given, a ``--data`` run's, which keeps its vocabulary beside it, where it is not).
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
    was_text = kept_vocab(root) is not None  # a --data run keeps its vocabulary with its first checkpoint
    if was_text != (request.data is not None):
        ran = "--data (its vocab.json is there)" if was_text else "the model file's own data"
        fix = "give the same --data and --tokenizer" if was_text else "leave out --data"
        raise PlannerError(
            f"--resume: {root} holds the checkpoints of a run on {ran}; {fix} to continue it (or start afresh "
            "with another --checkpoint-dir)"
        )
    if step >= request.steps:
        raise PlannerError(
            f"--resume: {found} is already at step {step}, and --steps {request.steps} is the run's last step "
            f"(counted from the start); give --steps above {step} to train on"
        )
    return step


def check_checkpoint_dir(plan: Plan, request: RunRequest, print_fn: Callable[[str], None]) -> None:
    """The checkpoint folder can be created and written, and is this plan's (checked before training,
    so no run's weights are lost and nothing the run did not write is replaced).

    The folders the check creates are removed again: a command that fails later leaves nothing
    behind, and the first save creates the folder for good.

    Args:
        plan: the plan (its model's fingerprint).
        request: ``planner run``'s options (the checkpoint folder, whether to save, ``--resume``).
        print_fn: where the note on an earlier run's checkpoints goes.

    Raises:
        PlannerError: it is a file, cannot be created or written, holds another model's checkpoints,
            or a ``latest`` or step folder that ``planner run`` did not write.
    """
    if not request.save_checkpoints:
        return
    root = request.checkpoint_root
    if root.exists() and not root.is_dir():
        raise PlannerError(f"checkpoint folder {root} is a file; give --checkpoint-dir a folder")
    check_checkpoint_owner(plan, request, print_fn)
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


def check_checkpoint_owner(plan: Plan, request: RunRequest, print_fn: Callable[[str], None]) -> None:
    """The checkpoint folder holds nothing this run would wrongly replace or mix with its own.

    A fresh run (no ``--resume``) into a folder of an earlier run of the same model goes ahead (re-running
    a plan must work) with one note: that run's checkpoints are replaced at this run's first save.

    Args:
        plan: the plan (its model's fingerprint).
        request: ``planner run``'s options.
        print_fn: where the note goes.

    Raises:
        PlannerError: another model's checkpoints are there, or a ``latest`` or a step folder this
            run would save that ``planner run`` did not write.
    """
    root, fingerprint = request.checkpoint_root, plan.model.fingerprint
    where = f"--checkpoint-dir {root}" if request.checkpoint_dir is not None else f"checkpoint folder {root}"
    check_latest_replaceable(root, where)
    earlier = earlier_checkpoints(root)
    others = [(p, m) for p, m in earlier if m.get("plan_fingerprint") not in (None, fingerprint)]
    if others:
        theirs = others[-1][1]["plan_fingerprint"]
        raise PlannerError(
            f"{where} holds checkpoints of another model (fingerprint {theirs}, {_steps(others)}; this plan's is "
            f"{fingerprint}); give --checkpoint-dir another folder, or remove {root} to start afresh"
        )
    every = request.checkpoint_every
    # the folders already there, not the steps to save: --steps may be huge, the folder is small
    for path in sorted(root.glob("step_*")) if root.is_dir() else []:
        step = step_of(path)
        if step is None:
            continue  # no step_dir name: no save writes there
        saves = step == request.steps or (every > 0 and step < request.steps and step % every == 0)
        if saves and not owned_by_planner(path):
            raise PlannerError(
                f"{where}: {path} is not a checkpoint `planner run` wrote, and this run would save step {step} "
                "there; move it away, or give --checkpoint-dir another folder"
            )
    if earlier and not request.resume:
        print_fn(
            f"note: {root} holds the checkpoints of an earlier run of this model ({_steps(earlier)}); this run "
            "replaces them at its first save (--resume would continue that run instead)"
        )


def _steps(found: list[tuple[Path, dict[str, Any]]]) -> str:
    """``steps 2 to 27`` (or ``step 4``) of the checkpoints found."""
    steps = sorted(int(m["step"]) for _, m in found)
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"


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
    vocab_file = kept_vocab(request.checkpoint_root) if request.save_checkpoints and request.resume else None
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


def check_stages(plan: Plan, traced: TracedModel, source: StageSource, graphs: RankGraphs | None) -> None:
    """Before any rank starts: the plan's tp against the model (``check_tp_degree``), every stage built
    once (illegal cuts), its tensor-parallel split (``check_tp_split``), and tied weights recorded.

    Raises:
        TraceError: a stage cannot be cut out of the model.
        PlanFileError: a tie the plan does not record (``check_ties``), or a ``tp_plan`` the stages
            cannot be split by.
    """
    check_tp_degree(source.model, plan.tp_plan, plan.tp)  # heads too, as `planner plan` checked its degree
    shardable = shardable_trace(traced, source.model, source.example, plan.tp_plan, plan.tp, graphs)
    for s in plan.stages:
        built = stage_module(shardable, s.start, s.end)
        if plan.tp > 1:
            check_tp_split(built, plan.tp_plan, plan.tp)
    check_ties(plan, traced)
