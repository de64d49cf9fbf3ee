"""Tier 2 (CPU torch, in this process): every ``planner`` command over drawn options (issue 66, part 1).

hypothesis draws command lines for ``plan``, ``run``, ``report``, ``export`` and ``export-weights``:
each of the command's options (read from click, so a new option is drawn too), with a value of its
type, a value at or past its bounds, or junk; the files come from a workspace that holds a real
model file, a plan of one rank and one of two, the one-rank plan's checkpoint and run.json, a TOML
job file, a text to train on, the user's own notes, junk, a folder and a name that does not exist.
Every command line must

- end with exit 0 or 2: never an internal error (1) or a traceback;
- on exit 2, say one line on stderr, starting "error: ";
- leave every file of the workspace as it was but the outputs it names (``-o``/``--output``,
  ``--timeline``, ``--trace``, ``--checkpoint-dir``, or their defaults); on exit 2, every file.

Everything runs for real in this process (profiling, the search, a one-rank plan's training and
checkpoints, reports, exports) but two waits on other processes: starting the two-rank plan's ranks
(``planner.run.launch._launch``) and waiting for another node's rendezvous store
(``_wait_for_store``). Reaching either ends the example as "would start ranks"; what happens after
is tested by tests/test_run*.py and tests/test_faults.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cli import main
from planner.errors import PlannerError

ROOT = Path(__file__).resolve().parents[1]
# examples per command in `make test`; PLANNER_CLI_EXAMPLES=2000 searches longer
EXAMPLES = int(os.environ.get("PLANNER_CLI_EXAMPLES", "60"))
COMMANDS = ["plan", "run", "report", "export", "export-weights"]
# options whose value is a file or folder the command writes
OUTPUT_OPTIONS = ("output", "timeline", "trace", "checkpoint_dir")
# the files a drawn path may name, relative to the workspace (the command runs there)
PATHS = [
    "model.py",
    "plan1.json",
    "plan2.json",
    "plan1.run.json",
    "plan1.ckpt",
    "plan1.ckpt/step_00000003",
    "job.toml",
    "data.txt",
    "notes.txt",
    "junk.json",
    "folder",
    "missing.json",
    "new.json",
    "out.png",
    "missing/new.json",
]
TARGETS = {
    "plan": ["model.py"] * 8 + ["raising.py", "plan1.json", "junk.json", "folder", "missing.py"],
    "run": ["plan1.json"] * 3 + ["plan2.json"] * 3 + ["model.py", "junk.json", "missing.json"],
    "report": ["plan1.json", "plan2.json", "plan2.json", "plan1.run.json", "junk.json", "missing.json"],
    "export": ["plan1.json", "plan2.json", "plan2.json", "model.py", "junk.json", "missing.json"],
    "export-weights": ["plan1.json", "plan1.json", "plan2.json", "plan1.ckpt", "junk.json", "missing.json"],
}
# what a user might give each option, by (command, option) or option: mostly sound values, and the
# ones a user gets wrong within the option's type; any option also draws junk now and then
GOOD: dict[str, list[str]] = {
    "size": ["tiny", "huge", ""],
    "gpus": ["1", "2", "4"],
    "gpu_type": ["h100", "a100-80g", "v100", "no-such", "junk.json", "missing.json"],
    "gpus_per_node": ["1", "2", "8"],
    "seed": ["0", "1"],
    "threads": ["1", "2"],
    "batch_size": ["4", "8", "16", "6"],
    "lr": ["0.001", "0.1"],
    "grad_clip": ["1", "0.5"],
    "dp": ["auto", "1", "2"],
    "tp": ["auto", "1", "2"],
    "stages_per_rank": ["auto", "1", "2"],
    "microbatches": ["auto", "1", "2", "4"],
    "accumulation": ["auto", "1", "2"],
    "dp_shard": ["auto", "2"],
    "memory_limit": ["0.0001", "1", "80"],
    "repeats": ["1", "2"],
    "plan.warmup": ["0", "1"],
    "schedule": ["auto", "gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev", "looped-bfs", "no-such"],
    "compare": ["2,1", "1,2", "Et|ttL", "Ett|tL", "Et**2|t*2L", "parts:0,2,5", "parts:0,x", "3", "job.toml"],
    "attention_kernel": ["auto", "flash", "math", "no-such"],
    "calibrate": ["plan1.run.json", "junk.json"],
    "config": ["job.toml", "junk.json", "missing.toml", "folder"],
    "overrides": ["d=8", "vocab=16", "seq=4", "unknown=1", "=1", "d", "d=-1", "d=" + "9" * 5000],
    "plan.output": ["new.json", "plan1.json", "plan2.json", "notes.txt"],
    "steps": ["1", "2", "3", "5"],
    "run.output": ["new.run.json", "plan1.run.json", "notes.txt"],
    "data": ["data.txt", "folder", "notes.txt"],
    "eval_every": ["0", "1", "2"],
    "eval_fraction": ["0.1", "0.5"],
    "eval_batches": ["0", "1"],
    "run.warmup": ["0", "2"],
    "checkpoint_dir": ["plan1.ckpt", "new.ckpt", "folder"],
    "checkpoint_every": ["0", "1", "2"],
    "nnodes": ["1", "2"],
    "node_rank": ["0", "1"],
    "timeout": ["5", "30", "300"],
    "rdzv_endpoint": ["localhost:0", "127.0.0.1:29531", "localhost:99999", "no-such-host.invalid:29500", "x"],
    "rdzv_id": ["a", "", "run-1"],
    "measured": ["plan1.run.json", "junk.json"],
    "timeline": ["out.png", "out.svg", "out.jpg"],
    "trace": ["trace.json", "notes.txt"],
    "rename": ["layers=blocks", "emb=embed", "layers.0=head", "x=y=z", "=y", "nothing"],
    "export.output": ["out.py", "out.toml", "out.csv", "new.json", "plan1.json"],
    "checkpoint": ["plan1.ckpt", "plan1.ckpt/step_00000003", "folder"],
    "export-weights.output": ["weights.pt", "new.json", "plan1.json"],
}
JUNK = st.sampled_from(["", "-1", "0", "nan", "inf", "1e308", "9" * 30, "--gpus", "auto", "\t", "ü"]) | st.text(
    max_size=8
).filter(lambda s: "\x00" not in s)


class WouldStartRanks(BaseException):
    """Raised where the command would start processes or wait for another node (a BaseException, so
    no ``except Exception`` of the planner's catches it)."""


def _would_start(*_: Any, **__: Any) -> None:
    raise WouldStartRanks


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workspace every example starts from (copied afresh for each)."""
    d = tmp_path_factory.mktemp("cli_template")
    shutil.copy(ROOT / "tests" / "fixtures" / "dies_at.py", d / "model.py")  # tied weights; dies only when asked
    with contextlib.chdir(d):
        fast = ["-q", "--repeats", "1", "--warmup", "0", "--batch-size", "8"]
        for gpus in ("1", "2"):
            planned = _invoke("plan", "model.py", "--gpus", gpus, *fast, "-o", f"plan{gpus}.json")
            assert planned.exit_code == 0, planned.output
        ran = _invoke("run", "plan1.json", "--steps", "3")
        assert ran.exit_code == 0, ran.output
    (d / "job.toml").write_text("gpus = 2\nbatch-size = 8\nrepeats = 1\n")
    (d / "data.txt").write_text("a bad cab faced a dead bee; " * 200)
    (d / "notes.txt").write_text("the user's own notes\n")
    (d / "raising.py").write_text(  # fails in build_model, after every option was read
        "def build_model(**_):\n    raise RuntimeError('never built')\n\n\ndef make_batch(n, **_):\n    return None\n"
    )
    (d / "junk.json").write_bytes(b"\xff not json {")
    (d / "folder").mkdir()
    (d / "folder" / "keep.txt").write_text("kept\n")
    return d


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder``: its content's digest, or "folder"."""
    return {
        str(p.relative_to(folder)): "folder" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
    }


def _named_outputs(command: str, args: list[str], folder: Path) -> list[Path]:
    """The outputs a command line names (its output options, or their defaults), resolved in ``folder``."""
    cmd = main.commands[command]  # type: ignore[attr-defined]
    with contextlib.chdir(folder):
        try:
            ctx = cmd.make_context(command, list(args), resilient_parsing=True)
        except (click.ClickException, click.exceptions.Exit):
            return []
        params = ctx.params
        named = [Path(str(params[k])) for k in OUTPUT_OPTIONS if params.get(k)]
        target = params.get("plan_file")
        if command == "run" and target:
            if not params.get("output"):
                named.append(Path(target).with_suffix(".run.json"))
            if not params.get("checkpoint_dir"):
                named.append(Path(target).with_suffix(".ckpt"))
        return [(folder / p).resolve() for p in named]


def _changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def _option_values(command: str, option: click.Option, data: st.DataObject) -> list[str]:
    """What follows ``option`` on a drawn command line: mostly a value from ``GOOD`` (or of its
    type), else junk or a path of the workspace."""
    if option.is_flag:
        return []
    name = str(option.name)
    good = GOOD.get(f"{command}.{name}", GOOD.get(name))
    if good is None:
        kind = option.type
        good = [str(c) for c in kind.choices] if isinstance(kind, click.Choice) else PATHS
    if data.draw(st.integers(0, 6)):
        return [data.draw(st.sampled_from(good))]
    return [data.draw(JUNK | st.sampled_from(PATHS))]


def _command_line(command: str, data: st.DataObject) -> list[str]:
    """``COMMAND TARGET [--option value | --flag]...``: the required options usually given, ``plan``'s
    profile short."""
    args = [data.draw(st.sampled_from(TARGETS[command]), label="target")]
    options = [p for p in main.commands[command].params if isinstance(p, click.Option) and p.name != "debug"]  # type: ignore[attr-defined]
    for option in options:
        if (option.required or option.name == "gpus") and data.draw(st.integers(0, 9)):
            args += [option.opts[0], *_option_values(command, option, data)]
    if command == "plan":
        args += ["--repeats", "1", "--warmup", "0"]  # profiling time, not what is tested (both are drawn too)
    for _ in range(data.draw(st.integers(0, 5))):
        option = data.draw(st.sampled_from(options))
        if option.name == "help" and data.draw(st.integers(0, 4)):
            continue  # --help ends the line at once: drawn less often
        value = _option_values(command, option, data)
        if option.name == "gpu_type" and value and value[0].strip().lower() == "cpu":
            value = ["h100"]  # `--gpu-type cpu` benchmarks this machine for seconds (and caches it in ~/.cache)
        args += [data.draw(st.sampled_from(option.opts)), *value]
    return args


@contextlib.contextmanager
def _ranks_not_started() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("planner.run.launch._launch", _would_start)
        patch.setattr("planner.run.launch._wait_for_store", _would_start)
        yield


@pytest.mark.parametrize("command", COMMANDS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_command_line_is_a_result_or_one_line_and_touches_only_its_outputs(
    template: Path, tmp_path: Path, command: str, data: st.DataObject
) -> None:
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    args = _command_line(command, data)
    data.draw(st.just(args), label="args")
    before = _snapshot(work)
    with contextlib.chdir(work), _ranks_not_started():
        try:
            result: Result | None = CliRunner().invoke(main, [command, *args], catch_exceptions=False)
        except WouldStartRanks:
            result = None
    changed = _changed(before, _snapshot(work))
    if result is None:
        event(f"{command}: would start ranks")
        code = 0
    else:
        code = result.exit_code
        event(f"{command} exit {code}: {result.stderr.strip().partition(':')[2][:24]}")
        assert code in (0, 2), (args, code, result.output)
        if code == 2:
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
            assert not changed, (args, sorted(changed), lines)
    outputs = _named_outputs(command, args, work)
    stray = [
        c for c in changed if not any((work / c).resolve() == o or o in (work / c).resolve().parents for o in outputs)
    ]
    assert not stray, (args, code, sorted(stray), [str(o) for o in outputs])


def test_the_workspace_plans_run_and_export_as_the_examples_assume(template: Path) -> None:
    # the drawn lines reach past the file checks only if these work: a failure here is the fixture's
    with contextlib.chdir(template):
        assert _invoke("report", "plan2.json").exit_code == 0
        assert _invoke("export", "plan2.json", "--to", "megatron").exit_code == 0
        weights = _invoke("export-weights", "plan1.json", "-o", "../weights.pt")
    assert weights.exit_code == 0, weights.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["plan", "--no-such-option"], "error: No such option '--no-such-option' (see 'planner plan --help')"),
        (["plan"], "error: Missing argument 'MODEL_FILE' (see 'planner plan --help')"),
        (["no-such-command"], "error: No such command 'no-such-command' (see 'planner --help')"),
        (["--no-such-option"], "error: No such option '--no-such-option' (see 'planner --help')"),
        (["run", "plan.json", "--steps", "0"], "error: Invalid value for '--steps': 0 is not in the range x>=1."),
        (["export", "plan.json", "--to", "x"], "error: Invalid value for '--to': 'x' is not one of 'torchtitan'"),
    ],
)
def test_a_usage_mistake_is_one_line(args: list[str], said: str) -> None:
    # was: click's usage line, a hint and "Error: ..." on four lines
    result = CliRunner().invoke(main, args, prog_name="planner")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(said)


