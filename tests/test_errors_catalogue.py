"""Every mistake gets one clear line: a catalogue of bad inputs, their messages and exit codes.

Each case runs the real ``planner`` command (click's test runner, in this process) on a small
model file or plan made for it, and must end with its expected exit code, one error line that
contains the expected words, and no traceback. The whole catalogue is written to
``docs/errors.md``; this test fails when that page no longer matches the code
(``PLANNER_UPDATE_DOCS=1 pytest tests/test_errors_catalogue.py`` rewrites it).
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from run_factory import TOY_FULL_WIDTH, edited_copy

from cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
TOY = (ROOT / "models" / "toy.py").read_text()
FAST = ["--repeats", "1", "--warmup", "0", "-q"]


@dataclass(frozen=True)
class Case:
    """One bad input: the command line (``{d}`` is the scratch folder), what it must answer."""

    group: str
    what: str
    args: str
    code: int
    expect: str
    setup: Callable[[Path], None] | None = None


def _toy(d: Path, name: str = "model.py", old: str = "", new: str = "") -> Path:
    assert not old or old in TOY, old
    path = d / name
    path.write_text(TOY.replace(old, new) if old else TOY)
    return path


def _variant(old: str, new: str, name: str = "bad.py") -> Callable[[Path], None]:
    return lambda d: None if _toy(d, name, old, new) else None


def _text(name: str, text: str) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)

    return write


def _folders(d: Path) -> None:
    """A folder without config.json, a folder of two model folders, a folder of model files, a FIFO."""
    (d / "empty").mkdir(exist_ok=True)
    for name in ("a", "b"):
        (d / "zoo" / name).mkdir(parents=True, exist_ok=True)
        (d / "zoo" / name / "config.json").write_text("{}")
    (d / "pys").mkdir(exist_ok=True)
    _toy(d / "pys", "toy.py")
    if not (d / "fifo").exists():
        os.mkfifo(d / "fifo")


def _edit_plan(edit: Callable[[dict], None], name: str = "edited.json") -> Callable[[Path], None]:
    return lambda d: None if edited_copy(d / "plan.json", edit, d / name) else None


def _rename_block(raw: dict) -> None:
    # renamed consistently in the plan file, so only the model can tell
    raw["blocks"][0]["name"] = "renamed"
    raw["stages"][0]["first_block"] = "renamed"
    if raw["stages"][0]["end"] == 1:
        raw["stages"][0]["last_block"] = "renamed"


def _cell(text: str) -> str:
    """``text`` in a cell of docs/errors.md's table: a | escaped, as GitHub's tables read it (in `code` too)."""
    return text.replace("|", "\\|")


def _recompute_99(raw: dict) -> None:
    raw["stages"][0]["recompute"] = "full:99"


def _checkpoint_folders(d: Path) -> None:
    """A folder with another model's checkpoint, one holding the user's own 'latest', one holding the
    user's own step_00000002 folder."""
    other = d / "other.ckpt" / "step_00000001"
    other.mkdir(parents=True, exist_ok=True)
    (other / ".metadata").write_bytes(b"")
    (other / "planner.json").write_text('{"step": 1, "plan_fingerprint": "0123456789abcdef"}')
    (d / "mine").mkdir(exist_ok=True)
    (d / "mine" / "latest").write_text("my notes\n")
    (d / "mine2" / "step_00000002").mkdir(parents=True, exist_ok=True)


def _double_batch(raw: dict) -> None:
    raw["batch_size"] *= 2
    # The fitted fixed share of a microbatch's time is a measurement: at 1.0 (a machine whose times
    # did not grow with the batch) the rescaled times equal the stored ones and the note names fewer
    # figures. Pinned, so the row below reads the same on every machine.
    raw["profile"]["fixed_fraction"] = 0.5


def _move_boundary(raw: dict) -> None:
    cut = 2 if raw["stages"][0]["end"] == 1 else 1  # the other legal boundary of the 3-block toy model
    raw["stages"][0]["end"] = cut
    raw["stages"][0]["last_block"] = raw["blocks"][cut - 1]["name"]
    raw["stages"][1]["start"] = cut
    raw["stages"][1]["first_block"] = raw["blocks"][cut]["name"]


def _estimated(raw: dict) -> None:
    raw["profile"].update(source="estimated", device="cuda", backend="nccl", hardware="h100", dtype="bf16")


def _half_stream(d: Path) -> None:
    """A copy of the plan whose model file's train_batches yields half the planned batch."""
    _toy(
        d,
        "stream.py",
        "x = torch.randn(batch_size, in_features, generator=g)",
        "x = torch.randn(batch_size // 2, in_features, generator=g)",
    )
    text = (
        (d / "stream.py")
        .read_text()
        .replace(
            "0.1 * torch.randn(batch_size, out_features, generator=g)",
            "0.1 * torch.randn(batch_size // 2, out_features, generator=g)",
        )
    )
    (d / "stream.py").write_text(text)
    edited_copy(d / "plan.json", lambda raw: raw["model"].update(path=str(d / "stream.py")), d / "stream.json")


NO_CHAIN = """
import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, mask):
        return self.lin(h) * mask


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x):
        mask = (x > 0).float()
        if mask.sum() > 0:  # data-dependent: neither fx nor export follows it
            mask = mask + 1
        for layer in self.layers:
            x = layer(x, mask)
        return x


def build_model(**_):
    return Model()


def make_batch(batch_size, **_):
    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 4)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
"""

TIED_SPLIT = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied to the input embedding

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def build_model(**_):
    return Model()


def make_batch(batch_size, **_):
    x = torch.randint(0, 16, (batch_size, 4))
    return (x,), x


def loss_fn(out, target):
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


