"""Tiers 1 and 2: FP8 training (``--dtype fp8``) as the planner chooses, costs and reports it: which linear
layers convert (torchao's and torchtitan's filters), the float8 GEMMs and casts the roofline charges
(checked against torchao's published H100 microbenchmark), and the refusals."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.core.levers.float8 import compute_dtype, float8_recipe, kept_layers, kept_reason, too_small
from planner.schema.plan_parts import LinearLayer

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def _layer(k: int = 4096, n: int = 4096, *, in_layer: bool = True, router: bool = False) -> LinearLayer:
    return LinearLayer("layers.0.mlp.w1", k, n, in_layer, router)


def test_fp8_dtypes_name_torchaos_recipes_over_bf16() -> None:
    assert float8_recipe("fp8") == "tensorwise" and float8_recipe("fp8-rowwise") == "rowwise"
    assert float8_recipe("bf16") is None and float8_recipe(None) is None
    assert compute_dtype("fp8") == compute_dtype("fp8-rowwise") == "bf16" and compute_dtype("fp32") == "fp32"


def test_which_layers_stay_in_bf16_and_why() -> None:
    assert kept_reason(_layer(), "tensorwise", small_filter=True) is None
    assert "multiples of 16" in str(kept_reason(_layer(4096, 1000), "tensorwise", small_filter=False))
    assert "outside the repeated layers" in str(kept_reason(_layer(in_layer=False), "rowwise", small_filter=False))
    assert "router" in str(kept_reason(_layer(router=True), "tensorwise", small_filter=False))
    # torchao's size thresholds only where asked (a GPU plan): a CPU plan runs the emulation whatever the size
    small = _layer(4096, 1024)
    assert "too small" in str(kept_reason(small, "tensorwise", small_filter=True))
    assert kept_reason(small, "tensorwise", small_filter=False) is None
    layers = [_layer(), LinearLayer("output", 4096, 128256, False), LinearLayer("layers.0.wk", 4096, 1024, True)]
    assert list(kept_layers(layers, "tensorwise", small_filter=True)) == ["output", "layers.0.wk"]


@settings(max_examples=300, deadline=None)
@given(
    k=st.sampled_from([16 * i for i in (1, 32, 64, 65, 128, 129, 256, 257, 512)]),
    n=st.sampled_from([16 * i for i in (1, 32, 64, 65, 128, 129, 256, 257, 512)]),
    recipe=st.sampled_from(["tensorwise", "rowwise"]),
)
def test_the_size_thresholds_are_torchaos_own_filter(k: int, n: int, recipe: str) -> None:
    # the planner's pure copy against torchao's auto filter itself, on widths either side of every threshold
    torch = pytest.importorskip("torch")
    float8 = pytest.importorskip("torchao.float8")
    with torch.device("meta"):
        layer = torch.nn.Linear(k, n)
    converts = float8._auto_filter_for_recipe(recipe, filter_fqns=[])(layer, "layers.0.w")
    assert too_small(k, n, recipe) == (not converts)


torch = pytest.importorskip("torch")
pytest.importorskip("torchao")


def _trace(path: Path, size: str | None = "tiny"):  # type: ignore[no-untyped-def]
    from planner.capture.load import load_model_file
    from planner.capture.trace import trace_model

    mf = load_model_file(path, size)
    inputs, _ = mf.batch(2, seed=0)
    return trace_model(mf.build(0), inputs)


def test_the_layers_of_an_fx_and_an_export_graph_by_their_module_names() -> None:
    from planner.capture.float8 import linear_layers

    fx_layers = linear_layers(_trace(MODELS / "llama.py"))
    assert len(fx_layers) == 29 and fx_layers[-1] == LinearLayer("output", 64, 512, False)
    assert fx_layers[0].name == "layers.0.attention.wq" and all(x.in_layer for x in fx_layers[:-1])
    pytest.importorskip("transformers")
    traced = _trace(MODELS / "hf" / "mixtral.py", None)
    assert traced.method == "export"
    layers = {x.name: x for x in linear_layers(traced)}
    modules = {n for n, m in traced.model.named_modules() if type(m) is torch.nn.Linear}
    assert set(layers) == modules  # export's aten.linear calls, named as the model names its modules
    assert "model.layers.0.mlp.gate" not in layers  # transformers' router: a module of its own calling F.linear


class _Routed(torch.nn.Module):
    """A layer whose nn.Linear router picks experts by top-k (as torchtitan's MoE router is)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(32, 16, bias=False)
        self.up = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).float().softmax(-1)
        top, _ = torch.topk(scores, 2, dim=-1)
        return self.up(x) * top.sum(-1, keepdim=True)


