"""A checkpoint folder belongs to one run of one plan (issue 66, items 4-6).

Tier 2 (one process) for the choice of the checkpoint to continue from, what a save clears and
what it refuses to replace, and the refusals before any rank starts (another model's checkpoints,
a ``latest`` the user wrote); tier 3 (gloo processes) for a fresh run into an earlier run's folder,
then ``--resume`` of the fresh one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from run_factory import plan_with_starts, saved  # noqa: E402

from cli import main  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.run import run_plan  # noqa: E402
from planner.run.checkpoint import (  # noqa: E402
    RankState,
    clear_stale,
    complete_checkpoints,
    foreign_latest,
    latest_checkpoint,
    parse_latest,
    save_checkpoint,
    save_weights,
    step_dir,
)
from planner.schema.run_request import RunRequest  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN_A, RUN_B = "a" * 32, "b" * 32


def _fake_step(root: Path, step: int, run_id: str | None, fingerprint: str = "fp", mtime: float | None = None) -> Path:
    """A step folder as ``planner run`` publishes one (an empty DCP ``.metadata`` is enough to choose from)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    meta = {"step": step, "plan_fingerprint": fingerprint, **({"run_id": run_id} if run_id else {})}
    (path / "planner.json").write_text(json.dumps(meta))
    if mtime is not None:
        os.utime(path / "planner.json", (mtime, mtime))
    return path


def _tiny_state() -> RankState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    return RankState(rank=0, tensors=dict(model.state_dict(keep_vars=True)))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_latest_pointer_formats() -> None:
    assert parse_latest("step_00000120\n") == ("step_00000120", None)  # written before runs had ids
    assert parse_latest(f"step_00000003 {RUN_A}\n") == ("step_00000003", RUN_A)
    for text in ("my notes\n", "step_120\n", f"step_00000003 {RUN_A} extra\n", "step_00000003\n\n", ""):
        assert parse_latest(text) is None, text


def test_resume_takes_the_step_latest_names_not_the_highest_number(tmp_path: Path) -> None:
    # defect 4: an interrupted run stopped at step 27, a later fresh run finished at step 3
    _fake_step(tmp_path, 27, RUN_A, mtime=1000.0)
    _fake_step(tmp_path, 3, RUN_B, mtime=2000.0)
    (tmp_path / "latest").write_text(f"step_00000003 {RUN_B}\n")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    # latest stale (its folder gone, or another run's than it says) or missing: the last one published
    (tmp_path / "latest").write_text(f"step_00000003 {RUN_A}\n")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    (tmp_path / "latest").write_text("step_00000099\n")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 3)
    (tmp_path / "latest").write_text("step_00000027\n")  # an older version's pointer
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 27)


def test_a_save_clears_partials_and_earlier_runs_of_this_model_only(tmp_path: Path) -> None:
    state = _tiny_state()
    for step in (2, 4):
        save_checkpoint(tmp_path, step, state, {"plan_fingerprint": "fp", "run_id": RUN_A})
    (tmp_path / ".step_00000009.partial").mkdir()  # a save that crashed: never resumable
    other_model = _fake_step(tmp_path, 7, RUN_A, fingerprint="other")
    users = tmp_path / "step_00000005"  # a user's own folder, whatever its name
    users.mkdir()
    (tmp_path / "notes.txt").write_text("mine\n")

    save_checkpoint(tmp_path, 3, state, {"plan_fingerprint": "fp", "run_id": RUN_B})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["latest", "notes.txt", "step_00000003", "step_00000005", "step_00000007"]
    assert (tmp_path / "latest").read_text() == f"step_00000003 {RUN_B}\n"
    assert other_model.is_dir() and users.is_dir()
    # a resumed run of a folder written before runs had ids keeps those folders: they are its own
    unnamed = _fake_step(tmp_path, 1, None)
    assert clear_stale(tmp_path, RUN_B, "fp", keep_unnamed=True) == [] and unnamed.is_dir()
    assert clear_stale(tmp_path, RUN_B, "fp", keep_unnamed=False) == [unnamed]


def test_a_save_never_replaces_what_planner_did_not_write(tmp_path: Path) -> None:
    state = _tiny_state()
    users = tmp_path / "step_00000005"
    users.mkdir(parents=True)
    (users / "data.bin").write_bytes(b"x")
    with pytest.raises(PlannerError, match="step_00000005 exists and is not a checkpoint `planner run` wrote"):
        save_checkpoint(tmp_path, 5, state, {"run_id": RUN_A})
    assert _tree(tmp_path) == {"step_00000005/data.bin": b"x"}

    (tmp_path / "latest").write_text("my notes\n")
    assert foreign_latest(tmp_path)
    with pytest.raises(PlannerError, match="latest is not a file `planner run` wrote"):
        save_checkpoint(tmp_path, 6, state, {"run_id": RUN_A})
    assert (tmp_path / "latest").read_text() == "my notes\n" and not step_dir(tmp_path, 6).exists()


