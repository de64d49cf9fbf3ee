"""Where a traced graph calls an experts module, recorded by both tracers without changing the graph's
operators, and that call replaced in a stage by one module call (``planner.capture.expert_calls``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.capture.ep_plan import resolve_experts
from planner.capture.expert_calls import META_KEY, TAG, ExpertCall, calls_of, replace_calls
from planner.capture.graph_file import dump_graph, load_graph
from planner.capture.load import load_model_file
from planner.capture.stage import build_stage_module
from planner.capture.trace import trace_model
from planner.errors import TraceError

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "moe_file.py"
MIXTRAL = ROOT / "models" / "hf" / "mixtral.py"


def _traced(path: Path, experts: bool, method: str):  # type: ignore[no-untyped-def]
    mf = load_model_file(path, "tiny")
    model = mf.build(seed=0)
    inputs, _ = mf.batch(2, seed=0)
    names = tuple(resolve_experts(mf, model).counts) if experts else ()
    return mf, model, inputs, trace_model(model, inputs, methods=(method,), experts=names)


def _ops(traced) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    return [(n.op, str(n.target)) for n in traced.gm.graph.nodes]


@pytest.mark.parametrize(("path", "method"), [(FIXTURE, "fx"), (MIXTRAL, "export")], ids=["fx", "export"])
def test_both_tracers_record_the_calls_and_keep_the_operators(path: Path, method: str) -> None:
    if method == "export":
        pytest.importorskip("transformers")
    *_, plain = _traced(path, False, method)
    *_, traced = _traced(path, True, method)
    # the same operators; torch.export names some getitem nodes otherwise, so the fingerprint moves
    assert _ops(traced) == _ops(plain) and (traced.fingerprint == plain.fingerprint) == (method == "fx")
    assert calls_of(plain.gm) == {}
    calls = calls_of(traced.gm)
    prefix = "layers.{}.moe.experts" if method == "fx" else "model.layers.{}.mlp.experts"
    assert list(calls) == [prefix.format(i) for i in range(2)]
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    for call in calls.values():
        assert all(name in nodes for name in (*call.inputs, call.output))
    if method == "export":  # the router's values: its top-k ids and their normalised weights
        assert [nodes[n].meta["val"].dtype for n in calls["model.layers.0.mlp.experts"].inputs] == [
            torch.float32,
            torch.int64,
            torch.float32,
        ]


class _Whole(nn.Module):
    """Calls the (whole) experts module: a replaced call that must compute what the graph did."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", experts)  # not registered: the stage holds it at its own name

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.inner(hidden, index, weights)


@pytest.mark.parametrize(("path", "method"), [(FIXTURE, "fx"), (MIXTRAL, "export")], ids=["fx", "export"])
def test_a_stage_with_its_calls_replaced_computes_what_the_graph_did(path: Path, method: str) -> None:
    if method == "export":
        pytest.importorskip("transformers")
    mf, model, inputs, traced = _traced(path, True, method)
    n = len(traced.blocks)
    graph_stage = build_stage_module(traced, 0, n)
    stage = build_stage_module(traced, 0, n)
    calls = calls_of(traced.gm)
    originals = {name: traced.model.get_submodule(name) for name in calls}

    def target(name: str) -> str:
        path_ = f"_experts_{name.replace('.', '_')}"
        stage.add_module(path_, _Whole(originals[name]))
        return path_

    assert replace_calls(stage, list(calls), target) == list(calls)
    kinds = [n.op for n in stage.graph.nodes]
    assert kinds.count("call_module") - [n.op for n in graph_stage.graph.nodes].count("call_module") == len(calls)
    assert not any("experts" in str(n.target) for n in stage.graph.nodes if n.op == "get_attr")
    x = tuple(t for t in inputs if isinstance(t, torch.Tensor))
    want, got = graph_stage(*x), stage(*x)
    torch.testing.assert_close(got, want)


def test_the_graph_file_carries_the_calls() -> None:
    pytest.importorskip("transformers")
    _, model, _, traced = _traced(MIXTRAL, True, "export")
    rebuilt = load_graph(dump_graph(traced.gm, traced.model), copy.deepcopy(traced.model))
    assert calls_of(rebuilt) == calls_of(traced.gm) and len(calls_of(rebuilt)) == 2
    assert isinstance(next(iter(calls_of(rebuilt).values())), ExpertCall)


def test_a_call_the_forward_never_makes_or_reads_beyond_its_inputs_is_one_line() -> None:
    mf = load_model_file(FIXTURE, "tiny")
    model = mf.build(seed=0)
    inputs, _ = mf.batch(2, seed=0)
    with pytest.raises(TraceError, match=r"fx: TraceError: the forward never calls the experts module layers\.0\.norm"):
        trace_model(model, inputs, methods=("fx",), experts=("layers.0.norm",))
    _, _, _, traced = _traced(FIXTURE, True, "fx")
    stage = build_stage_module(traced, 0, len(traced.blocks))
    call = calls_of(traced.gm)["layers.0.moe.experts"]
    # the experts' call marked as taking the router's logits instead of the hidden states: the
    # operators between it and the output read the hidden states, made outside the module
    nodes = {n.name: n for n in stage.graph.nodes}
    logits = next(n for n in stage.graph.nodes if n.op == "call_module" and "router" in str(n.target))
    del nodes[call.inputs[0]].meta[TAG]
    logits.meta[TAG] = (call.name, 0)
    with pytest.raises(TraceError, match=r"layers\.0\.moe\.experts reads .*, which is neither one of its three inputs"):
        replace_calls(stage, [call.name], lambda name: "x")
    assert traced.gm.meta[META_KEY]["layers.0.moe.experts"] == call
