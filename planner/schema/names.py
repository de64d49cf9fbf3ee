"""The planner's names for the choices its options take: schedules, split methods, recomputation,
dtypes, data-parallel modes, FSDP units and context-parallel attention, with torch's schedule names.

Pure module: never torch.
"""

from __future__ import annotations

from typing import Literal, get_args

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"]
Method = Literal["optimal", "uniform", "params", "given"]
Recompute = Literal["auto", "never", "selective", "full", "stage", "always"]
"""``--recompute``: activation checkpointing per stage ("always": the old name of "full")."""
Dtype = Literal["bf16", "fp16", "fp32", "fp8", "fp8-rowwise"]
"""``--dtype``; fp8 and fp8-rowwise: bf16 with the linear layers' GEMMs in float8 (``core/levers/float8``)."""
DpMode = Literal["ddp", "fsdp", "hsdp"]
"""How data-parallel replicas reduce their gradients: DDP (all-reduce; every replica holds the whole
stage), FSDP2 ``fully_shard`` (parameters, gradients and optimizer state sharded over every replica;
per stage or block by block: ``FsdpUnits``) or HSDP (``fully_shard`` on a 2-D mesh: sharded inside
groups of ``dp_shard`` replicas, the groups replicas of each other, their gradients all-reduced)."""
DP_MODES: tuple[str, ...] = get_args(DpMode)
FsdpUnits = Literal["stage", "block"]
"""What FSDP gathers at a time: "stage" (one ``fully_shard`` unit per stage, gathered from the first
forward to the last backward of a step, reduce-scattered once) or "block" (one unit per block, as
torchtitan shards each layer: gathered for each microbatch's forward and again for its backward,
resharded after each, its gradients reduce-scattered every microbatch)."""
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""The planner's schedule names (``--schedule``), in the order the search tries them."""
ZERO_BUBBLE: frozenset[str] = frozenset({"interleaved-zb", "zbv", "dualpipev"})
"""The zero-bubble schedules: each stage's backward runs as an input-gradient pass and a separate
weight-gradient pass (torch's ``_PipelineScheduleRuntime`` actions I and W)."""

TORCH_NAMES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
"""Our name -> the name ``torch.distributed.pipelining.get_schedule_class`` takes."""


def schedule_name(name: str) -> str:
    """Our name for a schedule given by our name or torch's class name (case-insensitive).

    Args:
        name: e.g. ``interleaved-1f1b``, ``Interleaved1F1B`` or ``ScheduleInterleaved1F1B``.

    Returns:
        The planner's name (a member of ``SCHEDULES``).

    Raises:
        ValueError: not a schedule torch 2.13 provides.
    """
    key = name.strip().lower().removeprefix("schedule")
    for ours, theirs in TORCH_NAMES.items():
        if key in (ours, theirs.lower()):
            return ours
    raise ValueError(
        f"not a pipeline schedule; expected one of {', '.join(SCHEDULES)}, auto "
        f"(or torch's names: {', '.join(TORCH_NAMES.values())})"
    )


CpAttention = Literal["all-gather", "ring"]
"""How context-parallel ranks attend over the whole sequence: "all-gather" (every position's keys and
values gathered before attention, the Llama 3 run's choice; Megatron-Core's ``--cp-comm-type
allgather``) or "ring" (passed around the group's ring a chunk at a time, overlapped with attention on
the chunk held: ``planner.run.ring_attention``; Megatron-Core's ``p2p``, torchtitan's ``alltoall``
rotation)."""
CP_ATTENTION: tuple[str, ...] = get_args(CpAttention)

METHODS: tuple[str, ...] = get_args(Method)
RECOMPUTE: tuple[str, ...] = get_args(Recompute)
DTYPES: tuple[str, ...] = get_args(Dtype)