class _RoutedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Routed(), _Routed()])
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_router_is_the_linear_layer_a_top_k_reads() -> None:
    from planner.capture.float8 import linear_layers
    from planner.capture.trace import trace_model

    layers = linear_layers(trace_model(_RoutedModel(), (torch.randn(2, 4, 32),)))
    assert [(x.name, x.router, x.in_layer) for x in layers] == [
        ("layers.0.gate", True, True),
        ("layers.0.up", False, True),
        ("layers.1.gate", True, True),
        ("layers.1.up", False, True),
        ("head", False, False),
    ]


def test_a_converted_stage_computes_what_the_converted_model_computes() -> None:
    # an export stage's aten.linear calls become modules first, then convert as the eager model's do
    pytest.importorskip("transformers")
    from planner.capture.float8 import convert_model, convert_stage, linear_layers
    from planner.capture.load import load_model_file
    from planner.capture.stage import stage_module
    from planner.costs.model_costs import float8_linears

    mf = load_model_file(MODELS / "hf" / "llama.py", "tiny")
    inputs, target = mf.batch(2, seed=0)
    traced = _trace(MODELS / "hf" / "llama.py")
    f8 = float8_linears("fp8", traced, small_filter=False)
    layers = linear_layers(traced)
    # its MLP is 172 wide: FP8 tensor cores need multiples of 16, so only the attention's layers convert
    assert f8 is not None and f8.converted == 16 == sum(
        x.in_layer and (x.in_features % 16, x.out_features % 16) == (0, 0) for x in layers
    )
    assert "lm_head" in f8.kept and "multiples of 16" in f8.kept["model.layers.0.mlp.up_proj"]
    stage = stage_module(traced, 0, len(traced.blocks))
    assert convert_stage(stage, f8, traced.model, emulate=True) == f8.converted
    model = mf.build(0)
    assert convert_model(model, f8, emulate=True) == f8.converted
    got, want = mf.loss_fn(stage(*inputs), target), mf.loss_fn(model(*inputs), target)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    plain = mf.loss_fn(mf.build(0)(*inputs), target)
    assert got.item() != plain.item()  # the casts changed the numbers: the layers really converted


def _linear_seconds(m: int, k: int, n: int, fp8: bool) -> float:
    """A compiled linear layer's forward and backward on an H100, as the roofline charges it (the bench's)."""
    from bench.fp8_linear import linear_seconds

    return linear_seconds(m, k, n, "tensorwise" if fp8 else None, compiled=True)


@pytest.mark.parametrize(
    ("shape", "published"),
    [((1024, 2048, 1024), 0.80), ((4096, 8192, 16384), 1.39)],
    ids=["small", "large"],
)
def test_float8_speedup_of_a_linear_layer_against_torchaos_h100_microbenchmark(
    shape: tuple[int, int, int], published: float
) -> None:
    # torchao/float8/README.md, "Performance": float8 over bf16 for a compiled linear on an H100 (M, K, N):
    # 0.80 for (1024, 2048, 1024), 1.39 for (4096, 8192, 16384). A check of the casts' and GEMMs' costs,
    # which come from the datasheet and NVIDIA's cuBLAS figure, not from these two numbers.
    speedup = _linear_seconds(*shape, fp8=False) / _linear_seconds(*shape, fp8=True)
    assert speedup == pytest.approx(published, rel=0.10)


def test_a_float8_gemm_runs_at_the_fp8_peak_and_its_casts_are_memory_bound() -> None:
    from planner.core.levers.hardware import GPUS

    hw = GPUS["h100"]
    m, k, n = 8192, 8192, 8192
    gemms = 3 * 2 * m * k * n  # forward, input gradient, weight gradient
    bf16, fp8 = _linear_seconds(m, k, n, False), _linear_seconds(m, k, n, True)
    assert bf16 == pytest.approx(gemms / (hw.peak("bf16") * hw.gemm_efficiency(m, n, k)), rel=0.05)
    gemm8 = gemms / (hw.peak("fp8") * hw.gemm_efficiency(m, n, k, fp8=True))
    # what is left is the casts (each operand, once per GEMM) and the layout copies: memory traffic
    casts = fp8 - gemm8
    elements = 3 * (m * k + k * n + m * n)
    assert 0 < casts < elements * 8 / (hw.memory_Bps * hw.memory_efficiency)


