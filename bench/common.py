"""What the bench scripts share: the repository's paths, the commands they start, the pages they write.

Every script in bench/ runs from the repository root as ``python -m bench.NAME``. A script imports
from bench/ this module, ``bench.cases`` (the planned-and-run cases of the accuracy benches) and the
helper modules it was split into, never another script.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from tabulate import tabulate

from planner.errors import PlannerError
from planner.schema.jsonfile import write_atomic
from planner.schema.plan import Plan, StagePlan
from planner.schema.result import MemoryMeasure, RunResult

if TYPE_CHECKING:
    from bench.published_rows import Published
    from planner.api import Costs
    from planner.capture.load import ModelFile
    from planner.schema.request import PlanRequest

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MODELS = ROOT / "models"
# The venv that runs a bench is the one whose `planner` it measures.
PLANNER = str(Path(sys.executable).parent / "planner")


# --------------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    """What one command did: its exit code (None when stopped at its timeout), output and wall time."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    note: str = ""  # why there is no exit code: "timed out after N s (stopped)"

    @property
    def error(self) -> str:
        """Empty when the command succeeded, else one line saying how it failed."""
        if self.returncode is None:
            return self.note
        if self.returncode == 0:
            return ""
        return f"exit {self.returncode}: {last_line(self.stderr, self.stdout) or 'nothing printed'}"


def execute(argv: Sequence[str], cwd: Path, timeout_s: float, env: Mapping[str, str] | None = None) -> Finished:
    """Run one command in ``cwd``, capturing both streams; stop its whole process group on a timeout.

    `planner run` starts one process per rank; `start_new_session` puts them in a group of their own,
    so a timeout stops exactly the processes this command started and nothing else.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=None if env is None else dict(env),
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        note = f"timed out after {timeout_s:.0f} s (stopped)"
        return Finished(None, out, err, time.perf_counter() - start, note)
    return Finished(proc.returncode, out, err, time.perf_counter() - start)


def run_timed(
    cmd: Sequence[str], timeout_s: float, cwd: Path = ROOT, env: Mapping[str, str] | None = None
) -> tuple[int, float, int, str, str]:
    """Run ``cmd`` (stopped after ``timeout_s``); return (exit code, wall seconds, peak RSS bytes of
    that child: ``os.wait4``'s own rusage, what ``/usr/bin/time -v`` reports, stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, cwd=cwd, env=None if env is None else dict(env))
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB on Linux)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, wall, usage.ru_maxrss * 1024, out.read(), err.read()


def last_line(*texts: str) -> str:
    """The last non-empty line of the first text that has one, fit for a markdown table cell."""
    for text in texts:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            line = lines[-1]
            return (line[:200] + " ...").replace("|", "\\|") if len(line) > 200 else line.replace("|", "\\|")
    return ""


