"""Tier 2: the `planner` command end to end on tiny models (plan, report) and its error handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from run_factory import edited_copy, run_report

from cli import main
from planner.schema.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
FAST = ["--repeats", "1", "--warmup", "0", "-q"]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def toy_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank plan of models/toy.py (batch 4), planned once for the tests that read it or give a
    command an edited copy (``edited_copy``); none of them writes it."""
    out = tmp_path_factory.mktemp("toy") / "plan.json"
    result = invoke("plan", str(MODELS / "toy.py"), "--gpus", "2", "--size", "tiny", "-b", "4", "-o", str(out), *FAST)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "encoder_lm", "resnet50", "shakespeare", "toy", "llama"])
def test_plan_every_model(model: str, tmp_path: Path) -> None:
    gpus = "1" if model == "toy" else "2"
    out = tmp_path / "plan.json"
    result = invoke(
        "plan", str(MODELS / f"{model}.py"), "--gpus", gpus, "--size", "tiny", "-b", "8", "-o", str(out), *FAST
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.n_ranks == int(gpus) and plan.model.trace_method == "fx"
    assert plan.stages[-1].end == len(plan.blocks)
    assert f"wrote {out}" in result.output


@pytest.mark.slow
def test_plan_prints_report_and_report_reprints_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = invoke(
        "plan",
        str(MODELS / "gpt.py"),
        "--gpus",
        "2",
        "--size",
        "tiny",
        "-b",
        "8",
        "-o",
        str(out),
        "--repeats",
        "1",
        "--warmup",
        "0",
    )
    assert result.exit_code == 0, result.output
    assert "planner (searched) *" in result.output and "uniform layers (torchtitan/Megatron)" in result.output
    report = invoke("report", str(out))
    assert report.exit_code == 0
    assert "planner (searched) *" in report.output
    assert report.output.strip() in result.output


def test_plan_options_reach_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = invoke(
        "plan",
        str(MODELS / "gpt.py"),
        "--gpus",
        "2",
        "--size",
        "tiny",
        "--set",
        "n_layers=2",
        "-b",
        "12",
        "-m",
        "3",
        "--schedule",
        "gpipe",
        "--method",
        "uniform",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--grad-clip",
        "0",
        "--seed",
        "3",
        "-o",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.model.config["n_layers"] == 2 and [b.name for b in plan.blocks].count("layers.1") == 1
    assert (plan.batch_size, plan.n_microbatches, plan.schedule, plan.method) == (12, 3, "gpipe", "uniform")
    assert (plan.optimizer.name, plan.optimizer.lr, plan.optimizer.grad_clip, plan.model.seed) == ("sgd", 0.1, None, 3)
    # The model path is stored absolute when the plan lives elsewhere, so the plan still works after cd.
    assert Path(plan.model.path).is_absolute()


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "nope.py", "--gpus", "2"], "model file nope.py does not exist"),
        (
            ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "huge"],
            "size 'huge' is not in gpt.py's SIZES; known sizes: tiny",
        ),
        (
            ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "--set", "n_layer=3"],
            "no config key 'n_layer'",
        ),
        (["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "--set", "oops"], "expected key=value"),
        (
            ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "-b", "10", "-m", "4"],
            "does not split into 4 equal microbatches",
        ),
        (
            ["plan", str(MODELS / "toy.py"), "--gpus", "9", "--size", "tiny", "-b", "18"],
            "the model has only 3 blocks (net1, relu, net2); use at most 3",
        ),
        (  # the --gpus typed, not the pipeline ranks left; at most one block per pipeline rank
            ["plan", str(MODELS / "toy.py"), "--gpus", "16", "--dp", "4", "--size", "tiny", "-b", "16"],
            "--gpus 16 --dp 4: 4 pipeline ranks of 4 GPUs each (tensor-parallel ranks x replicas), but the model has "
            "only 3 blocks (net1, relu, net2); use at most --gpus 12",
        ),
        (
            [
                "plan",
                str(MODELS / "gpt.py"),
                "--gpus",
                "4",
                "--size",
                "tiny",
                "-b",
                "8",
                "-m",
                "2",
                "--schedule",
                "1f1b",
            ],
            "1F1B",
        ),
        (
            ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "--schedule", "zbv", "-v", "3"],
            "exactly 2 stages on every rank",
        ),
        (
            ["plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "--schedule", "pipedream"],
            "--schedule pipedream: not a pipeline schedule",
        ),
        (
            [
                "plan",
                str(MODELS / "gpt.py"),
                "--gpus",
                "2",
                "--size",
                "tiny",
                "-b",
                "8",
                "-m",
                "3",
                "--schedule",
                "dualpipev",
            ],
            "does not split into 3 equal microbatches",
        ),
        (
            [
                "plan",
                str(MODELS / "gpt.py"),
                "--gpus",
                "2",
                "--size",
                "tiny",
                "-b",
                "8",
                "-m",
                "2",
                "--schedule",
                "DualPipeV",
            ],
            "needs at least one microbatch per stage (4 stages)",
        ),
        (["report", "missing.json"], "cannot read plan missing.json"),
    ],
)
def test_user_mistakes_are_one_line_errors(
    args: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args + (["-o", "p.json", *FAST] if args[0] == "plan" else []))
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1


