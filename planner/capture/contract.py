"""The promises of a model file that a pipeline relies on, checked on example data before profiling.

``make_batch`` returns batches of the size asked for, ``loss_fn`` is a scalar mean over the batch,
``train_batches`` yields what ``make_batch`` gives: each broken promise is one clear
``ModelFileError`` here instead of a wrong plan or a failure deep inside profiling or training.
Loading the file itself is ``planner.capture.load``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from planner.capture.blocks import GraphTrace, TracedModel
from planner.capture.load import Batch, ModelFile, shape_of
from planner.capture.meta_cache import meta_op_cache, on_meta
from planner.capture.stage import trace_root
from planner.errors import ModelFileError
from planner.torch_compat import pytree


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode inside the block, each module's mode restored after it. The flags are set directly:
    torch.export's modules refuse ``.eval()`` (their dropout is fixed in the graph)."""
    saved = [(m, m.training) for m in model.modules()]
    for m, _ in saved:
        m.training = False
    try:
        yield
    finally:
        for m, mode in saved:
            m.training = mode


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
"""torch's batch norms (their lazy forms become these at their first forward, which the trace runs)."""


def batch_norms(model: nn.Module) -> list[str]:
    """The modules of ``model`` that normalize by the statistics of the batch they are given (batch
    norm, which the planner runs in training mode): under a pipeline each microbatch, and under data
    parallelism each replica's share, is normalized by its own, so such a model trains as the unsplit
    one only with one microbatch and one replica (GPipe's caveat; torchgpipe's deferred batch norm
    shares only the running statistics).

    Args:
        model: the model as ``build_model`` gave it.

    Returns:
        Their names, in ``named_modules`` order.
    """
    return [name for name, m in model.named_modules() if isinstance(m, BATCH_NORMS)]


def check_forward(mf: ModelFile, model: nn.Module, inputs: tuple, target: torch.Tensor) -> None:
    """Run the model and ``loss_fn`` once on the example batch, so a mistake in the model file shows
    as one clear error here instead of deep inside profiling.

    Args:
        mf: the model file.
        model: a model built from it (a private copy: this runs forward in eval mode, no grad).
        inputs: the example microbatch's inputs.
        target: its target.

    Raises:
        ModelFileError: no trainable parameter, the forward or the loss fails, or the loss is not a
            scalar tensor or has no gradient.
    """
    check_trainable(mf, model)
    with evaluating(model), torch.no_grad(), meta_op_cache(on_meta(model, inputs)):
        out = mf._call("forward", model, *inputs)
    check_loss(mf, out, target)


def check_traced_forward(mf: ModelFile, traced: TracedModel, inputs: tuple, target: torch.Tensor) -> None:
    """``check_forward`` of a model traced on the meta device, on its trace rather than the model:
    model code may read data in an eager forward (transformers' mask code calls ``.item()``), which
    meta tensors have none of; the graph holds no such reads (the tracers refuse them).

    An fx trace kept what its graph returned when its values were recorded on these inputs on the
    meta device (``GraphTrace.example_output``; an fx graph's output is the model's own): only the
    loss runs. Otherwise the trace's root module runs (``trace_root``; torch.export's unflattens its
    flattened output).

    Args:
        mf: the model file.
        traced: the model's trace on ``inputs`` (meta).
        inputs: the example microbatch's inputs.
        target: its target.

    Raises:
        ModelFileError: the forward or the loss fails, or the loss is not a scalar tensor.
    """
    if isinstance(traced, GraphTrace) and traced.method == "fx" and traced.example_output is not None:
        check_loss(mf, traced.example_output, target)
    else:
        check_forward(mf, trace_root(traced), inputs, target)


SEQUENCE_DIM = 1  # [batch, seq, ...]: the dimension context parallelism splits, in every input and target


def _has_sequence(x: torch.Tensor) -> bool:
    """Whether dimension 1 of an input can be a sequence: token ids ``[batch, seq]`` (or more), or
    ``[batch, seq, ...]`` of three or more dimensions, where layers act on the last."""
    return x.dim() >= 3 or (x.dim() == 2 and not (x.is_floating_point() or x.is_complex()))


def sequence_length(inputs: tuple | list, cp: int) -> int:
    """The sequence context parallelism splits: dimension 1 of the model's inputs that have one (token
    ids of two or more dimensions, other tensors of three or more: in a float ``[batch, features]``
    dimension 1 is what the first layer contracts, no sequence), one length for all, divisible by
    ``2 x cp`` (each rank holds a chunk of two blocks, and computes the queries of two mirrored ones:
    ``planner.run.context_shard.Mirrored``).

    Args:
        inputs: one microbatch's positional inputs.
        cp: the context-parallel ranks it splits over.

    Returns:
        The length.

    Raises:
        ModelFileError: no input has a sequence dimension, two disagree, or it does not split into
            ``2 x cp`` equal blocks.
    """
    lengths = {int(x.shape[SEQUENCE_DIM]) for x in inputs if isinstance(x, torch.Tensor) and _has_sequence(x)}
    if len(lengths) != 1:
        found = (
            f"sequences of {sorted(lengths)} positions"
            if lengths
            else "no such dimension (token ids [batch, seq], or a [batch, seq, ...] tensor of three or more)"
        )
        raise ModelFileError(
            "context parallelism (--cp) splits dimension 1 of the model's inputs (the sequence); this model's "
            f"inputs have {found}; plan without --cp"
        )
    length = lengths.pop()
    if cp > 1 and length % (2 * cp):
        raise ModelFileError(
            f"--cp {cp}: the sequence has {length} positions, which do not split into {2 * cp} equal blocks (each "
            f"rank holds two, for the causal load balance); use a sequence length divisible by {2 * cp} (--set "
            "seq_len=...)"
        )
    return length