def planner_command(argv: Sequence[str], cwd: Path, timeout_s: float) -> str:
    """Run a ``planner`` command line (``argv`` starts with ``PLANNER``); "" if it succeeded, else its error line."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return execute(argv, cwd, timeout_s, env).error


def run_path_of(plan_path: Path, tag: str = "") -> Path:
    """Where the run of a plan file goes: X.run.json (or X.<tag>.run.json)."""
    return plan_path.with_name(plan_path.stem + (f".{tag}" if tag else "") + ".run.json")


def written(
    argv: Sequence[str], cwd: Path, what: str, path: Path, load: Callable[[Path], T], timeout_s: float
) -> tuple[T | None, str]:
    """Run a `planner` command in ``cwd`` (``what``: its name in messages), then read the file it
    wrote at ``path`` with ``load``: that, or None and the error line."""
    error = planner_command(argv, cwd, timeout_s)
    if error:
        return None, f"{what}: {error}"
    try:
        return load(path), ""
    except PlannerError as exc:
        return None, f"reading {path.name}: {last_line(str(exc))}"


def plan_file(argv: Sequence[str], plan_path: Path, timeout_s: float) -> tuple[Plan | None, str]:
    """`planner plan` (``argv``, writing ``plan_path``); the plan it wrote, or the error line."""
    return written(argv, plan_path.parent, "planner plan", plan_path, Plan.load, timeout_s)


def run_plan_file(plan_path: Path, run_path: Path, steps: int, timeout_s: float) -> tuple[RunResult | None, str]:
    """`planner run` a plan file; the run it wrote, or the error line."""
    argv = [PLANNER, "run", str(plan_path), "--steps", str(steps), "--no-checkpoint", "-o", str(run_path)]
    return written(argv, plan_path.parent, "planner run", run_path, RunResult.load, timeout_s)


def plan_and_run(
    argv: Sequence[str], plan_path: Path, steps: int, timeout_s: float
) -> tuple[Plan | None, RunResult | None, str]:
    """`planner plan` (``argv``, writing ``plan_path``), then `planner run` on the plan it wrote (the
    run beside it, X.run.json): what each wrote, and the first error line ("" when both succeeded)."""
    plan, error = plan_file(argv, plan_path, timeout_s)
    if plan is None:
        return None, None, error
    run, error = run_plan_file(plan_path, run_path_of(plan_path), steps, timeout_s)
    return plan, run, error


def copy_models(src: Path, dest: Path) -> None:
    """Copy a folder of model files (no bytecode caches), so that commands run on a copy."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))


# --------------------------------------------------------------------------------------------------
# plans made and run in this process
# --------------------------------------------------------------------------------------------------
def plan_on_costs(
    request: PlanRequest,
    costs: Costs,
    mf: ModelFile,
    *,
    created: str,
    memory_limit_bytes: int | None = None,
    jobs: int | None = None,
) -> Plan:
    """``make_plan``'s search on costs measured or estimated once (many plans, one profile): the same
    ``plan_from_costs`` (the blocks' tensor-parallel shares in the planning dtype, the optimizer's
    step rule), the links recorded as placed; not the runner's graph at the chosen size. With
    ``jobs``, the search's worker processes as ``planner plan --jobs`` starts them, where the
    measured tree's planner has them (``planner.workers``); None: none, every layout here."""
    import inspect
    from contextlib import nullcontext

    from planner.api import plan_from_costs
    from planner.core.heap import bulk_allocation
    from planner.core.step.predict import with_links

    pooled = jobs is not None and "pool" in inspect.signature(plan_from_costs).parameters
    if pooled:
        from planner.workers import SearchPool  # (a tree from before the worker processes has none)
    # with the cyclic collector paused, as make_plan runs its search: a bench timing the search
    # otherwise also times collections that planner plan never makes
    with bulk_allocation(), SearchPool(jobs) if pooled and jobs is not None else nullcontext() as pool:
        extra: dict[str, Any] = {"pool": pool} if pooled else {}
        plan = plan_from_costs(
            request,
            mf,
            costs,
            costs.blocks,
            costs.link,
            created=created,
            memory_limit_bytes=memory_limit_bytes,
            **extra,
        )
    return with_links(plan, costs.link)


def base_request(row: Published, tmp: Path) -> PlanRequest:
    """A published row's request (``bench.published_rows``): its model, GPUs, batch and degrees, and
    what it ran with in every variant of docs/published_runs.md.

    Args:
        row: the published row.
        tmp: where the request's plan would be written.

    Returns:
        The request.
    """
    from planner.schema.request import PlanRequest

    return PlanRequest.build(
        model_file=MODELS / "llama.py",
        size=row.size,
        overrides=row.overrides,
        gpus=row.gpus,
        gpu_type=row.gpu,
        gpus_per_node=8,
        dtype=row.dtype,
        batch_size=row.batch,
        tp=row.tp,
        dp=row.dp,
        cp=row.cp,
        output=tmp / "plan.json",
        progress=False,
        recompute="auto",
        **row.request,
    )


