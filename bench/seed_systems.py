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
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    DOCS,
    MODELS,
    PLANNER,
    ROOT,
    background_cpu,
    copy_models,
    cpu_model,
    execute,
    same_losses,
    table,
    write_page,
)

FIGURES = DOCS / "figures"
SCRIPT = "bench/seed_systems.py"
RERUN = ".venv/bin/python -m bench.seed_systems"
SEED = "0"  # passed as --seed to every plan: same weights and data on every rerun

# The executables a page's commands start with, as the user types them -> what runs here. The venv
# that runs this script is the one whose `planner` we measure.
EXECUTABLES = {"planner": PLANNER, "python": sys.executable}

# Full-size plans are estimated, not measured: built on the meta device for this GPU with the
# roofline model (`--gpu-type`), in fp32 as the tutorials trained. Nothing is allocated or run.
ESTIMATE_GPU = ["--gpu-type", "h100", "--dtype", "fp32"]

# ResNet-50 sweep: the tutorial split each batch of 120 images into splits of 1..60 images. The
# microbatch counts here are 120 / split size for the split sizes 60, 40, 20, 10, 5 and 3.
RESNET_BATCH = 120
RESNET_SWEEP = (2, 3, 6, 12, 24, 40)
RESNET_STEPS = 8

# Above this share of the CPU used by other processes around a page's commands, the page says so
# at the top: its timings are then the machine's load as much as the planner's.
BUSY_WARNING = 0.25


# --------------------------------------------------------------------------------------------------
# running commands
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cmd:
    """One command of a page, as the user types it from the repository root.

    Attributes:
        key: the name the page's renderer looks the outcome up by.
        argv: the words, starting with `planner` or `python`.
        needs: keys of earlier commands whose output this one reads; if one failed, this one is
            skipped (and named as skipped) instead of failing for a reason that is not its own.
        expect_fail: the page shows this command failing on purpose (a limit worth knowing).
        timeout_s: wall-clock limit; a command past it is stopped and reported as timed out.
    """

    key: str
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()
    expect_fail: bool = False
    timeout_s: float = 420.0

    @property
    def text(self) -> str:
        """The command line as a shell would show it."""
        return shlex.join(self.argv)


@dataclass
class Outcome:
    """What one command did."""

    cmd: Cmd
    returncode: int | None  # None: not run to completion (skipped or timed out)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    note: str = ""  # why there is no return code: "skipped: ..." or "timed out after N s"

    @property
    def ok(self) -> bool:
        """Whether the command did what the page expected of it."""
        if self.cmd.expect_fail:
            return self.returncode not in (None, 0)
        return self.returncode == 0

    def error_line(self) -> str:
        """The line that says what went wrong: the last non-empty line of stderr, else of stdout."""
        if self.note:
            return self.note
        for text in (self.stderr, self.stdout):
            lines = [line for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1].strip()
        return f"exit code {self.returncode}, nothing printed"


