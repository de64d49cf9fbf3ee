"""The model's tensor-parallel plan resolved and checked, and every block it splits given its share
(``planner.costs.tensor_parallel.tensor_parallel_shares``), fitted to the block's own costs: what
``planner plan`` asks of tensor parallelism before the search.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.capture.blocks import TracedModel
from planner.capture.load import ModelFile
from planner.capture.tp_plan import check_tp_plan, resolve_tp_plan
from planner.core.levers.hardware import HardwareSpec
from planner.costs.sequence import sequence_refusal
from planner.costs.tensor_parallel import tensor_parallel_shares
from planner.errors import ModelFileError
from planner.schema.costs import BlockCost
from planner.schema.request import PlanRequest
from planner.schema.shares import TensorParallelShare


@dataclass(frozen=True)
class TensorParallelBlocks:
    """The blocks with their ``tp`` shares, the plan they came from, and a note for the plan.

    Attributes:
        blocks: the blocks, ``tp`` set where the plan splits them.
        plan: pattern -> style (empty: the model is not split).
        note: one line on why the model is not split, for the plan's ``choice`` ("" when it is, or
            when ``--tp 1`` asked for no split).
        sequence_note: one line on why the split runs without sequence parallelism ("" when it can
            run with it, or was not asked about).
    """

    blocks: list[BlockCost]
    plan: dict[str, str]
    note: str = ""
    sequence_note: str = ""


def _fitted(block: BlockCost, share: TensorParallelShare) -> BlockCost:
    """The block with its share, the split bytes and counts at most the block's own (the share is
    counted on one forward, the block's figures may be measured or estimated); the split activations
    at most what the block saves less what every tp rank saves whole and autocast's weight copies.

    A compiled block saves less than its eager forward (``BlockCost.eager_activation_bytes``: the
    partitioner recomputes element-wise operators, whole and split alike), while the share counts the
    eager forward's tensors: the share is fitted to the eager count, then both parts scaled to what the
    compiled block saves, in the eager proportion. (Capped at the compiled count instead, the whole
    part alone could exceed it, leaving nothing split: every tp rank charged the whole layer.)"""
    own = block.activation_bytes - block.weight_cast_bytes
    eager = own if block.eager_activation_bytes is None else block.eager_activation_bytes - block.weight_cast_bytes
    unsplit = min(share.unsplit_activation_bytes, eager)
    sharded = min(share.sharded_activation_bytes, eager - unsplit)
    if eager > own:  # compiled: the same proportion of less
        unsplit = round(unsplit * own / eager)  # (at most own: unsplit is at most eager)
        sharded = min(round(sharded * own / eager), own - unsplit)  # (rounding may not add a byte)
    share = share.model_copy(
        update={
            "sharded_params": min(share.sharded_params, block.params),
            "sharded_param_bytes": min(share.sharded_param_bytes, block.param_bytes),
            "sharded_activation_bytes": sharded,
            "unsplit_activation_bytes": unsplit,
        }
    )
    return block.model_copy(update={"tp": share})


def tensor_parallel_blocks(
    mf: ModelFile,
    request: PlanRequest,
    traced: TracedModel,
    blocks: list[BlockCost],
    *,
    float_bytes: int | None = None,
    param_bytes: int | None = None,
    hardware: HardwareSpec | None = None,
    dtype: str | None = None,
    size: int | None = None,
) -> TensorParallelBlocks:
    """Resolve the model's tensor-parallel plan, check it and give every split block its share.

    Args:
        mf: the model file (its ``tp_plan``).
        request: ``tp`` (1: nothing is done; auto: an unusable plan leaves the model whole, with a note;
            N > 1: an unusable plan is an error) and the profiled microbatch.
        traced: the traced model the blocks are of.
        blocks: the blocks' costs.
        float_bytes: bytes of a floating activation in the planning dtype (autocast), None: as traced.
        param_bytes: bytes of a parameter element as the blocks count them (an estimate: the planning
            dtype's, the model being traced in fp32), None: as traced.
        hardware: the hardware of estimated costs (the shares' GEMM ``slowdown``); None: measured.
        dtype: the planning dtype (with ``hardware``).
        size: the samples per microbatch the blocks were costed at (``ProfileInfo.microbatch_size``),
            where the shares are counted, so that they scale with the blocks; None: the request's.

    Returns:
        The blocks with their shares, the plan and the note.

    Raises:
        ModelFileError: ``--tp N`` with a plan that uses other styles, does not fit the model, or a
            degree that does not divide its split sizes (or with ``--sequence-parallel`` where the
            shards would meet an operator that does not work token by token; or with ``--loss-parallel``
            where the plan splits no output head); or a model file's plan that does not fit.
    """
    if request.tp == 1 or request.tp_options == [1]:
        return TensorParallelBlocks(list(blocks), {})
    forced = isinstance(request.tp, int)
    resolved = resolve_tp_plan(mf, traced.model)
    if not resolved.plan:
        if forced and resolved.reason:
            raise ModelFileError(f"--tp {request.tp}: {resolved.reason}; give --tp 1 or auto")
        why = resolved.reason or "the model declares no tp_plan (nor a Hugging Face base_model_tp_plan)"
        return TensorParallelBlocks(list(blocks), {}, "" if forced else f"tensor parallelism: none, {why}")
    try:
        check_tp_plan(traced.model, resolved.plan, request.tp if isinstance(request.tp, int) else 1)
    except ModelFileError as e:
        if forced or resolved.source == "model file":
            raise
        return TensorParallelBlocks(list(blocks), {}, f"tensor parallelism: none, the {resolved.source}'s {e}")
    # counted at the blocks' own size: a share counted at another is fitted to blocks of that size,
    # then rescaled with them (costs reused for a request of other microbatches: bench/common.plan_on_costs)
    inputs, _ = mf.batch(size or request.microbatch_size, seed=request.seed)
    shares = tensor_parallel_shares(
        traced,
        inputs,
        resolved.plan,
        float_bytes=float_bytes,
        param_bytes=param_bytes,
        hardware=hardware,
        dtype=dtype,
    )
    if not shares:
        why = "the model was traced by module boundaries (tensor-parallel shares need a torch.fx or torch.export graph)"
        if forced:
            raise ModelFileError(f"--tp {request.tp}: {why}; give --tp 1")
        return TensorParallelBlocks(list(blocks), {}, f"tensor parallelism: none, {why}")
    refused = sequence_refusal(shares) if request.sequence_parallel else None
    if refused is not None and forced and request.sequence_parallel is True:
        raise ModelFileError(f"--sequence-parallel: {refused}; split that part in the tp_plan, or leave it out")
    if refused is not None:  # --tp auto: tensor parallelism without it, said in one line
        shares = {k: v.model_copy(update={"sequence": None}) for k, v in shares.items()}
    last = shares.get(blocks[-1].name) if blocks else None
    if request.loss_parallel and (last is None or not last.head_allgather_bytes):
        raise ModelFileError(
            "--loss-parallel: the tp_plan splits no output head in the model's last block (a 'colwise_rep' "
            "nn.Linear making the model's output, as torchtitan's 'output' or Hugging Face's 'lm_head'); add "
            "one to the tp_plan, or leave --loss-parallel out"
        )
    out = [_fitted(b, shares[b.name]) if b.name in shares else b for b in blocks]
    return TensorParallelBlocks(
        out, resolved.plan, sequence_note=f"sequence parallelism: none, {refused}" if refused else ""
    )


__all__ = ["TensorParallelBlocks", "tensor_parallel_blocks"]
