"""Tier 2: `planner plan --help` in headed groups, TOML job files (`--config`), and the job file
`planner report --config` prints, which must make the same plan again."""

from __future__ import annotations

import math
import re
from pathlib import Path

import click
import pytest
import tomllib
from click.testing import CliRunner, Result

from cli import main
from cli_groups import GroupedOption
from cli_jobfile import toml_key, toml_value
from cli_plan_options import PLAN_GROUPS
from planner.schema.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
FAST = ["--repeats", "1", "--warmup", "0", "-q"]
RUN_GROUPS = ("Run", "Data and evaluation", "Learning rate", "Checkpoints", "Nodes")


def invoke(*args: str) -> Result:
    # 80 columns, as a terminal or a pipe gives by default, whatever COLUMNS the test runs under
    return CliRunner().invoke(main, list(args), terminal_width=80)


def _sections(help_text: str) -> list[tuple[str, list[str]]]:
    """The help's sections in order: (heading, the long option names of each option line under it)."""
    sections: list[tuple[str, list[str]]] = []
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":") and not line.startswith("Usage"):
            sections.append((line[:-1], []))
        elif line.startswith("  -") and sections:
            first_column = re.split(r"\s{2,}", line.strip())[0]
            # "-g, --gpus N" -> --gpus; "--sequence-parallel / --no-sequence-parallel" -> --sequence-parallel
            sections[-1][1].append(re.findall(r"--[a-z][a-z-]*", first_column)[0])
    return sections


@pytest.mark.parametrize(("name", "groups"), [("plan", PLAN_GROUPS), ("run", RUN_GROUPS)])
def test_help_lists_every_option_once_under_its_group(name: str, groups: tuple[str, ...]) -> None:
    result = invoke(name, "--help")
    assert result.exit_code == 0, result.output
    sections = _sections(result.output)
    assert tuple(title for title, _ in sections) == groups
    listed = [(title, option) for title, options in sections for option in options]
    command = main.commands[name]
    expected = []
    for param in command.params:
        if isinstance(param, click.Option):
            group = param.group if isinstance(param, GroupedOption) and param.group else groups[-1]
            expected.append((group, max(param.opts, key=len)))
    expected.append((groups[-1], "--help"))
    assert sorted(listed) == sorted(expected)
    assert len({option for _, option in listed}) == len(listed)  # each once


def test_plan_help_fits_on_a_few_screens() -> None:
    lines = invoke("plan", "--help").output.splitlines()
    assert len(lines) < 100, len(lines)  # 267 lines before the groups; 95 with them
    assert max(len(line) for line in lines) <= 80


