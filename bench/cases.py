"""The cases of the accuracy benches: model files planned and run through the CLI, and their figures.

``bench.cost_accuracy`` and ``bench.repeated_accuracy`` both type what a user would type, `planner
plan` then `planner run`, as subprocesses in a temporary folder holding a copy of the model files,
for every (model, ranks, schedule); this module makes those cases, runs them and holds the error
figures both pages print.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import MODELS, PLANNER, ROOT, copy_models, plan_and_run
from planner.capture.load import load_model_file
from planner.core.step.predict import simulate_plan, stage_times
from planner.schema.plan import Plan
from planner.schema.result import RunResult

SEED = "0"
BENCH_MODELS = ("mlp_stack", "heavy_middle")
MB_SAMPLES: dict[str, int] = {"resnet50": 4}  # samples per microbatch (batch norm needs >= 2); others: DEFAULT
DEFAULT_MB_SAMPLES = 8  # --mb-samples; large enough that a block is not a few microseconds of work
DASH = "-"

Isolated = dict[str, tuple[float, float]]  # block name -> (fwd_s, bwd_s) per microbatch, timed alone


@dataclass(frozen=True)
class ModelSpec:
    """One model file to bench: its name in the tables, where it lies in the workspace, and its size."""

    name: str  # "gpt", "hf/gpt2", "mlp_stack"
    path: Path
    size: str | None
    skip: str = ""  # why it is not run (empty: it is)


@dataclass
class Case:
    """One (model, ranks, schedule): the plan and run it made, or why it failed."""

    model: ModelSpec
    ranks: int
    schedule: str
    batch: int
    microbatches: int
    plan_path: Path
    plan_options: tuple[str, ...] = ()  # more `planner plan` options (repeated_accuracy --plan-repeats)
    error: str = ""
    plan: Plan | None = None
    run: RunResult | None = None
    seconds: float = 0.0
    isolated: Isolated | None = None  # every block timed alone (`in_context=False`), by block name
    isolated_error: str = ""  # why the isolated profile failed

    @property
    def label(self) -> str:
        """The case in words, for progress lines."""
        return f"{self.model.name} p={self.ranks} {self.schedule}"


def smallest_size(path: Path) -> str | None:
    """`tiny` if the file has it, else its first SIZES entry, else None (the file's own defaults)."""
    sizes = getattr(load_model_file(path).module, "SIZES", None) or {}
    return "tiny" if "tiny" in sizes else next(iter(sizes), None)


def discover(work: Path, wanted: Sequence[str] | None, bench_size: bool) -> list[ModelSpec]:
    """Copy the model files into `work` and list those selected (by name or file stem)."""
    copy_models(MODELS, work / "models")
    copy_models(ROOT / "bench" / "models", work / "bench_models")
    files = [(p.stem, p) for p in sorted((work / "models").glob("*.py"))]
    files += [(f"hf/{p.stem}", p) for p in sorted((work / "models" / "hf").glob("*.py"))]
    files += [(stem, work / "bench_models" / f"{stem}.py") for stem in BENCH_MODELS]
    has_hf = importlib.util.find_spec("transformers") is not None
    specs = []
    for name, path in files:
        if wanted and name not in wanted and path.stem not in wanted:
            continue
        if name.startswith("hf/") and not has_hf:
            specs.append(ModelSpec(name, path, None, skip="transformers is not installed"))
            continue
        try:
            size = "bench" if bench_size and name in BENCH_MODELS else smallest_size(path)
        except Exception as exc:  # noqa: BLE001 - a file that does not import is named, not fatal
            specs.append(ModelSpec(name, path, None, skip=f"cannot import: {type(exc).__name__}: {exc}"))
            continue
        specs.append(ModelSpec(name, path, size))
    return specs


def make_case(
    work: Path,
    model: ModelSpec,
    ranks: int,
    schedule: str,
    tag: str = "",
    *,
    mb_samples: int = DEFAULT_MB_SAMPLES,
    plan_options: Sequence[str] = (),
) -> Case:
    """A case with its batch: 2 microbatches per rank, each of ``mb_samples`` samples (MB_SAMPLES where set)."""
    microbatches = 2 * ranks
    batch = microbatches * MB_SAMPLES.get(model.name, mb_samples)
    stem = f"{model.name.replace('/', '_')}_p{ranks}_{schedule}{tag}"
    return Case(model, ranks, schedule, batch, microbatches, work / f"{stem}.json", tuple(plan_options))


def plan_argv(case: Case, *extra: str) -> list[str]:
    """`planner plan` for a case."""
    words = ["plan", str(case.model.path), "--gpus", str(case.ranks), "--schedule", case.schedule, *case.plan_options]
    words += ["-b", str(case.batch), "-m", str(case.microbatches), "--seed", SEED, "-q", "-o", str(case.plan_path)]
    return [PLANNER, *words, *(["--size", case.model.size] if case.model.size else []), *extra]


def run_case(case: Case, steps: int, timeout_s: float) -> Case:
    """Plan and run one case, keeping what it wrote or why it failed."""
    t0 = time.perf_counter()
    case.plan, case.run, case.error = plan_and_run(plan_argv(case), case.plan_path, steps, timeout_s)
    case.seconds = time.perf_counter() - t0
    return case


def ok_cases(cases: Sequence[Case]) -> list[Case]:
    """The cases that planned and ran."""
    return [c for c in cases if c.plan is not None and c.run is not None and not c.error]


# --------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------
def rel(predicted: float, measured: float | None) -> float | None:
    """(predicted - measured) / measured in %, None when there is no measurement."""
    if measured is None or measured <= 0 or math.isnan(measured):
        return None
    return 100 * (predicted - measured) / measured


def pct(x: float | None) -> str:
    """A signed percentage, or a dash."""
    return DASH if x is None else f"{x:+.1f}%"


def ms(seconds: float | None) -> str:
    """Milliseconds with two decimals, or a dash."""
    return DASH if seconds is None else f"{seconds * 1e3:.2f}"


def mean_abs(xs: Sequence[float | None]) -> float | None:
    """Mean of the absolute values that exist, None when none does."""
    vals = [abs(x) for x in xs if x is not None]
    return statistics.mean(vals) if vals else None


def split_of(starts: Sequence[int], n_blocks: int) -> str:
    """Blocks per stage, e.g. 3+4."""
    ends = [*starts[1:], n_blocks]
    return "+".join(str(b - a) for a, b in zip(starts, ends))


def plan_split(plan: Plan) -> str:
    """A plan's blocks per stage."""
    return split_of([s.start for s in plan.stages], len(plan.blocks))


def shared_compute(plan: Plan) -> list[float]:
    """Per stage, fwd + bwd per microbatch as the simulator stretches them when ranks share cores.

    With more ranks than cores (4 ranks on 2 cores, one thread each) a rank's actions run slower
    while others compute; the simulator models that (processor sharing), and the run's action times
    include it. Each stage's forward and backward are scaled by the mean stretch of its simulated F
    and B actions (duration / unshared duration); without sharing this is ``fwd_s + bwd_s``.
    """
    sim = simulate_plan(plan)
    unshared = stage_times(plan.stages, plan.link.cpu_share)
    out = []
    for i, st in enumerate(plan.stages):

        def stretch(kind: str, i: int = i) -> float:
            # the action's processor part (all but its wait, StageTimes.msg) is what sharing stretches
            wait = unshared[i].msg
            alone = unshared[i].of(kind) - wait
            d = [e.end_s - e.start_s - wait for e in sim.events if e.stage == i and e.kind == kind]
            return statistics.mean(d) / alone if d and alone > 0 else 1.0

        out.append(st.fwd_s * stretch("F") + st.bwd_s * stretch("B"))
    return out
