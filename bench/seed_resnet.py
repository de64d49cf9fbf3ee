"""The ResNet-50 seed page: one device, split in two, and pipelined, with the split-size sweep.

Its own page record (``RESNET50``) because its figures are a sweep: a table of every configuration
that ran, a plot of the step time against the microbatch count, and the tutorial's smallest split
shown failing on purpose.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.common import DOCS, table
from bench.seed_pages import FullSize, Page, Setup
from bench.seed_run import Workspace
from bench.seed_text import code, ms, plan_excerpt, printed, run_excerpt, timing_note

FIGURES = DOCS / "figures"

# ResNet-50 sweep: the tutorial split each batch of 120 images into splits of 1..60 images. The
# microbatch counts here are 120 / split size for the split sizes 60, 40, 20, 10, 5 and 3.
RESNET_BATCH = 120
RESNET_SWEEP = (2, 3, 6, 12, 24, 40)
RESNET_STEPS = 8


def resnet_setup(tag: str, file: str, gpus: int, m: int, gpipe: bool = True) -> Setup:
    """A ResNet-50 tiny plan at the sweep's batch, and a short run of it."""
    options = ("--gpus", str(gpus), "-b", str(RESNET_BATCH), "-m", str(m), *(["--schedule", "gpipe"] if gpipe else []))
    return Setup(tag, file, "models/resnet50.py", options, RESNET_STEPS)


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


RESNET50 = Page(
    "resnet50",
    "Seed system: ResNet-50 on one device, split in two, and pipelined",
    RESNET_INTRO,
    (
        resnet_setup("one", "one.json", 1, 1, gpipe=False),
        resnet_setup("split", "split.json", 2, 1),
        *(resnet_setup(f"m{m}", f"pipe_m{m}.json", 2, m) for m in RESNET_SWEEP),
    ),
    FullSize(
        "planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 1 -b 120 -m 1 -o one.json\n"
        "planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 2 -b 120 -m 1 "
        "--schedule gpipe -o split.json\n"
        "for m in 2 3 6 10 12 15 24 40; do\n"
        "  planner plan models/resnet50.py --size imagenet --set image_size=128 --gpus 2 -b 120 -m $m "
        "--schedule gpipe -o pipe_m$m.json\n"
        "done\n"
        "for p in one.json split.json pipe_m*.json; do planner run $p --steps 10 --no-checkpoint; done",
        "`--size imagenet` is torchvision's ResNet-50 (width 64, 1000 classes); "
        "the tutorial fed it 128 x 128 images in batches of 120 and swept split sizes 1, 3, 5, 8, "
        "10, 12, 20, 40 and 60 (m = 120 / split size; split size 1 cannot train with batch norm, "
        "as above). It trained with SGD (`--optimizer sgd --lr 0.001`) on an MSE loss against "
        "one-hot labels; `models/resnet50.py` uses cross-entropy. Not run here: it needs two GPUs.",
        ("plan", "models/resnet50.py", "--size", "imagenet", "--set", "image_size=128", "--gpus", "2")
        + ("-b", "120", "-m", "10", "--schedule", "gpipe", "--optimizer", "sgd", "--lr", "0.001"),
    ),
    # The tutorial's smallest split (1 image) cannot train here: shown failing, on purpose.
    extra=(resnet_setup("m120", "pipe_m120.json", 2, RESNET_BATCH).plan_command(expect_fail=True),),
    render=render_resnet,
)