def _job(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.slow
def test_job_file_values_are_used_and_the_command_line_wins(tmp_path: Path) -> None:
    job = _job(
        tmp_path,
        f'model-file = "{MODELS / "gpt.py"}"\nsize = "tiny"\ngpus = 2\nbatch-size = 8\nschedule = "gpipe"\n'
        f'repeats = 1\nwarmup = 0\nquiet = true\noutput = "{tmp_path / "from_file.json"}"\n'
        "seed = 3\n[set]\nn_layers = 2\n",
    )
    out = tmp_path / "plan.json"
    result = invoke("plan", "--config", str(job), "-b", "12", "--set", "seq_len=16", "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)  # -o won over the file's output
    assert not (tmp_path / "from_file.json").exists()
    assert (plan.batch_size, plan.schedule, plan.model.seed, plan.profile.repeats) == (12, "gpipe", 3, 1)
    # --set adds to the file's table: both entries reach the model
    assert (plan.model.config["n_layers"], plan.model.config["seq_len"]) == (2, 16)


def _params(*args: str) -> dict[str, object]:
    """The values ``planner plan ARGS`` would run with (the job file read, nothing planned)."""
    with main.commands["plan"].make_context("plan", list(args)) as ctx:
        return ctx.params


def test_command_line_wins_over_the_job_file(tmp_path: Path) -> None:
    job = _job(tmp_path, 'model-file = "m.py"\ngpus = 4\nbatch-size = 16\ndp = "auto"\nsequence-parallel = false\n')
    assert _params("--config", str(job)) == {
        **_params("m.py", "--gpus", "4", "-b", "16", "--dp", "auto", "--no-sequence-parallel"),
    }
    mixed = _params("other.py", "-b", "8", "--config", str(job), "--sequence-parallel")
    assert (mixed["model_file"], mixed["gpus"], mixed["batch_size"], mixed["dp"], mixed["sequence_parallel"]) == (
        "other.py",
        4,
        8,
        "auto",
        True,
    )


def test_set_entries_add_to_the_job_file_and_win_per_key(tmp_path: Path) -> None:
    as_list = _job(tmp_path, 'gpus = 2\nset = ["n_layers=2", "dim=8"]\n', "list.toml")
    as_table = _job(tmp_path, 'gpus = 2\n[set]\nn_layers = 2\ndim = 8\nname = "x"\n', "table.toml")
    assert _params("m.py", "--config", str(as_list))["overrides"] == ("n_layers=2", "dim=8")
    assert _params("m.py", "--config", str(as_table))["overrides"] == ("n_layers=2", "dim=8", 'name="x"')
    merged = _params("m.py", "--config", str(as_list), "--set", "dim=16")["overrides"]
    assert merged == ("n_layers=2", "dim=8", "dim=16")  # parse_overrides keeps the last of a key


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus = 2\nbatch_size = 8\n", "unknown key 'batch_size'; did you mean 'batch-size'?"),
        ("gpus = 2\nzzz = 1\n", "unknown key 'zzz' (the nearest is"),
        ("gpus = 2\nbatch-size = \n", "not valid TOML: Invalid value (at line 2, column 14)"),
        ('gpus = "four"\n', 'gpus = "four": expected a whole number'),
        ("gpus = 2.5\n", "gpus = 2.5: expected a whole number"),
        ("gpus = 0\n", "gpus = 0: 0 is not in the range x>=1."),
        ('method = "best"\n', "method = \"best\": 'best' is not one of 'optimal', 'uniform', 'params', 'given'."),
        ('quiet = "yes"\n', 'quiet = "yes": expected true or false'),
        ("set = 3\n", 'set = 3: expected a table (set = { n_layers = 4 }) or a list of "KEY=VALUE" strings'),
        ("size = [1, 2]\n", "size = [1, 2]: expected a single string or number"),
        ('microbatches = "many"\n', "microbatches = \"many\": 'many' is neither a whole number nor 'auto'"),
        ('moe-imbalance = "lots"\n', "moe-imbalance = \"lots\": 'lots' is neither a number nor 'auto'"),
        ('config = "other.toml"\n', "config: a job file cannot name another"),
    ],
)
def test_job_file_mistakes_are_one_line(text: str, message: str, tmp_path: Path) -> None:
    job = _job(tmp_path, text)
    result = invoke("plan", "--config", str(job), str(MODELS / "toy.py"))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: --config {job}: {message}"] or (len(lines) == 1 and message in lines[0]), lines
    assert "Traceback" not in result.output


@pytest.mark.parametrize("what", ["missing", "folder"])
def test_a_job_file_that_is_not_a_file_is_one_line(what: str, tmp_path: Path) -> None:
    path = tmp_path / "nope.toml" if what == "missing" else tmp_path
    result = invoke("plan", "--config", str(path))
    assert result.exit_code == 2
    expected = "no such file" if what == "missing" else "is a folder"
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"error: --config {path}")
    assert expected in result.stderr


def test_toml_values_read_back_as_written() -> None:
    values = {
        "text": 'quote " backslash \\ tab \t newline \n del \x7f bell \x07 unicode é',
        "n": -3,
        "x": 0.1,
        "big": 1e300,
        "flag": False,
        "items": [1, "a", [2.5]],
        "table": {"plain": 1, "needs quotes": {"deep": True}, "": "empty key"},
    }
    text = "\n".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items())
    assert tomllib.loads(text) == values
    assert math.isinf(tomllib.loads(f"x = {toml_value(float('-inf'))}")["x"])
    with pytest.raises(TypeError):
        toml_value(None)


def _layout(plan: Plan) -> tuple[object, ...]:
    return (
        plan.schedule,
        plan.n_microbatches,
        plan.n_stages // plan.n_ranks,
        plan.accumulation,
        tuple(s.start for s in plan.stages),
        plan.dp,
        plan.dp_mode,
        plan.tp,
        tuple(s.recompute for s in plan.stages),
        plan.batch_size,
        plan.world_size,
    )


