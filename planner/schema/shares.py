"""How one block divides over ranks: under sequence parallelism (``SequenceShare``), expert
parallelism (``ExpertShare``) and tensor parallelism (``TensorParallelShare``).

Pure module: pydantic only, never torch. Counted once per block at the unsharded shapes
(``planner.costs``); ``planner.core.levers`` turns a block's costs into one rank's at a degree. Part
of ``BlockCost`` (``planner.schema.costs``), so they round-trip through ``plan.json`` with it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class SequenceShare(BaseModel):
    """What sequence parallelism changes in one block (Korthikanti et al. 2022; the runner's
    ``planner.run.sequence_shard``): the values computed from a row-wise layer's output up to the
    next column-wise layer are split along the sequence over the tp ranks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    activation_bytes: int = Field(
        ge=0,
        description="Of unsplit_activation_bytes, those saved of sequence shards (norms' inputs, a column-wise "
        "layer's input, kept as the shard): each tp rank holds 1/tp of them under sequence parallelism.",
    )
    compute: float = Field(
        default=0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Share of the block's work in those operators (by elements): it runs on 1/tp of the sequence.",
    )
    gather_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes of the column-wise layers' distinct inputs that are sequence shards: each all-gathered "
        "once in forward, its gradient reduce-scattered once in backward.",
    )
    gathers: int = Field(default=0, ge=0, description="How many such inputs.")
    regather_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes the column-wise layers gather again in backward: the layers reading a gathered sequence "
        "shard keep the shard for their weight gradients (not the gathered whole), and it is gathered again once "
        "for all of them when the first of those runs.",
    )
    regathers: int = Field(default=0, ge=0, description="How many such gathers.")
    column_bytes: int = Field(
        default=0,
        ge=0,
        description="Of activation_bytes, the column-wise layers' inputs kept as shards: whole again while a "
        "layer's weight gradient runs, and whole in a recomputed region (its own forward saves them).",
    )
    whole_input_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes of the column-wise layers' distinct inputs that are not (e.g. the first layer's, "
        "from the embedding): each one's gradient all-reduced once in backward.",
    )
    whole_inputs: int = Field(default=0, ge=0, description="How many such inputs.")
    param_grad_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes of the gradients of whole parameters read on sequence shards (a norm's weight), "
        "all-reduced over the tp ranks in backward.",
    )
    param_grads: int = Field(default=0, ge=0, description="How many such gradient all-reduces.")
    cut_share: float = Field(
        default=0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Of the bytes crossing a cut after this block, the share that is sequence shards: gathered "
        "whole before they leave a stage and cut again on arrival (one all-gather each way).",
    )
    mixed: str = Field(
        default="",
        description="The first operator run on sequence shards that does not work token by token (attention the "
        "tp plan leaves whole, a reduction over the sequence): sequence parallelism cannot split this block. "
        "'' when every one does.",
    )


