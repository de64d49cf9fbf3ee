"""The seed pages as records: what each page plans and trains, and one renderer for all of them.

A page is data: the tiny-size configurations it plans and trains (``Setup``: a `planner plan` and the
`planner run` of its plan), the tutorial's own size (``FullSize``: shown, and estimated on the meta
device), and the notes only that page makes. ``commands``, ``sections`` and ``full_size`` turn any
page into its commands and its markdown; ``bench.seed_systems`` runs them and writes the page. This
module holds four pages; the ResNet-50 sweep, with its own table and plot, is ``bench.seed_resnet``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench.common import same_losses
from bench.seed_run import SEED, Cmd, Workspace, planner
from bench.seed_text import (
    after,
    code,
    estimate_summary,
    eval_table,
    figures_table,
    line_starting,
    plan_excerpt,
    printed,
    run_excerpt,
    timing_note,
)

# Full-size plans are estimated, not measured: built on the meta device for this GPU with the
# roofline model (`--gpu-type`), in fp32 as the tutorials trained. Nothing is allocated or run.
ESTIMATE_GPU = ("--gpu-type", "h100", "--dtype", "fp32")

Column = tuple[str, dict[str, Any], dict[str, Any]]  # (label, plan.json, run.json) of a setup that ran


@dataclass(frozen=True)
class Setup:
    """One tiny-size configuration a page plans and trains: its `planner plan`, then `planner run` of that plan.

    Attributes:
        tag: names its commands: "" → `plan` and `run`, "fsdp" → `plan_fsdp` and `run_fsdp`.
        file: the plan file it writes; the run writes X.run.json beside it.
        model: the model file, as typed from the repository root.
        plan_options: `planner plan`'s options after `--size tiny` (the seed and `-o` follow them).
        steps: `planner run --steps`.
        run_options: `planner run`'s options before `--steps` (data, tokenizer, evaluations).
        label: its column in the figures table.
        layout: the heading its printed layout line goes under; None: the line is not shown.
    """

    tag: str
    file: str
    model: str
    plan_options: tuple[str, ...]
    steps: int
    run_options: tuple[str, ...] = ()
    label: str = ""
    layout: str | None = None

    @property
    def plan_key(self) -> str:
        """The key of its `planner plan` command."""
        return f"plan_{self.tag}" if self.tag else "plan"

    @property
    def run_key(self) -> str:
        """The key of its `planner run` command."""
        return f"run_{self.tag}" if self.tag else "run"

    @property
    def run_file(self) -> str:
        """The run.json its run writes."""
        return self.file.replace(".json", ".run.json")

    def plan_command(self, expect_fail: bool = False) -> Cmd:
        """`planner plan` of the model at its tiny size, with the fixed seed."""
        words = ("plan", self.model, "--size", "tiny", *self.plan_options, "--seed", SEED, "-o", self.file)
        return planner(self.plan_key, *words, expect_fail=expect_fail)

    def run_command(self) -> Cmd:
        """`planner run` of the plan, skipped when the plan failed."""
        words = ("run", self.file, *self.run_options, "--steps", str(self.steps), "--no-checkpoint")
        return planner(self.run_key, *words, needs=(self.plan_key,))


@dataclass(frozen=True)
class FullSize:
    """The tutorial's own size: the commands a page shows (not run here) and the estimate it plans.

    Attributes:
        commands: what a user with the GPUs would type.
        note: what that size is and why it is not run here.
        estimate: the `planner plan` words of that size, planned here on the meta device for
            ``ESTIMATE_GPU`` (cheap: nothing is allocated or run).
    """

    commands: str
    note: str
    estimate: tuple[str, ...]


def no_notes(ws: Workspace, columns: list[Column]) -> list[str]:
    """A page with nothing to add after its figures."""
    return []


@dataclass(frozen=True)
class Page:
    """One docs page: the commands it runs and how it turns their outcomes into markdown.

    Attributes:
        name: `--only NAME`; the page is docs/seed_<name>.md.
        title: the page's heading.
        intro: the paragraph naming the tutorial and what this page runs.
        setups: the configurations it plans and trains at the tiny size, in order.
        full: the tutorial's own size.
        report: `planner report` sets the first setup's plan against its run (printed with the rest).
        extra: commands run after the setups' (e.g. one shown failing on purpose).
        evals: the number format of the evaluations table's perplexity; None: no such table.
        notes: the page's own paragraphs after its figures, from the setups that ran.
        render: the page's own sections in place of the ones ``sections`` writes (the ResNet sweep).
    """

    name: str
    title: str
    intro: str
    setups: tuple[Setup, ...]
    full: FullSize
    report: bool = False
    extra: tuple[Cmd, ...] = ()
    evals: str | None = None
    notes: Callable[[Workspace, list[Column]], list[str]] = no_notes
    render: Callable[[Workspace], list[str]] | None = None

    @property
    def commands(self) -> list[Cmd]:
        """What a user types for the tiny size, in order; all are run here."""
        cmds = [cmd for s in self.setups for cmd in (s.plan_command(), s.run_command())]
        if self.report:
            first = self.setups[0]
            cmds.append(planner("report", "report", first.file, "--measured", first.run_file, needs=(first.run_key,)))
        return [*cmds, *self.extra]

    @property
    def estimate(self) -> Cmd:
        """The `--gpu-type` plan of the full size (run here: cheap, meta device)."""
        return planner("estimate", *self.full.estimate, *ESTIMATE_GPU, "-q", "-o", "full.json")


def commands_block(commands: Iterable[Cmd]) -> str:
    """The commands a user types (not those shown failing on purpose), as one code block."""
    return code("\n".join(cmd.text for cmd in commands if not cmd.expect_fail))


def sections(page: Page, ws: Workspace) -> list[str]:
    """A page's outputs, figures and notes (none unless a setup's commands, and the report, ran)."""
    if page.render is not None:
        return page.render(ws)
    shown: list[str] = []
    columns: list[Column] = []
    for s in page.setups:
        if s.layout is not None and ws.ok(s.plan_key):
            shown += [s.layout, code(line_starting(ws.stdout(s.plan_key), "layout:") or "(no layout line printed)")]
        if ws.ok(s.plan_key) and ws.ok(s.run_key):
            shown += [printed(ws, s.plan_key, plan_excerpt), printed(ws, s.run_key, run_excerpt)]
            columns.append((s.label, ws.json(s.file), ws.json(s.run_file)))
    if page.report:
        if not ws.ok("report"):
            return []
        shown += [
            printed(ws, "report", lambda out: after(out, "predicted vs measured")),
            "(`planner report` first prints the plan's balance tables again; they are the ones above.)",
        ]
    if not columns:
        return []
    out = ["## What it printed", *shown, "## Figures", figures_table(columns), timing_note()]
    if page.evals is not None:
        out += ["### Loss and perplexity over the steps (run.json `evals`)", eval_table(columns[0][2], page.evals)]
    return out + page.notes(ws, columns)


def full_size(page: Page, ws: Workspace) -> str:
    """The full-size section: the commands (shown, not run), their notes and the estimate's figures."""
    return "\n\n".join([code(page.full.commands), page.full.note, estimate_summary(ws, "estimate", "full.json")])


