"""Tier 2 (CPU torch): the tracing fallback chain, blocks, legal cuts and stage modules.

Stage chaining is checked bit for bit (``torch.equal``): a stage graph replays the very nodes of
the traced graph, in the same order, on the same parameters, so the result must not move.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.capture.blocks import GraphTrace, ModuleTrace, TracedModel
from planner.capture.load import load_model_file, move_model
from planner.capture.stage import build_stage_module, stage_module
from planner.capture.trace import trace_model
from planner.errors import PlannerError, TraceError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODELS = ["gpt", "encoder_lm", "resnet50", "shakespeare", "toy"]

EXPECTED_BLOCKS = {
    "gpt": [("tok_embeddings", False)]
    + [(f"layers.{i}", True) for i in range(4)]
    + [("norm", False), ("output", False)],
    # nn.Sequential(Encoder, TransformerEncoderLayer x 4, Decoder): only the repeated type is a layer
    "encoder_lm": [("0", False), ("1", True), ("2", True), ("3", True), ("4", True), ("5", False)],
    "resnet50": [("conv1", False), ("bn1", False), ("relu", False), ("maxpool", False)]
    + [(f"layer{s}.{i}", True) for s, n in zip((1, 2, 3, 4), (3, 4, 6, 3)) for i in range(n)]
    + [("avgpool", False), ("fc", False)],
    "shakespeare": [("token_embedding_table", False), ("position_embedding_table", False)]
    + [(f"blocks.{i}", True) for i in range(4)]
    + [("ln_f", False), ("lm_head", False)],
    "toy": [("net1", False), ("relu", False), ("net2", False)],
}


@functools.cache
def _load(path: str, size: str = "tiny", batch: int = 2, **overrides):
    """(model in eval mode, inputs, target, traced) for a model file; cached per module run."""
    mf = load_model_file(path, size, overrides or None)
    model = mf.build(seed=0).eval()
    inputs, target = mf.batch(batch, seed=0)
    return model, inputs, target, trace_model(model, inputs)


def shipped(name: str):
    return _load(str(ROOT / "models" / f"{name}.py"))


def fixture(name: str, **overrides):
    return _load(str(FIXTURES / f"{name}.py"), **overrides)


def run_stages(traced: TracedModel, starts: list[int], inputs: tuple):
    """Chain build_stage_module over the partition with the given stage starts (starts[0] == 0)."""
    bounds = list(starts) + [len(traced.blocks)]
    args = tuple(inputs)
    out = None
    for a, b in zip(bounds, bounds[1:]):
        out = build_stage_module(traced, a, b)(*args)
        args = out if isinstance(out, tuple) else (out,)
    return out


def legal_starts(traced: TracedModel) -> list[int]:
    """Block indices a stage may start at (after a legal cut)."""
    return [c.after + 1 for c in traced.cuts if c.legal]


# --- the shipped models ------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_shipped_models_trace_with_fx_and_expected_blocks(name):
    model, inputs, _, traced = shipped(name)
    assert traced.method == "fx" and traced.failures == []
    assert isinstance(traced, GraphTrace)
    assert [(b.name, b.is_layer) for b in traced.blocks] == EXPECTED_BLOCKS[name]
    assert len(traced.cuts) == len(traced.blocks) - 1
    assert [c.after for c in traced.cuts] == list(range(len(traced.blocks) - 1))
    # every compute node is in exactly one block
    names = [n for b in traced.blocks for n in b.nodes]
    assert len(names) == len(set(names))
    compute = [n.name for n in traced.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert sorted(names) == sorted(compute)


@pytest.mark.parametrize("name", ["gpt", "encoder_lm", "shakespeare", "toy"])
def test_shipped_model_cuts_are_all_legal(name):
    _, _, _, traced = shipped(name)
    assert all(c.legal and c.reason == "" for c in traced.cuts), [(c.after, c.reason) for c in traced.cuts]


def test_resnet_cut_before_inplace_relu_is_the_only_illegal_one():
    """ResNet's stem is conv1 -> bn1 -> ReLU(inplace=True): a stage starting at the in-place ReLU
    would modify its received (leaf, requires-grad) input, which autograd refuses."""
    _, _, _, traced = shipped("resnet50")
    illegal = [(traced.blocks[c.after].name, c.reason) for c in traced.cuts if not c.legal]
    assert illegal == [("bn1", "relu modifies a received tensor in place")]


def test_gpt_cut_bytes_and_tensors_exact():
    _, (tokens,), _, traced = shipped("gpt")
    B, T, d, vocab = tokens.shape[0], tokens.shape[1], 64, 512
    assert (B, T) == (2, 32)
    assert [len(c.tensors) for c in traced.cuts] == [1] * 6
    assert [c.consts for c in traced.cuts] == [()] * 6
    assert [c.nbytes for c in traced.cuts] == [B * T * d * 4] * 6
    assert traced.values[traced.blocks[-1].nodes[-1]].nbytes == B * T * vocab * 4  # the float logits


def test_shakespeare_position_embedding_input_crosses_first_cut():
    # `pos_emb = position_embedding_table(torch.arange(T))`: arange runs at root level next to the
    # token embedding, so the cut between the two embeddings carries both tensors.
    _, (idx,), _, traced = shipped("shakespeare")
    B, T, C = idx.shape[0], idx.shape[1], 64
    first = traced.cuts[0]
    assert len(first.tensors) == 2 and first.nbytes == B * T * C * 4 + T * 8  # float embedding + int64 arange
    assert [len(c.tensors) for c in traced.cuts[1:]] == [1] * 6


@pytest.mark.parametrize("name", MODELS)
def test_one_block_stages_reproduce_the_model(name):
    model, inputs, _, traced = shipped(name)
    with torch.no_grad():
        expected = model(*inputs)
        got = run_stages(traced, [0] + legal_starts(traced), inputs)
    assert torch.equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_partitions_reproduce_the_model(name, data):
    model, inputs, _, traced = shipped(name)
    chosen = data.draw(st.sets(st.sampled_from(legal_starts(traced))), label="stage starts")
    with torch.no_grad():
        expected = model(*inputs)
        got = run_stages(traced, [0] + sorted(chosen), inputs)
    assert torch.equal(got, expected)


def test_resnet_stages_reproduce_in_train_mode_too():
    # Train-mode batch norm normalises with the batch statistics: stages must still agree exactly.
    mf = load_model_file(ROOT / "models" / "resnet50.py", "tiny")
    model = mf.build(seed=0).train()
    inputs, _ = mf.batch(4, seed=0)
    traced = trace_model(model, inputs)
    starts = [0, 4, 11, 20]
    with torch.no_grad():
        got = run_stages(traced, starts, inputs)
        expected = model(*inputs)
    assert torch.equal(got, expected)


def test_single_stage_is_the_whole_model():
    model, inputs, _, traced = shipped("gpt")
    stage = build_stage_module(traced, 0, len(traced.blocks))
    with torch.no_grad():
        assert torch.equal(stage(*inputs), model(*inputs))


def test_stage_modules_share_parameters_with_the_trace():
    _, _, _, traced = shipped("gpt")
    stage = build_stage_module(traced, 1, 3)
    gm_params = {id(p) for p in traced.gm.parameters()}
    assert {id(p) for p in stage.parameters()} <= gm_params
    # the stage holds exactly the parameters of layers.0 and layers.1
    expected = {id(p) for n in ("layers.0", "layers.1") for p in traced.model.get_submodule(n).parameters()}
    assert {id(p) for p in stage.parameters()} == expected


@pytest.mark.parametrize("start, end", [(0, 0), (3, 2), (-1, 2), (0, 8), (7, 8)])
def test_bad_stage_range(start, end):
    _, _, _, traced = shipped("gpt")
    with pytest.raises(TraceError, match=r"not within the model's 7 blocks"):
        build_stage_module(traced, start, end)


# --- skip connections, shape constants, non-tensor values --------------------------------------


def test_skip_connection_crosses_every_inner_cut():
    model, inputs, _, traced = fixture("skip")
    assert [b.name for b in traced.blocks] == ["inp", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    # x0 = inp(x) is live until the head: it rides along with the hidden state over four cuts
    assert [len(c.tensors) for c in traced.cuts] == [1, 2, 2, 2, 2][:4] + [1]
    assert all(c.legal for c in traced.cuts)
    assert all(c.tensors[0] == "inp" for c in traced.cuts[:4])
    B, d = inputs[0].shape
    assert [c.nbytes for c in traced.cuts] == [B * d * 4, 2 * B * d * 4, 2 * B * d * 4, 2 * B * d * 4, B * d * 4]


def test_skip_connection_passes_through_a_stage_unchanged():
    model, inputs, _, traced = fixture("skip")
    with torch.no_grad():
        x0, h0 = build_stage_module(traced, 0, 2)(*inputs)
        x0_out, h1 = build_stage_module(traced, 2, 3)(x0, h0)
    assert x0_out is x0  # the skip value is returned as received, not recomputed or copied
    assert not torch.equal(h1, h0)


@settings(max_examples=20, deadline=None)
@given(chosen=st.sets(st.integers(1, 5)))
def test_skip_connection_random_partitions(chosen):
    model, inputs, _, traced = fixture("skip")
    with torch.no_grad():
        assert torch.equal(run_stages(traced, [0] + sorted(chosen), inputs), model(*inputs))


def test_shape_ints_cross_cuts_as_baked_constants():
    model, inputs, _, traced = fixture("shape_int")
    B, T, _ = inputs[0].shape
    assert all(c.legal for c in traced.cuts)
    assert all(len(c.tensors) == 1 for c in traced.cuts)
    consts = {traced.values[name].const for c in traced.cuts for name in c.consts}
    assert all(len(c.consts) == 2 for c in traced.cuts)
    assert consts == {B, T}
    assert all(traced.values[n].kind == "const" and traced.values[n].nbytes == 0 for c in traced.cuts for n in c.consts)
    # the last stage receives only the hidden state and still reshapes with the baked B * T
    last = build_stage_module(traced, len(traced.blocks) - 1, len(traced.blocks))
    assert len([n for n in last.graph.nodes if n.op == "placeholder"]) == 1
    with torch.no_grad():
        for starts in ([0, 1, 2, 3, 4], [0, 4], [0, 2], [0, 1, 3]):
            got = run_stages(traced, starts, inputs)
            assert got.shape == (B * T, 4)
            assert torch.equal(got, model(*inputs))


def test_non_tensor_value_makes_only_its_cut_illegal():
    model, inputs, _, traced = fixture("tuple_cross")
    assert [b.name for b in traced.blocks] == ["inp", "layers.0", "layers.1", "layers.2", "head"]
    assert [c.legal for c in traced.cuts] == [True, False, True, True]
    bad = traced.cuts[1]
    assert bad.reason == "non-tensor value(s) chunk cross this boundary"
    assert traced.values["chunk"].kind == "opaque"
    with pytest.raises(TraceError, match=r"cannot cut after block layers\.0: non-tensor value\(s\) chunk"):
        build_stage_module(traced, 0, 2)
    with pytest.raises(TraceError, match=r"cannot cut after block layers\.0"):
        build_stage_module(traced, 2, 5)
    with torch.no_grad():
        for starts in ([0, 1, 3, 4], [0, 3], [0, 1]):
            assert torch.equal(run_stages(traced, starts, inputs), model(*inputs))


def test_block_graph_edges_carry_the_values():
    _, _, _, traced = fixture("skip")
    g = traced.block_graph
    assert sorted(g.nodes) == list(range(6))
    # inp feeds layers.0 and (the skip) the last layer's block, where `h + x0` runs at root level
    assert g.edges[0, 1]["values"] == ["inp"] and g.edges[0, 4]["values"] == ["inp"]
    assert all(g.has_edge(i, i + 1) for i in range(5))


# --- fingerprint, no side effects --------------------------------------------------------------


def test_fingerprint_stable_across_builds_and_changes_with_structure():
    path = ROOT / "models" / "gpt.py"
    mf = load_model_file(path, "tiny")
    inputs, _ = mf.batch(2)
    a = trace_model(mf.build(seed=0), inputs).fingerprint
    b = trace_model(mf.build(seed=1), inputs).fingerprint  # other weights, same structure
    assert a == b and len(a) == 16
    other = load_model_file(path, "tiny", {"n_layers": 3})
    assert trace_model(other.build(seed=0), inputs).fingerprint != a
    wider = load_model_file(path, "tiny", {"ffn_dim": 128})
    assert trace_model(wider.build(seed=0), inputs).fingerprint != a


def test_fingerprint_is_the_models_wherever_and_in_whatever_dtype_it_was_traced():
    """A plan measured on a GPU (the model moved there first) or estimated for one (built on meta, cast
    to bf16) names the model `planner run` builds on the CPU in fp32. Llama's rotary tables are one
    buffer registered in every layer: ``Module.to`` gives each layer its own copy, which the fx tracer
    names apart, so the moved model traced into another graph (seen on an H100: a plan measured there
    was refused by `planner run` there)."""
    mf = load_model_file(ROOT / "models" / "llama.py", "tiny")
    inputs, _ = mf.batch(1)
    on_meta = tuple(x.to("meta") for x in inputs)
    built = trace_model(mf.build(seed=0), inputs).fingerprint
    moved = move_model(mf.build(seed=0), "meta")
    assert moved.layers[0].attention.rope_cos is moved.layers[3].attention.rope_cos
    assert trace_model(moved, on_meta).fingerprint == built
    assert trace_model(move_model(mf.build(seed=0), dtype=torch.bfloat16), inputs).fingerprint == built
    with torch.device("meta"):
        estimated = move_model(mf.build(seed=0), dtype=torch.bfloat16)
    assert trace_model(estimated, on_meta).fingerprint == built
    # what move_model prevents: plain .to() unshares the tables and the graph differs
    assert trace_model(mf.build(seed=0).to("meta"), on_meta).fingerprint != built
    # shapes still count
    assert (
        trace_model(load_model_file(ROOT / "models" / "llama.py", "tiny", {"dim": 96}).build(), inputs).fingerprint
        != built
    )


def _snapshot(model: torch.nn.Module):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {n: p.requires_grad for n, p in model.named_parameters()},
        [m.training for m in model.modules()],
    )


def _assert_unchanged(model: torch.nn.Module, snap) -> None:
    state, flags, training = snap
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k in state:
        assert torch.equal(now[k], state[k]), k
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == training


@pytest.mark.parametrize("name", ["gpt", "resnet50"])
def test_trace_does_not_modify_the_model(name):
    mf = load_model_file(ROOT / "models" / f"{name}.py", "tiny")
    model = mf.build(seed=0)  # train mode: batch norm would update running stats if run
    inputs, _ = mf.batch(2)
    snap = _snapshot(model)
    traced = trace_model(model, inputs)
    _assert_unchanged(model, snap)
    assert traced.model is not model
    assert not {id(p) for p in model.parameters()} & {id(p) for p in traced.model.parameters()}


# --- the fallback chain ------------------------------------------------------------------------


def test_data_dependent_control_flow_falls_back_to_module_boundaries():
    model, inputs, _, traced = fixture("data_dependent")
    assert traced.method == "modules" and isinstance(traced, ModuleTrace)
    assert [m for m, _ in traced.failures] == ["fx", "export"]
    assert "control flow" in traced.failures[0][1]
    assert "data-dependent" in traced.failures[1][1]
    assert all("\n" not in reason for _, reason in traced.failures)
    assert [(b.name, b.is_layer) for b in traced.blocks] == [
        ("inp", False),
        ("layers.0", True),
        ("layers.1", True),
        ("layers.2", True),
        ("head", False),
    ]
    assert all(c.legal for c in traced.cuts)
    B, d = inputs[0].shape
    assert [c.nbytes for c in traced.cuts] == [B * d * 4] * 4
    with pytest.raises(TraceError, match="module-boundary trace has no graph to cut"):
        build_stage_module(traced, 0, 2)
    # its blocks are a chain: stages call them one after another and give the model's output
    assert traced.chain_reason == ""
    torch.manual_seed(0)
    want = model(*inputs)
    with torch.no_grad():
        h = stage_module(traced, 0, 2)(*inputs)
        got = stage_module(traced, 2, 5)(h)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)


def test_work_between_blocks_is_no_chain():
    # a model that scales the hidden state between its layers: stages made of its blocks alone
    # would drop that, so the module-boundary trace says it is no chain
    import torch.nn as nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x) * 2
            if x.sum() > 0:  # keeps fx and export out
                return x
            return -x

    traced = trace_model(Scaled(), (torch.randn(2, 4),))
    assert traced.method == "modules"
    assert traced.chain_reason == "layers.1 does not take layers.0's output as it is (the model changes it in between)"
    with pytest.raises(TraceError, match="cannot run as a chain of stages: layers.1 does not take"):
        stage_module(traced, 0, 1)


def test_modules_fallback_does_not_modify_the_model():
    mf = load_model_file(FIXTURES / "data_dependent.py", "tiny")
    model = mf.build(seed=0)
    inputs, _ = mf.batch(2)
    snap = _snapshot(model)
    traced = trace_model(model, inputs)
    assert traced.method == "modules"
    _assert_unchanged(model, snap)
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_nothing_can_trace_a_model_without_children():
    mf = load_model_file(FIXTURES / "no_children.py", "tiny")
    model = mf.build()
    inputs, _ = mf.batch(2)
    with pytest.raises(TraceError) as e:
        trace_model(model, inputs)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("could not trace Flat with any of fx, export, modules (")
    assert "fx: TraceError: symbolically traced variables cannot be used as inputs to control flow" in msg
    assert "export: GuardOnDataDependentSymNode" in msg
    assert "modules: Flat has no child modules to use as pipeline blocks" in msg
    assert isinstance(e.value, PlannerError)


def test_methods_argument_restricts_the_chain():
    mf = load_model_file(FIXTURES / "data_dependent.py", "tiny")
    inputs, _ = mf.batch(2)
    with pytest.raises(TraceError) as e:
        trace_model(mf.build(), inputs, methods=("fx",))
    assert "any of fx (fx: TraceError" in str(e.value)
    assert trace_model(mf.build(), inputs, methods=("modules",)).failures == []


def test_shape_control_flow_is_traced_by_export():
    model, inputs, _, traced = fixture("shape_branch")
    assert traced.method == "export"
    assert traced.failures == [
        (
            "fx",
            "TraceError: symbolically traced variables cannot be used as inputs to control flow "
            "(at shape_branch.py:15: if h.shape[1] > 4:  # static under export (fixed example shape), a Proxy under fx)",
        )
    ]
    assert [(b.name, b.is_layer) for b in traced.blocks] == [
        ("inp", False),
        ("layers.0", True),
        ("layers.1", True),
        ("layers.2", True),
        ("norm", False),
        ("head", False),
    ]
    assert all(c.legal and len(c.tensors) == 1 for c in traced.cuts)


@settings(max_examples=20, deadline=None)
@given(chosen=st.sets(st.integers(1, 5)))
def test_export_graph_stages_reproduce_the_model(chosen):
    model, inputs, _, traced = fixture("shape_branch")
    with torch.no_grad():
        assert torch.equal(run_stages(traced, [0] + sorted(chosen), inputs), model(*inputs))


@pytest.mark.parametrize("name", ["encoder_lm", "toy"])
def test_export_gives_the_same_blocks_as_fx(name):
    model, inputs, _, fx_traced = shipped(name)
    traced = trace_model(model, inputs, methods=("export",))
    assert traced.method == "export"
    assert [(b.name, b.is_layer) for b in traced.blocks] == [(b.name, b.is_layer) for b in fx_traced.blocks]
    assert traced.fingerprint != fx_traced.fingerprint  # the method is part of the structure
    # Reference with grad enabled: under no_grad an eval-mode nn.TransformerEncoderLayer takes its
    # fused fast path (a different kernel, ~1e-7 apart), while export records the composite ops.
    expected = model(*inputs).detach()
    with torch.no_grad():
        assert torch.equal(run_stages(traced, list(range(len(traced.blocks))), inputs), expected)


# --- in-place operations whose result is not used ----------------------------------------------


class _MutatesInPlace(torch.nn.Module):
    """``y.mul_(2)`` with the result discarded: the mutation is the whole effect."""

    def __init__(self, mode: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.mode = mode

    def forward(self, x):
        y = self.lin(x)
        if self.mode == "method":
            y.mul_(2)
        else:
            y.view(-1).add_(1)  # through a view
        return torch.tanh(y)


class _InPlaceModel(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), _MutatesInPlace(mode), torch.nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["method", "view"])
def test_stage_keeps_in_place_ops_whose_result_is_unused(mode):
    torch.manual_seed(0)
    model = _InPlaceModel(mode).eval()
    x = torch.randn(2, 4)
    traced = trace_model(model, (x,))
    assert traced.method == "fx"
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(traced.gm(x), expected)  # the traced graph itself is right
        assert torch.equal(build_stage_module(traced, 0, 3)(x), expected)
        assert torch.equal(run_stages(traced, [0, 1, 2], (x,)), expected)


# --- what a failed trace says ---------------------------------------------------------------------


def test_a_long_reason_is_cut_between_sentences_never_inside_a_link():
    from planner.capture.trace import short_reason

    long = (
        "The model returned a cache object. " * 20
        + "See https://pytorch.org/docs/main/export.html#some-very-long-anchor for more."
    )
    try:
        raise RuntimeError(long)
    except RuntimeError as e:
        text = short_reason(e)
    assert text.startswith("RuntimeError: The model returned a cache object.") and "https" not in text
    message = text.split(" (at ")[0]  # then the line of the code it passed through
    assert len(message) <= 520 and message.endswith("cache object. ...")


def test_the_control_flow_advice_only_where_control_flow_stopped_the_tracer():
    from planner.capture.trace import trace_advice

    data = [("export", "GuardOnDataDependentSymNode: Could not guard on data-dependent expression Eq(u0, 1)")]
    cache = [("export", "RuntimeError: the output contains a DynamicCache, which torch.export cannot return")]
    assert "data-dependent control flow" in trace_advice(data)
    assert "control flow" not in trace_advice(cache) and "--debug" in trace_advice(cache)


class _ReturnsAnObject(torch.nn.Module):
    """A forward whose output neither tracer can return as a graph output (an opaque Python object)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> object:
        return functools.partial(print, self.lin(x))