class Workspace:
    """A temporary folder where a page's commands run exactly as typed.

    `models/` is copied in so that `models/gpt.py` and `models/data/shakespeare.txt` resolve as they
    do from the repository root, while plans, runs and checkpoints never land in the repository.
    """

    def __init__(self, folder: Path, label: str) -> None:
        self.folder = folder
        self.label = label
        self.outcomes: dict[str, Outcome] = {}
        copy_models(MODELS, folder / "models")

    def run(self, cmd: Cmd) -> Outcome:
        """Run one command (or skip it when a command it needs failed) and keep its outcome."""
        failed = [key for key in cmd.needs if not self.ok(key)]
        if failed:
            outcome = Outcome(cmd, None, note=f"skipped: it reads the output of `{self.outcomes[failed[0]].cmd.text}`")
        else:
            print(f"[{self.label}] $ {cmd.text}", flush=True)
            outcome = _execute(cmd, self.folder)
            status = "ok" if outcome.ok else f"FAILED: {outcome.error_line()}"
            print(f"[{self.label}]   {outcome.seconds:.1f} s, {status}", flush=True)
        self.outcomes[cmd.key] = outcome
        return outcome

    def ok(self, key: str) -> bool:
        """Whether the command with this key ran and succeeded."""
        outcome = self.outcomes.get(key)
        return outcome is not None and outcome.ok

    def stdout(self, key: str) -> str:
        """What the command with this key printed on stdout."""
        return self.outcomes[key].stdout

    def json(self, name: str) -> dict[str, Any]:
        """A JSON file a command wrote in the workspace."""
        data = json.loads((self.folder / name).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{name} holds {type(data).__name__}, expected an object")
        return data


def _execute(cmd: Cmd, cwd: Path) -> Outcome:
    """Run `cmd` in `cwd` (``bench.common.execute``: a timeout stops its whole process group)."""
    done = execute([EXECUTABLES.get(cmd.argv[0], cmd.argv[0]), *cmd.argv[1:]], cwd, cmd.timeout_s)
    return Outcome(cmd, done.returncode, done.stdout, done.stderr, done.seconds, note=done.note)


def planner(key: str, *words: str, needs: tuple[str, ...] = (), expect_fail: bool = False) -> Cmd:
    """A `planner ...` command."""
    return Cmd(key, ("planner", *words), needs=needs, expect_fail=expect_fail)


# --------------------------------------------------------------------------------------------------
# the machine
# --------------------------------------------------------------------------------------------------
def machine_facts() -> dict[str, str]:
    """CPU model, cores, torch and Python versions, read the way a user would check them."""
    cpu = cpu_model() or "unknown"
    probe = (
        "import platform, torch; print(torch.__version__); print(platform.python_version()); print(platform.platform())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    torch_version, python_version, system = out.splitlines()[:3]
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch": torch_version,
        "python": python_version,
        "system": system,
        "probe": f"python -c '{probe}'",
    }


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


# --------------------------------------------------------------------------------------------------
# pages
# --------------------------------------------------------------------------------------------------
@dataclass
class Page:
    """One docs page: the commands it runs and how it turns their outcomes into markdown.

    Attributes:
        name: `--only NAME`; the page is docs/seed_<name>.md.
        title: the page's heading.
        intro: the paragraph naming the tutorial and what this page runs.
        commands: what a user types for the tiny size, in order; all are run here.
        render: sections (markdown) from the outcomes: outputs, figures, page-specific tables.
        full_size: the commands for the tutorial's own size (shown, not run) and their notes.
        estimate: a `--gpu-type` plan of the full size (run here: cheap, meta device), or None.
        failures: filled while building: the lines the "What failed" section lists.
    """

    name: str
    title: str
    intro: str
    commands: list[Cmd]
    render: Callable[[Workspace], list[str]]
    full_size: Callable[[Workspace], str]
    estimate: Cmd | None = None
    failures: list[str] = field(default_factory=list)


def _commands_block(commands: Iterable[Cmd]) -> str:
    return code("\n".join(cmd.text for cmd in commands if not cmd.expect_fail))


# ---- 1. encoder-stack LM (Pipe tutorial) ----------------------------------------------------------
ENC_STEPS, ENC_EVAL, ENC_BATCH, ENC_M = 20, 5, 16, 8


ENC_INTRO = (
    "The PyTorch tutorial [Training Transformer models using Pipeline Parallelism]"
    "(https://pytorch.org/tutorials/intermediate/pipeline_tutorial.html) built a language model "
    "as one `nn.Sequential` (an embedding with positional encoding, a stack of "
    "`nn.TransformerEncoderLayer`s, a linear decoder), cut it in two halves over two GPUs with "
    "`torch.distributed.pipeline.sync.Pipe` (since removed from PyTorch) in `chunks = 8` "
    "microbatches, trained it on WikiText-2 words and reported loss and perplexity. "
    "`models/encoder_lm.py` builds that `nn.Sequential`; here the planner chooses the cut, and "
    "`planner run` trains it on two CPU processes on the word tokens of the shipped Shakespeare "
    "selection, evaluating on its held-out last 10 %."
)


def _encoder_lm_render(ws: Workspace) -> list[str]:
    """The encoder_lm page's outputs, figures and notes (none unless its commands ran)."""
    if not (ws.ok("plan") and ws.ok("run")):
        return []
    plan, run = ws.json("plan.json"), ws.json("plan.run.json")
    seq = plan["model"]["config"]["seq_len"]
    data_line = line_starting(ws.stdout("run"), "data ") or ""
    return [
        "## What it printed",
        printed(ws, "plan", plan_excerpt),
        printed(ws, "run", run_excerpt),
        "## Figures",
        figures_table([("encoder LM, 2 stages", plan, run)]),
        timing_note(),
        "### Loss and perplexity over the steps (run.json `evals`)",
        eval_table(run, ".1f"),
        "**The perplexity is optimistic.** This model has no causal mask (docs/data.md), so every "
        "position sees the very token it is asked to predict; its next-token loss falls far "
        "below what a causal model would reach, and is not comparable with the tutorial's.",
        f"Why `-b {ENC_BATCH} -m {ENC_M}`: `-m {ENC_M}` is the tutorial's `chunks = 8` (its batch "
        f"of 20 does not split into 8 equal microbatches, which `planner` requires). The default "
        f"batch of 32 does not run on this corpus: one held-out batch needs 32 rows x "
        f"({seq} + 1) = {32 * (seq + 1):,} word tokens, and the run's data line says "
        f"`{data_line}`.",
    ]


def _encoder_lm_full_size(ws: Workspace) -> str:
    """The encoder_lm page's full-size commands (shown, not run) and their notes."""
    return "\n\n".join(
        [
            code(
                "planner plan models/encoder_lm.py --size tutorial --gpus 2 -b 20 "
                "--optimizer sgd --lr 5.0 --grad-clip 0.5 -o plan.json\n"
                "planner run plan.json --data wikitext-2/wiki.train.tokens --tokenizer word "
                "--eval-every 50 --steps 150"
            ),
            "`--size tutorial` is the tutorial's model (embedding 4096, 12 encoder layers of "
            "4096 with 16 heads, WikiText-2's 28,782 words); `-b 20` and SGD at rate 5.0 with "
            "clipping at 0.5 are its training settings, 3 epochs of 50 batches its length. "
            "WikiText-2 is not shipped; give its training file to `--data`. Not run here: it "
            "needs two GPUs.",
            estimate_summary(ws, "estimate", "full.json"),
        ]
    )


def encoder_lm_page() -> Page:
    """The encoder-stack language model of "Training Transformer models using Pipeline Parallelism"."""
    commands = [
        planner(
            "plan",
            *("plan", "models/encoder_lm.py", "--size", "tiny", "--gpus", "2"),
            *("-b", str(ENC_BATCH), "-m", str(ENC_M), "--seed", SEED, "-o", "plan.json"),
        ),
        planner(
            "run",
            *("run", "plan.json", "--data", "models/data/shakespeare.txt", "--tokenizer", "word"),
            *("--eval-every", str(ENC_EVAL), "--steps", str(ENC_STEPS), "--no-checkpoint"),
            needs=("plan",),
        ),
    ]
    estimate = planner(
        "estimate",
        *("plan", "models/encoder_lm.py", "--size", "tutorial", "--gpus", "2", "-b", "20"),
        *("--optimizer", "sgd", "--lr", "5.0", "--grad-clip", "0.5", *ESTIMATE_GPU, "-q", "-o", "full.json"),
    )
    return Page(
        "encoder_lm",
        "Seed system: the encoder-stack LM in two pipeline stages",
        ENC_INTRO,
        commands,
        _encoder_lm_render,
        _encoder_lm_full_size,
        estimate,
    )


# ---- 2. GPT-style decoder with GPipe (torch.distributed.pipelining tutorial) ----------------------
GPT_STEPS, GPT_M = 12, 4


GPT_INTRO = (
    "The PyTorch tutorial [Introduction to Distributed Pipeline Parallelism]"
    "(https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html) splits a GPT-style "
    "decoder (token embedding, `nn.TransformerDecoderLayer`s in an `nn.ModuleDict`, layer norm, "
    "output projection) into two stages with `torch.distributed.pipelining`, before `layers.4`, "
    "and runs one training step of a batch of 32 as 4 microbatches with `ScheduleGPipe` on two "
    "processes. `models/gpt.py` is that model; here the planner chooses the cut for GPipe with "
    f"the tutorial's {GPT_M} microbatches, `planner run` trains it for {GPT_STEPS} steps on two "
    "CPU processes (on the file's synthetic next-token stream), and `planner report` sets the "
    "prediction against the run, stage by stage."
)


def _gpt_render(ws: Workspace) -> list[str]:
    """The gpt page's outputs, figures and notes (none unless its commands ran)."""
    if not all(ws.ok(k) for k in ("plan", "run", "report")):
        return []
    plan, run = ws.json("plan.json"), ws.json("plan.run.json")
    return [
        "## What it printed",
        printed(ws, "plan", plan_excerpt),
        printed(ws, "run", run_excerpt),
        printed(ws, "report", lambda out: after(out, "predicted vs measured")),
        "(`planner report` first prints the plan's balance tables again; they are the ones above.)",
        "## Figures",
        figures_table([("GPT decoder, GPipe, 2 stages", plan, run)]),
        timing_note(),
        _gpt_cut_note(plan),
    ]


def _gpt_full_size(ws: Workspace) -> str:
    """The gpt page's full-size commands (shown, not run) and their notes."""
    return "\n\n".join(
        [
            code(
                "planner plan models/gpt.py --size tutorial --gpus 2 --schedule gpipe -m 4 -o plan.json\n"
                "planner run plan.json --steps 20\n"
                "planner report plan.json --measured plan.run.json"
            ),
            "`--size tutorial` is the tutorial's `ModelArgs()`: dim 512, 8 decoder layers, 8 "
            "heads, vocabulary 10,000, sequences of 500 tokens, batch 32 (the tutorial's "
            "`nn.TransformerDecoderLayer` keeps its default feed-forward width, 2048). Not run "
            "here: it needs two GPUs.",
            estimate_summary(ws, "estimate", "full.json"),
        ]
    )


def gpt_page() -> Page:
    """The GPT-style decoder of "Introduction to Distributed Pipeline Parallelism", with GPipe."""
    commands = [
        planner(
            "plan",
            *("plan", "models/gpt.py", "--size", "tiny", "--gpus", "2", "--schedule", "gpipe"),
            *("-m", str(GPT_M), "--seed", SEED, "-o", "plan.json"),
        ),
        planner("run", "run", "plan.json", "--steps", str(GPT_STEPS), "--no-checkpoint", needs=("plan",)),
        planner("report", "report", "plan.json", "--measured", "plan.run.json", needs=("run",)),
    ]
    estimate = planner(
        "estimate",
        *("plan", "models/gpt.py", "--size", "tutorial", "--gpus", "2", "--schedule", "gpipe", "-m", "4"),
        *ESTIMATE_GPU,
        *("-q", "-o", "full.json"),
    )
    return Page(
        "gpt",
        "Seed system: the GPT-style decoder with GPipe",
        GPT_INTRO,
        commands,
        _gpt_render,
        _gpt_full_size,
        estimate,
    )


def _gpt_cut_note(plan: dict[str, Any]) -> str:
    """The planner's cut beside the tutorial's rule (half of the decoder layers on each stage)."""
    n_layers = int(plan["model"]["config"]["n_layers"])
    rule = f"layers.{n_layers // 2}"
    cut = plan["stages"][1]["first_block"] if len(plan["stages"]) > 1 else "(no cut)"
    verdict = "the same cut" if cut == rule else "a different cut"
    return (
        f"The tutorial cut its 8 layers before `layers.4`, half on each stage. At this size ({n_layers} "
        f"layers) that rule cuts before `{rule}`; the planner cut before `{cut}`: {verdict}."
    )


# ---- 3. DDP x pipeline on 4 ranks ----------------------------------------------------------------
DDP_STEPS = 10


DDP_INTRO = (
    "The PyTorch tutorial [Training Transformer models using Distributed Data Parallel and "
    "Pipeline Parallelism](https://pytorch.org/tutorials/advanced/ddp_pipeline.html) ran two "
    "replicas of a two-GPU pipeline on four GPUs: each process drove a `Pipe` over two GPUs "
    "and `DistributedDataParallel` averaged the gradients of the two pipes. Here the same "
    "layout (2 replicas x 2 stages, 4 ranks) is planned and trained on four CPU processes, with "
    "the GPT-style decoder of `models/gpt.py` at its tiny size (the tutorial's own model was the "
    "encoder-stack LM of [seed_encoder_lm.md](seed_encoder_lm.md), 8 layers); then the same "
    "with `--dp-mode fsdp`, where FSDP2 shards each stage's parameters, gradients and optimizer "
    "state over the replicas instead. Four processes share this machine's two cores, so the "
    "step times say more about time-sharing than about the layout."
)


def _ddp_pipeline_render(ws: Workspace) -> list[str]:
    """The ddp_pipeline page's outputs, figures and notes (none unless its commands ran)."""
    sections: list[str] = []
    columns = []
    for plan_key, run_key, plan_file, label in (
        ("plan", "run", "plan.json", "DDP"),
        ("plan_fsdp", "run_fsdp", "plan_fsdp.json", "FSDP"),
    ):
        if ws.ok(plan_key):
            layout = line_starting(ws.stdout(plan_key), "layout:") or "(no layout line printed)"
            sections += [f"### {label}: the layout line", code(layout)]
        if ws.ok(plan_key) and ws.ok(run_key):
            run_file = plan_file.replace(".json", ".run.json")
            sections += [printed(ws, plan_key, plan_excerpt), printed(ws, run_key, run_excerpt)]
            columns.append((f"{label}: 2 replicas x 2 stages", ws.json(plan_file), ws.json(run_file)))
    if not columns:
        return sections
    sections = ["## What it printed", *sections, "## Figures", figures_table(columns), timing_note()]
    if len(columns) == 2:
        a, b = columns[0][2]["losses"], columns[1][2]["losses"]
        same = same_losses(a, b)
        sections.append(
            f"Per-step losses of the DDP and FSDP runs equal to 1e-4: {'yes' if same else 'no'} "
            "(both train the same model on the same global batch; docs/running.md)."
        )
    return sections


def _ddp_pipeline_full_size(ws: Workspace) -> str:
    """The ddp_pipeline page's full-size commands (shown, not run) and their notes."""
    return "\n\n".join(
        [
            code(
                "planner plan models/encoder_lm.py --size tutorial --set nlayers=8 --gpus 4 --dp 2 -b 40 "
                "--optimizer sgd --lr 5.0 --grad-clip 0.5 -o plan.json\n"
                "planner run plan.json --data wikitext-2/wiki.train.tokens --tokenizer word --eval-every 50 "
                "--steps 150"
            ),
            "The tutorial's model was the encoder-stack LM with 8 layers of width 4096 (16 heads), "
            "each of its two processes reading batches of 20 (so `-b 40` over the two replicas), "
            "SGD at rate 5.0 with clipping at 0.5. Not run here: it needs four GPUs.",
            estimate_summary(ws, "estimate", "full.json"),
        ]
    )


def ddp_pipeline_page() -> Page:
    """Two pipelines of two stages, their gradients reduced by DDP (and the FSDP variant)."""
    commands = [
        planner(
            "plan",
            *("plan", "models/gpt.py", "--size", "tiny", "--gpus", "4", "--dp", "2"),
            "--seed",
            SEED,
            "-o",
            "plan.json",
        ),
        planner("run", "run", "plan.json", "--steps", str(DDP_STEPS), "--no-checkpoint", needs=("plan",)),
        planner(
            "plan_fsdp",
            *("plan", "models/gpt.py", "--size", "tiny", "--gpus", "4", "--dp", "2", "--dp-mode", "fsdp"),
            *("--seed", SEED, "-o", "plan_fsdp.json"),
        ),
        planner(
            "run_fsdp", "run", "plan_fsdp.json", "--steps", str(DDP_STEPS), "--no-checkpoint", needs=("plan_fsdp",)
        ),
    ]
    estimate = planner(
        "estimate",
        *("plan", "models/encoder_lm.py", "--size", "tutorial", "--set", "nlayers=8", "--gpus", "4", "--dp", "2"),
        *(
            "-b",
            "40",
            "--optimizer",
            "sgd",
            "--lr",
            "5.0",
            "--grad-clip",
            "0.5",
            *ESTIMATE_GPU,
            "-q",
            "-o",
            "full.json",
        ),
    )
    return Page(
        "ddp_pipeline",
        "Seed system: data parallel x pipeline parallel on 4 ranks",
        DDP_INTRO,
        commands,
        _ddp_pipeline_render,
        _ddp_pipeline_full_size,
        estimate,
    )


# ---- 4. ResNet-50: one device, split in two, pipelined ---------------------------------------------
def resnet_plan(key: str, out: str, gpus: int, m: int, gpipe: bool = True, expect_fail: bool = False) -> Cmd:
    """A ResNet-50 tiny plan at the sweep's batch."""
    words = ["plan", "models/resnet50.py", "--size", "tiny", "--gpus", str(gpus), "-b", str(RESNET_BATCH)]
    words += ["-m", str(m), *(["--schedule", "gpipe"] if gpipe else []), "--seed", SEED, "-o", out]
    return planner(key, *words, expect_fail=expect_fail)


def resnet_run(key: str, plan_file: str, plan_key: str) -> Cmd:
    """A short run of one ResNet plan."""
    return planner(key, "run", plan_file, "--steps", str(RESNET_STEPS), "--no-checkpoint", needs=(plan_key,))


RESNET_INTRO = (
    "The PyTorch tutorial [Single-Machine Model Parallel Best Practices]"
    "(https://pytorch.org/tutorials/intermediate/model_parallel_tutorial.html) timed "
    "torchvision's ResNet-50 three ways: on one GPU, split in two over two GPUs (`conv1` .. "
    "`layer2` on the first, the rest on the second; one batch at a time, so one GPU always "
    "waits), and that split with each batch of 120 images (128 x 128) pipelined in splits of "
    "1 to 60 images, plotting the time against the split size. Here the same three on this "
    "CPU, with `models/resnet50.py` at its tiny size (width 8, 10 classes, 32 x 32 images): "
    "one process (`--gpus 1`, both cores), the planner's two-stage split with one microbatch "
    f"(`--gpus 2 -m 1`, one core each: the naive split), and the same with the batch of "
    f"{RESNET_BATCH} cut into m = {', '.join(map(str, RESNET_SWEEP))} microbatches (split sizes "
    f"{', '.join(str(RESNET_BATCH // m) for m in RESNET_SWEEP)}), all with GPipe, which runs "
    "every forward before the backwards, as the tutorial's pipelined forward followed by "
    f"autograd's backward did. Each is trained for {RESNET_STEPS} steps on the file's synthetic "
    f"images. Batch {RESNET_BATCH} is the tutorial's; the 32 x 32 images keep the whole sweep "
    "to a few minutes here."
)


def resnet_page() -> Page:
    """ResNet-50 on one device vs split in two vs pipelined, with the split-size sweep."""
    commands = [
        resnet_plan("plan_one", "one.json", 1, 1, gpipe=False),
        resnet_run("run_one", "one.json", "plan_one"),
        resnet_plan("plan_split", "split.json", 2, 1),
        resnet_run("run_split", "split.json", "plan_split"),
    ]
    for m in RESNET_SWEEP:
        commands += [
            resnet_plan(f"plan_m{m}", f"pipe_m{m}.json", 2, m),
            resnet_run(f"run_m{m}", f"pipe_m{m}.json", f"plan_m{m}"),
        ]
    # The tutorial's smallest split (1 image) cannot train here: shown failing, on purpose.
    commands.append(resnet_plan("plan_m120", "pipe_m120.json", 2, RESNET_BATCH, expect_fail=True))
    return Page(
        "resnet50",
        "Seed system: ResNet-50 on one device, split in two, and pipelined",
        RESNET_INTRO,
        commands,
        render_resnet,
        resnet_full_size,
        planner(
            "estimate",
            *("plan", "models/resnet50.py", "--size", "imagenet", "--set", "image_size=128", "--gpus", "2"),
            *("-b", "120", "-m", "10", "--schedule", "gpipe", "--optimizer", "sgd", "--lr", "0.001"),
            *ESTIMATE_GPU,
            *("-q", "-o", "full.json"),
        ),
    )


@dataclass
class SweepPoint:
    """One ResNet configuration's plan and run figures."""

    label: str
    m: int
    plan: dict[str, Any]
    run: dict[str, Any]

    @property
    def timed_s(self) -> list[float]:
        """Step times of the timed steps."""
        return [self.run["step_times_s"][i - 1] for i in self.run["timed_steps"]]


def _resnet_points(ws: Workspace) -> tuple[SweepPoint | None, SweepPoint | None, list[SweepPoint]]:
    """The one-process run, the naive split and the sweep, each present only if it ran."""

    def point(label: str, plan_key: str, run_key: str, plan_file: str, m: int) -> SweepPoint | None:
        if not (ws.ok(plan_key) and ws.ok(run_key)):
            return None
        return SweepPoint(label, m, ws.json(plan_file), ws.json(plan_file.replace(".json", ".run.json")))

    one = point("one process", "plan_one", "run_one", "one.json", 1)
    split = point("split in two, m = 1", "plan_split", "run_split", "split.json", 1)
    sweep = [
        p
        for m in RESNET_SWEEP
        if (p := point(f"pipelined, m = {m}", f"plan_m{m}", f"run_m{m}", f"pipe_m{m}.json", m)) is not None
    ]
    return one, split, sweep


RESNET_HEADERS = [
    "configuration",
    "ranks",
    "m",
    "split size",
    "schedule",
    "blocks per stage",
    "predicted ms",
    "measured ms (median)",
    "measured min–max",
    "error",
    "samples/s",
    "speed vs one process",
    "final loss",
]


def resnet_table(points: list[SweepPoint], one: SweepPoint | None) -> str:
    """One row per configuration that ran: predicted and measured, and the speed against one process."""
    base = statistics.median(one.timed_s) if one else None
    rows = []
    for p in points:
        med = statistics.median(p.timed_s)
        pred = p.plan["prediction"]["step_time_s"]
        rows.append(
            [
                p.label,
                p.plan["n_ranks"],
                p.m,
                RESNET_BATCH // p.m,
                p.plan["schedule"],
                "+".join(str(s["end"] - s["start"]) for s in p.plan["stages"]),
                ms(pred),
                ms(med),
                f"{ms(min(p.timed_s))}–{ms(max(p.timed_s))}",
                f"{100 * (pred - med) / med:+.0f}%",
                f"{p.run['samples_per_s']:.0f}",
                "—" if base is None else f"{base / med:.2f}x",
                f"{p.run['losses'][-1]:.4f}",
            ]
        )
    return table(rows, RESNET_HEADERS)


def resnet_printed(ws: Workspace) -> list[str]:
    """What the one-process, naive-split and one sweep point's commands printed."""
    sections = ["## What it printed"]
    for key in ("plan_one", "run_one", "plan_split", "run_split"):
        if ws.ok(key):
            sections.append(printed(ws, key, plan_excerpt if key.startswith("plan") else run_excerpt))
    show = f"m{RESNET_SWEEP[2]}" if len(RESNET_SWEEP) > 2 else f"m{RESNET_SWEEP[0]}"
    if ws.ok(f"plan_{show}") and ws.ok(f"run_{show}"):
        sections.append(
            f"One point of the sweep, `-m {show[1:]}` (the others print the same lines with their own figures):"
        )
        sections += [printed(ws, f"plan_{show}", plan_excerpt), printed(ws, f"run_{show}", run_excerpt)]
    return sections


def resnet_losses_note(one: SweepPoint, split: SweepPoint) -> str:
    """Why one process and the naive split, the same computation, end at different losses."""
    a, b = one.run["losses"], split.run["losses"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > 1e-4 * max(1.0, abs(x))), len(a))
    return (
        "About the losses: one process and the naive split compute the same thing, one microbatch "
        f"of {RESNET_BATCH}, yet their losses agree (to 1e-4) for the first {same} step(s) only and "
        f"end at {a[-1]:.4f} and {b[-1]:.4f}: the floating-point sums run in another order with two "
        "threads in one process than with one thread in each of two, and training amplifies "
        "such last-bit differences. The pipelined runs differ more, because batch norm "
        "normalises each microbatch on its own (README, Limits)."
    )


