"""Tier 2 (CPU torch): Hugging Face models and HF-style model files.

(a) tests/fixtures/hf_style.py: a hand-written model shaped like transformers' (config class,
    PreTrainedModel-like wrapper, dict outputs, data-dependent padding and .item() checks).
(b) tests/fixtures/hf_gpt2.py: a real ``transformers.GPT2LMHeadModel`` built from a config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from planner.api import make_plan
from planner.capture.load import load_model_file
from planner.capture.stage import build_stage_module
from planner.capture.trace import trace_model
from planner.errors import TraceError
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
HF_STYLE = FIXTURES / "hf_style.py"
HF_GPT2 = FIXTURES / "hf_gpt2.py"

HF_STYLE_BLOCKS = (
    [("model.embed_tokens", False)]
    + [(f"model.layers.{i}", True) for i in range(4)]
    + [("model.norm", False), ("lm_head", False)]
)
GPT2_BLOCKS = (
    [("transformer.wte", False), ("transformer.wpe", False), ("transformer.drop", False)]
    + [(f"transformer.h.{i}", True) for i in range(4)]
    + [("transformer.ln_f", False), ("lm_head", False)]
)


def _quick_plan(path: Path, size: str, gpus: int = 2, method: str = "optimal", **kw: Any):
    return make_plan(
        PlanRequest.build(
            model_file=path,
            gpus=gpus,
            size=size,
            batch_size=4,
            warmup=0,
            repeats=1,
            progress=False,
            method=method,
            **kw,
        )
    )


def _check_tiling(plan: Plan) -> None:
    """Stages tile the blocks, each non-empty, ending at legal cuts."""
    assert plan.stages[0].start == 0 and plan.stages[-1].end == len(plan.blocks)
    assert all(a.end == b.start for a, b in zip(plan.stages, plan.stages[1:]))
    assert all(s.start < s.end for s in plan.stages)
    assert all(plan.blocks[s.end - 1].cut_legal for s in plan.stages[:-1])


def _check_optimal(plan: Plan) -> None:
    """The exact solver is no worse than any baseline on the same measured costs (which split is
    best depends on timing noise for models this small, so that is all a test can pin down)."""
    _check_tiling(plan)
    for name, baseline in plan.baselines.items():
        assert plan.prediction.step_time_s <= baseline.step_time_s * (1 + 1e-9), name


def _run_stages(traced, starts: list[int], inputs: tuple) -> torch.Tensor:
    """The model's output computed stage after stage, the stages starting at the blocks in ``starts``."""
    bounds = [*starts, len(traced.blocks)]
    args = inputs
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):
            out = build_stage_module(traced, a, b)(*args)
            args = out if isinstance(out, tuple) else (out,)
    return out


def _layers_per_stage(plan: Plan) -> list[int]:
    return [sum(b.is_layer for b in plan.blocks[s.start : s.end]) for s in plan.stages]


# --- (a) HF-style hand-written model -----------------------------------------------------------


def test_hf_style_model_falls_back_to_module_boundaries():
    mf = load_model_file(HF_STYLE, "tiny")
    model = mf.build()
    inputs, target = mf.batch(2)
    out = model(*inputs)
    assert set(out) == {"logits"} and out.logits.shape == (2, 8, 64)
    assert isinstance(model(*inputs, return_dict=False), tuple)
    traced = trace_model(model, inputs)
    assert traced.method == "modules"
    assert [m for m, _ in traced.failures] == ["fx", "export"]
    assert [(b.name, b.is_layer) for b in traced.blocks] == HF_STYLE_BLOCKS
    # layers return tuples (hidden,) and the next layer takes hidden: those cuts are legal
    assert [c.legal for c in traced.cuts] == [True] * 6
    assert traced.cuts[0].nbytes == 2 * 8 * 32 * 4


def test_hf_style_blocks_are_no_chain_so_make_plan_refuses_with_the_reason():
    # the layers take the attention mask besides the hidden states: no chain of stages can run them
    mf = load_model_file(HF_STYLE, "tiny")
    traced = trace_model(mf.build(), mf.batch(2)[0])
    assert traced.chain_reason == "model.layers.0 takes 2 tensors; a chain block takes only the previous block's output"
    with pytest.raises(TraceError, match=r"its blocks cannot run as a chain of stages: model.layers.0 takes 2 tensors"):
        _quick_plan(HF_STYLE, "tiny")