def search_update(base: PlanRequest) -> dict[str, Any]:
    """What docs/published_runs.md's search of a row leaves open (``bench.search_time --published``
    times the same search).

    Args:
        base: the row's request (``base_request``).

    Returns:
        The fields to update ``base`` with: the degrees, recomputation, sequence parallelism and
        data-parallel mode; a long-context run's context-parallel degree and attention too (the
        others keep cp 1).
    """
    update: dict[str, Any] = {
        "tp": "auto",
        "dp": "auto",
        "recompute": "auto",
        "sequence_parallel": "auto",
        "dp_mode": "auto",
    }
    if base.cp != 1:
        update.update(cp="auto", cp_attention="auto")
    return update


def tiny_gpt_request(overrides: Mapping[str, int], output: Path, **options: Any) -> PlanRequest:
    """`models/gpt.py` at its tiny size with ``overrides`` (each bench's own width, depth and
    sequence), planned quietly into ``output``; ``options``: the rest of the request (gpus, batch,
    schedule, recompute, ...), as ``PlanRequest.build`` takes them. The memory benches train it."""
    from planner.schema.request import PlanRequest

    return PlanRequest.build(
        model_file=MODELS / "gpt.py", size="tiny", overrides=dict(overrides), output=output, progress=False, **options
    )


def save_and_train(plan: Plan, path: Path, steps: int) -> RunResult:
    """Save ``plan`` at ``path`` (the runner reads its plan file) and train it ``steps`` steps in this
    process, without the step lines."""
    from planner.run import run_plan
    from planner.schema.run_request import RunRequest

    plan.save(path)
    return run_plan(plan, RunRequest(plan_file=path, steps=steps, echo=False))


class StagePeak(NamedTuple):
    """One stage's predicted peak memory beside the peak MemTracker saw (``planned_peaks``)."""

    stage: StagePlan
    measured: MemoryMeasure
    error_pct: float  # predicted / measured - 1, in %


def planned_peaks(
    request: PlanRequest, path: Path, steps: int, recompute: str | None = None
) -> tuple[Plan, RunResult, list[StagePeak]]:
    """Plan ``request`` in this process, save the plan at ``path``, train it ``steps`` steps; per stage
    whose peak was tracked, its prediction beside the measurement. ``recompute``: every stage's
    recompute value set to this in the plan (as a user edits plan.json, e.g. "full:2"), its figures
    predicted again."""
    from planner.api import make_plan
    from planner.core.step.predict import refresh

    plan = make_plan(request)
    if recompute is not None:
        stages = [s.model_copy(update={"recompute": recompute}) for s in plan.stages]
        plan = refresh(plan.model_copy(update={"stages": stages}))[0]
    result = save_and_train(plan, path, steps)
    peaks = [
        StagePeak(st, meas.memory, pct_error(st.memory_bytes, meas.memory.peak_bytes))
        for st, meas in zip(plan.stages, result.stages)
        if meas.memory is not None
    ]
    return plan, result, peaks


def timed_step_times(result: RunResult) -> list[float]:
    """A run's step times, timed steps only (not the first, nor the memory-tracked one)."""
    return [result.step_times_s[i - 1] for i in result.timed_steps]


