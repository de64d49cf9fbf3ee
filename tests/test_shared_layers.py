"""Layers that share weights: one layer module applied to every block (ALBERT, Universal Transformers),
and inputs shared under the two-part backward of zero-bubble schedules.

Each call of a module the forward calls again is a block of its own (both tracers key the later calls
``layer@N`` in a node's module stack), and its parameters are a tie across the stages that apply it.

torch's ``stage_backward_weight`` runs one ``autograd.grad`` per parameter group without keeping the
graph, so groups that reach shared nodes failed with "Trying to backward through the graph a second
time": ALBERT (one layer module applied to every block) stopped `planner plan` while profiling the
input/weight split, and T5 (a position bias made once and read by every decoder layer) stopped
`planner run` under interleaved-zb (tests/test_estimated_runs.py runs that one).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from cli import main
from planner.costs.timing import time_input_weight

ROOT = Path(__file__).resolve().parents[1]


class _SharedBias(nn.Module):
    """T5's pattern in small: a bias made by the first layer from its own weight, read by both layers."""

    def __init__(self) -> None:
        super().__init__()
        self.bias_table = nn.Parameter(torch.randn(8))
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias_table * 2
        return self.second(torch.relu(self.first(x) + bias)) + bias


def test_the_weight_backward_of_groups_that_share_nodes_runs() -> None:
    block = _SharedBias()
    x = torch.randn(3, 8, requires_grad=True)
    seconds = time_input_weight(lambda a: block(*a).square().mean(), (x,), list(block.parameters()))
    assert all(s >= 0 for s in seconds)
    want = torch.autograd.grad(block(x).square().mean(), list(block.parameters()))
    for p in block.parameters():
        p.grad = None
    time_input_weight(lambda a: block(*a).square().mean(), (x,), list(block.parameters()))
    for p, w in zip(block.parameters(), want):
        assert torch.allclose(p.grad, w)  # every group's gradient, counted once


class _Universal(nn.Module):
    """A Universal Transformer in small: one layer applied ``depth`` times (fx follows it)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.depth = depth
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(self.depth):
            h = h + self.layers[0](h)
        return self.head(h)


UNIVERSAL = """
import torch
from torch import nn
import torch.nn.functional as F

class Universal(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.depth = depth
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(self.depth):
            h = h + self.layers[0](h)
        return self.head(h)

def build_model(depth=6, **_ignored):
    return Universal(depth)

def make_batch(batch_size, **_ignored):
    return (torch.randn(batch_size, 6),), torch.randint(0, 3, (batch_size,))

loss_fn = F.cross_entropy
"""


@pytest.mark.parametrize("method", ["fx", "export"])
def test_each_application_of_a_shared_layer_is_a_block(method: str) -> None:
    from planner.capture.trace import trace_model

    traced = trace_model(_Universal(depth=4), (torch.randn(2, 6),), methods=(method,))
    names = [b.name for b in traced.blocks]
    assert names == ["embed", "layers.0", "layers.0#2", "layers.0#3", "layers.0#4", "head"]
    assert [b.is_layer for b in traced.blocks] == [False, True, True, True, True, False]
    assert all(c.legal for c in traced.cuts)
    ties = traced.tied_parameters()
    assert sorted(t.names for t in ties) == [("layers.0.0.bias",), ("layers.0.0.weight",)]
    assert all(t.blocks == (1, 2, 3, 4) for t in ties)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_shared_layer_split_over_stages_trains_like_the_unsplit_model(tmp_path: Path) -> None:
    """A Universal Transformer (torch.fx): the layer's applications on 2 stages, its weights a tie the
    runner keeps equal; measured (1F1B) and estimated plans (interleaved zero-bubble: the two-part backward
    of a layer whose weights other blocks also read). ALBERT (torch.export): tests/test_hf_matrix.py."""
    from planner.api import make_plan
    from planner.schema.request import PlanRequest
    from tests.run_factory import assert_trains_like_unsplit

    model = tmp_path / "universal.py"
    model.write_text(UNIVERSAL)
    # The measured plan takes the equal-layer split: on this noisy machine's costs the searched split may
    # keep every application of the layer on one stage (then nothing is shared across stages to check).
    for gpu_type, schedule, method in ((None, "1f1b", "uniform"), ("cpu", "interleaved-zb", "optimal")):
        request = PlanRequest.build(
            model_file=model,
            gpus=2,
            batch_size=4,
            microbatches=2,
            gpu_type=gpu_type,
            schedule=schedule,
            method=method,
            repeats=1,
            output=tmp_path / "plan.json",
            progress=False,
        )
        plan = make_plan(request)
        shared = [t for t in plan.ties if len(t.blocks) > 2]
        assert shared and all(len(plan.tie_stages(t)) == 2 for t in shared)  # the layer is on both stages
        assert_trains_like_unsplit(plan, tmp_path, f"{gpu_type}, {schedule}")


@pytest.mark.slow
def test_albert_report_names_the_shared_layer_once(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main,
        [
            "plan",
            str(ROOT / "models" / "hf" / "albert.py"),
            "--size",
            "tiny",
            "--gpus",
            "2",
            "--gpu-type",
            "cpu",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    tied = [line for line in result.output.splitlines() if line.strip().startswith("tied:")]
    assert len(tied) == 2, tied  # the embedding = the MLM decoder; the shared layer's 16 tensors on one line
    assert "16 parameters of albert.encoder.albert_layer_groups.0.albert_layers.0" in tied[1]
    assert "a copy on stages 0 and 1" in tied[1]
