"""Tier 2 (CPU torch): the launcher's torch.export graph, written and rebuilt on another copy of the
model (planner.capture.graph_file), is the graph a fresh export gives: the same code, parameters,
buffers and state-dict names in the same order, the same blocks, cuts, recorded values and
fingerprint, and the same outputs bit for bit. A graph that does not fit is refused or re-traced.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from planner.capture.blocks import GraphTrace
from planner.capture.graph import trace_export
from planner.capture.graph_file import GraphFileError, RankGraphs, dump_graph, load_graph
from planner.capture.load import load_model_file
from planner.capture.trace import trace_model

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# tied head (two names for one weight), buffers some of which stay out of the state dict (rotary
# tables), a buffer on the root module itself (BART's final_logits_bias), encoder-decoder inputs
FAMILIES = ["gpt2", "llama", "bart"]


def _built(family: str, tmp_path: Path) -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.test_hf_matrix import _model_file

    path, size = _model_file(family, tmp_path)
    mf = load_model_file(path, size, {})
    return mf.build(0), mf.batch(2, seed=0)[0]


def _names(module: nn.Module) -> tuple[list[str], list[str], list[str]]:
    return (
        [n for n, _ in module.named_parameters(remove_duplicate=False)],
        [n for n, _ in module.named_buffers(remove_duplicate=False)],
        list(module.state_dict()),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rebuilt_graph_is_the_exported_one(family: str, tmp_path: Path) -> None:
    model, example = _built(family, tmp_path)
    fresh = trace_model(model, example, methods=("export",), shapes_only=True)
    assert isinstance(fresh, GraphTrace)
    data = dump_graph(fresh.gm, fresh.model)
    rebuilt = trace_model(
        model, example, methods=("export",), shapes_only=True, exported=lambda private: load_graph(data, private)
    )
    assert isinstance(rebuilt, GraphTrace)
    assert rebuilt.gm.code == fresh.gm.code
    assert _names(rebuilt.gm) == _names(fresh.gm)
    assert rebuilt.fingerprint == fresh.fingerprint
    assert (rebuilt.blocks, rebuilt.cuts, rebuilt.values) == (fresh.blocks, fresh.cuts, fresh.values)
    assert [t.names for t in rebuilt.tied_parameters()] == [t.names for t in fresh.tied_parameters()]
    # the rebuilt graph reads the model it was rebuilt on: its weights, not copies
    assert {id(p) for p in rebuilt.gm.parameters()} == {id(p) for p in rebuilt.model.parameters()}


def test_a_rebuilt_graph_computes_what_the_export_does(tmp_path: Path) -> None:
    model, example = _built("llama", tmp_path)
    exported = trace_export(copy.deepcopy(model), example)
    rebuilt = load_graph(dump_graph(exported, model), model)
    torch.manual_seed(0)
    want = exported(*example)
    torch.manual_seed(0)
    got = rebuilt(*example)
    assert type(got) is type(want)  # the model's own output structure (pytree specs)
    assert torch.equal(got.logits, want.logits)


def test_a_graph_of_another_model_is_traced_afresh(tmp_path: Path) -> None:
    from planner.run.model import rebuilt_trace

    model, example = _built("gpt2", tmp_path)
    other, other_example = _built("llama", tmp_path)
    other_graph = dump_graph(trace_export(copy.deepcopy(other), other_example), other)

    class _Plan:  # the two fields rebuilt_trace reads
        class model:  # noqa: N801
            trace_method = "export"
            fingerprint = trace_model(model, example, methods=("export",), shapes_only=True).fingerprint

    # llama's graph does not fit gpt2's weights: no trace from it, so the rank exports its own
    assert rebuilt_trace(_Plan, model, example, other_graph) is None  # type: ignore[arg-type]


def test_bytes_that_are_no_graph_are_refused_in_one_line(tmp_path: Path) -> None:
    model, _ = _built("gpt2", tmp_path)
    for junk in (b"", b"not a pickle", pickle.dumps({"format": 0})):
        with pytest.raises(GraphFileError):
            load_graph(junk, model)
    assert RankGraphs.from_bytes(b"junk") is None
    graphs = RankGraphs(b"a", b"b")
    assert RankGraphs.from_bytes(graphs.to_bytes()) == RankGraphs(b"a", b"b")


def test_a_graph_holding_a_module_of_its_own_is_not_written() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu()

    net = Net()
    gm = torch.fx.symbolic_trace(net)  # calls self.lin as a module: not an exported graph
    with pytest.raises(GraphFileError, match="module lin"):
        dump_graph(gm, net)