# ---- 1. encoder-stack LM (Pipe tutorial) ----------------------------------------------------------
ENC_STEPS, ENC_EVAL, ENC_BATCH, ENC_M = 20, 5, 16, 8


def _encoder_lm_notes(ws: Workspace, columns: list[Column]) -> list[str]:
    """Why the perplexity is optimistic, and why the page's batch and microbatches."""
    seq = columns[0][1]["model"]["config"]["seq_len"]
    data_line = line_starting(ws.stdout("run"), "data ") or ""
    return [
        "**The perplexity is optimistic.** This model has no causal mask (docs/data.md), so every "
        "position sees the very token it is asked to predict; its next-token loss falls far "
        "below what a causal model would reach, and is not comparable with the tutorial's.",
        f"Why `-b {ENC_BATCH} -m {ENC_M}`: `-m {ENC_M}` is the tutorial's `chunks = 8` (its batch "
        f"of 20 does not split into 8 equal microbatches, which `planner` requires). The default "
        f"batch of 32 does not run on this corpus: one held-out batch needs 32 rows x "
        f"({seq} + 1) = {32 * (seq + 1):,} word tokens, and the run's data line says "
        f"`{data_line}`.",
    ]


ENCODER_LM = Page(
    "encoder_lm",
    "Seed system: the encoder-stack LM in two pipeline stages",
    "The PyTorch tutorial [Training Transformer models using Pipeline Parallelism]"
    "(https://pytorch.org/tutorials/intermediate/pipeline_tutorial.html) built a language model "
    "as one `nn.Sequential` (an embedding with positional encoding, a stack of "
    "`nn.TransformerEncoderLayer`s, a linear decoder), cut it in two halves over two GPUs with "
    "`torch.distributed.pipeline.sync.Pipe` (since removed from PyTorch) in `chunks = 8` "
    "microbatches, trained it on WikiText-2 words and reported loss and perplexity. "
    "`models/encoder_lm.py` builds that `nn.Sequential`; here the planner chooses the cut, and "
    "`planner run` trains it on two CPU processes on the word tokens of the shipped Shakespeare "
    "selection, evaluating on its held-out last 10 %.",
    (
        Setup(
            "",
            "plan.json",
            "models/encoder_lm.py",
            ("--gpus", "2", "-b", str(ENC_BATCH), "-m", str(ENC_M)),
            ENC_STEPS,
            ("--data", "models/data/shakespeare.txt", "--tokenizer", "word", "--eval-every", str(ENC_EVAL)),
            label="encoder LM, 2 stages",
        ),
    ),
    FullSize(
        "planner plan models/encoder_lm.py --size tutorial --gpus 2 -b 20 "
        "--optimizer sgd --lr 5.0 --grad-clip 0.5 -o plan.json\n"
        "planner run plan.json --data wikitext-2/wiki.train.tokens --tokenizer word "
        "--eval-every 50 --steps 150",
        "`--size tutorial` is the tutorial's model (embedding 4096, 12 encoder layers of "
        "4096 with 16 heads, WikiText-2's 28,782 words); `-b 20` and SGD at rate 5.0 with "
        "clipping at 0.5 are its training settings, 3 epochs of 50 batches its length. "
        "WikiText-2 is not shipped; give its training file to `--data`. Not run here: it "
        "needs two GPUs.",
        ("plan", "models/encoder_lm.py", "--size", "tutorial", "--gpus", "2", "-b", "20")
        + ("--optimizer", "sgd", "--lr", "5.0", "--grad-clip", "0.5"),
    ),
    evals=".1f",
    notes=_encoder_lm_notes,
)


