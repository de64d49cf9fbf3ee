"""The seed systems, reproduced: one docs page per tutorial system the planner grew from.

For each system this script types the commands a user would type (`planner plan`, `planner run`,
`planner report`) as subprocesses in a temporary folder holding a copy of `models/`, captures what
they print and the figures of the plan.json / run.json they write, and writes `docs/seed_<name>.md`
(the ResNet-50 page also `docs/figures/resnet50_split_sweep.png`). No figure on a page is typed by
hand: every number comes from a command's output or the files it wrote, on this machine, today.

    .venv/bin/python -m bench.seed_systems                    # all five pages (about 5-10 minutes)
    .venv/bin/python -m bench.seed_systems --only resnet50    # one page (repeat --only for more)
    .venv/bin/python -m bench.seed_systems --keep             # keep the temporary folder to look at

A command that fails is named on its page with its exit code and error line (the pages are written
anyway), and the script exits 1. Plans use a fixed seed (`--seed 0`), so weights, data and losses
repeat from run to run; step times do not: they are wall-clock times on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import DOCS, ROOT, background_cpu, write_page
from bench.seed_pages import DDP_PIPELINE, ENCODER_LM, GPT, SHAKESPEARE, Page, commands_block, full_size, sections
from bench.seed_resnet import RESNET50
from bench.seed_run import Outcome, Workspace, machine_facts
from bench.seed_text import plan_excerpt, printed, run_excerpt

SCRIPT = "bench/seed_systems.py"
RERUN = ".venv/bin/python -m bench.seed_systems"

# Above this share of the CPU used by other processes around a page's commands, the page says so
# at the top: its timings are then the machine's load as much as the planner's.
BUSY_WARNING = 0.25

# The pages, one record each (bench.seed_pages, bench.seed_resnet): `--only NAME` picks among them.
PAGES: dict[str, Page] = {page.name: page for page in (ENCODER_LM, GPT, DDP_PIPELINE, RESNET50, SHAKESPEARE)}


# --------------------------------------------------------------------------------------------------
# assembling a page
# --------------------------------------------------------------------------------------------------
def failure_line(outcome: Outcome) -> str:
    """One line of a page's "What failed": the command, how it failed and its error line."""
    if outcome.note.startswith("skipped: "):
        return f"`{outcome.cmd.text}` was not run: {outcome.note.removeprefix('skipped: ')}"
    what = "was expected to fail and did not" if outcome.cmd.expect_fail else "failed"
    code_text = "" if outcome.returncode is None else f" (exit code {outcome.returncode})"
    return f"`{outcome.cmd.text}` {what}{code_text}: `{outcome.error_line()}`"


def build(page: Page, facts: dict[str, str], scratch: Path) -> tuple[str, list[str]]:
    """Run a page's commands in a fresh workspace: its markdown (failures included) and the lines
    of its "What failed" section (empty when every command did what the page expected)."""
    folder = scratch / page.name
    folder.mkdir()
    ws = Workspace(folder, page.name)
    started = dt.datetime.now(dt.timezone.utc)
    busy_before = background_cpu()
    t0 = time.perf_counter()
    for cmd in [*page.commands, page.estimate]:
        ws.run(cmd)
    seconds = time.perf_counter() - t0
    busy_after = background_cpu()

    failures = [failure_line(outcome) for outcome in ws.outcomes.values() if not outcome.ok]
    body: list[str] = []
    full = ""
    try:
        body = sections(page, ws)
    except Exception as exc:  # noqa: BLE001 - a renderer that breaks (a changed run.json) is reported on the page
        failures.append(f"writing the page's outputs and figures failed: `{type(exc).__name__}: {exc}`")
    try:
        full = full_size(page, ws)
    except Exception as exc:  # noqa: BLE001 - likewise
        failures.append(f"writing the full-size section failed: `{type(exc).__name__}: {exc}`")

    text = [
        f"# {page.title}",
        page.intro,
        "## Commands",
        "From the repository root (plans use the default seed, spelled out so reruns compare):",
        commands_block(page.commands),
    ]
    busiest = max((x for x in (busy_before, busy_after) if not math.isnan(x)), default=0.0)
    if busiest > BUSY_WARNING:
        text.append(
            f"**Measured on a busy machine:** other processes used up to {100 * busiest:.0f}% of its "
            "CPU around these commands (Machine and date, below), so the step times here are "
            "longer, and the predictions further from them, than on an idle machine."
        )
    if failures:
        text += ["## What failed", "\n".join(f"- {line}" for line in failures)]
    text += body or _outputs_so_far(ws)
    text += ["## Full size (not run here)", full or "(not written: see What failed)"]
    text += [
        "## Machine and date",
        _machine_section(facts, started, seconds, busy_before, busy_after),
        f"Written by `{SCRIPT}`; rerun with `{RERUN} --only {page.name}`.",
    ]
    return "\n\n".join(text).rstrip() + "\n", failures


def _outputs_so_far(ws: Workspace) -> list[str]:
    """When a page's own tables cannot be made (a command failed), at least what did run."""
    excerpts: dict[str, Callable[[str], str]] = {"plan": plan_excerpt, "run": run_excerpt}
    shown = [
        printed(ws, key, excerpts.get(outcome.cmd.argv[1], str.rstrip))
        for key, outcome in ws.outcomes.items()
        if outcome.ok and not outcome.cmd.expect_fail and outcome.cmd.key != "estimate"
    ]
    return ["## What it printed (the commands that ran)", *shown] if shown else []


def _machine_section(
    facts: dict[str, str], started: dt.datetime, seconds: float, busy_before: float, busy_after: float
) -> str:
    """Where and when the page was measured, and how busy the machine was around it."""

    def pct(x: float) -> str:
        return "?" if math.isnan(x) else f"{100 * x:.0f}%"

    lines = [
        f"- CPU: {facts['cpu']}, {facts['cores']} cores (model name from /proc/cpuinfo)",
        f"- torch {facts['torch']}, Python {facts['python']}, {facts['system']} (from `{facts['probe']}`)",
        f"- measured {started.strftime('%Y-%m-%d %H:%M UTC')}; the commands above took {seconds:.0f} s of wall "
        "time, all of them together",
        f"- CPU used by other processes: {pct(busy_before)} of the machine just before the commands, "
        f"{pct(busy_after)} just after (2-second samples of /proc/stat while this script idled). Step "
        "times are wall-clock times: other jobs on these cores stretch them.",
    ]
    return "\n".join(lines)


def main() -> int:
    """Build the pages asked for; return 1 if any command failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(PAGES), help="build this page only (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args()
    names = args.only or list(PAGES)

    t0 = time.perf_counter()
    facts = machine_facts()
    scratch = Path(tempfile.mkdtemp(prefix="seed_systems_"))
    failed: list[str] = []
    try:
        for name in names:
            page_t0 = time.perf_counter()
            text, failures = build(PAGES[name], facts, scratch)
            out = DOCS / f"seed_{name}.md"
            write_page(out, text)
            print(f"wrote {out.relative_to(ROOT)} ({time.perf_counter() - page_t0:.0f} s)", flush=True)
            if failures:
                failed.append(name)
                for line in failures:
                    print(f"  FAILED: {line}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"total {time.perf_counter() - t0:.0f} s; pages with failures: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
