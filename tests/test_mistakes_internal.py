"""Tier 2: mistakes that were internal errors (issue 66): each a one-line refusal (exit 2) or a working command.

- ``export-weights -o`` onto an existing file (``KeyError: 'weights'``): its own earlier output is
  replaced, any other file refused untouched, as ``check_output`` treats every output kind.
- ``--memory-limit`` that rounds to 0 bytes (``ZeroDivisionError`` in the search) or past an
  exbibyte (a bound with no unit): refused up front in GiB; a 0-byte limit given to the pure core
  ends in "no layout fits", and the report's table of a plan with one shows no division.
- ``run --timeout 0.01``: refused up front (it launched the ranks, leaked c10d warnings and blamed a
  rank on another node of a one-node run).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from run_factory import plan_with_starts, saved

from cli import main
from planner.core.layout.inputs import Cluster, Constraints, Scaling, SearchSpace
from planner.core.layout.search import search
from planner.errors import InfeasibleError, PlannerError
from planner.report.tables import summary_table
from planner.schema.request import PlanRequest
from planner.schema.run_request import RunRequest
from tests.plan_factory import ADAMW, LINK, block, plan_of_blocks

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
FIXTURES = ROOT / "tests" / "fixtures"
BLOCKS = [block("embed", 1, 2, 1000, layer=False)] + [block(f"layers.{i}", 10, 20, 5000) for i in range(4)]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def refused(result: Result, *parts: str) -> str:
    """The one ``error:`` line of a refused command (exit 2), checked to name every part."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "internal error" not in lines[0] and "Traceback" not in result.output
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


# --- export-weights -o onto an existing file ---------------------------------------------------


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plan of tests/fixtures/dies_at.py and, in its default checkpoint folder, a checkpoint of
    step 1 holding the model's initial weights, written in this process as `planner run` keys it."""
    import torch.distributed.checkpoint as dcp

    from planner.run.checkpoint import META_FILE, step_dir
    from planner.run.model import load_plan_model

    folder = tmp_path_factory.mktemp("weights")
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], n_microbatches=2)
    path = saved(plan, folder)
    model = load_plan_model(plan, path).build(plan.model.seed)
    ckpt = step_dir(path.with_suffix(".ckpt"), 1)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / META_FILE).write_text(json.dumps({"step": 1, "plan_fingerprint": plan.model.fingerprint}))
    return path


def test_export_weights_replaces_its_own_earlier_output(checkpointed: Path, tmp_path: Path) -> None:
    import torch

    out = tmp_path / "model.pt"
    for _ in range(2):  # the second writes over the first's state dict (was KeyError: 'weights')
        result = invoke("export-weights", str(checkpointed), "-o", str(out))
        assert result.exit_code == 0, result.output
        assert f"wrote {out}: the weights after step 1" in result.output
    assert "emb.weight" in torch.load(out)


@pytest.mark.parametrize(
    ("content", "holds"),
    [
        (b'{"a": 1}', "holds JSON of another kind"),
        (b"import torch\n", "holds a Python file"),
        (b"\x00\x01binary", "holds binary data"),
    ],
    ids=["json", "python", "binary"],
)
def test_export_weights_refuses_a_foreign_file_untouched(
    checkpointed: Path, tmp_path: Path, content: bytes, holds: str
) -> None:
    out = tmp_path / "model.pt"
    out.write_bytes(content)
    line = refused(invoke("export-weights", str(checkpointed), "-o", str(out)), f"--output {out}", holds)
    assert "not a state dict" in line and "choose another file name, e.g. -o model.pt" in line
    assert out.read_bytes() == content


def test_export_weights_refuses_a_plan_and_a_training_checkpoint(checkpointed: Path, tmp_path: Path) -> None:
    import torch

    plan_copy = tmp_path / "plan.json"
    plan_copy.write_bytes(checkpointed.read_bytes())
    refused(invoke("export-weights", str(checkpointed), "-o", str(plan_copy)), "holds a plan, not a state dict")
    assert plan_copy.read_bytes() == checkpointed.read_bytes()
    whole = tmp_path / "whole.pt"
    torch.save({"model": {}, "step": 3}, whole)  # a dict of dicts: a training checkpoint, not a state dict
    before = whole.read_bytes()
    refused(invoke("export-weights", str(checkpointed), "-o", str(whole)), "a PyTorch file of another object")
    assert whole.read_bytes() == before


# --- --memory-limit that rounds to 0 bytes, or past any device -----------------------------------


def test_memory_limit_under_one_byte_is_refused_before_profiling() -> None:
    args = ["plan", str(MODELS / "llama.py"), "--size", "tiny", "--gpu-type", "h100", "--gpus", "2"]
    line = refused(invoke(*args, "--memory-limit", "1e-12"), "--memory-limit 1e-12", "1e-12 GiB", "under one byte")
    assert "give the per-rank limit in GiB" in line