def resnet_refused(ws: Workspace) -> list[str]:
    """The tutorial's smallest split (one image per microbatch), refused on purpose."""
    fail = ws.outcomes.get("plan_m120")
    if fail is None or fail.returncode is None:
        return []
    verdict = "refused, as expected" if fail.ok else "did NOT fail (unexpected)"
    return [
        f"### The tutorial's smallest split: 1 image ({verdict})",
        f"A microbatch of one image cannot train this network: batch norm in training mode needs "
        f"more than one value per channel, and `layer4` works on 1 x 1 maps at this image size. "
        f"`{fail.cmd.text}` exits with code {fail.returncode}:",
        code(fail.error_line()),
    ]


def render_resnet(ws: Workspace) -> list[str]:
    """The ResNet page's outputs, table and plot (from whatever configurations ran)."""
    one, split, sweep = _resnet_points(ws)
    points = [p for p in (one, split, *sweep) if p is not None]
    if not points:
        return []
    sections = [*resnet_printed(ws), "## Figures", resnet_table(points, one), timing_note()]
    if split is not None:
        cut = split.plan["stages"][1]["first_block"]
        sections.append(
            f"The tutorial's split put `conv1` .. `layer2` on the first device and `layer3.0` onward on "
            f"the second; the planner's two-stage split at m = 1 starts the second stage at `{cut}`. "
            "With one microbatch the two stages never overlap, so where the cut falls barely changes "
            "the step (the partition table above shows the alternatives); the sweep's splits are "
            "in the table's blocks-per-stage column."
        )
    figure = plot_resnet(one, split, sweep)
    if figure is not None:
        sections.append(f"![measured and predicted step time against the microbatch count]({figure})")
    if sweep:
        best = min(sweep, key=lambda p: statistics.median(p.timed_s))
        fastest = min(points, key=lambda p: statistics.median(p.timed_s))
        sections.append(
            f"Fastest pipelined point measured: m = {best.m} (split size {RESNET_BATCH // best.m}), "
            f"{ms(statistics.median(best.timed_s))} ms; fastest configuration overall: {fastest.label}."
        )
    if one is not None and split is not None:
        sections.append(resnet_losses_note(one, split))
    return sections + resnet_refused(ws)