def test_a_model_that_fails_for_another_reason_is_not_told_about_control_flow():
    with pytest.raises(TraceError) as e:
        trace_model(_ReturnsAnObject(), (torch.randn(2, 4),), methods=("export",))
    assert "control flow" not in str(e.value)


def test_an_exported_graph_runs_where_its_stages_run() -> None:
    """torch.export bakes the device of tensors made in the forward (a transformers model's positions
    and masks): traced on the CPU, the runner points them at the rank's device (here: meta), and the
    dtype checks export puts before each .to() are gone (autocast changes the dtypes they assert)."""
    pytest.importorskip("transformers")
    from planner.capture.graph import retarget_devices
    from planner.capture.load import load_model_file

    mf = load_model_file(Path(__file__).resolve().parents[1] / "models" / "hf" / "albert.py", "tiny")
    inputs, _ = mf.batch(2)
    traced = trace_model(mf.build(seed=0), inputs)
    assert traced.method == "export"
    assert not [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    made_here = [n for n in traced.gm.graph.nodes if n.kwargs.get("device") == torch.device("cpu")]
    assert made_here  # arange(..., device=cpu)
    assert retarget_devices(traced.gm, torch.device("meta")) >= len(made_here)
    assert not [n for n in traced.gm.graph.nodes if n.kwargs.get("device") == torch.device("cpu")]
    traced.gm.to("meta")
    out = traced.gm(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs])
    assert out.logits.device.type == "meta"


@pytest.mark.parametrize("name", [*MODELS, "llama"])
def test_the_planners_fx_tracer_makes_the_graph_fx_tracer_makes(name: str) -> None:
    """``trace_fx``'s tracer reads parameters from tables and lowers plain arguments through fx's own
    bypass table, and gives a node its arguments after making it: the graph is fx.Tracer's, node for
    node (names, ops, targets, arguments, and the users each node's arguments give it)."""
    import torch.fx as fx

    from planner.capture.graph import trace_fx

    mf = load_model_file(ROOT / "models" / f"{name}.py", "tiny")
    model = mf.build(0)
    inputs, _ = mf.batch(2)

    def nodes(graph: fx.Graph) -> list[tuple[str, ...]]:
        return [
            (n.name, n.op, str(n.target), str(n.args), str(n.kwargs), str(list(n.users)), str(n.all_input_nodes))
            for n in graph.nodes
        ]

    ours = trace_fx(model, inputs).graph
    theirs = fx.Tracer().trace(model)
    assert nodes(ours) == nodes(theirs) and len(nodes(ours)) >= 5