def test_memory_limit_past_an_exbibyte_names_its_unit() -> None:
    args = ["plan", str(MODELS / "llama.py"), "--size", "tiny", "--gpus", "2", "--memory-limit", "1e30"]
    refused(invoke(*args), "--memory-limit 1e+30", "1e+30 GiB", "at most 1073741824 GiB")


def test_memory_limit_bounds_hold_for_the_python_api_too() -> None:
    with pytest.raises(PlannerError, match="under one byte"):
        PlanRequest.build(model_file="m.py", gpus=2, memory_limit_gib="1e-12")
    assert PlanRequest.build(model_file="m.py", gpus=2, memory_limit_gib=1e-9).memory_limit_bytes == 1
    with pytest.raises(PlannerError, match="^--memory-limit nan: Input should be a finite number$"):
        PlanRequest.build(model_file="m.py", gpus=2, memory_limit_gib=float("nan"))


def test_a_zero_byte_limit_in_the_core_is_no_layout_fits() -> None:
    space = SearchSpace(16, "1f1b", None, 1)
    with pytest.raises(InfeasibleError, match="no layout fits the 0 GiB memory limit"):
        search(BLOCKS, Cluster(2, LINK), space, Constraints(ADAMW, 0), Scaling(1))  # was ZeroDivisionError


def test_the_summary_of_a_plan_with_a_zero_byte_limit_divides_by_nothing() -> None:
    plan = plan_of_blocks(BLOCKS).model_copy(update={"memory_limit_bytes": 0})
    assert "NO: the limit is 0 bytes" in summary_table(plan)  # was ZeroDivisionError


# --- run --timeout too short to work ------------------------------------------------------------


def test_a_timeout_too_short_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], n_microbatches=2)
    path = saved(plan, tmp_path)
    line = refused(invoke("run", str(path), "--timeout", "0.01"), "--timeout 0.01", "0.01 s is too short")
    assert "give --timeout 5 or more" in line and "another node" not in line
    assert not (tmp_path / "plan.run.json").exists() and not (tmp_path / "plan.ckpt").exists()


def test_the_timeout_minimum_holds_for_the_python_api_too() -> None:
    with pytest.raises(PlannerError, match=r"^--timeout 4.9: 4.9 s is too short"):
        RunRequest.build(plan_file="p.json", timeout_s=4.9)
    assert RunRequest.build(plan_file="p.json", timeout_s=5).timeout_s == 5


@pytest.mark.parametrize(
    ("cls", "values", "option"),
    [
        (PlanRequest, {"model_file": "m.py", "gpus": True}, "--gpus"),
        (PlanRequest, {"model_file": "m.py", "gpus": 2, "memory_limit_gib": True}, "--memory-limit"),
        (PlanRequest, {"model_file": "m.py", "gpus": 2, "batch_size": False}, "--batch-size"),
        (PlanRequest, {"model_file": "m.py", "gpus": 2, "dp": True}, "--dp"),
        (RunRequest, {"plan_file": "p.json", "timeout_s": True}, "--timeout"),
    ],
)
def test_a_truth_value_for_a_number_is_refused_by_the_python_api(cls: type, values: dict, option: str) -> None:
    # was: pydantic read True as 1 (one GPU, a 1 GiB limit, a 1 s timeout) without a word
    with pytest.raises(PlannerError, match=f"^{option} (True|False): {option} takes a value, not True or False$"):
        cls.build(**values)  # type: ignore[attr-defined]
    # the flags still take one
    PlanRequest.build(model_file="m.py", gpus=2, tp=2, sequence_parallel=True, compile=False)
    RunRequest.build(plan_file="p.json", resume=True, save_checkpoints=False)


@pytest.mark.parametrize(
    ("cls", "values", "option"),
    [
        (RunRequest, {"plan_file": "p.json", "checkpoint_dir": ""}, "--checkpoint-dir"),
        (RunRequest, {"plan_file": "p.json", "output": " "}, "--output"),
        (RunRequest, {"plan_file": "p.json", "data": ""}, "--data"),
        (PlanRequest, {"model_file": "m.py", "gpus": 2, "output": ""}, "--output"),
    ],
)
def test_an_empty_path_is_refused(cls: type, values: dict, option: str) -> None:
    """pathlib reads "" as the current folder: planner run --checkpoint-dir "" wrote its step
    folders there (an unset "$CKPT" in a launch script); now one line names the option."""
    with pytest.raises(PlannerError, match=f"^{option}: an empty path; give one, or leave it out for its default$"):
        cls.build(**values)  # type: ignore[attr-defined]
    assert RunRequest.build(plan_file="p.json", checkpoint_dir=".").checkpoint_dir is not None  # "." is asked for


def test_an_empty_checkpoint_folder_on_the_command_line_is_one_line(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    result = CliRunner().invoke(main, ["run", str(plan), "--checkpoint-dir", ""])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --checkpoint-dir: an empty path; give one, or leave it out for its default"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
