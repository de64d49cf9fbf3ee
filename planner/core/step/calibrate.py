"""Calibration loop: correct the profiled costs with what a real run of the plan measured.

Pure module (pydantic, no torch). ``calibrate(plan, run)`` compares the plan's predictions with the
run's measurements (``planner.schema.result.StageMeasure``):

1. Compute, per block: the run times every block inside its stage (``StageMeasure.blocks``, from
   the marks of ``planner.capture.clock``), so each block gets its own ``fwd_factor = measured fwd /
   profiled fwd`` and the same for backward. A block's factor is a property of the block, not of
   the stage it ran in, so it holds under any other split: one run of one split corrects every
   split (``docs/cost_accuracy.md`` measures that). The optimizer's factor is its stage's (the run
   times the optimizer per rank). A run without per-block times (a compiled plan, an older run)
   gives each block its stage's factors. Per stage the factors are kept too (``stages``).
2. Link: with the compute corrected, the unknown left in the step model
   (``planner.core.step.predict.predict``: the simulated schedule makespan + gradient passes +
   optimizer + clip all-reduce) is the fixed cost per message, which also takes in the runtime's
   bookkeeping around each action. The simulated step time is continuous and non-decreasing in
   ``latency_s`` (every action duration is, and a makespan is a max of sums of them), so the
   latency at which it equals the measured median step is found by bisection.
3. Global factor: if even zero latency predicts a slower step than measured (compute was
   over-estimated across the board), the latency stays 0 and one factor ``global_factor`` on every
   block time closes the gap, again by bisection. Otherwise it is 1.

``apply_calibration(blocks, link, cal)`` scales each block by its own factors (looked up by name)
times ``global_factor`` and sets the fitted latency. Applied to the measured split, the calibrated
costs re-predict the measured step time (tested to 1e-6). ``changes(cal)`` says what it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from planner.core.levers.data_parallel import check_run_replicas
from planner.core.step.predict import block_times_in_stages, plan_split, predict_plan
from planner.errors import PlanFileError
from planner.schema.costs import BlockCost, LinkCost
from planner.schema.jsonfile import parse_versioned, write_atomic
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest
from planner.schema.result import RunResult, check_run_matches

CALIBRATION_VERSION = 1
_BISECT_STEPS = 200  # halves the bracket to far below float resolution


class StageCalibration(BaseModel):
    """Correction factors of one stage of the measured run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int
    first_block: str = Field(description="FQN of the stage's first block in the measured run.")
    last_block: str = Field(description="FQN of the stage's last block in the measured run.")
    fwd_factor: float = Field(gt=0, description="Measured / predicted forward per microbatch.")
    bwd_factor: float = Field(gt=0, description="Measured / predicted backward per microbatch.")
    opt_factor: float = Field(gt=0, description="Measured / predicted optimizer step.")


class BlockCalibration(BaseModel):
    """Correction factors of one block, measured where it ran in the pipeline."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="The block's FQN.")
    fwd_factor: float = Field(gt=0, description="Measured / profiled forward per microbatch.")
    bwd_factor: float = Field(gt=0, description="Measured / profiled backward per microbatch.")
    opt_factor: float = Field(gt=0, description="Its stage's measured / predicted optimizer step.")
    measured_in_block: bool = Field(
        description="True: the block was timed on its own inside its stage (run.json's per-block times); False: "
        "the run timed only whole stages and the block took its stage's factors."
    )


class Calibration(BaseModel):
    """What one measured run says about the plan's costs; apply with ``apply_calibration``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = CALIBRATION_VERSION
    plan_fingerprint: str = Field(description="Model fingerprint of the plan that was run.")
    microbatch_size: int = Field(
        ge=1, description="Samples per microbatch of that plan (block costs are per microbatch)."
    )
    starts: tuple[int, ...] = Field(description="First block of each stage of the measured run.")
    stages: list[StageCalibration]
    blocks: list[BlockCalibration] = Field(
        default_factory=list,
        description="Per block, its own factors (empty: a calibration of an older version, by stage only). A block "
        "keeps them under any split: they are what makes one run of one split correct every other split.",
    )
    latency_s: float = Field(ge=0, description="Fitted fixed cost per point-to-point message, seconds.")
    bandwidth_Bps: float = Field(gt=0, description="Link bandwidth (kept from the plan, not fitted).")
    global_factor: float = Field(
        gt=0, description="Extra factor on every block time (1 unless zero latency over-predicts)."
    )
    measured_step_s: float = Field(description="The run's median step time.")
    predicted_step_s: float = Field(description="The plan's step prediction before calibration.")
    calibrated_step_s: float = Field(description="Re-prediction of the measured split with the calibrated costs.")

    def to_json(self) -> str:
        """The calibration as indented JSON text."""
        return self.model_dump_json(indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "calibration") -> Calibration:
        """Parse and validate a calibration's JSON text.

        Raises:
            PlanFileError: not JSON, another version, or invalid.
        """
        return parse_versioned(text, cls, CALIBRATION_VERSION, source, "calibration", "make it again from the run")

    def save(self, path: str | Path) -> None:
        """Write the calibration to ``path`` atomically."""
        write_atomic(path, self.to_json())


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted > 0 and measured > 0 else 1.0