def plot_resnet(one: SweepPoint | None, split: SweepPoint | None, sweep: list[SweepPoint]) -> str | None:
    """Draw measured (median, min–max) and predicted step time against m; the one-process and
    naive-split measurements as horizontal lines. Returns the path relative to docs/, or None."""
    if not sweep:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display here; and the page needs a file, not a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ms_x = [p.m for p in sweep]
    med = [1e3 * statistics.median(p.timed_s) for p in sweep]
    low = [m - 1e3 * min(p.timed_s) for m, p in zip(med, sweep)]
    high = [1e3 * max(p.timed_s) - m for m, p in zip(med, sweep)]
    ax.errorbar(
        ms_x,
        med,
        yerr=[low, high],
        fmt="o-",
        color="tab:blue",
        capsize=4,
        label="pipelined, measured (median, min–max)",
    )
    pred = [1e3 * p.plan["prediction"]["step_time_s"] for p in sweep]
    ax.plot(ms_x, pred, "s--", color="tab:blue", alpha=0.5, label="pipelined, predicted by the plan")
    if one is not None:
        ax.axhline(1e3 * statistics.median(one.timed_s), color="tab:gray", label="one process (2 threads), measured")
    if split is not None:
        ax.axhline(
            1e3 * statistics.median(split.timed_s),
            color="tab:red",
            linestyle=":",
            label="split in two, m = 1, measured",
        )
    ax.set_xscale("log")
    ax.set_xticks(ms_x)
    ax.set_xticklabels([f"{m}\n({RESNET_BATCH // m})" for m in ms_x])
    ax.minorticks_off()
    ax.set_xlabel(f"microbatches m per batch of {RESNET_BATCH} (split size)")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("ResNet-50 (tiny) training step on 2 CPU cores, GPipe over 2 processes")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / "resnet50_split_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(DOCS))


