"""Mixture-of-experts layers cost what they compute: grouped GEMMs are charged their FLOPs.

torch.utils.flop_counter has no formula for ``aten._grouped_mm`` (transformers 5 runs every Mixtral,
Qwen-MoE, ... expert through it, or through its own ``transformers::grouped_mm_fallback`` custom op),
so the roofline charged the experts nothing: a tiny Mixtral layer estimated 17 MFLOP where its
matmuls are about 68.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from planner.core.levers.hardware import get_hardware
from planner.costs.roofline import Roofline, Tally, grouped_gemm

ROOT = Path(__file__).resolve().parents[1]

aten = torch.ops.aten


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "a, b, offs, flops, dims",
    [
        ((64, 32), (4, 32, 16), 4, 2 * 64 * 32 * 16, (16, 16, 32)),  # tokens x experts' weights
        ((16, 64), (64, 32), 4, 2 * 16 * 64 * 32, (16, 32, 16)),  # a weight gradient: K split in groups
        ((4, 8, 32), (32, 64), 4, 2 * 8 * 32 * 64, (8, 16, 32)),  # N split in groups
        ((4, 8, 32), (4, 32, 16), None, 2 * 4 * 8 * 32 * 16, (8, 16, 32)),  # batched
    ],
)
def testgrouped_gemm_flops_are_the_ungrouped_products(a, b, offs, flops, dims) -> None:
    args = (_meta(*a), _meta(*b), torch.empty(offs, dtype=torch.int32, device="meta") if offs else None)
    assert grouped_gemm(aten._grouped_mm.default, args) == (flops, dims)
    assert grouped_gemm(aten.mm.default, args[:2]) is None  # flop_counter's own formula applies there


def _tallies(module: torch.nn.Module, hidden: int) -> tuple[Tally, Tally]:
    roof = Roofline(get_hardware("h100"), "bf16")
    x = torch.empty(1, 32, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = Tally(), Tally()
    with roof.phase(fwd):
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
    with roof.phase(bwd):
        out.sum().backward()
    return fwd, bwd


def test_a_mixtral_layer_costs_top_k_dense_layers() -> None:
    transformers = pytest.importorskip("transformers")
    shared = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        mixtral = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shared)
        )
        mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**shared))
    moe_fwd, moe_bwd = _tallies(mixtral.to(torch.bfloat16).model.layers[0].mlp, 256)
    dense_fwd, dense_bwd = _tallies(mistral.to(torch.bfloat16).model.layers[0].mlp, 256)
    router = 2 * 32 * 256 * 4  # tokens x hidden x experts
    assert moe_fwd.flops == pytest.approx(2 * dense_fwd.flops + router, rel=1e-3)
    assert moe_bwd.flops == pytest.approx(2 * dense_bwd.flops + 2 * router, rel=1e-3)
    assert moe_fwd.seconds >= 2 * dense_fwd.seconds * 0.9


@torch.library.custom_op("plannertest::mystery_mm", mutates_args=())
def _mystery_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@_mystery_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def _mystery_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = ctx.saved_tensors
    return grad @ b.T, a.T @ grad


def _mystery_save(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


_mystery_mm.register_autograd(_mystery_backward, setup_context=_mystery_save)


class _Mystery(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.plannertest.mystery_mm(x, self.w)


def test_an_operator_charged_no_flops_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """A library's custom operator without a FLOP formula (as transformers' experts were) is charged
    its bytes only: the estimate says so, naming it, instead of hiding it."""
    from planner.capture.trace import trace_model
    from planner.costs.estimate import estimate_blocks

    model = torch.nn.Sequential(_Mystery(), torch.nn.Linear(32, 4))
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    traced = trace_model(model, (x,), methods=("fx",))
    blocks = estimate_blocks(traced, (x,), y, torch.nn.functional.cross_entropy, get_hardware("h100"), progress=False)
    assert blocks[0].flops_fwd == 0  # the reason for the note
    err = capsys.readouterr().err
    assert "the estimate charges plannertest::mystery_mm its bytes only" in err
    assert "linear" not in err and "addmm" not in err  # aten operators are never named


def _layer_costs(model_file: str, overrides: dict[str, int], measure: bool) -> dict[str, float]:
    """Each layer's forward + backward on this CPU, 1 thread: measured, or estimated (``--gpu-type cpu``)."""
    from pathlib import Path

    from planner.api import estimated_costs, measured_costs
    from planner.capture.load import load_model_file
    from planner.schema.request import PlanRequest

    root = Path(__file__).resolve().parents[1]
    mf = load_model_file(root / model_file, "tiny", overrides)
    kw = dict(
        model_file=root / model_file,
        size="tiny",
        overrides=overrides,
        gpus=2,
        batch_size=8,
        microbatches=2,
        repeats=3,
        warmup=1,
        output=Path("unused.json"),
        progress=False,
    )
    if measure:
        blocks = measured_costs(mf, PlanRequest.build(**kw), 1, None).blocks
    else:
        blocks = estimated_costs(mf, PlanRequest.build(gpu_type="cpu", **kw), 1).blocks
    return {b.name: b.fwd_s + b.bwd_s for b in blocks if ".layers." in b.name}