def _errors(stderr: str) -> list[str]:
    """stderr without the note every test plan gets (made by hand, so "edited by hand")."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("note:")]


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="1f1b", n_microbatches=2)
    return saved(plan, tmp_path)


def test_a_plan_of_another_model_is_refused_before_any_rank_starts(plan_file: Path) -> None:
    # defect 5: plan.json re-planned for another model; plan.ckpt holds the old model's run
    root = plan_file.with_suffix(".ckpt")
    _fake_step(root, 4, RUN_A, fingerprint="0123456789abcdef")
    (root / "latest").write_text(f"step_00000004 {RUN_A}\n")
    before = _tree(root)
    out = plan_file.with_name("out.run.json")
    result = CliRunner().invoke(main, ["run", str(plan_file), "--steps", "2", "-o", str(out)])
    assert result.exit_code == 2, result.output
    lines = _errors(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint folder {root} holds checkpoints of another")
    assert "fingerprint 0123456789abcdef, step 4" in lines[0] and "give --checkpoint-dir another folder" in lines[0]
    assert "Traceback" not in result.output
    assert _tree(root) == before and not out.exists()


def test_a_latest_file_of_the_users_is_refused_and_left_as_it_was(plan_file: Path, tmp_path: Path) -> None:
    # defect 6: --checkpoint-dir DIR, where DIR/latest is the user's own file
    root = tmp_path / "mine"
    root.mkdir()
    (root / "latest").write_text("my run notes\n")
    result = CliRunner().invoke(main, ["run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(root)])
    assert result.exit_code == 2, result.output
    lines = _errors(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: --checkpoint-dir {root}: {root / 'latest'} is not a file")
    assert "move it away, or give --checkpoint-dir another folder" in lines[0]
    assert _tree(root) == {"latest": b"my run notes\n"}

    # nor a folder of the user's where this run would save its last step
    (root / "latest").unlink()
    (root / "step_00000002").mkdir()
    (root / "step_00000002" / "notes.txt").write_text("mine\n")
    result = CliRunner().invoke(main, ["run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(root)])
    assert result.exit_code == 2, result.output
    lines = _errors(result.stderr)
    assert (
        len(lines) == 1 and "step_00000002 is not a checkpoint `planner run` wrote, and this run would save" in lines[0]
    )
    assert _tree(root) == {"step_00000002/notes.txt": b"mine\n"}


@pytest.mark.multiprocess
def test_a_fresh_run_replaces_an_earlier_run_and_resume_continues_the_fresh_one(plan_file: Path) -> None:
    # defect 4 end to end: run A of this plan (its folders, as it left them: only planner.json and
    # .metadata are read before a fresh run replaces them) saved steps 2 and 4 and crashed saving 6;
    # a fresh run B of the same plan ends at step 3
    plan = plan_with_starts(FIXTURES / "dies_at.py", [0, 3], schedule="1f1b", n_microbatches=2)
    root = plan_file.with_suffix(".ckpt")
    for step in (2, 4):
        _fake_step(root, step, RUN_A, fingerprint=plan.model.fingerprint)
    (root / "latest").write_text(f"step_00000004 {RUN_A}\n")
    (root / ".step_00000006.partial").mkdir()

    lines: list[str] = []
    run_plan(plan, RunRequest(plan_file=plan_file, steps=3, echo=False), print_fn=lines.append)
    assert [line for line in lines if line.startswith("note:")] == [
        f"note: {root} holds the checkpoints of an earlier run of this model (steps 2 to 4); this run replaces "
        "them at its first save (--resume would continue that run instead)"
    ]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]
    assert save_weights(plan_file, None, plan_file.with_name("model.pt"))[1] == 3  # export-weights' default

    resumed = run_plan(plan, RunRequest(plan_file=plan_file, steps=5, resume=True, echo=False))
    assert resumed.first_step == 4 and resumed.checkpoints == [str(step_dir(root, 5))]
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000003", "step_00000005"]
    run_ids = {json.loads((p / "planner.json").read_text())["run_id"] for p in complete_checkpoints(root)}
    assert len(run_ids) == 1 and (root / "latest").read_text() == f"step_00000005 {run_ids.pop()}\n"