# ---- 2. GPT-style decoder with GPipe (torch.distributed.pipelining tutorial) ----------------------
GPT_STEPS, GPT_M = 12, 4


def _gpt_cut_note(ws: Workspace, columns: list[Column]) -> list[str]:
    """The planner's cut beside the tutorial's rule (half of the decoder layers on each stage)."""
    plan = columns[0][1]
    n_layers = int(plan["model"]["config"]["n_layers"])
    rule = f"layers.{n_layers // 2}"
    cut = plan["stages"][1]["first_block"] if len(plan["stages"]) > 1 else "(no cut)"
    verdict = "the same cut" if cut == rule else "a different cut"
    return [
        f"The tutorial cut its 8 layers before `layers.4`, half on each stage. At this size ({n_layers} "
        f"layers) that rule cuts before `{rule}`; the planner cut before `{cut}`: {verdict}."
    ]


GPT = Page(
    "gpt",
    "Seed system: the GPT-style decoder with GPipe",
    "The PyTorch tutorial [Introduction to Distributed Pipeline Parallelism]"
    "(https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html) splits a GPT-style "
    "decoder (token embedding, `nn.TransformerDecoderLayer`s in an `nn.ModuleDict`, layer norm, "
    "output projection) into two stages with `torch.distributed.pipelining`, before `layers.4`, "
    "and runs one training step of a batch of 32 as 4 microbatches with `ScheduleGPipe` on two "
    "processes. `models/gpt.py` is that model; here the planner chooses the cut for GPipe with "
    f"the tutorial's {GPT_M} microbatches, `planner run` trains it for {GPT_STEPS} steps on two "
    "CPU processes (on the file's synthetic next-token stream), and `planner report` sets the "
    "prediction against the run, stage by stage.",
    (
        Setup(
            "",
            "plan.json",
            "models/gpt.py",
            ("--gpus", "2", "--schedule", "gpipe", "-m", str(GPT_M)),
            GPT_STEPS,
            label="GPT decoder, GPipe, 2 stages",
        ),
    ),
    FullSize(
        "planner plan models/gpt.py --size tutorial --gpus 2 --schedule gpipe -m 4 -o plan.json\n"
        "planner run plan.json --steps 20\n"
        "planner report plan.json --measured plan.run.json",
        "`--size tutorial` is the tutorial's `ModelArgs()`: dim 512, 8 decoder layers, 8 "
        "heads, vocabulary 10,000, sequences of 500 tokens, batch 32 (the tutorial's "
        "`nn.TransformerDecoderLayer` keeps its default feed-forward width, 2048). Not run "
        "here: it needs two GPUs.",
        ("plan", "models/gpt.py", "--size", "tutorial", "--gpus", "2", "--schedule", "gpipe", "-m", "4"),
    ),
    report=True,
    notes=_gpt_cut_note,
)