def check_loss(mf: ModelFile, out: object, target: torch.Tensor) -> None:
    """Run ``loss_fn`` on the model's output for the example batch (no grad): the second half of
    ``check_forward``, for an output already at hand (a meta trace's, ``GraphTrace.example_output``).

    Args:
        mf: the model file.
        out: the model's output on the example microbatch.
        target: its target.

    The output's floating-point tensors are given to ``loss_fn`` as leaves that need a gradient (as
    training's would): a loss that then needs none was cut from them (``.detach()``, ``.item()``, a
    new tensor), and training would have nothing to step.

    Raises:
        ModelFileError: the loss fails, is not a scalar tensor, or has no gradient.
    """
    leaves = pytree.tree_map_only(torch.Tensor, _needing_grad, out)
    with torch.enable_grad():
        loss = mf._call("loss_fn", mf.loss_fn, leaves, target)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ModelFileError(
            f"{mf.path.name}: loss_fn() returned {shape_of(loss) if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}; expected a scalar tensor (a mean over the batch)"
        )
    if not loss.requires_grad and any(
        x.requires_grad for x in pytree.tree_leaves(leaves) if isinstance(x, torch.Tensor)
    ):
        raise ModelFileError(
            f"{mf.path.name}: loss_fn() returned a loss with no gradient: it does not depend on the model's output "
            "(.detach(), .item() or a new tensor cut it off); compute the loss from the output's tensors"
        )


def _needing_grad(x: torch.Tensor) -> torch.Tensor:
    """A floating-point tensor as a leaf that needs a gradient (another as it is)."""
    return x.detach().requires_grad_() if x.is_floating_point() or x.is_complex() else x


