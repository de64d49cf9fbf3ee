"""The seed pages' text: excerpts of what the commands printed, and figures from the files they wrote.

Every number a seed page shows comes from here: verbatim lines of a command's output ("..." marks
the lines left out) and figures read from its plan.json and run.json.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import table
from bench.seed_run import Workspace


# --------------------------------------------------------------------------------------------------
# excerpts of what the commands printed (verbatim lines; "..." marks lines left out)
# --------------------------------------------------------------------------------------------------
def select_lines(text: str, keep: Callable[[int, str, list[str]], bool]) -> str:
    """The lines of `text` that `keep(index, line, lines)` accepts, one "..." for each gap."""
    lines = text.rstrip("\n").splitlines()
    out: list[str] = []
    gap = False
    for i, line in enumerate(lines):
        if keep(i, line, lines):
            if gap:
                out.append("...")
                gap = False
            out.append(line)
        else:
            gap = True
    if gap:
        out.append("...")
    return "\n".join(out)


def plan_excerpt(stdout: str, search_rows: int = 4) -> str:
    """`planner plan`'s report: header, stage and partition tables, the best few search candidates
    and the summary lines (the rest of the search table is left out)."""
    in_search = False
    row = 0

    def keep(i: int, line: str, lines: list[str]) -> bool:
        nonlocal in_search, row
        if line.startswith("joint search"):
            in_search, row = True, -2  # the column header and its dashes come first
            return True
        if in_search:
            if not line.strip():
                in_search = False
                return True
            row += 1
            return row <= search_rows
        return True

    return select_lines(stdout, keep)


def run_excerpt(stdout: str, first_steps: int = 3, tail: int = 4) -> str:
    """`planner run`'s output: the launch and data lines, the first steps, every evaluation and
    the last lines (the summary)."""

    def keep(i: int, line: str, lines: list[str]) -> bool:
        if not line.startswith("step "):
            return True  # launch / data / eval / summary lines
        steps_before = sum(1 for prev in lines[:i] if prev.startswith("step "))
        return steps_before < first_steps or i >= len(lines) - tail

    return select_lines(stdout, keep)


def after(stdout: str, marker: str) -> str:
    """The lines from the first one starting with `marker` to the end."""
    lines = stdout.rstrip("\n").splitlines()
    for i, line in enumerate(lines):
        if line.startswith(marker):
            return "\n".join(lines[i:])
    return stdout.rstrip("\n")


def line_starting(stdout: str, prefix: str) -> str | None:
    """The first line starting with `prefix` (stripped), or None."""
    for line in stdout.splitlines():
        if line.strip().startswith(prefix):
            return line.strip()
    return None


def code(text: str) -> str:
    """A fenced code block."""
    return f"```\n{text.rstrip()}\n```"


def printed(ws: Workspace, key: str, excerpt: Callable[[str], str]) -> str:
    """A command and an excerpt of what it printed (and its stderr, when it printed any)."""
    outcome = ws.outcomes[key]
    body = f"$ {outcome.cmd.text}\n{excerpt(outcome.stdout)}"
    text = code(body)
    if outcome.stderr.strip():
        tail = "\n".join(outcome.stderr.rstrip().splitlines()[-6:])
        text += f"\n\nOn stderr (last lines):\n\n{code(tail)}"
    return text


# --------------------------------------------------------------------------------------------------
# figures from plan.json and run.json
# --------------------------------------------------------------------------------------------------
def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, to a tenth."""
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def split_of(plan: dict[str, Any]) -> str:
    """Blocks per stage and the blocks each stage starts and ends with."""
    stages = plan["stages"]
    counts = "+".join(str(s["end"] - s["start"]) for s in stages)
    names = ", ".join(f"{s['first_block']}..{s['last_block']}" for s in stages)
    return f"{counts} ({names})"


def layout_of(plan: dict[str, Any]) -> str:
    """Replicas x pipeline ranks = processes, and stages. plan.json's `n_ranks` counts the ranks of
    one pipeline; the run starts `dp` times as many processes."""
    dp, pp, stages = plan["dp"], plan["n_ranks"], plan["n_stages"]
    per_rank = "" if stages == pp else f", {stages // pp} per rank"
    return (
        f"{plural(dp, 'replica')} x {plural(pp, 'pipeline rank')} = {plural(dp * pp, 'rank')}; "
        f"{plural(stages, 'stage')}{per_rank}"
    )


