"""A rank's data: the model file's own stream of global batches, or ``--data``'s text
(``planner.data.TextBatches``, sized by the model's vocabulary), each cut to this replica's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from planner.capture.blocks import TracedModel
from planner.capture.graph import buffers_restored
from planner.capture.load import ModelFile, model_output
from planner.capture.shapes import shapes_or_real
from planner.capture.stage import stage_inputs, stage_module, trace_root
from planner.run.checkpoint import kept_vocab
from planner.run.mesh import RankMesh
from planner.schema.plan import Plan
from planner.schema.run_request import RunRequest


def replica_rows(value: Any, replica: int, replicas: int) -> Any:
    """This replica's rows of a batch (tensors and tuples, lists or dicts of them; dim 0 is the sample).

    Args:
        value: a global batch's inputs or target.
        replica: this replica, 0 .. replicas - 1.
        replicas: the plan's replicas (they divide the batch).

    Returns:
        The same structure holding the replica's contiguous share of the rows (anything that is not
        a tensor is kept as it is).
    """
    if replicas == 1:
        return value
    if isinstance(value, torch.Tensor):
        n = value.shape[0] // replicas
        return value[replica * n : (replica + 1) * n]
    if isinstance(value, (tuple, list)):
        return type(value)(replica_rows(v, replica, replicas) for v in value)
    if isinstance(value, dict):
        return {k: replica_rows(v, replica, replicas) for k, v in value.items()}
    return value


def model_stream(mf: ModelFile, plan: Plan, mesh: RankMesh, skip: int) -> Iterator[tuple[Any, torch.Tensor]]:
    """The model file's own stream of global batches, cut to this replica's rows, after ``skip``
    batches (a resumed run replays the seeded stream up to its step).

    Args:
        mf: the plan's model file (its ``train_batches``).
        plan: the plan (batch size, seed, replicas).
        mesh: this rank's place (its replica).
        skip: global batches to pass over first.

    Returns:
        An iterator of (inputs, target), this replica's rows.
    """
    for k, (inputs, target) in enumerate(mf.train_batches(plan.batch_size, seed=plan.model.seed)):
        if k >= skip:
            rows = mesh.data_replica(plan)  # a context-parallel rank reads its replica's rows whole
            yield replica_rows(inputs, rows, plan.dp), replica_rows(target, rows, plan.dp)


def text_stream(plan: Plan, request: RunRequest, mf: ModelFile, mesh: RankMesh, vocab_size: int) -> Any:
    """``--data``'s stream for this replica (``planner.data.TextBatches``), reading the vocabulary kept
    beside the checkpoints when there is one, so a resumed run reads the same ids (the worker keeps
    it with the first checkpoint: ``planner.run.checkpoint.keep_vocab``).

    Args:
        plan: the plan (microbatch and batch size, seed, replicas).
        request: ``planner run``'s options (``--data``, ``--tokenizer``, the checkpoint folder).
        mf: the plan's model file (its example batch gives the format).
        mesh: this rank's place (its replica).
        vocab_size: the model's output width.

    Returns:
        The stream (a ``TextBatches``).

    Raises:
        DataError: the text or the vocabulary file does not suit the model.
    """
    from planner.data import TextBatches

    example = mf.batch(plan.microbatch_size, seed=plan.model.seed)
    # only a resumed run continues the kept ids: a fresh one builds its own from its --data (an earlier
    # run's vocabulary, of another text, would give other ids) and replaces it with its first checkpoint
    vocab_file = kept_vocab(request.checkpoint_root) if request.save_checkpoints and request.resume else None
    return TextBatches(
        request.data,
        example=example,
        vocab_size=vocab_size,
        global_rows=plan.batch_size,
        replica=mesh.data_replica(plan),
        replicas=plan.dp,
        tokenizer=request.tokenizer,
        eval_fraction=request.eval_fraction,
        vocab_file=vocab_file,
    )


def vocab_size_of(traced: TracedModel, example: tuple) -> int:
    """The model's vocabulary: the last dimension of its output on one example microbatch (as every
    rank computes it, so the parent's vocabulary is theirs).

    Args:
        traced: the model traced for the plan.
        example: one microbatch's positional inputs (the plan's model file's, at its seed).

    Returns:
        The width of the model's first output's last dimension.
    """
    # the forward must leave no trace: batch norm's running statistics and the RNG are put back
    with buffers_restored(trace_root(traced)), torch.random.fork_rng(devices=[]), torch.no_grad():
        whole = stage_module(traced, 0, len(traced.blocks))
        out = shapes_or_real(whole, whole, *stage_inputs(example))  # its shape only: on fake tensors where they run
    first = out[0] if isinstance(out, tuple) else model_output(out)
    return int(first.shape[-1])