def resnet_full_size(ws: Workspace) -> str:
    """The tutorial's size: full ResNet-50, 1000 classes, 128 x 128 images, batch 120."""
    return "\n\n".join(
        [
            code(
                "planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 1 -b 120 -m 1 -o one.json\n"
                "planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 2 -b 120 -m 1 "
                "--schedule gpipe -o split.json\n"
                "for m in 2 3 6 10 12 15 24 40; do\n"
                "  planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 2 -b 120 -m $m "
                "--schedule gpipe -o pipe_m$m.json\n"
                "done\n"
                "for p in one.json split.json pipe_m*.json; do planner run $p --steps 10 --no-checkpoint; done"
            ),
            "`--size imagenet` is torchvision's ResNet-50 (width 64, 1000 classes); "
            "the tutorial fed it 128 x 128 images in batches of 120 and swept split sizes 1, 3, 5, 8, "
            "10, 12, 20, 40 and 60 (m = 120 / split size; split size 1 cannot train with batch norm, "
            "as above). It trained with SGD (`--optimizer sgd --lr 0.001`) on an MSE loss against "
            "one-hot labels; `models/resnet50.py` uses cross-entropy. Not run here: it needs two GPUs.",
            estimate_summary(ws, "estimate", "full.json"),
        ]
    )


