"""Tier 3: every plan runs. Each model file in models/ is planned at 2, 3 and 4 ranks and at 4 ranks
with the replicas searched (--dp auto), the dense ones of models/hf/ at 4 (at 2: tests/test_hf_matrix.py), as a user would (`planner plan`, the joint search on), and each plan trains for 2 steps
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
    assert {"gpt2.py", "llama.py", "qwen.py", "bert_mlm.py", "mixtral.py", "qwen_moe.py", "t5.py", "albert.py"} <= set(
        HF
    )


# (gpus, dp): one pipeline at 2, 3 and 4 ranks, and 4 ranks where the search also chooses the
# replicas (and DDP or FSDP). The Hugging Face files, slower to trace, run at 4 ranks only: at 2 ranks
# tests/test_hf_matrix.py plans, runs and compares every one of them with the unsplit model (measured
# and --gpu-type cpu plans); the mixture-of-experts ones (whose layers are the dense ones' but for the
# experts), T5 and ALBERT only there, to keep the suite near 20 minutes.
# The 2-rank plans are made with --gpu-type cpu (estimated on the meta device): every file in models/
# then also runs from a plan made for hardware not measured (the transformers files: in the matrix).
LAYOUTS = [(2, "1", True), (3, "1", False), (4, "1", False), (4, "auto", False)]
MATRIX_ONLY = {"models/hf/mixtral.py", "models/hf/qwen_moe.py", "models/hf/t5.py", "models/hf/albert.py"}
CASES = [
    pytest.param(
        f,
        size,
        batch,
        gpus,
        dp,
        estimated,
        id=f"{f}-{gpus}{'-dp' if dp != '1' else ''}{'-cpu-estimate' if estimated else ''}",
    )
    for f, size, batch in FILES
    for gpus, dp, estimated in LAYOUTS
    if not f.startswith("models/hf/") or (gpus == 4 and dp == "1" and f not in MATRIX_ONLY)
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("model", "size", "batch", "gpus", "dp", "estimated"), CASES)
def test_every_plan_runs_or_is_refused_at_plan_time(
    model: str, size: str, batch: int, gpus: int, dp: str, estimated: bool, tmp_path: Path
) -> None:
    if model.startswith("models/hf/"):
        pytest.importorskip("transformers")
    plan_file = tmp_path / "plan.json"
    args = ["plan", str(ROOT / model), "--size", size, "--gpus", str(gpus), "--dp", dp, "-b", str(batch)]
    args += ["--gpu-type", "cpu"] if estimated else []
    planned = CliRunner().invoke(main, [*args, "--repeats", "1", "--warmup", "0", "-q", "-o", str(plan_file)])
    if planned.exit_code != 0:
        # a refusal is one line naming why, and leaves no plan behind
        lines = [line for line in planned.output.splitlines() if line.strip()]
        assert planned.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), planned.output
        assert not plan_file.exists()
        return
    plan = Plan.load(plan_file)
    assert plan.world_size == gpus and (plan.profile.source == "estimated") == estimated
    run_file = tmp_path / "run.json"
    ran = CliRunner().invoke(main, ["run", str(plan_file), "--steps", "2", "--no-checkpoint", "-o", str(run_file)])
    assert ran.exit_code == 0, f"{model} at {gpus} ranks ({plan.schedule}, m={plan.n_microbatches}): {ran.output}"
    result = RunResult.load(run_file)
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)  # finite, not NaN