@pytest.mark.slow
def test_an_fp8_gpu_plan_reports_its_layers_and_beats_bf16_when_compiled(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli import main
    from planner.schema.plan import Plan

    steps = {}
    for dtype in ("bf16", "fp8"):
        out = tmp_path / f"{dtype}.json"
        args = ["plan", str(MODELS / "llama.py"), "--size", "8b", "--gpus", "8", "--gpu-type", "h100", "-b", "16"]
        args += ["--dp-mode", "fsdp", "--dp", "8", "--compile", "--dtype", dtype, "-o", str(out), "-q"]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        plan = Plan.load(out)
        steps[dtype] = plan.prediction.step_time_s
    f8 = plan.profile.float8
    assert f8 is not None and f8.recipe == "tensorwise" and plan.profile.dtype == "bf16"
    # 32 layers x (q, o, w1, w2, w3) convert; k and v (4096 x 1024) are below torchao's threshold; the head stays
    assert f8.converted == 160 and len(f8.kept) == 65 and "output" in f8.kept
    report = CliRunner().invoke(main, ["report", str(out)], catch_exceptions=False).output
    assert "float8 (torchao, tensorwise scaling): 160 of 225 linear layers" in report
    assert "of the bf16 peak, which float8 GEMMs double" in report
    assert 1.15 < steps["bf16"] / steps["fp8"] < 1.6  # torchtitan's 8B on 8 H100: 6,667 -> 8,532 tokens/s (1.28)
    # the plan's own answer: its layout and split priced with every layer in bf16 (the bf16 plan's here)
    assert f8.bf16_step_s == pytest.approx(steps["bf16"], rel=0.02)
    assert f"float8 pays here: {f8.bf16_step_s / steps['fp8']:.2f}x as fast as the same layout" in report


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-type", "a100-80g", "--dtype", "fp8"], r"^--dtype fp8: a100-80g has no FP8 tensor cores"),
        (["--dtype", "fp8", "--compile"], r"^--dtype fp8 with --compile: on cpu float8 runs in torchao's emulation"),
    ],
)
def test_fp8_where_it_cannot_run_is_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from cli import main

    cmd = ["plan", str(MODELS / "llama.py"), "--size", "tiny", "--gpus", "2", "-b", "8", "-o", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, [*cmd, *args, "-q"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and __import__("re").search(message, lines[0].removeprefix("error: ")), result.output


def test_a_model_without_a_convertible_linear_layer_is_refused() -> None:
    # models/gpt.py runs torch's TransformerEncoderLayer, which fx keeps whole: its one linear is the head
    from planner.costs.model_costs import float8_linears
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match=r"none of the model's 1 linear layers would train in float8 \(outside"):
        float8_linears("fp8", _trace(MODELS / "gpt.py"), small_filter=False)


def test_every_recipe_and_filter_combination_keeps_the_same_layers_on_cpu_and_gpu_where_large() -> None:
    layers = [_layer(k, n) for k, n in itertools.product((8192, 16384), (8192, 28672))]
    for recipe in ("tensorwise", "rowwise"):
        assert kept_layers(layers, recipe, True) == kept_layers(layers, recipe, False) == {}


def test_a_compiled_float8_plan_is_refused_before_any_rank_starts_where_float8_is_emulated(tmp_path: Path) -> None:
    # a plan made for GPUs (--gpu-type h100 --compile --dtype fp8) run on this CPU: torchao's emulation does not
    # compile, said in the parent in one line
    from run_factory import plan_with_starts, saved

    from planner.errors import PlannerError
    from planner.run import run_plan
    from planner.schema.plan_parts import Float8Linears
    from planner.schema.run_request import RunRequest

    plan = plan_with_starts(MODELS / "llama.py", [0, 3], schedule="1f1b", n_microbatches=2)
    f8 = Float8Linears(recipe="tensorwise", converted=28, kept={"output": "outside the repeated layers"})
    plan = plan.model_copy(update={"compile": True, "profile": plan.profile.model_copy(update={"float8": f8})})
    with pytest.raises(PlannerError, match=r"^--dtype fp8 with --compile: on cpu float8 runs in torchao's emulation"):
        run_plan(plan, RunRequest(plan_file=saved(plan, tmp_path), steps=1))


def test_fsdp_float8_gathers_add_one_scale_all_reduce_a_step() -> None:
    # torchao's precompute_float8_dynamic_scale_for_fsdp after the optimizer: the scales of every float8
    # weight in one all-reduce over the ranks sharding them (4 here: 2 x ceil(log2 4) = 4 latencies of
    # 1 ms), charged only where FSDP gathers float8 weights, not under DDP
    from plan_factory import block
    from test_fsdp_units import ADAMW, LINK

    from planner.core.layout.inputs import Layout
    from planner.core.split.cuts import Split
    from planner.core.step.predict import predict

    plain = [block(f"layers.{i}", 10, 20, 1000) for i in range(4)]
    float8 = [b.model_copy(update={"float8_share": 0.75}) for b in plain]
    for mode, extra in (("fsdp", 4 * LINK.latency_s), ("ddp", 0.0)):
        layout = Layout("gpipe", 1, 2, 1, dp=4, dp_mode=mode)
        _, without = predict(plain, Split(starts=(0,)), LINK, layout, ADAMW)
        _, with_scales = predict(float8, Split(starts=(0,)), LINK, layout, ADAMW)
        gathered = with_scales.dp_reduce_s - without.dp_reduce_s  # FSDP's gathers of float8 bytes: less traffic
        assert with_scales.step_time_s - gathered == pytest.approx(without.step_time_s + extra, rel=1e-12)
