"""Tier 3: every plan runs. Each model file in models/ and models/hf/ is planned at 2, 3 and 4
ranks, as a user would (`planner plan`, the joint search on), and each plan trains for 2 steps
(`planner run`); or `planner plan` refuses it in one line. A failure at run time is a defect:
whatever the planner accepts, the runner must run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from planner.schema.plan import Plan
from planner.schema.result import RunResult

ROOT = Path(__file__).resolve().parents[1]
OURS = sorted(p.name for p in (ROOT / "models").glob("*.py"))
HF = sorted(p.name for p in (ROOT / "models" / "hf").glob("*.py"))
# (file, size, batch): batches that split into microbatches at every rank count tried
FILES = [(f"models/{name}", "tiny", 16) for name in OURS] + [(f"models/hf/{name}", "tiny", 8) for name in HF]


def test_the_lists_cover_every_shipped_model_file() -> None:
    assert {"gpt.py", "encoder_lm.py", "resnet50.py", "shakespeare.py", "toy.py", "llama.py"} <= set(OURS)
    assert {"gpt2.py", "llama.py", "qwen.py", "bert_mlm.py"} <= set(HF)


@pytest.mark.multiprocess
@pytest.mark.parametrize("gpus", [2, 3, 4])
@pytest.mark.parametrize(("model", "size", "batch"), FILES, ids=[f for f, _, _ in FILES])
def test_every_plan_runs_or_is_refused_at_plan_time(
    model: str, size: str, batch: int, gpus: int, tmp_path: Path
) -> None:
    if model.startswith("models/hf/"):
        pytest.importorskip("transformers")
    plan_file = tmp_path / "plan.json"
    args = ["plan", str(ROOT / model), "--size", size, "--gpus", str(gpus), "-b", str(batch)]
    planned = CliRunner().invoke(main, [*args, "--repeats", "1", "--warmup", "0", "-q", "-o", str(plan_file)])
    if planned.exit_code != 0:
        # a refusal is one line naming why, and leaves no plan behind
        lines = [line for line in planned.output.splitlines() if line.strip()]
        assert planned.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), planned.output
        assert not plan_file.exists()
        return
    plan = Plan.load(plan_file)
    assert plan.n_ranks == gpus
    run_file = tmp_path / "run.json"
    ran = CliRunner().invoke(main, ["run", str(plan_file), "--steps", "2", "-o", str(run_file)])
    assert ran.exit_code == 0, f"{model} at {gpus} ranks ({plan.schedule}, m={plan.n_microbatches}): {ran.output}"
    result = RunResult.load(run_file)
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)  # finite, not NaN
