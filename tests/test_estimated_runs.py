"""A plan made for hardware that is not here names the model the run builds, and runs.

The estimate builds the model on the meta device, traces it as built (fp32) and costs its blocks in the
planning dtype; the run builds it on the CPU in fp32 (and a measured plan on a GPU moves it there
first). All of them must trace to one fingerprint and the same block nodes, or `planner run` refuses
the plan on the very model it was made for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.api import make_plan
from planner.capture.load import load_model_file
from planner.capture.trace import trace_model
from planner.run import run_plan, train_reference
from planner.run.model import planned_source, trace_for_plan
from planner.schema.request import PlanRequest
from planner.schema.run_request import RunRequest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = sorted(
    str(p.relative_to(ROOT)) for p in [*(ROOT / "models").glob("*.py"), *(ROOT / "models" / "hf").glob("*.py")]
)


# T5's layer norm casts to its weight's dtype only for 16-bit weights, and transformers runs MoE experts
# as torch._grouped_mm in bf16 but a custom op in fp32: traced cast to bf16 they were other graphs than
# the fp32 one `planner run` builds. The estimate now traces the model as built and costs it in bf16.
BRANCH_ON_DTYPE = {"models/hf/t5.py", "models/hf/mixtral.py", "models/hf/qwen_moe.py"}


def _size(path: str) -> str | None:
    return "tiny" if "tiny" in getattr(load_model_file(ROOT / path).module, "SIZES", {}) else None


@pytest.mark.slow
@pytest.mark.parametrize("path", MODEL_FILES)
def test_every_shipped_model_has_one_fingerprint_measured_or_estimated(path: str, tmp_path: Path) -> None:
    size = _size(path)
    mf = load_model_file(ROOT / path, size)
    inputs, _ = mf.batch(2)
    built = trace_model(mf.build(seed=0), inputs).fingerprint  # what planner run (and a measured plan) traces
    for gpu_type in ("cpu", "h100"):
        request = PlanRequest.build(
            model_file=ROOT / path,
            size=size,
            gpus=2,
            batch_size=4,
            microbatches=2,
            gpu_type=gpu_type,
            output=tmp_path / "plan.json",
            progress=False,
        )
        plan = make_plan(request)
        assert plan.model.fingerprint == built, gpu_type
        # what `planner run` checks before it builds a stage: the fingerprint and every block's nodes
        source = planned_source(plan, mf)
        trace_for_plan(plan, source.model, source.example)


def test_models_that_branch_on_dtype_are_in_the_matrix() -> None:
    assert BRANCH_ON_DTYPE <= set(MODEL_FILES)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["models/llama.py"])
def test_a_plan_estimated_for_this_cpu_trains_like_the_unsplit_model(path: str, tmp_path: Path) -> None:
    """Llama's rotary tables are one buffer shared by every layer (the estimate casts it). The
    transformers files' --gpu-type cpu plans (GPT-2 traced by torch.export, whose meta graph has a copy
    after attention that the CPU's has not; T5 under interleaved-zb) train in tests/test_hf_matrix.py."""
    # T5 under a two-part backward: its relative position bias, made in a stage's first decoder layer and
    # read by the others, joins the stage's parameter groups, and torch's weight backward freed the
    # graph after the first group ("backward through the graph a second time")
    request = PlanRequest.build(
        model_file=ROOT / path,
        size=_size(path),
        gpus=2,
        batch_size=4,
        microbatches=2,
        gpu_type="cpu",
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = make_plan(request)
    assert plan.profile.source == "estimated" and plan.n_ranks == 2
    plan.save(tmp_path / "plan.json")
    got = run_plan(plan, RunRequest(plan_file=tmp_path / "plan.json", steps=2))
    want = train_reference(plan, tmp_path / "plan.json", 2)
    assert got.losses == pytest.approx(want.losses, rel=1e-4)
    assert torch.isfinite(torch.tensor(got.losses)).all()