WIDE = {"dim": 256, "ffn_dim": 1024, "seq_len": 64}  # matrix products, the experts most, dominate the CPU time


@pytest.mark.slow
@pytest.mark.timing  # measured CPU times: run alone on the cores (Makefile)
def test_a_mixtral_layer_is_estimated_as_a_dense_layer_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured CPU profile and the --gpu-type cpu estimate of a Mixtral layer agree as a dense
    (Llama) layer's of the same width do; charged nothing for its experts, the estimate fell to a
    fraction of the measured time, which this catches."""
    pytest.importorskip("transformers")
    measured = {m: _layer_costs(m, WIDE, measure=True) for m in ("models/hf/mixtral.py", "models/hf/llama.py")}

    def ratio(model_file: str) -> float:  # estimated / measured, mean over layers
        estimated, seconds = _layer_costs(model_file, WIDE, measure=False), measured[model_file]
        return sum(estimated[name] / m for name, m in seconds.items()) / len(seconds)

    dense_ratio = ratio("models/hf/llama.py")
    moe = ratio("models/hf/mixtral.py")
    assert moe > 0.55 * dense_ratio, (moe, dense_ratio)  # measured here: 0.73-0.79 against 0.95-0.99
    # the check catches experts charged nothing (as before grouped GEMMs had a formula): 0.32-0.34;
    # only the estimate changes, so the measured times are reused and the comparison is with the
    # full estimate's ratio over the same measurements (a noisy measurement of the dense layer, 0.41
    # instead of 0.95 once in CI, moves both sides of the check above, not this one)
    import planner.costs.roofline as roofline

    monkeypatch.setattr(roofline, "grouped_gemm", lambda func, args: None)
    blind = ratio("models/hf/mixtral.py")
    # the two estimates over the same measured times of the same layers: 0.53 here, whatever the noise
    assert blind < 0.7 * moe, (blind, moe, dense_ratio)


def test_an_estimated_moe_plan_searches_microbatches_down_to_one_sample(tmp_path: Path) -> None:
    # transformers' MoE experts do not run eagerly on the meta device (Mixtral's loop over the experts
    # the router hit calls Tensor.item; GPT-OSS's grouped GEMMs refuse fp32), but trace at any size: the
    # estimate reaches one sample, as large MoE runs train (it stopped at half the profiled size)
    pytest.importorskip("transformers")
    from planner.api import make_plan
    from planner.schema.request import PlanRequest

    request = PlanRequest.build(
        model_file=ROOT / "models" / "hf" / "mixtral.py",
        size="tiny",
        gpus=4,
        batch_size=32,
        gpu_type="h100",
        output=tmp_path / "plan.json",
        progress=False,
    )
    plan = make_plan(request)
    assert (plan.profile.microbatch_size, plan.profile.min_microbatch_size) == (4, 1)