def test_hf_style_cli_plan_is_refused_in_one_line(tmp_path):
    from click.testing import CliRunner

    import cli

    out = tmp_path / "plan.json"
    args = ["plan", str(HF_STYLE), "--size", "tiny", "--gpus", "2", "--batch-size", "4", "--repeats", "1"]
    result = CliRunner().invoke(cli.main, [*args, "--warmup", "0", "-o", str(out), "-q"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: this model was traced by module boundaries (fx: ")
    assert "make its blocks a chain" in lines[0]
    assert not out.exists()


def test_cli_plan_error_is_one_line(tmp_path):
    from click.testing import CliRunner

    import cli

    args = [
        "plan",
        str(FIXTURES / "no_children.py"),
        "--size",
        "tiny",
        "--gpus",
        "2",
        "--batch-size",
        "4",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "-o",
        str(tmp_path / "plan.json"),
        "-q",
    ]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "could not trace Flat" in lines[0] and "modules:" in lines[0]
    assert "Traceback" not in result.output
    assert not (tmp_path / "plan.json").exists()


# --- (b) a real transformers GPT-2 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.slow
def test_raw_gpt2_is_traced_by_export_with_its_kv_cache_off(transformers):
    # as a user brings it: GPT2LMHeadModel returns a ModelOutput and, by default, a KV cache that
    # torch.export cannot flatten; the planner switches the cache off and takes the logits
    mf = load_model_file(HF_GPT2, "tiny")
    model = mf.build().eval()
    assert isinstance(model, transformers.GPT2LMHeadModel) and model.config.use_cache is False
    inputs, _ = mf.batch(2)
    traced = trace_model(model, inputs)
    assert traced.method == "export" and [m for m, _ in traced.failures] == ["fx"]
    assert [(b.name, b.is_layer) for b in traced.blocks] == GPT2_BLOCKS
    assert all(c.legal for c in traced.cuts)
    [tie] = traced.tied_parameters()
    assert tie.names == ("transformer.wte.weight", "lm_head.weight") and tie.blocks == (0, 8)
    expected = model(*inputs).logits.detach()
    torch.testing.assert_close(_run_stages(traced, [0, 4], inputs), expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_raw_gpt2_make_plan_records_the_tie(transformers):
    plan = _quick_plan(HF_GPT2, "tiny")
    assert plan.model.trace_method == "export"
    _check_optimal(plan)
    [tie] = plan.ties
    assert tie.blocks == ("transformer.wte", "lm_head") and tie.params == 256 * 64
    assert plan.tie_stages(tie) == [0, 1]
    head = plan.blocks[-1]
    assert head.tied_params == tie.params and head.params == tie.params  # the head's stage holds a copy


@pytest.mark.slow
def test_wrapped_gpt2_is_traced_by_export_and_stages_reproduce_it(transformers):
    mf = load_model_file(HF_GPT2, "wrapped")
    model = mf.build().eval()
    inputs, _ = mf.batch(2)
    traced = trace_model(model, inputs)
    assert traced.method == "export"
    assert [m for m, _ in traced.failures] == ["fx"]
    assert [(b.name, b.is_layer) for b in traced.blocks] == [("model." + n, layer) for n, layer in GPT2_BLOCKS]
    assert all(c.legal for c in traced.cuts)
    expected = model(*inputs).detach()
    assert expected.shape == (2, 16, 256)
    for starts in ([0, 3, 5], list(range(len(traced.blocks))), [0, 7]):
        torch.testing.assert_close(_run_stages(traced, starts, inputs), expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_wrapped_gpt2_make_plan(transformers):
    # one stage a rank: with the schedule searched, measured costs this small (timing noise, the
    # other test worker on the same cores) may favour two a rank, which this test is not about
    plan = _quick_plan(HF_GPT2, "wrapped", schedule="1f1b")
    assert plan.model.trace_method == "export"
    assert [b.name for b in plan.blocks] == ["model." + n for n, _ in GPT2_BLOCKS]
    assert len(plan.stages) == 2
    _check_optimal(plan)
    assert plan.baselines["uniform"].starts == (0, 5)  # h.0-1 | h.2-3


@pytest.mark.slow
def test_hf_llama_70b_config_plans_on_the_meta_device_through_export(transformers):
    # transformers' eager forward reads data (.item() in its mask code), which meta tensors have
    # none of: planning for GPUs that are not here goes through torch.export, and attention in the
    # exported graph is charged as the fused kernel (not S x S scores per head)
    plan = make_plan(
        PlanRequest.build(
            model_file=ROOT / "models" / "hf" / "llama.py",
            size="70b",
            overrides={"n_layers": 2},
            gpus=2,
            batch_size=2,
            microbatches=2,
            gpu_type="h100",
            tp=1,  # the blocks as a whole model's (a plan of tp 2 records one tensor-parallel rank's)
            progress=False,
        )
    )
    assert plan.model.trace_method == "export" and plan.profile.source == "estimated"
    names = [b.name for b in plan.blocks]
    assert names == [
        "model.embed_tokens",
        "model.rotary_emb",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    layer = plan.blocks[2]
    assert layer.params == 855_654_400  # Llama 3 70B's layer
    # fused attention: about 3.5 GiB saved per 8192-token layer (the unfused math would save 20 GB),
    # besides the bf16 copies of its matmuls' weights that autocast saves (2 bytes per parameter, the
    # two norms' weights not cast), told apart
    assert layer.weight_cast_bytes == 2 * (layer.params - 2 * 8192)
    assert 2 * 2**30 < layer.activation_bytes - layer.weight_cast_bytes < 4 * 2**30
    assert plan.blocks[3].activation_bytes == layer.activation_bytes  # estimated once, shared
    assert plan.profile.tokens_per_sample == 8192