@pytest.mark.slow
def test_report_config_makes_an_expert_parallel_plan_again(tmp_path: Path) -> None:
    # the degree and the imbalance given are in the job file: the replay shards and charges the same
    pytest.importorskip("transformers")
    first = tmp_path / "first.json"
    args = ["--size", "tiny", "--gpus", "4", "--dp", "2", "--ep", "2", "--moe-imbalance", "1.3", "--gpu-type", "h100"]
    made = invoke("plan", str(MODELS / "hf" / "mixtral.py"), *args, "-b", "8", "-o", str(first), *FAST)
    assert made.exit_code == 0, made.output
    report = invoke("report", str(first), "--config")
    table = tomllib.loads(report.output)
    assert (table["ep"], table["moe-imbalance"]) == (2, 1.3)
    remade = invoke("plan", "--config", str(_job(tmp_path, report.output)), "-o", str(tmp_path / "again.json"))
    assert remade.exit_code == 0, remade.output
    original, replayed = Plan.load(first), Plan.load(tmp_path / "again.json")
    assert (replayed.ep, replayed.moe_imbalance) == (2, 1.3) and _layout(replayed) == _layout(original)
    assert [b.experts for b in replayed.blocks] == [b.experts for b in original.blocks]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "2"],  # everything searched
        ["--gpus", "4", "--dp", "2", "--dp-mode", "fsdp", "--schedule", "1f1b", "--recompute", "full"],
    ],
    ids=["searched", "fsdp-1f1b-full"],
)
def test_report_config_makes_the_same_plan_again(args: list[str], tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    made = invoke("plan", str(MODELS / "gpt.py"), "--size", "tiny", "-b", "8", *args, "-o", str(first), *FAST)
    assert made.exit_code == 0, made.output
    report = invoke("report", str(first), "--config")
    assert report.exit_code == 0, report.output
    table = tomllib.loads(report.output)
    assert table["output"] == str(first) and table["method"] == "given"
    job = _job(tmp_path, report.output)
    again = tmp_path / "again.json"
    remade = invoke("plan", "--config", str(job), "-o", str(again))
    assert remade.exit_code == 0, remade.output
    original, replayed = Plan.load(first), Plan.load(again)
    assert _layout(replayed) == _layout(original)
    assert (replayed.model.config, replayed.model.seed) == (original.model.config, original.model.seed)
    assert replayed.optimizer == original.optimizer
    both = invoke("report", str(first), "--config", "--timeline", str(tmp_path / "t.png"))
    assert both.exit_code == 2 and "--config prints the job file only" in both.stderr


@pytest.mark.slow
def test_report_config_makes_an_fp8_plan_again(tmp_path: Path) -> None:
    # the plan records bf16 as its dtype (what computes around the float8 layers): the job file asks for fp8
    pytest.importorskip("torchao")
    first = tmp_path / "first.json"
    args = ["--gpus", "2", "--gpu-type", "h100", "--dtype", "fp8-rowwise", "-b", "8", "--set", "dim=4096"]
    made = invoke("plan", str(MODELS / "llama.py"), "--size", "tiny", *args, "-o", str(first), "-q")
    assert made.exit_code == 0, made.output
    report = invoke("report", str(first), "--config")
    assert tomllib.loads(report.output)["dtype"] == "fp8-rowwise"
    again = tmp_path / "again.json"
    remade = invoke("plan", "--config", str(_job(tmp_path, report.output)), "-o", str(again))
    assert remade.exit_code == 0, remade.output
    original, replayed = Plan.load(first), Plan.load(again)
    f8, again8 = original.profile.float8, replayed.profile.float8
    assert f8 is not None and again8 is not None and _layout(replayed) == _layout(original)
    assert (again8.recipe, again8.converted, again8.kept) == (f8.recipe, f8.converted, f8.kept)
    # (the given layout's costs and prediction come within 0.1 % of the searched plan's, its bf16 figure alike)
    assert again8.bf16_step_s == pytest.approx(f8.bf16_step_s, rel=1e-2)


def test_report_config_makes_a_context_parallel_plan_again(tmp_path: Path) -> None:
    # the degree and the attention's method travel in the job file (the degree used to be dropped)
    first = tmp_path / "first.json"
    args = ["--gpus", "4", "--gpu-type", "h100", "--cp", "2", "--dp", "1", "-b", "8", "--set", "seq_len=4096"]
    made = invoke("plan", str(MODELS / "llama.py"), "--size", "tiny", *args, "-o", str(first), "-q")
    assert made.exit_code == 0, made.output
    report = invoke("report", str(first), "--config")
    job = tomllib.loads(report.output)
    original = Plan.load(first)
    assert (job["cp"], job["cp-attention"]) == (2, original.cp_attention)
    again = tmp_path / "again.json"
    remade = invoke("plan", "--config", str(_job(tmp_path, report.output)), "-o", str(again))
    assert remade.exit_code == 0, remade.output
    replayed = Plan.load(again)
    assert (replayed.cp, replayed.cp_attention) == (2, original.cp_attention)
    assert _layout(replayed) == _layout(original)