def check_trainable(mf: ModelFile, model: nn.Module) -> None:
    """The model has a parameter to train.

    Args:
        mf: the model file.
        model: a model built from it.

    Raises:
        ModelFileError: no parameter needs a gradient.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(
            f"{mf.path.name}: build_model() returned a model with no trainable parameter (none, or every one "
            "with requires_grad=False): a pipeline has nothing to train"
        )


def _batch_dim_sizes(batch: Batch) -> set[int]:
    inputs, target = batch
    return {int(t.shape[0]) for t in (*inputs, target) if isinstance(t, torch.Tensor) and t.dim() >= 1}


def check_batch_size(mf: ModelFile, n: int, seed: int) -> Batch:
    """``make_batch(n)`` returns tensors whose first dimension is ``n``: the schedule splits the
    batch into microbatches along dim 0, so a file that ignores ``batch_size`` would be profiled,
    estimated and trained on batches of another size.

    Args:
        mf: the model file.
        n: the batch size to ask for.
        seed: seed of the example data.

    Returns:
        The batch.

    Raises:
        ModelFileError: a tensor whose first dimension is not ``n``.
    """
    inputs, target = mf.batch(n, seed=seed)
    sizes = _batch_dim_sizes((inputs, target))
    if sizes != {n}:
        raise ModelFileError(
            f"{mf.path.name}: make_batch({n}) returned tensors whose first dimension is {sorted(sizes)}, not {n}; "
            "the pipeline splits batches along dim 0: make make_batch honour batch_size (batch first)"
        )
    return inputs, target


def _layout(batch: Batch) -> list[tuple[str, tuple[int, ...], str] | str]:
    """Per input, then the target: (name, shape, dtype) of a tensor, or the repr of anything else."""
    inputs, target = batch
    out: list[tuple[str, tuple[int, ...], str] | str] = []
    for i, x in enumerate((*inputs, target)):
        name = "target" if i == len(inputs) else f"input {i}"
        out.append(
            (name, tuple(x.shape), str(x.dtype).removeprefix("torch.")) if isinstance(x, torch.Tensor) else repr(x)
        )
    return out


def check_train_batch(mf: ModelFile, batch_size: int, seed: int) -> None:
    """The first batch of the training stream has the layout the plan was made for (that of
    ``make_batch(batch_size)``): same inputs, shapes and dtypes. Checked before any rank starts, so
    a stream of the wrong batch size is one line here instead of a collective failing on the rank
    that happens to notice.

    Args:
        mf: the model file.
        batch_size: the plan's batch size.
        seed: the plan's seed.

    Raises:
        ModelFileError: the first difference, named.
    """
    if getattr(mf.module, "train_batches", None) is None:
        return  # the stream is make_batch itself
    want = _layout(mf.batch(batch_size, seed=seed))
    got = _layout(next(mf.train_batches(batch_size, seed=seed)))
    if len(got) != len(want):
        raise ModelFileError(
            f"{mf.path.name}: train_batches({batch_size}) yields {len(got) - 1} input(s) but make_batch({batch_size}) "
            f"gives {len(want) - 1}, which the plan was made with; make both return the same inputs"
        )
    for g, w in zip(got, want):
        if g != w:
            what = w[0] if isinstance(w, tuple) else "an input"
            shown = lambda v: f"shape {list(v[1])} {v[2]}" if isinstance(v, tuple) else v  # noqa: E731
            raise ModelFileError(
                f"{mf.path.name}: train_batches({batch_size}) yields {what} of {shown(g)} but the plan was made for "
                f"{shown(w)} (make_batch({batch_size})); yield batches of batch_size samples shaped like make_batch's"
            )


def check_batch_contract(
    mf: ModelFile, model: nn.Module, microbatch_size: int, seed: int, device: torch.device
) -> None:
    """Check the two promises a pipeline relies on, on two microbatches of example data.

    1. ``make_batch(n)`` returns tensors whose first dimension is ``n``: the schedule splits the
       batch into microbatches along dim 0, so a file that ignores ``batch_size`` would be
       profiled on the wrong batch.
    2. ``loss_fn`` is a mean over the batch: the pipeline averages the microbatch losses, which
       equals the batch loss only then. The loss of the two-microbatch batch is compared with the
       mean of its halves' losses (eval mode and no grad, so dropout cannot blur the comparison).

    The check runs the model in full precision on twice the plan's microbatch, which on a GPU can
    need more memory than training itself (a large vocabulary's fp32 logits and loss): when that
    runs out of device memory, the check is made again on two microbatches of one sample, since
    the promises do not depend on the microbatch size.

    Args:
        mf: the model file.
        model: a model built from it (a private copy; run in eval mode and restored).
        microbatch_size: samples per microbatch of the plan.
        seed: seed of the example data.
        device: where ``model`` lives.

    Raises:
        ModelFileError: a batch of the wrong size, a non-finite loss, or a loss that is not a mean.
    """
    out_of_memory = False
    try:
        full, parts = _losses_of_halves(mf, model, microbatch_size, seed, device)
    except ModelFileError as e:
        if microbatch_size == 1 or not isinstance(e.__cause__, torch.OutOfMemoryError):
            raise
        out_of_memory = True
    if out_of_memory:  # retried outside the handler, so that the failed attempt's tensors are freed first
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            full, parts = _losses_of_halves(mf, model, 1, seed, device)
        except ModelFileError as e:
            raise ModelFileError(
                f"{e} (checking the model file on 2 x {microbatch_size} samples ran out of memory, and on 2 x 1)"
            ) from e.__cause__
        microbatch_size = 1
    n = 2 * microbatch_size
    if not all(math.isfinite(v) for v in (full, *parts)):
        raise ModelFileError(
            f"{mf.path.name}: loss_fn() is {full} on the example batch (microbatches: {parts[0]}, {parts[1]}); "
            "check the model's initialisation and the loss"
        )
    mean = (parts[0] + parts[1]) / 2
    if abs(full - mean) <= 1e-3 * max(abs(full), abs(mean)) + 1e-7:
        return
    summed = abs(full - 2 * mean) <= 1e-3 * max(abs(full), abs(mean)) + 1e-7
    why = "sums over the batch instead of averaging" if summed else "is not a mean over the batch"
    raise ModelFileError(
        f"{mf.path.name}: loss_fn() {why}: {full:.6g} on {n} samples but {parts[0]:.6g} and {parts[1]:.6g} on its two "
        "halves; the pipeline averages microbatch losses, which equals the batch loss only for a mean: "
        "use reduction='mean' (the contract's default cross-entropy does)"
    )


def _losses_of_halves(
    mf: ModelFile, model: nn.Module, microbatch_size: int, seed: int, device: torch.device
) -> tuple[float, list[float]]:
    """The loss of a batch of two microbatches of ``microbatch_size`` and the loss of each half."""
    inputs, target = check_batch_size(mf, 2 * microbatch_size, seed)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    target = target.to(device)
    halves = [
        (
            tuple(
                x[i * microbatch_size : (i + 1) * microbatch_size] if isinstance(x, torch.Tensor) else x for x in inputs
            ),
            target[i * microbatch_size : (i + 1) * microbatch_size],
        )
        for i in range(2)
    ]
    with evaluating(model), torch.no_grad():
        full = float(mf._call("loss_fn", mf.loss_fn, mf._call("forward", model, *inputs), target))
        parts = [float(mf._call("loss_fn", mf.loss_fn, mf._call("forward", model, *x), y)) for x, y in halves]
    return full, parts