# ---- 5. char-level Shakespeare transformer, data parallel ----------------------------------------
SHK_STEPS, SHK_EVAL = 40, 10


SHK_INTRO = (
    "Andrej Karpathy's lecture \"Let's build GPT: from scratch, in code, spelled out\" builds a "
    "character-level transformer (token and position embeddings, blocks of causal multi-head "
    "self-attention and a feed-forward layer, a final layer norm and head) and trains it on "
    "Shakespeare, printing train and validation loss as it goes. `models/shakespeare.py` is "
    "that model. Here it is trained by two data-parallel replicas of a one-stage pipeline "
    "(`--dp 2`, each replica half of every batch, gradients averaged by DDP) on the "
    "characters of the shipped Shakespeare selection, evaluating on its held-out last 10 %. "
    "Unlike `models/encoder_lm.py` and `models/gpt.py`, which attend to the whole window "
    "(docs/data.md), this model is causal, so its perplexity is a real next-character perplexity."
)


def _shakespeare_render(ws: Workspace) -> list[str]:
    """The shakespeare page's outputs, figures and notes (none unless its commands ran)."""
    if not (ws.ok("plan") and ws.ok("run")):
        return []
    plan, run = ws.json("plan.json"), ws.json("plan.run.json")
    layout = line_starting(ws.stdout("plan"), "layout:") or "(no layout line printed)"
    return [
        "## What it printed",
        "The layout line:",
        code(layout),
        printed(ws, "plan", plan_excerpt),
        printed(ws, "run", run_excerpt),
        "## Figures",
        figures_table([("2 replicas x 1 stage", plan, run)]),
        timing_note(),
        "### Loss and perplexity over the steps (run.json `evals`)",
        eval_table(run, ".2f"),
        f"For scale: {_vocab_from(ws.stdout('run'))}",
    ]


