"""Expert plans: which modules hold a mixture-of-experts layer's experts (``planner.capture.ep_plan``),
and how the tensor-parallel plan leaves them whole (CPU, meta device)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from planner.capture.ep_plan import ExpertLayer, resolve_experts
from planner.capture.load import load_model_file
from planner.capture.tp_plan import check_tp_plan, resolve_tp_plan
from planner.errors import ModelFileError

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "moe_file.py"


def _meta(path: Path, size: str | None = "tiny") -> tuple[Any, nn.Module]:
    mf = load_model_file(path, size)
    with torch.device("meta"):
        return mf, mf.build()


def _file(ep_plan: object, path: str = "m.py") -> Any:
    """A stand-in ModelFile whose module declares ``ep_plan``."""
    return types.SimpleNamespace(module=types.SimpleNamespace(ep_plan=ep_plan), path=Path(path), config={"k": 3})


def test_a_model_files_own_plan_names_its_experts_modules() -> None:
    mf, model = _meta(FIXTURE)
    experts = resolve_experts(mf, model)
    # 4 experts of (24 x 16) in and (16 x 24) out, fp32, in each of the 2 layers
    per_layer = 4 * (24 * 16 + 16 * 24)
    assert experts.layers == tuple(
        ExpertLayer(f"layers.{i}.moe.experts", 4, per_layer, 4 * per_layer, ((24, 16), (16, 24))) for i in range(2)
    )
    assert experts.source == "model file" and experts.patterns == ("layers.*.moe.experts",)
    assert experts.counts == {"layers.0.moe.experts": 4, "layers.1.moe.experts": 4}


def test_a_plan_function_gets_the_config_and_transformers_style_names_are_read() -> None:
    _, model = _meta(FIXTURE)
    seen: list[dict] = []

    def plan(**config: int) -> dict[str, str]:
        seen.append(config)
        return {"layers.*.moe.experts": "ep_dispatch_experts"}

    assert len(resolve_experts(_file(plan), model).layers) == 2 and seen == [{"k": 3}]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (["layers.*.moe.experts"], r"m\.py: ep_plan is list, not a dict of module-name patterns"),
        ({"layers.*.moe.experts": "colwise"}, r"gives 'layers\.\*\.moe\.experts' the style 'colwise'"),
        ({"layers.*.mlp.experts": "experts"}, r"'layers\.\*\.mlp\.experts' matches no module .*named like"),
        ({"layers.*": "experts"}, r"'layers\.0' needs every parameter to lead with the expert index"),
        ({"layers.*.norm": "experts"}, r"'layers\.0\.norm' needs every parameter .* weight \(16,\), bias"),
        ({"layers.*.moe.experts.w_x": "grouped_gemm"}, r"'layers\.\*\.moe\.experts\.w_x' matches no parameter"),
        ({"layers.*.moe.router.weight": "grouped_gemm"}, r"'layers\.0\.moe\.router\.weight' is not a parameter"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_one_line(plan: object, message: str) -> None:
    _, model = _meta(FIXTURE)
    with pytest.raises(ModelFileError, match=message) as e:
        resolve_experts(_file(plan), model)
    assert "\n" not in str(e.value)


def test_a_plan_function_that_raises_is_one_line() -> None:
    _, model = _meta(FIXTURE)

    def plan(**config: int) -> dict[str, str]:
        raise KeyError("n_experts")

    with pytest.raises(ModelFileError, match=r"ep_plan\(\*\*config\) raised KeyError"):
        resolve_experts(_file(plan), model)


def test_a_declared_expert_count_must_be_the_leading_dimension() -> None:
    _, model = _meta(FIXTURE)
    model.layers[0].moe.experts.num_experts = 8  # type: ignore[union-attr,index]
    with pytest.raises(
        ModelFileError, match=r"'layers\.0\.moe\.experts' needs .* index \(8 experts\), then .*; it holds w_in"
    ):
        resolve_experts(_file({"layers.*.moe.experts": "experts"}), model)


@pytest.mark.parametrize(("model_file", "n"), [("mixtral.py", 4), ("qwen_moe.py", 8)])
def test_transformers_moe_models_are_recognised_as_they_ship(model_file: str, n: int) -> None:
    pytest.importorskip("transformers")
    mf, model = _meta(ROOT / "models" / "hf" / model_file)
    experts = resolve_experts(mf, model)
    assert experts.source == "Hugging Face config" and experts.patterns == ("model.layers.*.mlp.experts",)
    assert experts.counts == {f"model.layers.{i}.mlp.experts": n for i in range(2)}
    # the shared expert of Qwen2-MoE and the routers replicate: only the grouped weights are experts'
    layer = model.get_submodule("model.layers.0.mlp.experts")
    assert experts.layers[0].params == sum(p.numel() for p in layer.parameters())


def test_transformers_experts_inside_a_users_wrapper_and_from_the_tp_plan_alone() -> None:
    pytest.importorskip("transformers")
    mf, inner = _meta(ROOT / "models" / "hf" / "mixtral.py")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = inner

    wrapped = Wrapper()
    assert list(resolve_experts(mf, wrapped).counts) == [f"lm.model.layers.{i}.mlp.experts" for i in range(2)]
    inner.config.base_model_ep_plan = None  # a config that says so in its tensor-parallel plan only
    assert list(resolve_experts(mf, wrapped).counts) == [f"lm.model.layers.{i}.mlp.experts" for i in range(2)]


def test_dense_models_have_no_experts() -> None:
    for path, size in ((ROOT / "models" / "llama.py", "tiny"), (ROOT / "models" / "toy.py", None)):
        mf, model = _meta(path, size)
        experts = resolve_experts(mf, model)
        assert experts.layers == () and experts.counts == {} and experts.source == ""


@pytest.mark.parametrize("model_file", ["mixtral.py", "qwen_moe.py"])
def test_the_tp_plan_keeps_the_experts_whole_and_passes_over_layers_the_config_lacks(model_file: str) -> None:
    # transformers 5 splits the grouped expert weights (packed_colwise, rowwise on 3-D parameters,
    # moe_tp_experts), which torch's styles cannot: those entries go, the attention still splits;
    # Qwen2-MoE's dense-MLP patterns match no layer of a config whose every layer routes to experts
    pytest.importorskip("transformers")
    mf, model = _meta(ROOT / "models" / "hf" / model_file)
    resolved = resolve_tp_plan(mf, model)
    assert resolved.reason == "" and resolved.whole == ("model.layers.*.mlp.experts",)
    assert not any(".mlp." in k for k in resolved.plan), resolved.plan
    assert resolved.plan["model.layers.*.self_attn.q_proj"] == "colwise"
    check_tp_plan(model, resolved.plan, 2)


def test_a_packed_style_outside_the_experts_is_still_refused() -> None:
    pytest.importorskip("transformers")
    mf, model = _meta(ROOT / "models" / "hf" / "mixtral.py")
    model.config.base_model_tp_plan = {  # type: ignore[union-attr]
        **model.config.base_model_tp_plan,  # type: ignore[union-attr]
        "layers.*.self_attn.q_proj": "packed_colwise",
    }
    resolved = resolve_tp_plan(mf, model)
    assert resolved.plan == {} and "'packed_colwise' (for 'layers.*.self_attn.q_proj')" in resolved.reason