@pytest.mark.parametrize(("option", "value"), [("-m", "two"), ("-m", "0"), ("--stages-per-rank", "-1")])
def test_count_or_auto_options_refuse_other_values(option: str, value: str) -> None:
    result = CliRunner().invoke(main, ["plan", str(MODELS / "gpt.py"), "--gpus", "2", option, value])
    assert result.exit_code == 2
    assert "is neither a whole number nor 'auto'" in result.output or "is not a positive number" in result.output
    assert "Traceback" not in result.output


def test_report_rejects_a_damaged_plan(toy_plan: Path, tmp_path: Path) -> None:
    out = edited_copy(toy_plan, lambda raw: raw["stages"][0].update(end=0), tmp_path / "plan.json")
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 2 and "is not a valid plan" in result.output


def test_help_explains_every_option() -> None:
    import click

    for name, command in main.commands.items():
        result = invoke(name, "--help")
        assert result.exit_code == 0 and command.help
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"planner {name} {param.opts[0]} has no help text"
                assert param.opts[0] in result.output


def test_more_threads_than_cores_is_warned_before_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    toy = str(MODELS / "toy.py")
    over = invoke("plan", toy, "--gpus", "2", "--threads", "3", *FAST, "-o", str(tmp_path / "a.json"))
    assert over.exit_code == 0, over.output
    assert over.output.startswith(
        "warning: --threads 3 x --gpus 2 ranks is more than this machine's 4 cores: the profile and the run "
        "oversubscribe them (default: 2)"
    )
    fits = invoke("plan", toy, "--gpus", "2", "--threads", "2", *FAST, "-o", str(tmp_path / "b.json"))
    assert fits.exit_code == 0 and "warning" not in fits.output, fits.output


def test_plan_for_a_gpu_that_is_not_here(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = invoke(
        "plan",
        str(MODELS / "gpt.py"),
        "--gpus",
        "2",
        "--size",
        "tiny",
        "-b",
        "8",
        "--gpu-type",
        "h100",
        "--dtype",
        "bf16",
        "-o",
        str(out),
        "-q",
    )
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert (plan.profile.source, plan.profile.hardware, plan.profile.dtype, plan.profile.backend) == (
        "estimated",
        "h100",
        "bf16",
        "nccl",
    )
    # bf16: 2 bytes per parameter and per boundary value (the chosen microbatch x seq 32 x dim 64)
    assert sum(b.param_bytes for b in plan.blocks) == 2 * sum(b.params for b in plan.blocks)
    assert plan.blocks[0].cut_bytes == plan.microbatch_size * 32 * 64 * 2
    assert all(b.fwd_s > 0 and b.flops_fwd > 0 for b in plan.blocks if b.is_layer)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu-type", "h900"], "h900"),
        (["--gpu-type", "v100", "--dtype", "bf16"], "bf16"),
    ],
)
def test_hardware_mistakes_are_one_line_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(MODELS / "gpt.py"),
            "--gpus",
            "2",
            "--size",
            "tiny",
            "-b",
            "8",
            "-o",
            str(tmp_path / "p.json"),
            *FAST,
            *args,
        ],
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_report_measured_needs_a_run_file(toy_plan: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(toy_plan), "--measured", str(tmp_path / "nope.run.json")])
    assert result.exit_code == 2 and "cannot read run result" in result.output
    blocks = CliRunner().invoke(main, ["report", str(toy_plan), "--blocks"])
    assert blocks.exit_code == 2 and "--blocks compares with a run" in blocks.output