def alternate(
    plans: Mapping[str, Plan],
    folder: Path,
    rounds: int,
    steps: int,
    *,
    echo: bool = True,
    after_round: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Train every plan for ``steps`` steps once per round, the plans taking turns so that the machine's
    drift hits all alike: per plan, the timed step times of all rounds and the last round's losses."""
    from planner.run import run_plan
    from planner.schema.run_request import RunRequest

    paths: dict[str, Path] = {}
    for i, (name, plan) in enumerate(plans.items()):
        paths[name] = folder / f"plan{i}.json"
        plan.save(paths[name])
    measured: dict[str, list[float]] = {name: [] for name in plans}
    losses: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, plan in plans.items():
            print(f"round {r + 1}/{rounds}: {name}", flush=True)
            result = run_plan(plan, RunRequest(plan_file=paths[name], steps=steps, echo=echo))
            measured[name].extend(timed_step_times(result))
            losses[name] = result.losses
        if after_round is not None:
            after_round(r)
    return measured, losses


def same_losses(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two runs' per-step losses agree to 1e-4 (relative, absolute below 1)."""
    return all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(a, b))


def blocks_per_stage(plan: Plan) -> str:
    """How many blocks each stage holds, e.g. 3+4."""
    return "+".join(str(s.end - s.start) for s in plan.stages)


# --------------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------------
def gpu_type_of(device_name: str) -> str | None:
    """The planner's spec name (``--gpu-type``) for a CUDA device name ("NVIDIA H100 80GB HBM3" →
    "h100"); None when ``planner/core/levers/hardware.py`` has none of that name."""
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100", "l40s", "l4", "a10g", "v100", "mi300x"):
        if key in lowered:
            return key
    return None


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` is empty on Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def host() -> str:
    """This machine's name and core count, as the pages' first lines give them."""
    return f"{platform.node()}, {os.cpu_count()} cores"


def machine() -> str:
    """Host, CPU model, cores, torch and Python versions."""
    import torch

    cpu = cpu_model() or "unknown CPU"
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def background_cpu(seconds: float = 2.0) -> float:
    """Share of the machine's CPU time other processes used over `seconds`, while this script idles.

    The step times on the pages are wall-clock times; when other jobs share the cores they stretch.
    Sampling /proc/stat while nothing of ours runs says how busy the machine was around the run.
    """

    def jiffies() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
        idle = values[3] + values[4]  # idle + iowait
        return sum(values) - idle, sum(values)

    try:
        busy0, total0 = jiffies()
        time.sleep(seconds)
        busy1, total1 = jiffies()
    except OSError:
        return math.nan
    return (busy1 - busy0) / max(1, total1 - total0)


# --------------------------------------------------------------------------------------------------
# pages
# --------------------------------------------------------------------------------------------------
def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, numparse: bool = False) -> str:
    """A GitHub markdown table; cells as given unless ``numparse`` (then numbers align right)."""
    return tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=not numparse)


def write_page(path: Path | str, text: str, option: str = "--out") -> None:
    """Write a page (or any text file) whole or not at all, creating its folder.

    A page that cannot be written there (a folder in the way, no permission) holds what a bench
    measured, often minutes of it: it is kept in the temporary folder instead, and the bench ends with
    one line naming both (``SystemExit``), not a traceback.
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, option)
    except (PlannerError, OSError) as e:
        fd, kept = tempfile.mkstemp(prefix=f"{Path(path).stem}.", suffix=Path(path).suffix or ".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        raise SystemExit(f"error: {last_line(str(e))}; the page is kept at {kept}") from None


# docs/published_runs.md's mixture-of-experts section: bench/moe_published.py writes it, and
# bench/published_runs.py, which writes the rest of the page whole, keeps it as it is
MOE_PUBLISHED = (
    "<!-- BEGIN moe-published (written by bench/moe_published.py) -->",
    "<!-- END moe-published -->",
)


def kept_between(doc: Path, begin: str, end: str) -> str:
    """What lies between the two marker lines of the page ``doc`` ("" where it or they are missing)."""
    text = doc.read_text() if doc.exists() else ""
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def between_markers(text: str, begin: str, end: str, body: str) -> str | None:
    """``text`` with what lies between the two marker lines replaced by ``body``; None without both."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def write_between_markers(doc: Path, begin: str, end: str, body: str) -> None:
    """Write ``body`` between the two marker lines of the page ``doc`` (the rest of it as it is); a
    page not there yet (a trial run's ``--out``) is written as the markers and ``body`` alone. Exits
    with an error naming the markers when the page lacks them, or naming the page when it cannot be
    read, or (``write_page``) naming where the page was kept when it cannot be written."""
    try:
        old = doc.read_text() if doc.exists() else f"{begin}\n{end}\n"
    except OSError as e:
        sys.exit(f"error: cannot read {doc}: {e.strerror or e}")
    text = between_markers(old, begin, end, body)
    if text is None:
        sys.exit(f"error: {doc} lacks the markers {begin} ... {end}")
    write_page(doc, text)
    print(f"wrote {doc}", file=sys.stderr)


def pct_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured, in %."""
    return 100 * (predicted - measured) / measured