tp_plan = {"head": "colwise_rep"}
"""

HELD_PORT = 29561
_HELD: list[socket.socket] = []  # kept open until the tests end


def _hold_port(port: int) -> None:
    """Listen on ``port`` as another program would (if something already does, it is held anyway)."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        _HELD.append(s)
    except OSError:
        s.close()


def _striking(d: Path, signame: str, name: str) -> None:
    """NAME.py, a copy of the toy model whose rank 1 sends itself ``signame`` as it draws the batch
    of step 3 (RANK is set in the workers only), and NAME.json, its 2-rank plan."""
    text = TOY.replace("import torch\n", "import os\nimport signal\n\nimport torch\n", 1).replace(
        "    while True:\n",
        "    step = 0\n    while True:\n        step += 1\n"
        f"        if os.environ.get('RANK') == '1' and step == 3:\n            os.kill(os.getpid(), signal.{signame})\n",
        1,
    )
    (d / f"{name}.py").write_text(text)
    _write_plan(d, d / f"{name}.py", f"{name}.json", "--gpus", "2", "--schedule", "gpipe", "--method", "uniform")


M = "{d}/model.py"
PLAN = ["plan", M, "--gpus", "2", "-b", "8", *FAST, "-o", "{d}/out.json"]
P = " ".join(PLAN)