def test_a_run_of_another_plan_is_refused_before_the_report_prints(toy_plan: Path, tmp_path: Path) -> None:
    run = run_report(Plan.load(toy_plan), step_times_s=[0.1, 0.1, 0.1], plan_fingerprint="0123456789abcdef")
    run.save(tmp_path / "other.run.json")
    result = CliRunner().invoke(main, ["report", str(toy_plan), "--measured", str(tmp_path / "other.run.json")])
    assert result.exit_code == 2
    # one line, and no table of the plan before it (the tables used to print, then the error)
    assert result.output.splitlines() == [
        f"error: the run was of a model with fingerprint 0123456789abcdef, the plan is for "
        f"{Plan.load(toy_plan).model.fingerprint}; compare a plan with the run.json `planner run` wrote for it"
    ]


def test_a_picture_format_is_refused_before_the_report_prints(toy_plan: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(toy_plan), "--timeline", str(tmp_path / "step.jpg")])
    assert result.exit_code == 2 and "cannot write a .jpg picture" in result.stderr
    assert result.stdout == ""  # not the whole report first, then the refusal
    assert not (tmp_path / "step.jpg").exists()


def test_one_file_for_both_the_picture_and_the_trace_is_refused(toy_plan: Path, tmp_path: Path) -> None:
    same = tmp_path / "step.png"
    result = CliRunner().invoke(
        main, ["report", str(toy_plan), "--timeline", str(same), "--trace", f"{tmp_path}/./step.png"]
    )
    assert result.exit_code == 2 and result.stdout == "" and not same.exists()
    assert (
        result.stderr.strip().startswith("error: --timeline and --trace both name")
        and "give two files" in result.stderr
    )


def test_the_picture_title_says_what_follows_the_pipeline(toy_plan: Path) -> None:
    from cli import picture_title

    plan = Plan.load(toy_plan)
    step_ms = plan.prediction.step_time_s * 1e3
    title = picture_title(plan, plan.prediction.step_time_s * 0.9)
    assert f"predicted step {step_ms:.1f} ms: the pipeline below, then {step_ms * 0.1:.1f} ms after it" in title
    assert "after it" not in picture_title(plan, plan.prediction.step_time_s)