# ---- 3. DDP x pipeline on 4 ranks ----------------------------------------------------------------
DDP_STEPS = 10


def _ddp_losses_note(ws: Workspace, columns: list[Column]) -> list[str]:
    """Whether the DDP and FSDP runs, the same training, lost the same (when both ran)."""
    if len(columns) != 2:
        return []
    same = same_losses(columns[0][2]["losses"], columns[1][2]["losses"])
    return [
        f"Per-step losses of the DDP and FSDP runs equal to 1e-4: {'yes' if same else 'no'} "
        "(both train the same model on the same global batch; docs/running.md)."
    ]


DDP_PIPELINE = Page(
    "ddp_pipeline",
    "Seed system: data parallel x pipeline parallel on 4 ranks",
    "The PyTorch tutorial [Training Transformer models using Distributed Data Parallel and "
    "Pipeline Parallelism](https://pytorch.org/tutorials/advanced/ddp_pipeline.html) ran two "
    "replicas of a two-GPU pipeline on four GPUs: each process drove a `Pipe` over two GPUs "
    "and `DistributedDataParallel` averaged the gradients of the two pipes. Here the same "
    "layout (2 replicas x 2 stages, 4 ranks) is planned and trained on four CPU processes, with "
    "the GPT-style decoder of `models/gpt.py` at its tiny size (the tutorial's own model was the "
    "encoder-stack LM of [seed_encoder_lm.md](seed_encoder_lm.md), 8 layers); then the same "
    "with `--dp-mode fsdp`, where FSDP2 shards each stage's parameters, gradients and optimizer "
    "state over the replicas instead. Four processes share this machine's two cores, so the "
    "step times say more about time-sharing than about the layout.",
    tuple(
        Setup(
            tag,
            f"plan{'_' + tag if tag else ''}.json",
            "models/gpt.py",
            ("--gpus", "4", "--dp", "2", *mode),
            DDP_STEPS,
            label=f"{label}: 2 replicas x 2 stages",
            layout=f"### {label}: the layout line",
        )
        for tag, mode, label in (("", (), "DDP"), ("fsdp", ("--dp-mode", "fsdp"), "FSDP"))
    ),
    FullSize(
        "planner plan models/encoder_lm.py --size tutorial --set nlayers=8 --gpus 4 --dp 2 -b 40 "
        "--optimizer sgd --lr 5.0 --grad-clip 0.5 -o plan.json\n"
        "planner run plan.json --data wikitext-2/wiki.train.tokens --tokenizer word --eval-every 50 "
        "--steps 150",
        "The tutorial's model was the encoder-stack LM with 8 layers of width 4096 (16 heads), "
        "each of its two processes reading batches of 20 (so `-b 40` over the two replicas), "
        "SGD at rate 5.0 with clipping at 0.5. Not run here: it needs four GPUs.",
        ("plan", "models/encoder_lm.py", "--size", "tutorial", "--set", "nlayers=8", "--gpus", "4", "--dp", "2")
        + ("-b", "40", "--optimizer", "sgd", "--lr", "5.0", "--grad-clip", "0.5"),
    ),
    notes=_ddp_losses_note,
)


