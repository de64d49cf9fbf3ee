"""The meta operator cache answers repeated calls exactly as the meta kernels do (CPU torch tier)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.capture.graph import record_values, trace_fx
from planner.capture.meta_cache import MetaOpCache, meta_op_cache, on_meta


def _layers(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)) for _ in range(n))
    )


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def test_identical_layers_run_their_kernels_once_and_record_the_same_values() -> None:
    with torch.device("meta"):
        model = _layers(6)
    x = torch.empty(4, 16, device="meta")
    gm = trace_fx(model, (x,))
    cache = MetaOpCache()
    with cache:
        out = gm(x)
    # addmm, gelu, addmm, native_layer_norm: run for the first layer, answered for the other five
    assert (cache.misses, cache.hits) == (4, 5 * 4)
    assert out.shape == (4, 16) and out.device.type == "meta"
    assert record_values(gm, (x,)) == _recorded_plainly(gm, x)  # record_values caches on its own


def _recorded_plainly(gm: torch.fx.GraphModule, x: torch.Tensor) -> dict:
    """What record_values gives without the cache (the same interpreter, no dispatch mode)."""
    from planner.capture.blocks import describe

    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> object:
            out = super().run_node(n)
            values[n.name] = describe(out)
            return out

    with torch.no_grad():
        Recorder(gm).run(x)
    return values


def test_outputs_match_the_kernels_metadata_for_strided_and_multi_output_ops() -> None:
    a = torch.empty(3, 8, 5, device="meta").transpose(0, 2)  # not contiguous
    b = torch.empty(5, 8, 7, device="meta")
    expected = [
        torch.bmm(a.transpose(0, 1).transpose(1, 2), b.transpose(0, 1)),
        torch.nn.functional.layer_norm(b, (7,)),
        a * 2.0,
        torch.softmax(b, -1),
        torch.topk(b, 3, -1)[1],
    ]
    cache = MetaOpCache()
    with cache:
        for _ in range(2):  # the second round is answered from the cache
            got = [
                torch.bmm(a.transpose(0, 1).transpose(1, 2), b.transpose(0, 1)),
                torch.nn.functional.layer_norm(b, (7,)),
                a * 2.0,
                torch.softmax(b, -1),
                torch.topk(b, 3, -1)[1],  # one of two outputs
            ]
    assert cache.hits > 0
    for e, g in zip(expected, got):
        assert (g.shape, g.stride(), g.dtype, g.device) == (e.shape, e.stride(), e.dtype, e.device)


def test_views_in_place_and_real_results_are_never_replayed() -> None:
    x = torch.empty(4, 6, device="meta")
    cache = MetaOpCache()
    with cache:
        for _ in range(3):
            v = x.view(6, 4)
            assert v.untyped_storage().nbytes() == x.untyped_storage().nbytes()  # still a view of x
            y = x.clone()
            assert y.add_(1.0) is y  # in place returns its own tensor
            r = torch.arange(5)  # a CPU tensor holds values: never answered from the cache
            assert r.tolist() == [0, 1, 2, 3, 4]
            z = x * torch.tensor(2.0)  # a real (0-dim) tensor argument: the call runs
            assert z.device.type == "meta"
    assert not any(f is torch.ops.aten.view.default for f, *_ in cache.answers)
    assert not any(f is torch.ops.aten.add_.Tensor for f, *_ in cache.answers)
    assert not any(f is torch.ops.aten.mul.Tensor for f, *_ in cache.answers)


def test_gradients_flow_through_replayed_outputs() -> None:
    with torch.device("meta"):
        model = _layers(3)
    x = torch.empty(4, 16, device="meta", requires_grad=True)
    with meta_op_cache() as cache:
        model(x).sum().backward()
    assert cache is not None and cache.hits > 0
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    assert x.grad is not None and x.grad.shape == x.shape


def test_on_meta_looks_at_parameters_and_inputs() -> None:
    real = nn.Linear(2, 2)
    assert not on_meta(real, (torch.zeros(1, 2),))
    assert on_meta(real, (torch.zeros(1, 2, device="meta"),))
    with torch.device("meta"):
        assert on_meta(nn.Linear(2, 2))
    assert not on_meta(nn.ReLU(), (3, None))


def _recorded_both_ways(path: str, size: str | None, overrides: dict) -> tuple[dict, dict, int]:
    from planner.capture.load import load_model_file
    from planner.capture.trace import trace_model

    mf = load_model_file(path, size, overrides)
    with torch.device("meta"):
        model = mf.build()
    inputs, _ = mf.batch(2, 0)
    inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    traced = trace_model(model, inputs, ("fx", "export"))
    return record_values(traced.gm, inputs), record_values(traced.gm, inputs, blocks=traced.blocks), len(traced.blocks)


@pytest.mark.parametrize(
    ("path", "size", "overrides"),
    [
        ("models/llama.py", "tiny", {"n_layers": 6}),
        ("models/gpt.py", None, {"n_layers": 4}),
        ("models/shakespeare.py", None, {}),
        ("models/encoder_lm.py", None, {}),
        ("models/hf/llama.py", None, {}),  # torch.export: layers inlined, module paths in the nodes
        ("models/hf/albert.py", None, {}),  # one layer module called for every block
    ],
)
def test_replaying_twin_blocks_records_what_running_every_node_records(
    path: str, size: str | None, overrides: dict
) -> None:
    plain, replayed, n_blocks = _recorded_both_ways(path, size, overrides)
    assert n_blocks >= 3
    assert replayed == plain


def test_twins_are_replayed_and_a_changed_block_is_run() -> None:
    """Six identical layers and one wider: the wider one has its own signature and runs; the
    replayed values of the others are the ones a run gives."""
    from planner.capture.graph import _Replaying
    from planner.capture.trace import trace_model

    with torch.device("meta"):
        model = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6)),
            nn.Sequential(nn.Linear(16, 24), nn.ReLU()),
        )
    x = torch.empty(3, 16, device="meta")
    traced = trace_model(model, (x,), ("fx",))
    assert len(traced.blocks) == 7
    runs = []
    original = _Replaying._begin

    def counting(self: _Replaying, block: object) -> None:
        original(self, block)  # type: ignore[arg-type]
        runs.append(self.replay is None)

    _Replaying._begin = counting  # type: ignore[method-assign]
    try:
        replayed = record_values(traced.gm, (x,), blocks=traced.blocks)
    finally:
        _Replaying._begin = original  # type: ignore[method-assign]
    assert runs == [True, False, False, False, False, False, True]
    assert replayed == traced.values
    last = traced.blocks[-1].nodes[0]
    assert replayed[last].nbytes == 3 * 24 * 4


def test_meta_build_skips_initialisers_and_restores_them() -> None:
    from planner.capture.meta_cache import meta_build

    original = torch.nn.init.kaiming_uniform_
    calls: list[str] = []
    with meta_build():
        assert torch.nn.init.kaiming_uniform_ is not original  # skipped inside
        layer = torch.nn.Linear(4, 3)
        calls.append(str(layer.weight.device))
    assert calls == ["meta"] and torch.nn.init.kaiming_uniform_ is original
    w = torch.zeros(3, 4)
    torch.nn.init.kaiming_uniform_(w)  # works again on real tensors
    assert w.abs().sum() > 0
    # also restored when the build raises
    with pytest.raises(RuntimeError), meta_build():
        raise RuntimeError("build_model failed")
    assert torch.nn.init.kaiming_uniform_ is original


def test_an_initialiser_kept_during_a_meta_build_still_initialises_real_tensors() -> None:
    """A library imported inside the build may keep what it finds on torch.nn.init (transformers'
    initialization module does, and restores torch's initialisers from that copy ever after): what
    it kept must skip only meta tensors, so real models built later are initialised."""
    from planner.capture.meta_cache import meta_build

    with meta_build():
        kept = torch.nn.init.normal_
        assert kept(torch.empty(2, device="meta")).is_meta  # skipped: no values to set
        inside = kept(torch.zeros(64, device="cpu"), std=1.0)  # a real tensor asked for inside the build
    after = kept(torch.zeros(64), std=1.0)
    assert inside.abs().sum() > 0 and after.abs().sum() > 0


_BUILD = """
import hashlib, sys, torch
from planner.capture.load import load_model_file
from planner.capture.meta_cache import meta_build
mf = load_model_file(sys.argv[1])
if sys.argv[2] == "meta-first":
    with meta_build():
        mf.build(seed=0)
model = mf.build(seed=0)
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode()); digest.update(tensor.detach().contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


@pytest.mark.slow
def test_a_hugging_face_model_built_after_a_meta_build_has_the_same_weights() -> None:
    """A plan estimated for a GPU builds the model on meta first; transformers' initialisers are then
    imported inside the build. The real model built next in the same process (the unsplit reference
    of a test, a profile) must get the weights a fresh process gives it: it once got none (torch.empty
    memory: nan or huge losses), in whichever pytest worker had estimated a plan earlier."""
    pytest.importorskip("transformers")
    model = Path(__file__).resolve().parent.parent / "models" / "hf" / "gpt2.py"

    def digest(order: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _BUILD, str(model), order], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert digest("meta-first") == digest("real-only")


def test_leaves_block_flags_only_values_read_after_the_block() -> None:
    """x -> a -> b -> c -> out, with a also read by c: in the block (a, b), a and b leave it (c reads
    both); in (b, c), b does not (only c reads it) and c does (the output reads it)."""
    import torch.fx as fx

    from planner.capture.signature import leaves_block

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x + 1
            b = a * 2
            c = b - a
            return c

    gm = fx.symbolic_trace(Chain())
    nodes = {n.name: n for n in gm.graph.nodes}
    a, b, c = (n.name for n in gm.graph.nodes if n.op == "call_function")
    assert leaves_block((a, b), nodes) == [True, True]
    assert leaves_block((b, c), nodes) == [False, True]
    assert leaves_block((a, b, c), nodes) == [False, False, True]