@pytest.mark.multiprocess
def test_plan_run_report_calibrate_loop(tmp_path: Path) -> None:
    plan_path, run_path = tmp_path / "plan.json", tmp_path / "plan.run.json"
    assert (
        invoke(
            "plan", str(MODELS / "gpt.py"), "--gpus", "2", "--size", "tiny", "-b", "8", "-o", str(plan_path), *FAST
        ).exit_code
        == 0
    )
    result = invoke("run", str(plan_path), "--steps", "4")
    assert result.exit_code == 0, result.output
    assert "measured vs" in result.output and run_path.exists()
    report = invoke("report", str(plan_path), "--measured", str(run_path), "--blocks")
    assert report.exit_code == 0, report.output
    assert "predicted vs measured" in report.output
    assert "every block, profiled vs inside the pipeline" in report.output and " layers.0 " in report.output
    assert any(line.startswith("step ") and line.rstrip().endswith("%") for line in report.output.splitlines())
    # the predicted step drawn over the one the run recorded, and as trace events
    png, trace = tmp_path / "step.png", tmp_path / "step.trace.json"
    drawn = invoke("report", str(plan_path), "--measured", str(run_path), "--timeline", str(png), "--trace", str(trace))
    assert drawn.exit_code == 0, drawn.output
    assert png.read_bytes().startswith(b"\x89PNG")
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}  # predicted and measured
    # an existing picture may be replaced; a model file may not
    again = invoke("report", str(plan_path), "--timeline", str(png))
    assert again.exit_code == 0, again.output
    refused = invoke("report", str(plan_path), "--timeline", str(MODELS / "gpt.py"))
    assert refused.exit_code == 2 and "not a picture" in refused.output
    calibrated = tmp_path / "calibrated.json"
    result = invoke(
        "plan",
        str(MODELS / "gpt.py"),
        "--gpus",
        "2",
        "--size",
        "tiny",
        "-b",
        "8",
        "-o",
        str(calibrated),
        "--calibrate",
        str(run_path),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    from planner.schema.result import RunResult

    run, old, new = RunResult.load(run_path), Plan.load(plan_path), Plan.load(calibrated)
    # the plan records what the calibration changed, block by block, and the report prints it
    assert new.calibration[0].endswith("timed inside their stage, the rest by their stage's factors)")
    assert "calibrated: " in invoke("report", str(calibrated)).output
    # Re-planned on the costs the run was measured against, corrected by it, the measured split
    # now predicts the measured step time.
    assert new.link.name.endswith("+calibrated")
    from planner.core.split.cuts import Split
    from planner.core.step.predict import plan_layout, predict, slots_of

    layout = plan_layout(old)
    _, again = predict(
        new.blocks, Split(starts=old.prediction.starts), new.link, layout, old.optimizer, slots_of(new.profile)
    )
    assert again.step_time_s == pytest.approx(run.median_step_s, rel=0.02)


def _write_model(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_model.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build_model(**config):\n    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))\n\n" + body
    )
    return path


@pytest.mark.parametrize(
    "body, message",
    [
        # a target the default cross-entropy cannot use: the default named, and how to give another
        (
            "def make_batch(batch_size, **config):\n    return (torch.randn(batch_size, 4),), torch.randn(batch_size, 7)\n",
            "user_model.py defines no loss_fn, and the default (cross-entropy",
        ),
        (
            "def make_batch(batch_size, **config):\n    return (torch.randn(batch_size, 4),), [1, 2]\n",
            "must return a pair (inputs, target_tensor), the inputs a tuple or a dict of keyword inputs; got (tuple, list)",
        ),
        (
            "def make_batch(batch_size, **config):\n    return {'x': torch.randn(batch_size, 4), 'y': torch.randn(batch_size, 2)}\n",
            "got dict (the whole batch as one dict: give the target apart)",
        ),
        (
            "def make_batch(batch_size, **config):\n    return (torch.randn(batch_size, 5),), torch.zeros(batch_size, dtype=torch.long)\n",
            "user_model.py: forward() raised RuntimeError",
        ),
        (
            "def make_batch(batch_size, **config):\n    return (torch.randn(batch_size, 4),), torch.zeros(batch_size, dtype=torch.long)\n"
            "def loss_fn(output, target):\n    return output.sum(dim=1)\n",
            "loss_fn() returned (2,); expected a scalar tensor",
        ),  # microbatch 8 / 4 = 2
    ],
)
def test_model_file_mistakes_found_before_profiling(body: str, message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["plan", str(_write_model(tmp_path, body)), "--gpus", "2", "-b", "8", "-o", str(tmp_path / "p.json"), *FAST],
    )
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_unwritable_output_is_one_line(toy_plan: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(MODELS / "toy.py"),
            "--gpus",
            "2",
            "--size",
            "tiny",
            "-b",
            "4",
            "-o",
            str(tmp_path / "missing" / "p.json"),
            *FAST,
        ],
    )
    assert result.exit_code == 2 and "folder" in result.output and "does not exist" in result.output
    result = CliRunner().invoke(main, ["run", str(toy_plan), "-o", str(tmp_path / "missing" / "r.json")])
    assert result.exit_code == 2 and "does not exist" in result.output  # refused before any training


