"""The one record of a split: where each stage starts and how each stage recomputes (``Split``).

The solver returns one (``planner.core.split.stage_model.Partition`` is a ``Split`` with its
bottleneck), the stage plans lay one out, the search's candidates and the predictions carry one.
Only the schema keeps the two fields apart (``Prediction``, ``Candidate``, ``StagePlan`` in
plan.json): ``Split.of`` reads them back at that boundary.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from planner.core.levers.recompute import compact_flags, recompute_flags


class HasSplit(Protocol):
    """A schema record holding a split's two fields (``Prediction``, ``Candidate``)."""

    @property
    def starts(self) -> tuple[int, ...]: ...

    @property
    def recompute(self) -> tuple[str, ...]: ...


class Split(BaseModel):
    """A split of the blocks into contiguous stages, and each stage's recompute mode.

    Whether the cuts are legal for a model's blocks (non-empty stages, cuts only after blocks that
    allow one) is checked where the blocks are known (``stage_model.check_starts``), with the user's
    error message; the record itself takes any starts.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    starts: tuple[int, ...] = Field(
        description="First block of each stage; starts[0] == 0, strictly increasing. Stage k is "
        "blocks[starts[k]:starts[k+1]], the last stage runs to the end."
    )
    recompute: tuple[str, ...] = Field(
        default=(),
        description="Per stage: how it checkpoints its activations, block by block: never, selective or full, "
        "selective:k or full:k (only its first k checkpoint regions), or stage; empty when no stage recomputes "
        "(the one form a split is kept in, so equal splits compare equal).",
    )

    @field_validator("recompute", mode="before")
    @classmethod
    def _compact(cls, v: Any) -> Any:
        # True (older callers' flag) is "stage"; all "never" is stored as ()
        return compact_flags(v) if isinstance(v, (tuple, list)) else v

    @classmethod
    def of(cls, record: HasSplit) -> Split:
        """The split a schema record keeps as two fields (a ``Prediction`` or ``Candidate``).

        Args:
            record: anything with ``starts`` and ``recompute``.

        Returns:
            The split.
        """
        return cls(starts=record.starts, recompute=record.recompute)

    @property
    def n_stages(self) -> int:
        """How many stages the split has."""
        return len(self.starts)

    @property
    def flags(self) -> list[str]:
        """Every stage's recompute mode, "never" included (``recompute`` is empty when none does)."""
        return recompute_flags(self.recompute, len(self.starts))