CASES: list[Case] = [
    Case(
        "model file",
        "no tracer follows it and its blocks are no chain",
        "plan {d}/nochain.py --gpus 2 -b 8",
        2,
        "cannot run as a chain of stages: layers.0 takes 2 tensors",
        _text("nochain.py", NO_CHAIN),
    ),
    Case(
        "model file",
        "train_batches yields another batch size than planned",
        "run {d}/stream.json --steps 1",
        2,
        "train_batches(8) yields input 0 of shape [4, 10] float32 but the plan was made for shape [8, 10] float32",
        _half_stream,
    ),
    # --- a job file (--config) ----------------------------------------------------------------------
    Case("job file", "job file missing", "plan --config {d}/nope.toml {d}/model.py", 2, "no such file"),
    Case(
        "job file",
        "not valid TOML",
        "plan --config {d}/bad.toml {d}/model.py",
        2,
        "not valid TOML: Invalid value (at line 2, column 14)",
        _text("bad.toml", "gpus = 2\nbatch-size = \n"),
    ),
    Case(
        "job file",
        "a key spelt as the Python name",
        "plan --config {d}/key.toml {d}/model.py",
        2,
        "unknown key 'batch_size'; did you mean 'batch-size'?",
        _text("key.toml", "gpus = 2\nbatch_size = 8\n"),
    ),
    Case(
        "job file",
        "a value of the wrong kind",
        "plan --config {d}/kind.toml {d}/model.py",
        2,
        "gpus = 2.5: expected a whole number",
        _text("kind.toml", "gpus = 2.5\n"),
    ),
    Case(
        "job file",
        "a value the option refuses",
        "plan --config {d}/zero.toml {d}/model.py",
        2,
        "gpus = 0: 0 is not in the range x>=1.",
        _text("zero.toml", "gpus = 0\n"),
    ),
    # --- the model file ---------------------------------------------------------------------------
    Case("model file", "model file missing", "plan {d}/nope.py --gpus 2", 2, "does not exist"),
    Case(
        "model file",
        "a folder without config.json",
        "plan {d}/empty --gpus 2",
        2,
        "is a folder without config.json",
        _folders,
    ),
    Case(
        "model file", "a folder of model folders", "plan {d}/zoo --gpus 2", 2, "is a folder of models (a, b)", _folders
    ),
    Case("model file", "a folder of model files", "plan {d}/pys --gpus 2", 2, "give one of its Python files", _folders),
    Case("model file", "a FIFO", "plan {d}/fifo --gpus 2", 2, "is a FIFO, not a file the planner can read", _folders),
    Case(
        "model file",
        "a plan given as the model file",
        "plan {d}/plan.json --gpus 2",
        2,
        "is a plan written by the planner, not a model; train with it (planner run",
    ),
    Case(
        "model file", "syntax error", "plan {d}/bad.py --gpus 2", 2, "importing", _text("bad.py", "def build_model(:\n")
    ),
    Case(
        "model file",
        "raises at import",
        "plan {d}/bad.py --gpus 2",
        2,
        "ValueError: boom",
        _text("bad.py", "raise ValueError('boom')\n"),
    ),
    Case(
        "model file",
        "sys.exit(3) at import",
        "plan {d}/bad.py --gpus 2",
        2,
        "exit",
        _text("bad.py", "import sys\nsys.exit(3)\n"),
    ),
    Case(
        "model file",
        "no build_model",
        "plan {d}/bad.py --gpus 2",
        2,
        "does not define build_model",
        _variant("def build_model(", "def build_model_renamed("),
    ),
    Case(
        "model file",
        "no make_batch",
        "plan {d}/bad.py --gpus 2",
        2,
        "does not define make_batch",
        _variant("def make_batch(", "def make_batch_renamed("),
    ),
    Case(
        "model file",
        "build_model returns no module",
        "plan {d}/bad.py --gpus 2",
        2,
        "expected a torch.nn.Module",
        _variant("    return ToyModel(in_features, hidden, out_features)", "    return 42"),
    ),
    Case(
        "model file",
        "build_model raises",
        "plan {d}/bad.py --gpus 2",
        2,
        "build_model() raised RuntimeError",
        _variant("    return ToyModel(in_features, hidden, out_features)", "    raise RuntimeError('no weights')"),
    ),
    Case(
        "model file",
        "make_batch returns the wrong shape",
        "plan {d}/bad.py --gpus 2",
        2,
        "must return a pair (inputs, target_tensor), the inputs a tuple or a dict",
        _variant("    return (x,), y", "    return x, y"),
    ),
    Case(
        "model file",
        "make_batch raises",
        "plan {d}/bad.py --gpus 2",
        2,
        "make_batch() raised",
        _variant(
            "    x = torch.randn(batch_size, in_features)",
            "    x = torch.randn(batch_size, in_features) / undefined_name",
        ),
    ),
    Case(
        "model file",
        "forward raises",
        "plan {d}/bad.py --gpus 2",
        2,
        "forward() raised",
        _variant("        return self.net2(self.relu(self.net1(x)))", "        return self.net2(x.t())"),
    ),
    Case(
        "model file",
        "a tensor-parallel split the model's code cannot run (a torch.export trace reshaping to the full width)",
        "plan {d}/bad.py --gpus 2 --tp 2 -b 8 --repeats 1 --warmup 0 -q",
        2,
        "--tp 2: the model does not trace with its tp_plan layers split 2 ways",
        _variant(*TOY_FULL_WIDTH),
    ),
    Case(
        "model file",
        "sequence parallelism where the sequence shards reach attention the tp_plan leaves whole",
        "plan {d}/gpt.py --size tiny --gpus 4 --tp 2 --sequence-parallel -b 8 --repeats 1 --warmup 0 -q",
        2,
        "which does not work token by token",
        _text("gpt.py", (ROOT / "models" / "gpt.py").read_text()),
    ),
    Case(
        "model file",
        "loss parallelism where the tp_plan splits no output head",
        "plan {d}/gpt.py --size tiny --gpus 4 --tp 2 --loss-parallel -b 8 --repeats 1 --warmup 0 -q",
        2,
        "--loss-parallel: the tp_plan splits no output head in the model's last block",
        _text("gpt.py", (ROOT / "models" / "gpt.py").read_text()),
    ),
    Case(
        "model file",
        "a tp_plan that splits a tied weight",
        "plan {d}/tied.py --gpus 2 --tp 2 -b 8 --repeats 1 --warmup 0 -q",
        2,
        "whose weight is tied to emb: torch gives a split layer a sharded weight of its own",
        _text("tied.py", TIED_SPLIT),
    ),
    Case(
        "model file",
        "loss_fn raises",
        "plan {d}/bad.py --gpus 2",
        2,
        "loss_fn() raised",
        _variant("    return F.mse_loss(output, target)", "    return F.mse_loss(output, target[:, :1].t())"),
    ),
    Case(
        "model file",
        "no loss_fn, and targets the default cross-entropy cannot take",
        "plan {d}/bad.py --gpus 2",
        2,
        "bad.py defines no loss_fn, and the default (cross-entropy",
        _variant(
            "def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:\n"
            "    return F.mse_loss(output, target)  # mean reduction\n",
            "",
        ),
    ),
    Case(
        "model file",
        "loss_fn returns no scalar",
        "plan {d}/bad.py --gpus 2",
        2,
        "expected a scalar tensor",
        _variant("    return F.mse_loss(output, target)", "    return (output - target) ** 2"),
    ),
    Case(
        "model file",
        "loss sums instead of averaging",
        "plan {d}/bad.py --gpus 2 -b 8",
        2,
        "sums over the batch",
        _variant("    return F.mse_loss(output, target)", "    return F.mse_loss(output, target, reduction='sum')"),
    ),
    Case(
        "model file",
        "loss is not a mean over the batch",
        "plan {d}/bad.py --gpus 2 -b 8",
        2,
        "is not a mean over the batch",
        _variant("    return F.mse_loss(output, target)", "    return F.mse_loss(output[:1], target[:1])"),
    ),
    Case(
        "model file",
        "loss_fn detaches the output",
        "plan {d}/bad.py --gpus 2 -b 8",
        2,
        "loss_fn() returned a loss with no gradient",
        _variant("    return F.mse_loss(output, target)", "    return F.mse_loss(output.detach(), target)"),
    ),
    Case(
        "model file",
        "a model with no trainable parameter",
        "plan {d}/bad.py --gpus 2 -b 8",
        2,
        "a model with no trainable parameter",
        _variant(
            "    return ToyModel(in_features, hidden, out_features)",
            "    return ToyModel(in_features, hidden, out_features).requires_grad_(False)",
        ),
    ),
    Case(
        "model file",
        "make_batch ignores batch_size",
        "plan {d}/bad.py --gpus 2 -b 8",
        2,
        "first dimension is [3], not 4",
        _variant(
            "    x = torch.randn(batch_size, in_features)\n    y = torch.randn(batch_size, out_features)",
            "    x = torch.randn(3, in_features)\n    y = torch.randn(3, out_features)",
        ),
    ),
    Case(
        "model file",
        "SIZES is a list",
        "plan {d}/bad.py --gpus 2 --size tiny",
        2,
        "SIZES",
        _variant("SIZES: dict[str, dict] = {", "SIZES = [1, 2]\n_UNUSED: dict[str, dict] = {"),
    ),
    Case("model file", "unknown --size", "plan {d}/model.py --gpus 2 --size huge", 2, "known sizes: tiny, wide"),
    Case(
        "model file",
        "--set of an unknown key",
        "plan {d}/model.py --gpus 2 --set depth=3",
        2,
        "has no config key 'depth'",
    ),
    Case("model file", "--set without =", "plan {d}/model.py --gpus 2 --set depth", 2, "expected key=value"),
    Case("model file", "--set with an empty key", "plan {d}/model.py --gpus 2 --set =3", 2, "expected key=value"),
    Case(
        "model file",
        "--set a value build_model rejects",
        'plan {d}/model.py --gpus 2 --set hidden="x"',
        2,
        "rejected the config",
    ),
    # --- options of planner plan ------------------------------------------------------------------
    Case("plan options", "--gpus 0", "plan {d}/model.py --gpus 0", 2, "--gpus"),
    Case(
        "plan options",
        "more stages than blocks",
        "plan {d}/model.py --gpus 5 -b 10 -m 5",
        2,
        "the model has only 3 blocks",
    ),
    Case(
        "plan options",
        "a --compare file that is not there",
        "plan {d}/model.py --gpus 2 --compare {d}/titan.toml",
        2,
        "titan.toml does not exist; give a file holding torchtitan's module_fqns_per_model_part",
    ),
    Case(
        "plan options",
        "more pipeline ranks than blocks once tp takes its share",
        "plan {d}/model.py --gpus 8 --tp 2 --gpu-type h100 -b 8",
        2,
        "--gpus 8 --tp 2: 4 pipeline ranks of 2 GPUs each (tensor-parallel ranks x replicas), but the model has only 3",
    ),
    Case("plan options", "--batch-size 0", "plan {d}/model.py --gpus 2 -b 0", 2, "--batch-size"),
    Case(
        "plan options",
        "--memory-limit under one byte",
        "plan {d}/model.py --gpus 2 --memory-limit 1e-12",
        2,
        "1e-12 GiB is 0.0011 bytes, under one byte (the limit is in GiB)",
    ),
    Case(
        "plan options",
        "--memory-limit past an exbibyte",
        "plan {d}/model.py --gpus 2 --memory-limit 1e30",
        2,
        "1e+30 GiB is past any device (at most 1073741824 GiB, an exbibyte)",
    ),
    Case(
        "plan options",
        "batch not divisible by --microbatches",
        "plan {d}/model.py --gpus 2 -b 30 -m 4",
        2,
        "does not split into 4 equal microbatches",
    ),
    Case(
        "plan options",
        "1F1B with fewer microbatches than stages",
        "plan {d}/model.py --gpus 3 -b 8 -m 2 --schedule 1f1b",
        2,
        "needs at least one microbatch per stage",
    ),
    Case(
        "plan options",
        "DualPipeV with fewer microbatches than stages",
        "plan {d}/model.py --gpus 2 -b 8 -m 2 --schedule dualpipev",
        2,
        "needs at least one microbatch per stage (4 stages)",
    ),
    Case(
        "plan options",
        "V-shaped schedule with other than 2 stages per rank",
        "plan {d}/model.py --gpus 2 --schedule zbv --stages-per-rank 3",
        2,
        "exactly 2 stages on every rank",
    ),
    Case(
        "plan options",
        "several stages per rank under a one-stage schedule",
        "plan {d}/model.py --gpus 2 --schedule gpipe --stages-per-rank 2",
        2,
        "does not work with --schedule gpipe (one stage per rank)",
    ),
    Case(
        "plan options",
        "selective checkpointing under a zero-bubble schedule",
        "plan {d}/model.py --gpus 2 --schedule zbv --recompute selective",
        2,
        "--recompute selective cannot run under --schedule zbv",
    ),
    Case(
        "plan options",
        "FSDP units under DDP",
        "plan {d}/model.py --gpus 2 --dp 2 --dp-mode ddp --fsdp-units block",
        2,
        "--fsdp-units block shards with FSDP, but --dp-mode is ddp",
    ),
    Case(
        "plan options",
        "sequence parallelism with torch.compile",
        "plan {d}/model.py --gpus 2 --tp 2 --sequence-parallel --compile",
        2,
        "--sequence-parallel runs eagerly only; leave out --compile",
    ),
    Case("plan options", "unknown --schedule", "plan {d}/model.py --gpus 2 --schedule zb", 2, "--schedule"),
    Case("plan options", "unknown --method", "plan {d}/model.py --gpus 2 --method best", 2, "--method"),
    Case("plan options", "--memory-limit 0", "plan {d}/model.py --gpus 2 --memory-limit 0", 2, "--memory-limit"),
    Case("plan options", "--memory-limit nan", "plan {d}/model.py --gpus 2 --memory-limit nan", 2, "--memory-limit"),
    Case(
        "plan options",
        "--memory-limit nothing fits",
        "plan {d}/model.py --gpus 2 -b 8 --schedule gpipe --memory-limit 0.0000001 " + " ".join(FAST),
        2,
        "GiB memory limit: the closest",
    ),
    Case("plan options", "unknown --recompute", "plan {d}/model.py --gpus 2 --recompute sometimes", 2, "--recompute"),
    Case("plan options", "unknown --gpu-type", "plan {d}/model.py --gpus 2 --gpu-type h1000", 2, "h1000"),
    Case(
        "plan options",
        "a --gpu-type hardware file that is missing",
        "plan {d}/model.py --gpus 2 --gpu-type {d}/nohw.json",
        2,
        "no such file; give a hardware file written by `planner probe",
    ),
    Case(
        "plan options",
        "a --gpu-type file that is not a hardware file",
        "plan {d}/model.py --gpus 2 --gpu-type {d}/notes.json",
        2,
        "not a hardware file (spec: Field required)",
        _text("notes.json", '{"format": 1, "gpus": 8}'),
    ),
    Case("probe", "probe without --gpus and -o", "probe --quick", 2, "give --gpus N and -o FILE.json"),
    Case(
        "plan options",
        "--attention-kernel without --gpu-type",
        "plan {d}/model.py --gpus 2 --attention-kernel flash",
        2,
        "--attention-kernel applies to --gpu-type estimates of GPUs only",
    ),
    Case(
        "plan options",
        "an attention kernel the GPU table has no figures for",
        "plan {d}/model.py --gpus 2 --gpu-type a100-80g --attention-kernel cudnn",
        2,
        "no figures for it on a100-80g",
    ),
    Case(
        "run options",
        "--eval-every without --data",
        "run {d}/plan.json --eval-every 2",
        2,
        "--eval-every acts on the text of --data: give --data PATH too",
    ),
    Case(
        "run options",
        "--tokenizer and --eval-fraction without --data",
        "run {d}/plan.json --tokenizer word --eval-fraction 0.5",
        2,
        "--eval-fraction, --tokenizer act on the text of --data: give --data PATH too, or leave them out",
    ),
    Case("run options", "--resume with nothing to resume", "run {d}/plan.json --resume", 2, "no complete checkpoint"),
    Case(
        "run options",
        "--data that does not exist",
        "run {d}/plan.json --data {d}/no-such-corpus.txt",
        2,
        "no-such-corpus.txt",
    ),
    Case("run options", "--data for a model without token ids", "run {d}/plan.json --data {d}/model.py", 2, "token"),
    Case(
        "run options",
        "export-weights without a checkpoint",
        "export-weights {d}/plan.json -o {d}/w.pt",
        2,
        "no complete checkpoint",
    ),
    Case(
        "export", "--rename without OLD=NEW", "export {d}/plan.json --to torchtitan --rename layers", 2, "give OLD=NEW"
    ),
    Case(
        "export",
        "--rename that matches no block",
        "export {d}/plan.json --to torchtitan --rename layer=blocks",
        2,
        "no block is 'layer' or inside it",
    ),
    Case(
        "export",
        "--rename giving two blocks one name",
        "export {d}/plan.json --to torchtitan --rename net1=net2",
        2,
        "one name, 'net2'; rename them apart",
    ),
    Case(
        "export",
        "-o naming a model file",
        "export {d}/plan.json --to csv -o {d}/model.py",
        2,
        "not a `planner export` output",
    ),
    Case(
        "plan options",
        "--compare layer counts for a model without repeated layers",
        "plan {d}/model.py --gpus 2 --compare 50,50 " + " ".join(FAST),
        2,
        "no repeated layers to count",
    ),
    Case(
        "plan options",
        "--dp-mode fsdp with one replica",
        "plan {d}/model.py --gpus 2 --dp-mode fsdp",
        2,
        "--dp-mode fsdp shards over replicas, but --dp is 1",
    ),
    Case(
        "plan options",
        "--compare with a Megatron repeat that does not unroll",
        "plan {d}/model.py --gpus 2 --compare Et**2|t*2L",
        2,
        "cannot read '**2'",
    ),
    Case(
        "plan options",
        "--compare naming a file without module lists",
        "plan {d}/model.py --gpus 2 --compare {d}/model.py",
        2,
        "holds no module_fqns_per_model_part",
    ),
    Case(
        "plan options",
        "--method given without --compare",
        "plan {d}/model.py --gpus 2 --method given",
        2,
        "--compare SPLIT",
    ),
    Case(
        "plan options",
        "--multi-node without --gpu-type",
        "plan {d}/model.py --gpus 2 --multi-node",
        2,
        "--multi-node applies to estimated costs only",
    ),
    Case(
        "plan options",
        "a dtype the GPU lacks",
        "plan {d}/model.py --gpus 2 --gpu-type v100 --dtype bf16",
        2,
        "not supported on v100",
    ),
    Case(
        "plan options",
        "--dtype fp8 for a GPU without FP8 tensor cores",
        "plan {d}/model.py --gpus 2 --gpu-type a100-80g --dtype fp8",
        2,
        "--dtype fp8: a100-80g has no FP8 tensor cores",
    ),
    Case(
        "plan options",
        "--cp-attention ring without context parallelism",
        "plan {d}/model.py --gpus 2 --cp-attention ring",
        2,
        "--cp-attention ring needs --cp above 1 (or --cp auto)",
    ),
    Case(
        "plan options",
        "--cp for a model whose inputs are features, no sequence",
        "plan {d}/model.py --gpus 2 --cp 2 --dp 1",
        2,
        "context parallelism (--cp) splits dimension 1 of the model's inputs (the sequence); this model's inputs have no",
    ),
    Case(
        "plan options",
        "--cp for a model whose attention runs inside a module torch.fx keeps whole",
        "plan {d}/encoder_lm.py --size tiny --gpus 2 --cp 2 --dp 1 --gpu-type h100",
        2,
        "runs nn.MultiheadAttention inside, which torch.fx keeps whole",
        _text("encoder_lm.py", (ROOT / "models" / "encoder_lm.py").read_text()),
    ),
    Case(
        "plan options",
        "--dtype fp8 with --compile where float8 runs emulated",
        "plan {d}/model.py --gpus 2 --dtype fp8 --compile",
        2,
        "--dtype fp8 with --compile: on cpu float8 runs in torchao's emulation",
    ),
    Case(
        "plan options",
        "--dtype fp8 for a model none of whose linear layers would convert",
        "plan {d}/model.py --gpus 2 --dtype fp8",
        2,
        "none of the model's 2 linear layers would train in float8",
    ),
    Case("plan options", "--lr 0", "plan {d}/model.py --gpus 2 --lr 0", 2, "--lr"),
    Case(
        "plan options",
        "--lr nan",
        "plan {d}/model.py --gpus 2 --lr nan",
        2,
        "--lr nan: Input should be a finite number",
    ),
    Case(
        "plan options",
        "--lr inf",
        "plan {d}/model.py --gpus 2 --lr inf",
        2,
        "--lr inf: Input should be a finite number",
    ),
    Case("plan options", "--grad-clip -1", "plan {d}/model.py --gpus 2 --grad-clip -1", 2, "--grad-clip"),
    Case("plan options", "--grad-clip nan", "plan {d}/model.py --gpus 2 --grad-clip nan", 2, "--grad-clip"),
    Case("plan options", "--threads 0", "plan {d}/model.py --gpus 2 --threads 0", 2, "--threads"),
    Case("plan options", "--repeats 0", "plan {d}/model.py --gpus 2 --repeats 0", 2, "--repeats"),
    Case("plan options", "--warmup -1", "plan {d}/model.py --gpus 2 --warmup -1", 2, "--warmup"),
    Case("plan options", "--seed -1", "plan {d}/model.py --gpus 2 --seed -1", 2, "--seed"),
    Case(
        "plan options", "--seed of 24 digits", "plan {d}/model.py --gpus 2 --seed 100000000000000000000000", 2, "--seed"
    ),
    Case("plan options", "unknown --optimizer", "plan {d}/model.py --gpus 2 --optimizer lion", 2, "--optimizer"),
    Case(
        "plan options",
        "--calibrate a missing run",
        "plan {d}/model.py --gpus 2 --calibrate {d}/nope.run.json",
        2,
        "cannot read run result",
    ),
    Case(
        "plan options",
        "--calibrate a plan",
        "plan {d}/model.py --gpus 2 --calibrate {d}/plan.json",
        2,
        "is a plan, not a run report",
    ),
    Case(
        "plan options",
        "--calibrate a run of another model",
        "plan {d}/other.py --gpus 1 -b 8 --calibrate {d}/one.run.json " + " ".join(FAST),
        2,
        "the calibration was measured on a model with fingerprint",
        _variant("        self.relu = nn.ReLU()", "        self.relu = nn.GELU()", "other.py"),
    ),
    Case(
        "plan options",
        "--calibrate with a run that timed no step",
        "plan {d}/model.py --gpus 1 -b 8 --calibrate {d}/two.run.json " + " ".join(FAST),
        2,
        "the run timed no step",
    ),
    Case(
        "plan options",
        "--sequence-parallel with --tp 1",
        "plan {d}/model.py --gpus 2 --tp 1 --sequence-parallel",
        2,
        "--sequence-parallel splits along the sequence what tensor parallelism keeps whole, but --tp is 1",
    ),
    Case(
        "plan options",
        "--loss-parallel with --tp 1",
        "plan {d}/model.py --gpus 2 --tp 1 --loss-parallel",
        2,
        "--loss-parallel computes the loss on the output head's logits split over the tensor-parallel ranks, but "
        "--tp is 1",
    ),
    Case(
        "plan options",
        "--fsdp-units with one replica",
        "plan {d}/model.py --gpus 2 --dp 1 --fsdp-units block",
        2,
        "--fsdp-units block shards with FSDP over replicas, but --dp is 1",
    ),
    Case(
        "model file",
        "--set of a field a Hugging Face config does not have",
        "plan {d}/hf/config.json --gpus 2 --gpu-type cpu --set hidden_sise=128",
        2,
        "no field 'hidden_sise'; did you mean hidden_size",
        _text("hf/config.json", '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'),
    ),
    Case(
        "plan options",
        "--cp-attention ring for a model whose attention drops out",
        "plan {d}/hfd/config.json --gpus 2 --gpu-type cpu --cp 2 --dp 1 --set seq_len=16 --cp-attention ring",
        2,
        "--cp-attention ring: ring attention runs attention without dropout, and this model's attention drops out",
        _text(
            "hfd/config.json",
            '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": '
            '128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, '
            '"attention_dropout": 0.1}',
        ),
    ),
    Case(
        "model file",
        "a Hugging Face config with architectures as a string",
        "plan {d}/hfs/config.json --gpus 2 --gpu-type cpu",
        2,
        "\"architectures\" is the string 'LlamaForCausalLM', not a list of class names",
        _text("hfs/config.json", '{"model_type": "llama", "architectures": "LlamaForCausalLM"}'),
    ),
    # --- outputs ----------------------------------------------------------------------------------
    Case(
        "outputs",
        "-o into a missing folder",
        "plan {d}/model.py --gpus 2 -o {d}/missing/plan.json",
        2,
        "does not exist",
    ),
    Case(
        "outputs",
        "plan -o onto the model file",
        "plan {d}/model.py --gpus 2 -o {d}/model.py",
        2,
        "holds something that is not a plan",
    ),
    Case("outputs", "run -o onto the plan", "run {d}/plan.json -o {d}/plan.json", 2, "holds a plan, not a run result"),
    Case(
        "outputs",
        "-o onto a symbolic link",
        "plan {d}/model.py --gpus 2 -o {d}/link.json",
        2,
        "is a symbolic link",
        lambda d: None if (d / "link.json").symlink_to(d / "plan.json") else None,
    ),
    Case("outputs", "-o onto a device", "plan {d}/model.py --gpus 2 -o /dev/null", 2, "not a regular file"),
    Case("outputs", "-o onto a folder", "plan {d}/model.py --gpus 2 -o {d}", 2, "is a directory"),
    # --- plan files given to run and report --------------------------------------------------------
    Case("plan files", "run a missing plan", "run {d}/nope.json", 2, "cannot read plan"),
    Case(
        "plan files", "run a file that is not JSON", "run {d}/junk.json", 2, "is not JSON", _text("junk.json", "plan?")
    ),
    Case(
        "plan files", "run a JSON list", "run {d}/list.json", 2, "expected a JSON object", _text("list.json", "[1, 2]")
    ),
    Case(
        "plan files",
        "run a plan of another version",
        "run {d}/v9.json",
        2,
        "this planner reads version 1",
        _text("v9.json", '{"version": 9}'),
    ),
    Case("plan files", "run a run report", "run {d}/one.run.json", 2, "is a run result, not a plan"),
    Case("plan files", "run a model file", "run {d}/model.py", 2, "is a Python file (a model file?), not a plan"),
    Case(
        "plan files",
        "report a Hugging Face config",
        "report {d}/config.json",
        2,
        "is a Hugging Face model config, not a plan; plan it first",
        _text("config.json", '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'),
    ),
    Case(
        "plan files",
        "a negative stage time",
        "report {d}/neg.json",
        2,
        "greater than or equal to 0",
        _edit_plan(lambda raw: raw["stages"][0].update(fwd_s=-1.0), "neg.json"),
    ),
    Case(
        "plan files",
        "FSDP block units in a plan of DDP replicas",
        "report {d}/units.json",
        2,
        "fsdp_units is block under ddp",
        _edit_plan(lambda raw: raw.update(fsdp_units="block"), "units.json"),
    ),
    Case(
        "plan files",
        "stages that do not tile the blocks",
        "report {d}/gap.json",
        2,
        "stages must be contiguous",
        _edit_plan(lambda raw: raw["stages"][1].update(start=raw["stages"][0]["end"] + 1), "gap.json"),
    ),
    Case(
        "plan files",
        "a renamed block",
        "run {d}/renamed.json --steps 1",
        2,
        "block 0 of the plan is 'renamed'",
        _edit_plan(_rename_block, "renamed.json"),
    ),
    Case(
        "plan files",
        "a stage recomputing more checkpoint regions than it has",
        "run {d}/rc99.json --steps 1",
        2,
        "recompute 'full:99' names 99 checkpoint regions, but the stage has",
        _edit_plan(_recompute_99, "rc99.json"),
    ),
    Case(
        "plan files",
        "a stage boundary moved by hand (figures recomputed)",
        "report {d}/moved.json",
        0,
        "was edited by hand or written by another version",
        _edit_plan(_move_boundary, "moved.json"),
    ),
    Case(
        "plan files",
        "batch_size doubled by hand (costs rescaled to the new microbatch)",
        "report {d}/batch.json",
        0,
        "its blocks were costed at: their costs were rescaled to",
        _edit_plan(_double_batch, "batch.json"),
    ),
    Case(
        "plan files",
        "an estimated GPU plan run on a machine without GPUs",
        "run {d}/gpu.json --steps 1",
        2,
        "this machine has no GPU",
        _edit_plan(_estimated, "gpu.json"),
    ),
    Case(
        "plan files",
        "the model file of a plan is gone",
        "run {d}/moved/plan.json --steps 1",
        2,
        "does not exist",
        lambda d: (d / "moved").mkdir() or shutil.copy(d / "gone.json", d / "moved" / "plan.json") and None,
    ),
    Case("plan files", "report a missing plan", "report {d}/nope.json", 2, "cannot read plan"),
    Case(
        "plan files",
        "report --measured a plan",
        "report {d}/plan.json --measured {d}/plan.json",
        2,
        "is a plan, not a run report",
    ),
    Case(
        "plan files",
        "report --measured a run of another split",
        "report {d}/plan.json --measured {d}/one.run.json",
        2,
        "the run has measurements for 1 stage(s), the plan has 2",
    ),
    # --- options of planner run -------------------------------------------------------------------
    Case("run options", "--steps 0", "run {d}/plan.json --steps 0", 2, "--steps"),
    Case("run options", "--nnodes 0", "run {d}/plan.json --nnodes 0", 2, "--nnodes"),
    Case(
        "run options", "several nodes without an endpoint", "run {d}/plan.json --nnodes 2", 2, "needs --rdzv-endpoint"
    ),
    Case(
        "run options",
        "stages not divisible by nodes",
        "run {d}/three.json --nnodes 2 --rdzv-endpoint localhost:29555",
        2,
        "3 ranks cannot be spread evenly over 2 node(s)",
    ),
    Case(
        "run options",
        "--rdzv-endpoint without a port",
        "run {d}/plan.json --rdzv-endpoint notahost:abc",
        2,
        "expected HOST:PORT with a port number",
    ),
    Case(
        "run options",
        "--rdzv-endpoint of an unknown host",
        "run {d}/plan.json --rdzv-endpoint nosuchhost.invalid:29500",
        2,
        "cannot be resolved",
    ),
    Case("run options", "-o into a missing folder", "run {d}/plan.json -o {d}/missing/run.json", 2, "does not exist"),
    Case("run options", "--timeout 0", "run {d}/plan.json --timeout 0", 2, "--timeout"),
    Case(
        "run options",
        "a checkpoint folder of another model",
        "run {d}/plan.json --checkpoint-dir {d}/other.ckpt",
        2,
        "holds checkpoints of another model (fingerprint 0123456789abcdef",
        _checkpoint_folders,
    ),
    Case(
        "run options",
        "a checkpoint folder holding the user's own 'latest'",
        "run {d}/plan.json --checkpoint-dir {d}/mine",
        2,
        "latest is not a file `planner run` wrote",
    ),
    Case(
        "run options",
        "the user's own folder where a step would be saved",
        "run {d}/plan.json --steps 2 --checkpoint-dir {d}/mine2",
        2,
        "is not a checkpoint `planner run` wrote, and this run would save step 2",
    ),
    Case(
        "run options",
        "--timeout too short to work",
        "run {d}/plan.json --timeout 0.01",
        2,
        "0.01 s is too short to tell a hung rank from a busy one",
    ),
    Case(
        "run options",
        "export-weights -o onto a model file",
        "export-weights {d}/plan.json -o {d}/model.py",
        2,
        "holds a Python file, not a state dict; choose another file name, e.g. -o model.pt",
    ),
    Case(
        "run options",
        "export-weights -o onto a plan",
        "export-weights {d}/plan.json -o {d}/plan.json",
        2,
        "holds a plan, not a state dict",
    ),
    Case(
        "run options",
        "--node-rank outside --nnodes",
        "run {d}/plan.json --nnodes 2 --rdzv-endpoint localhost:29555 --node-rank 2",
        2,
        "--node-rank 2 is not a node of --nnodes 2",
    ),
    Case(
        "run options",
        "--rdzv-endpoint port 0 on several nodes",
        "run {d}/plan.json --nnodes 2 --rdzv-endpoint localhost:0",
        2,
        "port 0 lets the store pick any free port",
    ),
    Case(
        "run options",
        "--rdzv-endpoint on a port another program (or run) holds",
        f"run {{d}}/plan.json --rdzv-endpoint localhost:{HELD_PORT}",
        2,
        f"port {HELD_PORT} on this machine is in use",
        lambda d: _hold_port(HELD_PORT),
    ),
    # --- while training ---------------------------------------------------------------------------
    Case(
        "training",
        "a rank is killed (SIGKILL, the out-of-memory killer)",
        "run {d}/killed.json --steps 5 -o {d}/killed.run.json",
        1,
        "rank 1 was killed by SIGKILL at step 3",
        lambda d: _striking(d, "SIGKILL", "killed"),
    ),
    Case(
        "training",
        "a rank stops responding (SIGSTOP, a hang)",
        "run {d}/stopped.json --steps 5 --timeout 5 -o {d}/stopped.run.json",
        1,
        "rank 1 stopped responding: no progress for 5 s at step 3 (--timeout 5)",
        lambda d: _striking(d, "SIGSTOP", "stopped"),
    ),
    Case(
        "training", "the data stream ends", "run {d}/ends.json --steps 3", 2, "train_batches() ended after 1 batch(es)"
    ),
    Case("training", "a NaN loss", "run {d}/nan.json --steps 3", 2, "step 2: the loss is nan; training stopped"),
]


