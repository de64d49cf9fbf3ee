"""Mixture-of-experts layers cost what they compute: grouped GEMMs are charged their FLOPs.

torch.utils.flop_counter has no formula for ``aten._grouped_mm`` (transformers 5 runs every Mixtral,
Qwen-MoE, ... expert through it, or through its own ``transformers::grouped_mm_fallback`` custom op),
so the roofline charged the experts nothing: a tiny Mixtral layer estimated 17 MFLOP where its
matmuls are about 68.
"""

from __future__ import annotations

import pytest
import torch

from planner.core.hardware import get_hardware
from planner.costs.roofline import Roofline, Tally, _grouped_gemm

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
def test_grouped_gemm_flops_are_the_ungrouped_products(a, b, offs, flops, dims) -> None:
    args = (_meta(*a), _meta(*b), torch.empty(offs, dtype=torch.int32, device="meta") if offs else None)
    assert _grouped_gemm(aten._grouped_mm.default, args) == (flops, dims)
    assert _grouped_gemm(aten.mm.default, args[:2]) is None  # flop_counter's own formula applies there


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
