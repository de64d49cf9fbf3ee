"""Layers that share weights or inputs under the split backward of zero-bubble schedules.

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

ALBERT = """
import torch
import torch.nn.functional as F

def build_model(vocab_size=128, hidden=32, layers=4, seq_len=16, **_ignored):
    from transformers import AlbertConfig, AlbertForMaskedLM
    config = AlbertConfig(vocab_size=vocab_size, embedding_size=16, hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=seq_len,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    return AlbertForMaskedLM(config)

def make_batch(batch_size, vocab_size=128, seq_len=16, **_ignored):
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return {"input_ids": ids}, ids
"""


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


@pytest.mark.slow
def test_albert_plans(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = tmp_path / "albert.py"
    model.write_text(ALBERT)
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        main, ["plan", str(model), "--gpus", "2", "-b", "4", "--repeats", "1", "-q", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.exists()
