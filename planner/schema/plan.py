"""plan.json: the versioned, validated document ``planner plan`` writes and ``planner run`` reads.

Pure module: pydantic only, never torch. A plan round-trips through its JSON text exactly
(``Plan.from_json(plan.to_json()) == plan``; tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.schema.costs import BlockCost, LinkCost, OptimizerSpec, split_recompute
from planner.schema.counts import group_replicas
from planner.schema.jsonfile import parse_versioned, read_text, write_atomic
from planner.schema.names import CpAttention, DpMode, FsdpUnits, Method, Schedule
from planner.schema.plan_parts import Candidate, ModelRef, Prediction, ProfileInfo, StagePlan, Tie

# Still 1: the data-parallel fields (``dp``, ``dp_mode``, ``Prediction.dp_reduce_s``, ``Candidate.dp``)
# have defaults that mean what a plan without them meant (one pipeline on every rank), so plans
# written before them load unchanged; a planner that predates them refuses a plan that has them
# (extra fields are forbidden), rather than running it as one pipeline.
PLAN_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Plan(_Frozen):
    """A complete plan: one pipeline of ``n_ranks`` ranks, run as ``dp`` data-parallel replicas.

    Ranks form a 3-D (dp, pp, tp) mesh of ``world_size = dp x n_ranks x tp`` processes:
    ``torch.arange(world_size).view(dp, n_ranks, tp)`` with ``mesh_dim_names=("dp", "pp", "tp")``, i.e.
    global rank = (replica x n_ranks + pipeline rank) x tp + tensor-parallel rank. A pipeline rank's tp
    ranks are consecutive (on one node: their all-reduces run every layer); a replica's pipeline ranks
    follow one another (its stage-to-stage messages stay on one node where they can); the replicas of
    one pipeline rank are ``n_ranks x tp`` global ranks apart and reduce that rank's gradients
    (``dp_mode``). An expert-parallel plan (``ep`` > 1) lays the ranks out pipeline-outermost instead
    (``pp_outer``), as Megatron-LM (its tp-cp-ep-dp-pp order) and torchtitan (its pp, dp, cp, tp mesh)
    do: ``view(n_ranks, dp, tp)``, global rank = (pipeline rank x dp + replica) x tp + tensor-parallel
    rank, so the replicas of a pipeline rank, and with them an expert-parallel group (``ep``
    consecutive ranks: ``ep_replicas`` replicas' tensor-parallel ranks), fill a node together and its
    all-to-alls stay on the node's links where they can. Everything per stage
    (``stages``, ``StagePlan.rank``, memory, block costs) is one tensor-parallel rank of one replica,
    the same on every replica; each replica reads its own ``replica_batch_size`` samples per step in
    ``accumulation`` passes of ``n_microbatches`` microbatches of ``microbatch_size``. With ``tp`` 1 this is
    the 2-D (dp, pp) mesh. Context parallelism (``cp`` > 1) makes each data-parallel replica ``cp``
    consecutive mesh replicas (``replicas = dp x cp`` take the place of ``dp`` above), each holding
    the replica's rows and its own chunk of their sequences; its figures per stage are one such rank's.
    """

    version: int = PLAN_VERSION
    created: str
    model: ModelRef
    profile: ProfileInfo
    link: LinkCost = Field(
        description="The link between neighbouring ranks (on one node, when inter_node_link is set)."
    )
    inter_node_link: LinkCost | None = Field(
        default=None, description="The link between ranks on different nodes (None: every boundary uses link)."
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=1,
        description="Ranks per node, global rank g on node g // gpus_per_node (with inter_node_link).",
    )
    optimizer: OptimizerSpec
    method: Method
    schedule: Schedule
    n_stages: int = Field(ge=1, description="Pipeline stages (n_ranks x stages per rank).")
    n_ranks: int = Field(
        ge=1,
        description="Pipeline ranks of one replica (pp: --gpus / (dp x tp)); world_size = dp x n_ranks x tp in all.",
    )
    dp: int = Field(
        default=1,
        ge=1,
        description="Data-parallel replicas of the pipeline, each on its own n_ranks ranks, each reading "
        "batch_size / dp samples per step (1: one pipeline on every rank).",
    )
    dp_mode: DpMode = Field(
        default="ddp",
        description="How the replicas reduce gradients: ddp (DistributedDataParallel, all-reduce; every replica "
        "holds its stages whole) or fsdp (fully_shard: parameters, gradients and optimizer state "
        "sharded over the replicas) or hsdp (fully_shard on a 2-D mesh: sharded inside groups of dp_shard replicas, "
        "the groups' gradients all-reduced, as multi-node FSDP runs shard inside a node). Always ddp with one replica.",
    )
    dp_shard: int | None = Field(
        default=None,
        ge=2,
        description="Under hsdp, the replicas of each shard group: replicas k x dp_shard .. (k + 1) x dp_shard - 1 "
        "shard their stages' state among them (mesh dimension dp_shard), replica i of every group holds the "
        "same shard (dp_replicate); under context parallelism the replicas are dp x cp, as everywhere the "
        "stages are reduced or sharded. None under ddp and fsdp (fsdp shards over all the replicas).",
    )
    fsdp_units: FsdpUnits = Field(
        default="stage",
        description="Under fsdp or hsdp, the fully_shard units: stage (each stage one unit, gathered from its first "
        "forward to its last backward, gradients reduce-scattered once per pass) or block (each checkpoint "
        "unit of blocks its own, resharded after every forward and backward, gradients reduce-scattered every "
        "microbatch). Always stage under ddp.",
    )
    tp: int = Field(
        default=1,
        ge=1,
        description="Tensor-parallel ranks every pipeline rank is split over (1: none). Each stage module is "
        "sharded by tp_plan with torch's parallelize_module on its tp ranks, which sit on one node.",
    )
    cp: int = Field(
        default=1,
        ge=1,
        description="Context-parallel ranks (1: none): every sequence split along dimension 1 of the model's "
        "inputs and target into cp chunks, one per rank, which hold the same stages and attend over the whole "
        "sequence as cp_attention says (planner.run.context_shard). The cp ranks of a replica are "
        "cp consecutive replicas of the mesh (replicas = dp x cp): their gradients are averaged with the "
        "replicas' (under fsdp the stages are sharded over all dp x cp ranks, as torchtitan's dp_shard_cp).",
    )
    cp_attention: CpAttention = Field(
        default="all-gather",
        description="With cp > 1, how attention reaches every position's keys and values: all-gather (gathered "
        "before attention) or ring (passed around the group a chunk at a time, overlapped with attention: "
        "planner.run.ring_attention). A plan of cp 1 records all-gather.",
    )
    tp_plan: dict[str, str] = Field(
        default_factory=dict,
        description="The tensor-parallel plan used: module-name patterns (fnmatch, '*' matches one name part) "
        "to styles: colwise, rowwise (torch's ColwiseParallel / RowwiseParallel). Empty when tp is 1.",
    )
    experts: dict[str, int] = Field(
        default_factory=dict,
        description="The model's mixture-of-experts layers: each experts module's name -> its expert count, as the "
        "model's expert plan names them (planner.capture.ep_plan; empty: a dense model). Every rank holding a "
        "layer holds all its experts unless ep shards them; tensor parallelism leaves them whole (with ep > 1 an "
        "expert group spans the tensor-parallel ranks instead).",
    )
    ep: int = Field(
        default=1,
        ge=1,
        description="Expert-parallel ranks (1: none): each mixture-of-experts layer's experts sharded over ep "
        "consecutive ranks of the same pipeline rank, the tokens routed to them dispatched and combined with "
        "all-to-alls (planner.run.experts); dense layers keep their layout. With tp 1 the ranks are ep replicas; "
        "with tp > 1 a group spans the tensor-parallel ranks of ep / tp replicas (ep a multiple of tp), each "
        "routing its 1 / tp of the replica's tokens and gathering the others' results, as Megatron-Core with an "
        "expert tensor-parallel size of 1 and torchtitan with etp 1 do. Its replicas (ep_replicas) divide dp; ep "
        "divides every layer's expert count.",
    )
    moe_imbalance: float | None = Field(
        default=None,
        ge=1,
        allow_inf_nan=False,
        description="--moe-imbalance as given: the busiest expert's routed rows over the mean, which the blocks' "
        "ExpertShare.imbalance follow; None: auto (the router's where the model ran, else MOE_IMBALANCE).",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="Sequence parallelism with the tensor parallelism (tp > 1 only): row-wise outputs "
        "reduce-scattered along the sequence, the residual adds and norms between layers run on each tp rank's "
        "slice of the sequence and save 1/tp of their activations, column-wise inputs all-gathered "
        "(planner.run.sequence_shard).",
    )
    loss_parallel: bool = Field(
        default=False,
        description="Loss parallelism with the tensor parallelism (tp > 1 only): the output head's logits stay "
        "split over the tp ranks and the loss runs on each rank's columns under torch's loss_parallel "
        "(planner.run.tensor_shard), never gathered whole.",
    )
    batch_size: int = Field(ge=1, description="Samples per step over all replicas (the global batch).")
    n_microbatches: int = Field(ge=1, description="Microbatches per pass of each replica's pipeline.")
    accumulation: int = Field(
        default=1,
        ge=1,
        description="Pipeline passes per step: each replica runs the schedule this many times, on batch / (dp x "
        "accumulation) samples each, gradients accumulated; one optimizer step. Each pass allocates its "
        "n_microbatches receive buffers, so more passes of fewer microbatches need less memory (and pay the "
        "pipeline's warm-up and drain once per pass).",
    )
    blocks: list[BlockCost]
    costed_microbatch_size: int | None = Field(
        default=None,
        ge=1,
        description="The microbatch size (samples) the blocks' costs are for: the plan's microbatch size when it "
        "was made. A hand edit of batch_size, dp, accumulation or n_microbatches that changes the microbatch size "
        "is re-predicted on the costs rescaled to the new size. None: a plan written before this field (its costs "
        "are taken to be at its microbatch size).",
    )
    stages: list[StagePlan]
    prediction: Prediction
    baselines: dict[str, Prediction] = Field(description="The same costs split by other methods, for comparison.")
    memory_limit_bytes: int | None = Field(default=None, ge=0, description="Per-rank limit planned for (None: none).")
    search: list[Candidate] = Field(
        default_factory=list, description="The best candidates of the joint search, best first (empty: none ran)."
    )
    choice: str = Field(default="", description="Why this schedule, microbatch count and stages per rank.")
    calibration: list[str] = Field(
        default_factory=list,
        description="What --calibrate changed in the profiled costs, one line each (empty: not calibrated).",
    )
    ties: list[Tie] = Field(default_factory=list, description="Parameters several blocks read (tied weights).")
    compile: bool = Field(
        default=False,
        description="Train with torch.compile (--compile): the runner compiles each stage module whole, with "
        "torch._functorch.config.donated_buffer=False (pipelining's two-part backward retains the graph). Measured "
        "costs are the compiled blocks'; estimated costs charge each run of memory-bound operators between GEMMs "
        "and attention as one fused kernel, and save what AOTAutograd's partitioner keeps (planner/costs/fusion.py).",
    )

    def stages_reading(self, blocks: Iterable[int]) -> list[int]:
        """The stages that hold any of ``blocks`` (block indices), ascending."""
        wanted = set(blocks)
        return [s.index for s in self.stages if any(s.start <= k < s.end for k in wanted)]

    def tie_stages(self, tie: Tie) -> list[int]:
        """The stages holding a copy of ``tie``'s parameter, ascending (the first holds the owner)."""
        index = {b.name: k for k, b in enumerate(self.blocks)}
        return self.stages_reading(index[name] for name in tie.blocks)

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch of one replica's pipeline:
        ``batch_size // (dp * accumulation * n_microbatches)``."""
        return self.batch_size // (self.dp * self.accumulation * self.n_microbatches)

    @property
    def pass_batch_size(self) -> int:
        """Samples one pass of one replica's pipeline reads: ``batch_size // (dp * accumulation)``."""
        return self.batch_size // (self.dp * self.accumulation)

    @property
    def replica_batch_size(self) -> int:
        """Samples per step each replica reads: ``batch_size // dp``."""
        return self.batch_size // self.dp

    @property
    def replicas(self) -> int:
        """The mesh's replicas, the ranks holding the same stages: ``dp x cp`` (a context-parallel
        replica's ``cp`` ranks each run its rows' own chunk of the sequence). Replica ``r`` reads the rows
        of data-parallel replica ``r // cp`` and chunk ``r % cp`` of their sequences."""
        return self.dp * self.cp

    @property
    def shard_size(self) -> int:
        """Replicas a stage's parameters, gradients and optimizer state are sharded over: 1 under ddp,
        ``replicas`` under fsdp, ``dp_shard`` under hsdp."""
        if self.dp_mode == "hsdp" and self.dp_shard is not None:
            return self.dp_shard
        return self.replicas if self.dp_mode == "fsdp" else 1

    @property
    def sharded(self) -> bool:
        """Whether the replicas shard their stages with FSDP2's ``fully_shard`` (fsdp or hsdp)."""
        return self.replicas > 1 and self.dp_mode in ("fsdp", "hsdp")

    @property
    def world_size(self) -> int:
        """Processes in all: ``dp * cp * n_ranks * tp``."""
        return self.n_ranks * self.replicas * self.tp

    @property
    def ep_replicas(self) -> int:
        """The replicas an expert-parallel group covers: ``ep / tp`` (a group spans their tensor-parallel
        ranks; ``ep`` with tp 1)."""
        return group_replicas(self.ep, self.tp)

    @property
    def pp_outer(self) -> bool:
        """Whether the ranks are laid out pipeline-outermost, (pp, dp, tp): expert-parallel plans
        (``ep`` > 1), whose expert groups are replicas of one pipeline rank (see the class docstring)."""
        return self.ep > 1

    def global_rank(self, replica: int, pp_rank: int, tp_rank: int = 0) -> int:
        """The global rank of tensor-parallel rank ``tp_rank`` of pipeline rank ``pp_rank`` of replica
        ``replica``: ``(replica * n_ranks + pp_rank) * tp + tp_rank``, or pipeline-outermost
        (``pp_outer``) ``(pp_rank * dp + replica) * tp + tp_rank``.

        Args:
            replica: the mesh replica, 0 .. replicas - 1 (``dp x cp``).
            pp_rank: the pipeline rank, 0 .. n_ranks - 1.
            tp_rank: the tensor-parallel index, 0 .. tp - 1.

        Returns:
            The rank in ``0 .. world_size - 1``.

        Raises:
            ValueError: any index is out of range.
        """
        if not 0 <= replica < self.replicas or not 0 <= pp_rank < self.n_ranks or not 0 <= tp_rank < self.tp:
            raise ValueError(
                f"replica {replica}, pipeline rank {pp_rank}, tensor-parallel rank {tp_rank} is outside the plan's "
                f"{self.replicas} x {self.n_ranks} x {self.tp} mesh"
            )
        if self.pp_outer:
            return (pp_rank * self.replicas + replica) * self.tp + tp_rank
        return (replica * self.n_ranks + pp_rank) * self.tp + tp_rank

    def replica_of(self, global_rank: int) -> int:
        """The mesh replica (``0 .. dp x cp - 1``) a global rank belongs to.

        Args:
            global_rank: a rank in ``0 .. world_size - 1``.

        Returns:
            ``global_rank // (n_ranks * tp)`` (pipeline-outermost: ``global_rank // tp % dp``).

        Raises:
            ValueError: the rank is outside ``0 .. world_size - 1``.
        """
        return self._split_rank(global_rank)[0]

    def pp_rank_of(self, global_rank: int) -> int:
        """The pipeline rank (``StagePlan.rank``) a global rank runs.

        Args:
            global_rank: a rank in ``0 .. world_size - 1``.

        Returns:
            ``global_rank // tp % n_ranks`` (pipeline-outermost: ``global_rank // (dp * tp)``).

        Raises:
            ValueError: the rank is outside ``0 .. world_size - 1``.
        """
        return self._split_rank(global_rank)[1]

    def _split_rank(self, global_rank: int) -> tuple[int, int]:
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"rank {global_rank} is outside the plan's {self.world_size} ranks")
        if self.pp_outer:
            pp_rank, replica = divmod(global_rank // self.tp, self.replicas)
            return replica, pp_rank
        return divmod(global_rank // self.tp, self.n_ranks)

    def tp_rank_of(self, global_rank: int) -> int:
        """The tensor-parallel index a global rank holds of its pipeline rank's stages.

        Args:
            global_rank: a rank in ``0 .. world_size - 1``.

        Returns:
            ``global_rank % tp``.

        Raises:
            ValueError: the rank is outside ``0 .. world_size - 1``.
        """
        self._split_rank(global_rank)
        return global_rank % self.tp

    @property
    def stages_per_rank(self) -> int:
        """Stages every rank runs."""
        return self.n_stages // self.n_ranks

    def stages_of(self, rank: int) -> list[StagePlan]:
        """The stages ``rank`` runs, in stage order."""
        return [s for s in self.stages if s.rank == rank]

    @model_validator(mode="before")
    @classmethod
    def _one_stage_per_rank_by_default(cls, data: Any) -> Any:
        # Plans written before stages could share a rank have one stage per rank: fill that in.
        if isinstance(data, dict) and "n_ranks" not in data and isinstance(data.get("stages"), list):
            data = {**data, "n_ranks": data.get("n_stages")}
            data["stages"] = [
                {**st, "rank": st.get("index", i)} if isinstance(st, dict) and "rank" not in st else st
                for i, st in enumerate(data["stages"])
            ]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.batch_size % (self.dp * self.accumulation * self.n_microbatches):
            split = (f"dp {self.dp} x " if self.dp > 1 else "") + (
                f"accumulation {self.accumulation} x " if self.accumulation > 1 else ""
            )
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by {split}n_microbatches {self.n_microbatches}"
            )
        if self.replicas == 1 and self.dp_mode != "ddp":
            raise ValueError(f"dp_mode is {self.dp_mode} with one replica; a plan of one replica records ddp")
        if self.cp > 1:
            self._check_context()
        elif self.cp_attention != "all-gather":
            raise ValueError(f"cp_attention {self.cp_attention} with cp 1; a plan of cp 1 records all-gather")
        if self.fsdp_units != "stage" and self.dp_mode == "ddp":
            raise ValueError(f"fsdp_units is {self.fsdp_units} under ddp; only fsdp and hsdp shard per block")
        if (self.dp_mode == "hsdp") != (self.dp_shard is not None):
            raise ValueError(
                f"dp_mode {self.dp_mode} with dp_shard {self.dp_shard}: hsdp needs dp_shard (replicas per shard "
                "group), and only hsdp has one"
            )
        if self.dp_shard is not None and (self.replicas % self.dp_shard or self.dp_shard == self.replicas):
            of = f"dp {self.dp}" if self.cp == 1 else f"the {self.replicas} replicas (dp {self.dp} x cp {self.cp})"
            raise ValueError(
                f"dp_shard {self.dp_shard} must divide {of} into several groups (all replicas in one group is fsdp)"
            )
        if self.ep > 1:
            self._check_experts()
        if (self.tp > 1) != bool(self.tp_plan):
            raise ValueError(f"tp is {self.tp} with {len(self.tp_plan)} tp_plan entries; a split needs its plan")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1 (it splits what tensor parallelism keeps whole)")
        if self.sequence_parallel and self.compile:
            raise ValueError("sequence_parallel runs eagerly only: compile must be false")
        if self.loss_parallel and self.tp == 1:
            raise ValueError("loss_parallel needs tp > 1 (it leaves the output head's tp split in place)")
        if self.loss_parallel and self.cp > 1:
            raise ValueError("loss_parallel does not run with cp > 1 yet (the logits are gathered there)")
        if len(self.stages) != self.n_stages:
            raise ValueError(f"n_stages is {self.n_stages} but {len(self.stages)} stages are listed")
        if self.n_stages % self.n_ranks:
            raise ValueError(f"{self.n_stages} stages do not spread evenly over {self.n_ranks} ranks")
        held = [sum(1 for s in self.stages if s.rank == r) for r in range(self.n_ranks)]
        if any(h != self.stages_per_rank for h in held) or any(s.rank >= self.n_ranks for s in self.stages):
            raise ValueError(
                f"every one of the {self.n_ranks} ranks must run {self.stages_per_rank} stage(s); "
                f"the stages' ranks are {[s.rank for s in self.stages]}"
            )
        expected = 0
        for i, stage in enumerate(self.stages):
            if stage.index != i or stage.start != expected or stage.end <= stage.start or stage.end > len(self.blocks):
                raise ValueError(
                    f"stage {i} covers blocks [{stage.start}, {stage.end}); stages must be contiguous from 0 "
                    f"within the {len(self.blocks)} blocks"
                )
            if not (
                self.blocks[stage.start].name == stage.first_block
                and self.blocks[stage.end - 1].name == stage.last_block
            ):
                raise ValueError(f"stage {i}'s block names do not match the block list")
            self._check_recompute_count(stage)
            expected = stage.end
        if expected != len(self.blocks):
            raise ValueError(f"stages cover {expected} of {len(self.blocks)} blocks")
        names = {b.name for b in self.blocks}
        for tie in self.ties:
            unknown = [b for b in tie.blocks if b not in names]
            if unknown:
                raise ValueError(f"tied parameter {tie.names[0]} names block(s) {unknown} that the plan does not have")
        return self

    def _check_context(self) -> None:
        """What context parallelism does not combine with yet: ``compile`` of a model traced by
        ``torch.export`` (torch.compile of its graph's masks on DTensors gives them another dtype than
        eager)."""
        if self.compile and self.model.trace_method == "export":
            raise ValueError(
                f"cp {self.cp} with compile of a torch.export graph: context parallelism does not combine with it yet"
            )

    def _check_experts(self) -> None:
        """An expert-parallel plan's experts, tensor-parallel ranks and replicas: ``ep`` divides the
        experts, ``tp`` divides ``ep``, and the replicas a group covers divide ``dp``."""
        if not self.experts:
            raise ValueError(f"ep is {self.ep} but the plan records no experts to shard")
        if not self.model.expert_calls:
            raise ValueError(
                f"ep is {self.ep} but the model was traced without its experts' calls (model.expert_calls)"
            )
        if self.ep % self.tp:
            raise ValueError(
                f"ep {self.ep} is no multiple of tp {self.tp} (an expert-parallel group spans the tensor-parallel ranks)"
            )
        if self.replicas % self.ep_replicas:
            of = f"dp {self.dp}" if self.cp == 1 else f"the {self.replicas} replicas (dp {self.dp} x cp {self.cp})"
            raise ValueError(
                f"ep {self.ep} covers {self.ep_replicas} replicas, which do not divide {of} (the "
                "expert-parallel ranks are replicas' tensor-parallel ranks)"
            )
        odd = {name: n for name, n in self.experts.items() if n % self.ep}
        if odd:
            name, n = next(iter(odd.items()))
            raise ValueError(f"ep {self.ep} does not divide the {n} experts of {name}")

    def _check_recompute_count(self, stage: StagePlan) -> None:
        """A stage's "full:k" / "selective:k" names at most as many checkpoint regions as it has.

        A region is one block, or blocks joined where no legal cut lies between them (as
        ``planner.core.levers.recompute.checkpoint_units`` counts them); "full:99" on a stage of two
        regions was run as "full" without a word.
        """
        mode, count = split_recompute(stage.recompute)
        if count is None:
            return
        regions = 1 + sum(self.blocks[c - 1].cut_legal for c in range(stage.start + 1, stage.end))
        if count > regions:
            raise ValueError(
                f"stage {stage.index}'s recompute {stage.recompute!r} names {count} checkpoint regions, but the stage "
                f"has {regions} ({stage.first_block} to {stage.last_block}); give {mode}:K with K up to {regions}, "
                f"or {mode} for all of them"
            )

    def to_json(self) -> str:
        """The plan as indented JSON text."""
        return self.model_dump_json(indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> Plan:
        """Parse and validate a plan's JSON text.

        Args:
            text: the JSON text.
            source: name used in error messages (usually the file path).

        Returns:
            The plan.

        Raises:
            PlanFileError: not JSON, another version, or fails validation.
        """
        return parse_versioned(text, cls, PLAN_VERSION, source, "plan", "re-run `planner plan` to make a new one")

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` (via a temporary file, so a failure never leaves half a plan)."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read and validate a plan file.

        Raises:
            PlanFileError: missing, unreadable, malformed or of another version.
        """
        text = read_text(path, "plan", f"make one with `planner plan MODEL.py -o {path}`")
        return cls.from_json(text, str(path))

    def model_path(self, plan_path: str | Path) -> Path:
        """The model file, resolving a relative path against the plan file's folder."""
        p = Path(self.model.path)
        return p if p.is_absolute() else (Path(plan_path).resolve().parent / p)


# the records live in planner.schema.plan_parts; importers keep reading them from here
__all__ = ["PLAN_VERSION", "Candidate", "ModelRef", "Plan", "Prediction", "ProfileInfo", "StagePlan", "Tie"]