class ExpertShare(BaseModel):
    """What of a block its mixture-of-experts layers' experts hold and send (``BlockCost.experts``):
    the part expert parallelism shards over ``ep`` replicas and the tokens it dispatches to them
    (``planner.core.levers.experts.at_degree``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(ge=1, description="The block's mixture-of-experts layers (an all-to-all pair each way).")
    experts: int = Field(ge=1, description="Experts per layer (the least, where the block's layers differ).")
    params: int = Field(ge=0, description="Of the block's params, its experts' (all layers, every expert).")
    param_bytes: int = Field(ge=0, description="Their bytes, as the block counts its parameters.")
    dispatch_bytes: int = Field(
        ge=0,
        description="Bytes of the rows the block's layers route to their experts per microbatch (every token "
        "through top_k experts; all layers), in the activations' dtype: what dispatch sends and combine returns.",
    )
    rows: int = Field(default=0, ge=0, description="The rows dispatch_bytes holds (all layers; 0: not counted).")
    token_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes of the tokens the block's layers hand their experts per microbatch (T x d each, all "
        "layers, the activations' dtype; dispatch_bytes over top_k): what one tensor-parallel rank gathers from "
        "the others where an expert group spans them (planner.core.levers.experts). 0: not counted (taken as "
        "dispatch_bytes).",
    )
    flops_fwd: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Forward FLOPs of the experts' GEMMs per microbatch (2 x rows x each expert's weight elements).",
    )
    saved_bytes: int = Field(
        default=0,
        ge=0,
        description="Of activation_bytes, what the experts' GEMMs save per microbatch at an even spread (each "
        "GEMM's input and output rows, all layers): the busiest rank saves imbalance x these.",
    )
    gemm_s: dict[int, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Per expert-parallel degree, the forward seconds of the block's expert GEMMs on the busiest "
        "rank: each layer's experts / degree of them, multiplying the rows routed to them (imbalance x the mean, "
        "degree x as many per expert as unsplit); the backward's two GEMMs per weight take twice this. Estimated "
        "costs only (the roofline at those shapes: few rows per expert leave a GEMM memory-bound on its "
        "weights); listed for every divisor of experts. Empty (measured costs): the measured time stands, "
        "its experts' FLOP share scaled by the imbalance.",
    )
    imbalance: dict[int, Annotated[float, Field(ge=1, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Per expert-parallel degree, the routed rows of the busiest rank over the mean (summed over "
        "the block's layers, each layer's busiest rank): measured from the router on the example microbatch, "
        "or from the --moe-imbalance setting (planner.costs.experts.spread_imbalance). Empty: 1 (an even spread).",
    )

    ranks: int = Field(
        default=1,
        ge=1,
        description="In one rank's costs (planner.core.levers.experts.at_degree): the expert-parallel group of "
        "whose ranks it holds 1 / ranks of every layer's experts; 1 in a model's own costs (every expert).",
    )
    span: int = Field(
        default=1,
        ge=1,
        description="Of those ranks, the tensor-parallel ranks of one replica the group spans (each routes its "
        "1 / span of the replica's tokens): the group covers ranks / span replicas.",
    )

    def imbalance_at(self, ep: int) -> float:
        """The busiest rank's rows over the mean at degree ``ep`` (1 where nothing is listed).

        Args:
            ep: the expert-parallel degree.

        Returns:
            The factor.
        """
        return self.imbalance.get(ep, 1.0) if ep > 1 else 1.0


class TensorParallelShare(BaseModel):
    """How one block divides over ``tp`` tensor-parallel ranks, from its model's tensor-parallel plan.

    Measured or estimated once, at the unsharded shapes and the profiled microbatch size;
    ``planner.core.levers.tensor_parallel.at_degree`` turns a block's costs into one tensor-parallel rank's
    at a degree. Column-wise layers split their output features, row-wise layers their input features
    (Megatron-LM's layout, torch's ``ColwiseParallel`` / ``RowwiseParallel``): every operator between a
    column-wise and the following row-wise layer then runs on 1/tp of the features, and each row-wise
    output is all-reduced over the tensor-parallel ranks in forward, each column-wise input's gradient
    in backward. A ``colwise_rep`` layer (an output head) splits its output features and all-gathers
    its output whole in forward.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sharded_params: int = Field(ge=0, description="Of the block's params, those the plan splits over the tp ranks.")
    sharded_param_bytes: int = Field(ge=0, description="Bytes of those parameters.")
    sharded_compute: float = Field(
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Share of the block's forward and backward work in split operators (by FLOPs): it runs on "
        "1/tp of the features; the rest (norms, embeddings, residual adds) runs whole on every tp rank.",
    )
    sharded_activation_bytes: int = Field(
        ge=0, description="Of activation_bytes, those saved by split operators (each tp rank holds 1/tp of them)."
    )
    unsplit_activation_bytes: int = Field(
        default=0,
        ge=0,
        description="Of activation_bytes, those every tp rank saves whole (a column-wise layer's input, a norm's "
        "input and output): what sharded_activation_bytes can be at most is activation_bytes less these.",
    )
    fwd_allreduce_bytes: int = Field(
        ge=0, description="Bytes all-reduced over the tp ranks in forward per microbatch (row-wise outputs)."
    )
    bwd_allreduce_bytes: int = Field(
        ge=0, description="Bytes all-reduced in backward per microbatch (column-wise inputs' gradients)."
    )
    fwd_allgather_bytes: int = Field(
        default=0,
        ge=0,
        description="Bytes all-gathered over the tp ranks in forward per microbatch (the whole outputs of "
        "colwise_rep layers, e.g. an output head's logits); their backward takes each rank's slice, no traffic.",
    )
    head_allgather_bytes: int = Field(
        default=0,
        ge=0,
        description="Of fwd_allgather_bytes, an output head's: a colwise_rep nn.Linear's whole output (the logits), "
        "which loss parallelism leaves split (the loss then runs on each rank's columns, torch's loss_parallel).",
    )
    head_rows: int = Field(
        default=0, ge=0, description="Rows of that output (its elements over its last dimension: the tokens)."
    )
    fwd_allreduces: int = Field(ge=0, description="All-reduces in forward per microbatch.")
    bwd_allreduces: int = Field(ge=0, description="All-reduces in backward per microbatch.")
    sequence: SequenceShare | None = Field(
        default=None,
        description="What sequence parallelism changes in the block (planner.capture.tp_sequence); None: "
        "counted before sequence parallelism was modelled, or nothing of the block is a sequence shard.",
    )
    divisor: int = Field(
        ge=0,
        description="The greatest common divisor of every split size (features, heads): a degree must divide it. "
        "0: any degree (a block whose only split layers are colwise_rep, e.g. an output head, whose rows torch "
        "shards unevenly where the degree does not divide them); gcd(0, n) = n, so 0 joins the others' gcd as is.",
    )
    slowdown: dict[int, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Per degree, the factor by which the split part's time on one tp rank exceeds sharded_compute / "
        "tp: estimated costs only, from the roofline's GEMM efficiency at the split layers' sharded shapes (a "
        "column-wise layer's GEMM on n / tp output features, a row-wise one's on k / tp input features, which "
        "reach less of peak, HardwareSpec.gemm_efficiency). Listed for the divisors of divisor up to 64; a degree "
        "not listed takes the largest listed degree below it, 1.0 when there is none. Empty (measured costs): 1.0.",
    )

    def slowdown_at(self, tp: int) -> float:
        """The split part's slowdown at degree ``tp`` (``slowdown``; 1.0 where nothing applies).

        Args:
            tp: the tensor-parallel degree.

        Returns:
            The factor, the largest listed degree at most ``tp`` answering for an unlisted one.
        """
        below = [t for t in self.slowdown if t <= tp]
        return self.slowdown[max(below)] if below else 1.0