def _shakespeare_full_size(ws: Workspace) -> str:
    """The shakespeare page's full-size commands (shown, not run) and their notes."""
    return "\n\n".join(
        [
            code(
                "planner plan models/shakespeare.py --size tutorial --gpus 2 --dp 2 -b 64 --lr 3e-4 -o plan.json\n"
                "planner run plan.json --data tinyshakespeare.txt --tokenizer char --eval-every 500 --steps 5000"
            ),
            "`--size tutorial` is the lecture's final model (384-wide embeddings, 6 heads, 6 "
            "layers, a context of 256 characters, dropout 0.2); `-b 64`, AdamW at 3e-4 and "
            "5,000 steps evaluated every 500 are its training settings. The lecture trained on "
            "the tiny-shakespeare file (about 1 MB), which is not shipped: give it to `--data`. "
            "Not run here: the lecture trained on one GPU; this layout needs two.",
            estimate_summary(ws, "estimate", "full.json"),
        ]
    )


def shakespeare_page() -> Page:
    """Karpathy's character-level Shakespeare transformer, trained by 2 data-parallel replicas."""
    commands = [
        planner(
            "plan",
            *("plan", "models/shakespeare.py", "--size", "tiny", "--gpus", "2", "--dp", "2", "--seed", SEED),
            *("-o", "plan.json"),
        ),
        planner(
            "run",
            *("run", "plan.json", "--data", "models/data/shakespeare.txt", "--tokenizer", "char"),
            *("--eval-every", str(SHK_EVAL), "--steps", str(SHK_STEPS), "--no-checkpoint"),
            needs=("plan",),
        ),
    ]
    estimate = planner(
        "estimate",
        *("plan", "models/shakespeare.py", "--size", "tutorial", "--gpus", "2", "--dp", "2", "-b", "64"),
        *("--lr", "3e-4", *ESTIMATE_GPU, "-q", "-o", "full.json"),
    )
    return Page(
        "shakespeare",
        "Seed system: the character-level Shakespeare transformer, data parallel",
        SHK_INTRO,
        commands,
        _shakespeare_render,
        _shakespeare_full_size,
        estimate,
    )