def _scaled(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor  # unknown stays unknown


def _scale_block(b: BlockCost, s: StageCalibration | BlockCalibration, g: float) -> BlockCost:
    f, w, o = s.fwd_factor * g, s.bwd_factor * g, s.opt_factor * g
    return b.model_copy(
        update={
            "fwd_s": b.fwd_s * f,
            "bwd_s": b.bwd_s * w,
            "bwd_input_s": _scaled(b.bwd_input_s, w),
            "bwd_weight_s": _scaled(b.bwd_weight_s, w),
            "recompute_s": _scaled(b.recompute_s, f),  # recomputation is a forward
            "selective_recompute_s": _scaled(b.selective_recompute_s, f),
            "fwd_cold_s": _scaled(b.fwd_cold_s, f),
            "bwd_cold_s": _scaled(b.bwd_cold_s, w),
            "opt_s": _scaled(b.opt_s, o),
            "grad_s": _scaled(b.grad_s, o),  # passes over the same parameters' gradients
        }
    )


def _block_factors(plan: Plan, run: RunResult, stages: Sequence[StageCalibration]) -> list[BlockCalibration]:
    """Every block's factors: its own where the run timed it inside its stage, else its stage's.

    The run's per-block times (``StageMeasure.blocks``) count the last block's loss as the profile
    does (forward and backward), so the two compare like with like; and the first block of a stage
    that receives its activations from another rank ran cold, as did the last block of one that
    receives its gradient, so those are compared with the block's time plus its cold start (a
    factor then carries to a split where the block runs warm inside a stage).
    """
    out = []
    planned = block_times_in_stages(plan.blocks, plan.stages)
    for st, m, sc in zip(plan.stages, run.stages, stages):
        part = plan.blocks[st.start : st.end]
        timed = [x.name for x in m.blocks] == [b.name for b in part]
        for k, b in enumerate(part):
            if timed:
                f_planned, b_planned = planned[st.start + k]
                fwd, bwd = _ratio(m.blocks[k].fwd_s, f_planned), _ratio(m.blocks[k].bwd_s, b_planned)
            else:
                fwd, bwd = sc.fwd_factor, sc.bwd_factor
            out.append(
                BlockCalibration(
                    name=b.name, fwd_factor=fwd, bwd_factor=bwd, opt_factor=sc.opt_factor, measured_in_block=timed
                )
            )
    return out


def apply_calibration(
    blocks: Sequence[BlockCost], link: LinkCost, cal: Calibration, starts: Sequence[int] | None = None
) -> tuple[list[BlockCost], LinkCost]:
    """Calibrated copies of ``blocks`` and ``link``.

    Each block's times are multiplied by the factors of the stage that contained it in the
    measured run (and by ``cal.global_factor``); those factors stay with the block when a new
    partition puts it in another stage. The link gets the fitted latency.

    Args:
        blocks: per-block costs of the same model (same block names, in order).
        link: the link to calibrate (its bandwidth is kept).
        cal: the calibration.
        starts: the measured run's stage starts (default ``cal.starts``).

    Returns:
        The calibrated blocks and link.

    Raises:
        PlanFileError: the blocks are not the ones the calibration was measured on.
    """
    if cal.blocks and starts is None:
        return _apply_by_block(blocks, link, cal)
    starts = tuple(cal.starts if starts is None else starts)
    n = len(blocks)
    if len(starts) != len(cal.stages) or not starts or starts[0] != 0 or starts[-1] >= n:
        raise PlanFileError(
            f"starts {starts} do not fit the calibration's {len(cal.stages)} stage(s) over {n} blocks; "
            "calibrate with a run of a plan for this model"
        )
    ends = list(starts[1:]) + [n]
    out: list[BlockCost] = []
    for s, a, b in zip(cal.stages, starts, ends):
        if (blocks[a].name, blocks[b - 1].name) != (s.first_block, s.last_block):
            raise PlanFileError(
                f"calibration stage {s.stage} covered {s.first_block} .. {s.last_block}, but blocks {a}..{b - 1} are "
                f"{blocks[a].name} .. {blocks[b - 1].name}; the model's blocks changed since the run: "
                "run the new plan and calibrate from that run"
            )
        out.extend(_scale_block(x, s, cal.global_factor) for x in blocks[a:b])
    return out, _calibrated_link(link, cal)


def _calibrated_link(link: LinkCost, cal: Calibration) -> LinkCost:
    name = link.name if link.name.endswith("+calibrated") else f"{link.name}+calibrated"
    return link.model_copy(update={"name": name, "latency_s": cal.latency_s})


def _apply_by_block(blocks: Sequence[BlockCost], link: LinkCost, cal: Calibration) -> tuple[list[BlockCost], LinkCost]:
    """``apply_calibration`` with every block's own factors, looked up by name."""
    factors = {b.name: b for b in cal.blocks}
    names = [b.name for b in blocks]
    if set(names) != set(factors):
        missing = sorted(set(factors) - set(names))[:3] or sorted(set(names) - set(factors))[:3]
        raise PlanFileError(
            f"the calibration's blocks are not this model's (e.g. {', '.join(missing)}); the model's blocks changed "
            "since the run: run the new plan and calibrate from that run"
        )
    return [_scale_block(b, factors[b.name], cal.global_factor) for b in blocks], _calibrated_link(link, cal)


def _bisect_up(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the non-decreasing ``f`` reaches ``target`` (f(lo) <= target <= f(hi))."""
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return hi if abs(f(hi) - target) <= abs(f(lo) - target) else lo


def calibrate(plan: Plan, run: RunResult) -> Calibration:
    """Fit compute factors per stage, the link latency and a global factor to a measured run.

    Args:
        plan: the plan that was run.
        run: its run.json, with per-stage measurements.

    Returns:
        The calibration; ``calibrated_step_s`` is the re-prediction of the measured split.

    Raises:
        PlanFileError: the run is not of this plan, or has no step time.
    """
    check_run_matches(plan, run)
    check_run_replicas(plan, run)
    measured = run.median_step_s
    if measured is None or measured <= 0:  # None: steps 1 and 2 only, the set-up and the memory-tracked
        if run.status != "completed":  # (more steps would not have helped: it stopped)
            raise PlanFileError(
                f"the run {run.status} before it timed a step ({run.stopped}); calibrate with a run that "
                "completed 3 steps or more"
            )
        raise PlanFileError(
            "the run timed no step (step 1 sets the schedule up, the last runs under the memory tracker); "
            "re-run `planner run` with --steps 3 or more"
        )
    split = plan_split(plan)
    starts = split.starts
    # The optimizer steps all of a rank's stages at once: its measured time is the rank's (on every
    # stage of the rank), so the factor compares it with the rank's predicted total.
    rank_opt = {r: sum(s.opt_s for s in plan.stages_of(r)) for r in range(plan.n_ranks)}
    stages = [
        StageCalibration(
            stage=s.index,
            first_block=s.first_block,
            last_block=s.last_block,
            fwd_factor=_ratio(m.fwd_s, s.fwd_s),
            bwd_factor=_ratio(m.bwd_s, s.bwd_s),
            opt_factor=_ratio(m.optimizer_s, rank_opt[s.rank] if plan.stages_per_rank > 1 else s.opt_s),
        )
        for s, m in zip(plan.stages, run.stages)
    ]
    blocks = _block_factors(plan, run, stages)

    def make(latency: float, g: float) -> Calibration:
        return Calibration(
            plan_fingerprint=plan.model.fingerprint,
            microbatch_size=plan.microbatch_size,
            starts=starts,
            stages=stages,
            blocks=blocks,
            latency_s=latency,
            bandwidth_Bps=plan.link.bandwidth_Bps,
            global_factor=g,
            measured_step_s=measured,
            predicted_step_s=plan.prediction.step_time_s,
            calibrated_step_s=0.0,
        )

    def step(latency: float, g: float) -> float:
        # the run's stages are replica 0's (every replica runs the same ones); the measured step
        # includes the gradient reduction over the replicas, as the prediction does
        blocks, link = apply_calibration(plan.blocks, plan.link, make(latency, g))
        return predict_plan(plan, split, blocks=blocks, link=link)[1].step_time_s

    latency, g = 0.0, 1.0
    floor = step(0.0, 1.0)
    alone = plan.n_ranks == 1 and plan.dp == 1  # no message at all: neither a stage boundary nor a reduction
    if floor > measured or alone:
        # Compute alone (no fixed message cost) is already slower than the run, or there are no
        # messages to fit: one factor on all compute takes up the difference.
        if alone:
            latency = plan.link.latency_s
        hi = 2.0
        while step(latency, hi) < measured and hi < 1e6:
            hi *= 2
        g = _bisect_up(lambda x: step(latency, x), measured, 1e-9, hi)
    else:
        hi = max(plan.link.latency_s, 1e-6)
        while step(hi, 1.0) < measured and hi < 1e3:
            hi *= 2
        latency = _bisect_up(lambda x: step(x, 1.0), measured, 0.0, hi)
    return make(latency, g).model_copy(update={"calibrated_step_s": step(latency, g)})


def plan_path_of_run(run: RunResult, run_path: str | Path) -> Path:
    """The plan file a run was made from: ``run.plan_path`` if recorded and present, else the
    sibling ``X.json`` of ``X.run.json`` (``planner run``'s default output name).

    Raises:
        PlanFileError: neither exists.
    """
    candidates = []
    if run.plan_path:
        candidates.append(Path(run.plan_path))
    rp = Path(run_path)
    if rp.name.endswith(".run.json"):
        candidates.append(rp.with_name(rp.name[: -len(".run.json")] + ".json"))
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in candidates) or "nothing recorded"
    raise PlanFileError(
        f"cannot find the plan {run_path} was a run of (tried {tried}); put the plan back where it was run from, "
        "or next to the run report as PLAN.json beside PLAN.run.json"
    )


class RunCalibration(NamedTuple):
    """A calibration with the plan whose run it was fitted to."""

    plan: Plan  # its ``blocks`` are the costs the factors were fitted against, so a re-plan of the
    # same model and microbatch size scales those rather than re-profile
    fit: Calibration


def load_calibration(run_path: str | Path, plan_path: str | Path | None = None) -> RunCalibration:
    """Calibrate from files: a run.json and the plan it ran (found via ``plan_path_of_run`` if not given).

    Returns:
        The plan that was run and the calibration fitted to its run.

    Raises:
        PlanFileError: a file is missing or invalid, or the run is not of the plan.
    """
    run = RunResult.load(run_path)
    plan = Plan.load(plan_path if plan_path is not None else plan_path_of_run(run, run_path))
    return RunCalibration(plan, calibrate(plan, run))


def changes(cal: Calibration) -> list[str]:
    """What applying ``cal`` changes, one line each (the plan records them; the report prints them).

    Args:
        cal: the calibration.

    Returns:
        Lines naming the spread of the block factors, the blocks moved most, the fitted latency and
        the global factor.
    """
    rows = cal.blocks or []
    out = []
    if rows:
        timed = sum(b.measured_in_block for b in rows)
        out.append(f"{len(rows)} blocks ({timed} timed inside their stage, the rest by their stage's factors)")
        for what in ("fwd", "bwd"):
            vals = sorted(getattr(b, f"{what}_factor") for b in rows)
            worst = max(rows, key=lambda b: abs(getattr(b, f"{what}_factor") - 1.0))
            out.append(
                f"{'forward' if what == 'fwd' else 'backward'} x{vals[0]:.3f} .. x{vals[-1]:.3f} "
                f"(median x{vals[len(vals) // 2]:.3f}; most: {worst.name} x{getattr(worst, f'{what}_factor'):.3f})"
            )
        opt = sorted({round(b.opt_factor, 3) for b in rows})
        out.append("optimizer and gradient passes " + ", ".join(f"x{v:.3f}" for v in opt) + " (per stage run)")
    out.append(f"link latency {cal.latency_s * 1e3:.3f} ms per message (fitted to the measured step)")
    if cal.global_factor != 1.0:
        out.append(f"every block time x{cal.global_factor:.4f} (zero latency over-predicted the step)")
    out.append(
        f"the run: step {cal.measured_step_s * 1e3:.1f} ms measured, {cal.predicted_step_s * 1e3:.1f} ms predicted, "
        f"{cal.calibrated_step_s * 1e3:.1f} ms re-predicted calibrated"
    )
    return out


def calibrated_request(request: PlanRequest, run_plan: Plan, size: int) -> PlanRequest:
    """The request as a calibration can serve it: factors hold for the layout and microbatch size
    they were measured at, so ``--dp auto`` keeps the run's replica count (when it divides the
    ranks and the batch) and ``--microbatches auto`` the run's microbatch size.

    Args:
        request: the plan request.
        run_plan: the plan the calibrating run trained.
        size: the run's samples per microbatch (of one replica).

    Returns:
        The request, with ``dp`` and ``microbatches`` pinned where they were auto and the run's fit.
    """
    update: dict[str, object] = {}
    dp = request.dp
    if dp == "auto" and request.gpus % run_plan.dp == 0 and request.batch_size % run_plan.dp == 0:
        dp = update["dp"] = run_plan.dp
    replica_batch = request.batch_size // (dp if isinstance(dp, int) else 1)
    if request.microbatches is None and size > 0 and replica_batch % size == 0:
        update["microbatches"] = replica_batch // size
    return request.model_copy(update=update) if update else request


def levers_text(autocast: str | None, compile: bool) -> str:
    """The speed levers in words, for messages: e.g. "autocast bf16, compiled" or "fp32, eager".

    Args:
        autocast: the autocast dtype, or None.
        compile: whether the stages are compiled.

    Returns:
        The text.
    """
    return f"{f'autocast {autocast}' if autocast else 'fp32'}, {'compiled' if compile else 'eager'}"


def check_levers(run_plan: Plan, request: PlanRequest) -> None:
    """Refuse a calibration measured under other speed levers (autocast, compile) than the request's:
    its per-stage factors correct costs that were measured another way.

    Args:
        run_plan: the plan the calibrating run trained.
        request: the plan request.

    Raises:
        PlanFileError: the levers differ.
    """
    had = (run_plan.profile.autocast, run_plan.compile)
    asked = (request.autocast, request.compile)
    if had != asked:
        raise PlanFileError(
            f"--calibrate: the run trained a plan made {levers_text(*had)}, this plan asks for {levers_text(*asked)}; "
            "its factors would not carry over: calibrate from a run of a plan made with the same --dtype and --compile"
        )


def check_calibration(cal: Calibration, fingerprint: str, microbatch_size: int) -> None:
    """Refuse a calibration measured on another model or another microbatch size.

    Args:
        cal: the calibration.
        fingerprint: the fingerprint of the model traced for this plan.
        microbatch_size: this plan's samples per microbatch.

    Raises:
        PlanFileError: the fingerprints or microbatch sizes differ.
    """
    if cal.plan_fingerprint != fingerprint:
        raise PlanFileError(
            f"the calibration was measured on a model with fingerprint {cal.plan_fingerprint}, "
            f"this one is {fingerprint}; calibrate from a run of a plan of this model"
        )
    if cal.microbatch_size != microbatch_size:
        raise PlanFileError(
            f"the calibration was measured with microbatches of {cal.microbatch_size}, this plan uses "
            f"{microbatch_size}; its factors would not carry over: calibrate from a run with the same -b/-m"
        )