def _write_plan(d: Path, model: Path, out: str, *args: str) -> None:
    result = CliRunner().invoke(main, ["plan", str(model), "-b", "8", *FAST, "-o", str(d / out), *args])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model file, plans of it, a run report, and the model files the training cases need."""
    d = tmp_path_factory.mktemp("errors")
    model = _toy(d)
    # equal layer counts: a 2+1 split whatever the timings, so the messages below never change
    _write_plan(d, model, "plan.json", "--gpus", "2", "--schedule", "gpipe", "--method", "uniform")
    _write_plan(d, model, "three.json", "--gpus", "3", "--schedule", "gpipe")
    _write_plan(d, model, "one.json", "--gpus", "1")
    # 3 steps: one timed (step 1 sets up, the last runs under the memory tracker); 2 steps time none
    result = CliRunner().invoke(main, ["run", str(d / "one.json"), "--steps", "3"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["run", str(d / "one.json"), "--steps", "2", "-o", str(d / "two.run.json")])
    assert result.exit_code == 0, result.output
    gone = _toy(d, "gone.py")
    _write_plan(d, gone, "gone.json", "--gpus", "1")
    gone.unlink()
    ends = _toy(d, "ends.py", "    while True:\n", "    for _ in range(1):\n")
    _write_plan(d, ends, "ends.json", "--gpus", "1")
    nan = _toy(
        d,
        "nan.py",
        "        yield (x,), y\n",
        "        yield (x,), y\n        x = x * float('nan')\n        yield (x,), y\n",
    )
    _write_plan(d, nan, "nan.json", "--gpus", "1")
    return d


def _run(case: Case, d: Path) -> tuple[int, str, str]:
    if case.setup is not None:
        case.setup(d)
    args = [a.replace("{d}", str(d)) for a in case.args.split()]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "Error:", "note:", "warning:"))]
    return errors[-1] if errors else (lines[-1] if lines else "")


@pytest.mark.slow
def test_every_mistake_gets_one_clear_line(scratch: Path) -> None:
    assert len(CASES) >= 60
    rows = []
    failures = []
    for case in CASES:
        code, stdout, stderr = _run(case, scratch)
        line = _error_line(stderr)
        ok = (
            code == case.code
            and case.expect in stderr
            and "Traceback" not in stdout + stderr
            and (case.code == 0 or line.lower().startswith("error:"))
        )
        if not ok:
            failures.append(f"{case.what}: exit {code}, stderr {stderr.strip()[-400:]!r}")
        shown = line.replace(str(scratch), "<dir>")
        rows.append(
            f"| {case.group} | {case.what} | `{_cell(case.args.replace('{d}', '<dir>'))}` | {code} | {_cell(shown)} |"
        )
    assert not failures, "\n".join(failures)
    text = (
        "# Every mistake, its message and its exit code\n\n"
        "Written by `tests/test_errors_catalogue.py`, which runs each bad input through the real `planner` "
        "command and fails when a message or exit code here no longer matches the code "
        "(`PLANNER_UPDATE_DOCS=1 pytest tests/test_errors_catalogue.py` rewrites this page). Exit codes: "
        "2 a usage or input mistake (also one a rank stops on: a NaN loss, a failing data stream), 1 a run "
        "that stopped after its ranks started (a rank killed or hung; run.json "
        "keeps the steps completed) or a bug in the planner (none below), 130 Ctrl-C, 143 SIGTERM, 0 accepted. "
        "`--debug` shows the full traceback instead of the one line. `<dir>` is the folder of the files each case "
        "made; `model.py` is a copy of `models/toy.py`.\n\n"
        "Beyond these cases, `tests/test_cli_property.py` draws command lines of `plan`, `run`, `report`, "
        "`export` and `export-weights` (every option, sound values, values past their bounds and junk, the "
        "files of a workspace; 60 per command in `make test`, `PLANNER_CLI_EXAMPLES=N` for more) and checks "
        "that each ends with exit 0, or 2 and one `error:` line, and leaves every file but the outputs it "
        "names as it was (on exit 2, every file).\n\n"
        f"{len(CASES)} cases.\n\n"
        "| kind | mistake | command | exit | what the user reads |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    if os.environ.get("PLANNER_UPDATE_DOCS"):
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, (
        "docs/errors.md is out of date: PLANNER_UPDATE_DOCS=1 pytest tests/test_errors_catalogue.py"
    )