def test_the_group_alone_still_shows_its_help() -> None:
    result = CliRunner().invoke(main, [])
    assert "Commands:" in result.output and "plan" in result.output


def test_regression_cli_seed_out_of_range(tmp_path: Path) -> None:
    # Was: RuntimeError: Overflow when unpacking long (torch.manual_seed), an internal error, status 1.
    model = tmp_path / "model.py"
    model.write_text(
        "def build_model(**_):\n    raise RuntimeError('never built')\n\ndef make_batch(n, **_):\n    return None\n"
    )
    args = ["plan", str(model), "-g", "1", "--seed", "100000000000000000000000", "-o", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, args, catch_exceptions=True)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert result.output.strip().startswith("error: --seed 100000000000000000000000: Input should be less than")
    assert len(result.output.strip().splitlines()) == 1


def test_regression_cli_unknown_home_directory(tmp_path: Path) -> None:
    # Was: RuntimeError: Could not determine home directory (Path.expanduser), an internal error, status 1.
    args = ["plan", "~planner_no_such_user_xyz/model.py", "-g", "1", "-o", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, args, catch_exceptions=True)
    assert result.exit_code == 2, result.output
    assert "error: model file ~planner_no_such_user_xyz/model.py cannot be found" in result.output


def test_debug_reraises_the_domain_error_for_its_traceback(tmp_path: Path) -> None:
    # --debug is the one way to a traceback, by design: the error is the domain's, not an internal one
    result = CliRunner().invoke(main, ["--debug", "report", str(tmp_path / "missing.json")], catch_exceptions=True)
    assert isinstance(result.exception, PlannerError)


def test_regression_a_control_character_in_a_path_stays_in_the_one_line(template: Path, tmp_path: Path) -> None:
    # found by the property test: a record separator (\x1e) in --checkpoint broke the error in two
    # lines (str.splitlines, like a terminal, breaks there); messages escape what is not printable
    args = ["export-weights", str(template / "plan1.json"), "-o", str(tmp_path / "w.pt"), "--checkpoint", "\x1e"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "\\x1e" in result.stderr