# ---- 5. char-level Shakespeare transformer, data parallel ----------------------------------------
SHK_STEPS, SHK_EVAL = 40, 10


def _vocab_note(ws: Workspace, columns: list[Column]) -> list[str]:
    """A sentence on the uniform-guess loss for the vocabulary size the run's data line reports."""
    return [f"For scale: {_vocab_from(ws.stdout('run'))}"]


def _vocab_from(stdout: str) -> str:
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


SHAKESPEARE = Page(
    "shakespeare",
    "Seed system: the character-level Shakespeare transformer, data parallel",
    "Andrej Karpathy's lecture \"Let's build GPT: from scratch, in code, spelled out\" builds a "
    "character-level transformer (token and position embeddings, blocks of causal multi-head "
    "self-attention and a feed-forward layer, a final layer norm and head) and trains it on "
    "Shakespeare, printing train and validation loss as it goes. `models/shakespeare.py` is "
    "that model. Here it is trained by two data-parallel replicas of a one-stage pipeline "
    "(`--dp 2`, each replica half of every batch, gradients averaged by DDP) on the "
    "characters of the shipped Shakespeare selection, evaluating on its held-out last 10 %. "
    "Unlike `models/encoder_lm.py` and `models/gpt.py`, which attend to the whole window "
    "(docs/data.md), this model is causal, so its perplexity is a real next-character perplexity.",
    (
        Setup(
            "",
            "plan.json",
            "models/shakespeare.py",
            ("--gpus", "2", "--dp", "2"),
            SHK_STEPS,
            ("--data", "models/data/shakespeare.txt", "--tokenizer", "char", "--eval-every", str(SHK_EVAL)),
            label="2 replicas x 1 stage",
            layout="The layout line:",
        ),
    ),
    FullSize(
        "planner plan models/shakespeare.py --size tutorial --gpus 2 --dp 2 -b 64 --lr 3e-4 -o plan.json\n"
        "planner run plan.json --data tinyshakespeare.txt --tokenizer char --eval-every 500 --steps 5000",
        "`--size tutorial` is the lecture's final model (384-wide embeddings, 6 heads, 6 "
        "layers, a context of 256 characters, dropout 0.2); `-b 64`, AdamW at 3e-4 and "
        "5,000 steps evaluated every 500 are its training settings. The lecture trained on "
        "the tiny-shakespeare file (about 1 MB), which is not shipped: give it to `--data`. "
        "Not run here: the lecture trained on one GPU; this layout needs two.",
        ("plan", "models/shakespeare.py", "--size", "tutorial", "--gpus", "2", "--dp", "2", "-b", "64", "--lr", "3e-4"),
    ),
    evals=".2f",
    notes=_vocab_note,
)