def plural(n: int, word: str) -> str:
    """`1 stage`, `2 stages`."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def tokens_per_sample(plan: dict[str, Any]) -> int | None:
    """Tokens per sample of a token-id model (None for images)."""
    value = plan["profile"].get("tokens_per_sample")
    return int(value) if value else None


FigureRow = tuple[str, Callable[[dict[str, Any], dict[str, Any]], str | None]]


def _error(plan: dict[str, Any], run: dict[str, Any]) -> str:
    pred, meas = plan["prediction"]["step_time_s"], run["median_step_s"]
    return f"{100 * (pred - meas) / meas:+.0f}%"


def _pred_tokens(plan: dict[str, Any], run: dict[str, Any]) -> str | None:
    tps = tokens_per_sample(plan)
    return None if tps is None else f"{tps * plan['batch_size'] / plan['prediction']['step_time_s']:,.0f}"


def _eval(plan: dict[str, Any], run: dict[str, Any]) -> str | None:
    evals = run.get("evals") or []
    return (
        None
        if not evals
        else f"{evals[-1]['loss']:.4f} / {evals[-1]['perplexity']:.1f} (after step {evals[-1]['step']})"
    )


FIGURES_ROWS: list[FigureRow] = [
    ("schedule, microbatches", lambda p, r: f"{p['schedule']}, m = {p['n_microbatches']}"),
    ("layout", lambda p, r: layout_of(p)),
    ("blocks per stage", lambda p, r: split_of(p)),
    ("predicted step (ms)", lambda p, r: ms(p["prediction"]["step_time_s"])),
    ("measured step, median (ms)", lambda p, r: ms(r["median_step_s"])),
    ("prediction error (plan - run) / run", _error),
    ("predicted samples/s", lambda p, r: f"{p['batch_size'] / p['prediction']['step_time_s']:,.1f}"),
    ("measured samples/s", lambda p, r: f"{r['samples_per_s']:,.1f}"),
    ("predicted tokens/s", _pred_tokens),
    ("measured tokens/s", lambda p, r: f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else None),
    ("final train loss", lambda p, r: f"{r['losses'][-1]:.4f} (step {len(r['losses'])})"),
    ("eval loss / perplexity", _eval),
    ("peak RSS of the largest rank (MB)", lambda p, r: f"{max(r['peak_rss_bytes']) / 2**20:.0f}"),
    ("timed steps (median over)", lambda p, r: f"{len(r['timed_steps'])} of {r['steps']}"),
]


def figures_table(columns: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> str:
    """Figures (rows) of one or more (label, plan.json, run.json) runs (columns); rows that no run
    has (tokens for images, evaluations without held-out text) are left out."""
    rows = []
    for label, fn in FIGURES_ROWS:
        cells = [fn(plan, run) for _, plan, run in columns]
        if any(cell is not None for cell in cells):
            rows.append([label, *(cell if cell is not None else "—" for cell in cells)])
    headers = ["figure", *(label for label, _, _ in columns)]
    return table(rows, headers)


def eval_table(run: dict[str, Any], perplexity: str) -> str:
    """The run's evaluations (run.json `evals`) beside the training loss of the same step;
    ``perplexity``: its format (".1f")."""
    rows = [
        [e["step"], f"{run['losses'][e['step'] - 1]:.4f}", f"{e['loss']:.4f}", format(e["perplexity"], perplexity)]
        for e in run.get("evals") or []
    ]
    return table(rows, ["step", "train loss (that step's batch)", "eval loss", "eval perplexity"])


def timing_note() -> str:
    """How the step figures were taken (the same on every page)."""
    return (
        "Measured step = median wall time of the timed steps (`planner run` leaves out step 1, which "
        "sets up, and the last step, which runs under the memory tracker); samples/s and tokens/s "
        "are the global batch over that median. Predicted = the plan's simulated step from the "
        "costs it profiled on this machine a minute earlier."
    )


OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD"}


def estimate_summary(ws: Workspace, key: str, plan_file: str) -> str:
    """What the full-size estimate says the tutorial's size needs, or why there is no estimate."""
    if key not in ws.outcomes:
        return "(No estimate was asked for.)"
    if not ws.ok(key):
        return f"The estimate did not run: `{ws.outcomes[key].error_line()}`."
    est = ws.json(plan_file)
    params = sum(s["params"] for s in est["stages"])
    peak = est["prediction"]["max_memory_bytes"] / 2**30
    return (
        f"The planner's estimate for that size (`{ws.outcomes[key].cmd.text}`, planned here on the meta "
        f"device, nothing trained): {params:,} parameters; {est['dp'] * est['n_ranks']} GPUs "
        f"({layout_of(est)}), {est['schedule']} with m = {est['n_microbatches']}; a peak of "
        f"{peak:.1f} GiB on the fullest GPU (fp32 weights and gradients, "
        f"{OPTIMIZER_NAMES.get(est['optimizer']['name'], est['optimizer']['name'])}'s state, in-flight "
        "activations and buffers); predicted step "
        f"{ms(est['prediction']['step_time_s'])} ms on H100s. These figures are the roofline model's, "
        "not validated on a GPU here (README, Limits)."
    )