def test_plan_with_a_stage_past_the_last_block_is_rejected(toy_plan: Path, tmp_path: Path) -> None:
    out = edited_copy(toy_plan, lambda raw: raw["stages"][1].update(end=99), tmp_path / "plan.json")
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 2 and "within the 3 blocks" in result.output


@pytest.mark.slow
def test_baseline_over_the_memory_limit_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(MODELS / "gpt.py"),
            "--gpus",
            "2",
            "--size",
            "tiny",
            "-b",
            "8",
            "--method",
            "uniform",
            "--memory-limit",
            "0.001",
            "-o",
            str(tmp_path / "p.json"),
            *FAST,
        ],
    )
    assert result.exit_code == 2, result.output
    assert "the uniform split needs" in result.output and "use --method optimal" in result.output


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_works_before_and_after_the_subcommand(where: str, tmp_path: Path) -> None:
    """`planner plan ... --debug` is where users put it (the one-line errors suggest --debug)."""
    from planner.errors import ModelFileError

    args = ["plan", str(tmp_path / "missing.py"), "--gpus", "2"]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    result = CliRunner().invoke(main, args)
    assert isinstance(result.exception, ModelFileError)  # the traceback, not the one line
    plain = CliRunner().invoke(main, ["plan", str(tmp_path / "missing.py"), "--gpus", "2"])
    assert plain.exit_code == 2 and plain.output.startswith("error: model file")


def test_an_estimated_plan_is_left_to_the_exit_only_by_the_console_script(tmp_path: Path) -> None:
    """``planner plan --gpu-type`` in the console script freezes what it built instead of collecting
    it before the process ends (planner.core.heap.kept_until_exit); ``main`` called in a process that
    goes on (this test's, a user's script) leaves the collector as it was."""
    import gc
    import subprocess
    import sys

    args = ["plan", str(ROOT / "models" / "toy.py"), "--gpus", "2", "--gpu-type", "h100", "-q"]
    before = gc.get_freeze_count()
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert gc.get_freeze_count() == before and gc.isenabled()
    script = (  # counted as the command ends, before the exit's own freeze (atexit) runs
        "import gc, sys\n"
        "import cli\n"
        "try:\n"
        "    cli.console()\n"
        "finally:\n"
        "    print('frozen', gc.get_freeze_count(), file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *args, "-o", str(tmp_path / "b.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    frozen = int(done.stderr.split("frozen")[-1].split()[0])
    assert frozen > 10_000  # the plan's objects, all of them frozen
    assert Plan.load(tmp_path / "b.json").model_dump(exclude={"created"}) == Plan.load(tmp_path / "a.json").model_dump(
        exclude={"created"}
    )


def test_a_batch_norm_model_split_into_microbatches_is_told_it_does_not_train_as_unsplit(tmp_path: Path) -> None:
    path = tmp_path / "bn_model.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build_model(**config):\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.GroupNorm(2, 4), nn.Linear(4, 3))\n\n"
        "def make_batch(batch_size, **config):\n"
        "    return (torch.randn(batch_size, 4),), torch.randint(0, 3, (batch_size,))\n"
    )
    out = tmp_path / "p.json"
    result = invoke(
        "plan", str(path), "--gpus", "2", "-b", "8", "-m", "2", "--schedule", "gpipe", "-o", str(out), *FAST
    )
    assert result.exit_code == 0, result.output
    # the one batch norm named (GroupNorm normalizes each sample alone: not counted)
    assert Plan.load(out).model.batch_norms == ["1"]
    assert (
        "note: 1 batch-norm layer (1) normalizes each microbatch by its own statistics: with 2 microbatches of 4"
        in result.output
    )
    whole = invoke("plan", str(path), "--gpus", "2", "-b", "8", "-m", "1", "--schedule", "gpipe", "-o", str(out), *FAST)
    assert whole.exit_code == 0 and "batch-norm" not in whole.output