def _vocab_from(stdout: str) -> str:
    """A sentence on the uniform-guess loss for the vocabulary size the run's data line reports."""
    line = line_starting(stdout, "data ") or ""
    marker = "vocabulary "
    if marker not in line:
        return "the run printed no vocabulary size."
    words = line.split(marker, 1)[1].split()
    try:
        size = int(words[0].rstrip(",;"))
    except (IndexError, ValueError):
        return "the run printed no vocabulary size."
    return (
        f"the run's vocabulary has {size} ids, so a model guessing uniformly would score a loss of "
        f"ln {size} = {math.log(size):.2f}, a perplexity of {size}."
    )


PAGES: dict[str, Callable[[], Page]] = {
    "encoder_lm": encoder_lm_page,
    "gpt": gpt_page,
    "ddp_pipeline": ddp_pipeline_page,
    "resnet50": resnet_page,
    "shakespeare": shakespeare_page,
}


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


def build(page: Page, facts: dict[str, str], scratch: Path) -> str:
    """Run a page's commands in a fresh workspace and return its markdown (failures included)."""
    folder = scratch / page.name
    folder.mkdir()
    ws = Workspace(folder, page.name)
    started = dt.datetime.now(dt.timezone.utc)
    busy_before = background_cpu()
    t0 = time.perf_counter()
    for cmd in page.commands:
        ws.run(cmd)
    if page.estimate is not None:
        ws.run(page.estimate)
    seconds = time.perf_counter() - t0
    busy_after = background_cpu()

    page.failures += [failure_line(outcome) for outcome in ws.outcomes.values() if not outcome.ok]
    body: list[str] = []
    full = ""
    try:
        body = page.render(ws)
    except Exception as exc:  # noqa: BLE001 - a renderer that breaks (a changed run.json) is reported on the page
        page.failures.append(f"writing the page's outputs and figures failed: `{type(exc).__name__}: {exc}`")
    try:
        full = page.full_size(ws)
    except Exception as exc:  # noqa: BLE001 - likewise
        page.failures.append(f"writing the full-size section failed: `{type(exc).__name__}: {exc}`")

    sections = [
        f"# {page.title}",
        page.intro,
        "## Commands",
        "From the repository root (plans use the default seed, spelled out so reruns compare):",
        _commands_block(page.commands),
    ]
    busiest = max((x for x in (busy_before, busy_after) if not math.isnan(x)), default=0.0)
    if busiest > BUSY_WARNING:
        sections.append(
            f"**Measured on a busy machine:** other processes used up to {100 * busiest:.0f}% of its "
            "CPU around these commands (Machine and date, below), so the step times here are "
            "longer, and the predictions further from them, than on an idle machine."
        )
    if page.failures:
        sections += ["## What failed", "\n".join(f"- {line}" for line in page.failures)]
    if not body:
        body = _outputs_so_far(ws)
    sections += body
    sections += ["## Full size (not run here)", full or "(not written: see What failed)"]
    sections += [
        "## Machine and date",
        _machine_section(facts, started, seconds, busy_before, busy_after),
        f"Written by `{SCRIPT}`; rerun with `{RERUN} --only {page.name}`.",
    ]
    return "\n\n".join(sections).rstrip() + "\n"


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
            page = PAGES[name]()
            page_t0 = time.perf_counter()
            text = build(page, facts, scratch)
            out = DOCS / f"seed_{name}.md"
            write_page(out, text)
            print(f"wrote {out.relative_to(ROOT)} ({time.perf_counter() - page_t0:.0f} s)", flush=True)
            if page.failures:
                failed.append(name)
                for line in page.failures:
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
